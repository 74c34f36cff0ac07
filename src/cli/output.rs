//! What the commands print. A command's output on stdout is its result: if it cannot be
//! written (a closed pipe, a terminal that hung up), the command fails with
//! [`OutputError`] and exits non-zero, so a caller never takes partial output for a whole
//! one. A note on stderr ("wrote FILE") only accompanies a result already made: if it
//! cannot be written it is lost, and the exit status stays the command's. Neither panics,
//! as `println!` and `eprintln!` do (exit 101).

use std::io::Write;

/// Standard output refused the command's result.
#[derive(Debug, thiserror::Error)]
#[error("cannot write the result to standard output")]
pub struct OutputError(#[source] pub std::io::Error);

/// JSON text as it may go to a terminal: every character serde_json leaves as it is that a
/// terminal acts on or that reorders a line (DEL, the C1 controls such as CSI, the
/// bidirectional formatting characters, the line and paragraph separators) written as its
/// `\uXXXX` escape, which decodes to the same value. What the JSON holds comes from files
/// and executors; shown raw, it could drive the reader's terminal.
pub(crate) fn json_for_terminal(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        // Inside strings C0 is escaped (by serde_json, or the text is no JSON); outside,
        // it is layout: line breaks stay, and a carriage return or tab (a line read from a
        // file could hold one, and a CR lets the rest overwrite the line) becomes a space,
        // the same whitespace to a JSON reader. DEL and C1 are the rest of the controls.
        if c.is_control() && c <= '\u{1f}' && c != '\n' {
            out.push(' ');
        } else if (c.is_control() && c > '\u{1f}') || flowhost_broker::rearranges_lines(c) {
            out.push_str(&format!("\\u{:04x}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    out
}

/// Copies JSON text line by line from `from` to `to` as [`json_for_terminal`] shows it, and
/// flushes. A read error is `from`'s (an I/O error); only a write is [`OutputError`].
pub(crate) fn copy_json_for_terminal(
    from: &mut dyn std::io::BufRead,
    to: &mut dyn Write,
) -> super::CliResult<()> {
    let mut line = Vec::new();
    loop {
        line.clear();
        if from.read_until(b'\n', &mut line)? == 0 {
            break;
        }
        // Verified records are UTF-8; were one not, its bytes show as U+FFFD, never raw.
        to.write_all(json_for_terminal(&String::from_utf8_lossy(&line)).as_bytes())
            .map_err(OutputError)?;
    }
    to.flush().map_err(OutputError)?;
    Ok(())
}

/// Writes `args` to stdout and flushes it, so a refusal is seen here and not lost at exit.
pub(crate) fn to_stdout(args: std::fmt::Arguments<'_>) -> Result<(), OutputError> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(args)
        .and_then(|()| out.flush())
        .map_err(OutputError)
}

/// Writes `args` to stderr, ignoring a failure (see the module documentation).
pub(crate) fn to_stderr(args: std::fmt::Arguments<'_>) {
    let _ = std::io::stderr().lock().write_fmt(args);
}

/// `print!` for a command's result: `Err(OutputError)` instead of a panic.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::output::to_stdout(format_args!($($arg)*))
    };
}

/// `println!` for a command's result: `Err(OutputError)` instead of a panic.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::cli::output::to_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `eprintln!` for a note beside the result: never fails, never panics.
macro_rules! note {
    ($($arg:tt)*) => {
        $crate::cli::output::to_stderr(format_args!("{}\n", format_args!($($arg)*)))
    };
}

#[cfg(test)]
mod json_tests {
    /// Escaped, the same JSON value; raw, none of the characters a terminal acts on.
    #[test]
    fn json_for_a_terminal_escapes_what_a_terminal_acts_on() {
        let value = serde_json::json!({"tool": "add\u{9b}2J\u{202e}x\u{7f}", "n": "é→"});
        // Whitespace a file's line may hold between tokens: a carriage return would let
        // what follows overwrite the line.
        let text = serde_json::to_string(&value)
            .unwrap()
            .replacen(',', ",\r\t", 1);
        let shown = super::json_for_terminal(&text);
        assert!(
            !shown.contains(['\u{9b}', '\u{202e}', '\u{7f}', '\r', '\t']),
            "{shown}"
        );
        assert!(shown.contains("é→"), "{shown}");
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&shown).unwrap(),
            value
        );
    }
}
