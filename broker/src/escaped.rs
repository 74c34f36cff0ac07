//! Text an executor chose (a socket name, a path, an error message, a stderr line) as shown
//! to a person: in a log line or on a terminal.

use std::fmt::{self, Write};

/// Shows `T` with every control character (C0, DEL and C1: what [`char::is_control`]
/// names, CR, ESC, BEL, ENQ, SO and SI among them), every bidirectional formatting
/// character and the Unicode line and paragraph separators written as `\u{..}`, and
/// everything else as it is. What an executor (or a publisher's file) chose so cannot move
/// the cursor, retitle, erase or recolour the operator's terminal, reorder what a line
/// shows, nor forge a line of the host's log, when it is printed or logged. For people
/// only: records are JSON and keep the exact data.
///
/// `tracing`'s text format escapes only some of these, and only in an event's message;
/// fields written with `%` go out raw. Every executor-derived string a log line or the
/// terminal shows goes through this.
#[derive(Debug, Clone, Copy)]
pub struct Escaped<T>(pub T);

impl<T: fmt::Display> fmt::Display for Escaped<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(Escaping(f), "{}", self.0)
    }
}

/// Writes through to a formatter, escaping control characters on the way.
struct Escaping<'a, 'b>(&'a mut fmt::Formatter<'b>);

impl Write for Escaping<'_, '_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        // Runs without a control character are written whole.
        let mut start = 0;
        for (at, c) in s.char_indices() {
            if c.is_control() || rearranges_lines(c) {
                self.0.write_str(&s[start..at])?;
                write!(self.0, "\\u{{{:x}}}", u32::from(c))?;
                start = at + c.len_utf8();
            }
        }
        self.0.write_str(&s[start..])
    }
}

/// Characters that change what a line shows without being control characters: the
/// bidirectional embeddings, overrides, isolates and marks (a right-to-left override makes
/// `error: denied` read backwards, or hides the words after it behind earlier ones), and
/// the line and paragraph separators, which some terminals and log viewers break lines at.
pub fn rearranges_lines(c: char) -> bool {
    matches!(
        c,
        '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{2028}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
    )
}

#[cfg(test)]
mod tests {
    use super::Escaped;

    #[test]
    fn every_control_character_is_escaped_and_nothing_else() {
        let text = "a\u{1b}]0;t\u{7}\r\n\u{5}\u{e}\u{f}\u{7f}\u{9b}\u{0}é→z";
        let shown = Escaped(text).to_string();
        assert_eq!(
            shown,
            "a\\u{1b}]0;t\\u{7}\\u{d}\\u{a}\\u{5}\\u{e}\\u{f}\\u{7f}\\u{9b}\\u{0}é→z"
        );
        assert!(!shown.chars().any(char::is_control));
        assert_eq!(Escaped("plain text").to_string(), "plain text");
    }

    /// A publisher's or an executor's text reordering what the operator reads: serde's
    /// "unknown field" errors carried a manifest's key as it was.
    #[test]
    fn bidirectional_formatting_and_line_separators_are_escaped() {
        let text = "ok \u{202e}deinied\u{202c} \u{2066}x\u{2069}\u{2028}\u{2029}\u{200f}\u{61c}";
        assert_eq!(
            Escaped(text).to_string(),
            "ok \\u{202e}deinied\\u{202c} \\u{2066}x\\u{2069}\\u{2028}\\u{2029}\\u{200f}\\u{61c}"
        );
        // Letters of right-to-left scripts are text, not formatting.
        assert_eq!(Escaped("שלום مرحبا").to_string(), "שלום مرحبا");
    }
}
