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
