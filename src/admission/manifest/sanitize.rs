//! Making publisher text safe to show to a client or an operator's terminal.

use std::iter::Peekable;
use std::str::Chars;

/// `text` without terminal escape sequences, control characters or bidirectional overrides.
///
/// Removed: ANSI/ECMA-48 escape sequences (CSI such as colour codes and cursor moves, OSC
/// such as window titles and hyperlinks, DCS/SOS/PM/APC strings, and two-character escapes),
/// their 8-bit C1 forms, every other control character, and the Unicode bidirectional
/// embedding, override and isolate controls (which can make displayed text read differently
/// from what was signed). Whitespace controls (tab, line feed, carriage return, vertical tab,
/// form feed) become a single space each so that words stay apart. Everything else is kept.
pub fn sanitize_for_client(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\u{1b}' => skip_escape(&mut chars),
            '\u{9b}' => skip_control_sequence(&mut chars),
            '\u{90}' | '\u{98}' | '\u{9d}' | '\u{9e}' | '\u{9f}' => skip_string(&mut chars),
            '\t' | '\n' | '\r' | '\u{b}' | '\u{c}' => out.push(' '),
            c if c.is_control() || is_bidi_control(c) => {}
            c => out.push(c),
        }
    }
    out
}

fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// After ESC: a CSI (`ESC [`), a string (`ESC ]`, `ESC P`, `ESC X`, `ESC ^`, `ESC _`), or an
/// escape with optional intermediate bytes and one final character (`ESC ( B`, `ESC c`).
fn skip_escape(chars: &mut Peekable<Chars<'_>>) {
    match chars.next() {
        Some('[') => skip_control_sequence(chars),
        Some(']' | 'P' | 'X' | '^' | '_') => skip_string(chars),
        Some(c) if ('\u{20}'..='\u{2f}').contains(&c) => {
            while chars
                .next_if(|c| ('\u{20}'..='\u{2f}').contains(c))
                .is_some()
            {}
            chars.next_if(|c| ('\u{30}'..='\u{7e}').contains(c));
        }
        Some(_) | None => {}
    }
}

/// A control sequence: parameter and intermediate bytes, then one final byte. A character
/// outside those ranges ends the sequence without being consumed, as a terminal would.
fn skip_control_sequence(chars: &mut Peekable<Chars<'_>>) {
    while chars
        .next_if(|c| ('\u{20}'..='\u{3f}').contains(c))
        .is_some()
    {}
    chars.next_if(|c| ('\u{40}'..='\u{7e}').contains(c));
}

/// A command string, ended by BEL, ST (`ESC \`) or the C1 ST; an unterminated string runs
/// to the end of the text and is dropped whole.
fn skip_string(chars: &mut Peekable<Chars<'_>>) {
    while let Some(c) = chars.next() {
        match c {
            '\u{7}' | '\u{9c}' => return,
            '\u{1b}' => {
                chars.next_if_eq(&'\\');
                return;
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_is_unchanged() {
        for text in ["Reads the signed terms.", "Prix: 12 € — naïve 日本", ""] {
            assert_eq!(sanitize_for_client(text), text);
        }
    }

    #[test]
    fn ansi_sequences_are_removed() {
        let cases = [
            ("\u{1b}[31mred\u{1b}[0m text", "red text"),
            ("a\u{1b}[2J\u{1b}[1;1Hb", "ab"),
            ("\u{1b}]0;evil title\u{7}visible", "visible"),
            (
                "\u{1b}]8;;http://x.example\u{1b}\\link\u{1b}]8;;\u{1b}\\",
                "link",
            ),
            ("\u{1b}Pq#0;2;0;0;0\u{1b}\\after", "after"),
            ("\u{1b}(Bcharset", "charset"),
            ("\u{1b}cReset", "Reset"),
            ("\u{9b}31mC1\u{9b}0m", "C1"),
            ("\u{9d}title\u{9c}shown", "shown"),
            ("tail\u{1b}", "tail"),
            ("\u{1b}]unterminated", ""),
        ];
        for (input, expected) in cases {
            assert_eq!(sanitize_for_client(input), expected, "{input:?}");
        }
    }

    #[test]
    fn controls_and_bidi_overrides_are_removed() {
        assert_eq!(sanitize_for_client("a\u{0}b\u{7}c\u{7f}d\u{85}e"), "abcde");
        assert_eq!(
            sanitize_for_client("line one\nline\ttwo\r"),
            "line one line two "
        );
        assert_eq!(
            sanitize_for_client("safe\u{202e}txt.exe\u{202c} \u{2066}x\u{2069}"),
            "safetxt.exe x"
        );
    }

    #[test]
    fn output_never_contains_controls() {
        let nasty: String = (0u32..0x300)
            .filter_map(char::from_u32)
            .chain("\u{1b}[".chars())
            .collect();
        let out = sanitize_for_client(&nasty);
        assert!(out.chars().all(|c| !c.is_control() && !is_bidi_control(c)));
    }
}
