//! What a command's output leaves changed on the caller's terminal after the command is gone.
//!
//! The relay passes the command's output to the caller's terminal as it is, so whatever the
//! command turns on there (mouse or focus reports, bracketed paste, the alternate screen, a
//! colour of the palette, the default colours) stays on when it ends without turning it off
//! (killed, timed out, or careless). flowhost puts back exactly what it saw the command
//! change, and nothing else: colours and modes the user set before the run are kept.
//!
//! The output is read as a UTF-8 terminal reads it (as flowhost's own terminals are): the
//! bytes of a character are text, and a C1 control is one written alone or in UTF-8; after
//! the command switches the terminal off UTF-8 (`ESC % @`), every byte is read alone, as the
//! terminal then reads it. A terminal set to another encoding before the run that acts on
//! raw C1 bytes can be sent one this reading takes for part of a character. Otherwise
//! reading is conservative: what may set colours in ways not read here has every colour put
//! back, which only sets them to the terminal's defaults.

/// Written before each batch of flowhost's messages: CAN ends any control sequence the
/// command's output left open, ST any string (a window title, DCS, APC, PM), SGR 0 any
/// attribute (concealed text among them), and SI with `ESC ( B` any character set it chose
/// (line drawing). The command's output, relayed as it is, could otherwise swallow a REFUSED
/// or GATE FAILED line into a title, or show it invisibly. On a terminal none of these were
/// pending, they do nothing seen.
pub(super) const BEFORE_MESSAGES: &[u8] = b"\x18\x1b\\\x1b[0m\x0f\x1b(B";

/// Written once the command has ended, after what it changed is undone: a soft reset
/// (DECSTR) ends the scroll margins, origin and insert modes it left and shows the cursor,
/// and `CSI ? 7 h` turns line wrap back on (off, a line's end would be written over its last
/// column), so flowhost's last words are neither kept in a region that scrolls them away nor
/// cut.
const SOFT_RESET: &[u8] = b"\x1b[!p\x1b[?7h";

/// The Linux console's palette reset (`ESC ] R`), ended with ST, which the console ignores
/// and which ends it as an OSC a terminal emulator ignores.
const CONSOLE_PALETTE_RESET: &[u8] = b"\x1b]R\x1b\\";

/// Private modes that change what the terminal sends as input, or holds back its output, and
/// that a command ending normally turns off: mouse reports (9, 1000-1003) and their
/// encodings (1005, 1006, 1015, 1016), focus reports (1004), bracketed paste (2004),
/// synchronized output (2026), colour-scheme change reports (2031), in-band resize
/// reports (2048) and Windows Terminal's win32-input-mode (9001). Left on, the shell after
/// the run reads mouse moves, resizes, theme changes or every key as typed text.
const INPUT_MODES: [u16; 15] = [
    9, 1000, 1001, 1002, 1003, 1004, 1005, 1006, 1015, 1016, 2004, 2026, 2031, 2048, 9001,
];

/// The private mode (DECANM) whose reset switches the terminal to VT52 mode.
const VT52_MODE: u16 = 2;

/// Private modes that switch to the alternate screen. Left on, flowhost's last words and the
/// shell after them are written on a screen that is not the user's.
const ALTERNATE_SCREENS: [u16; 3] = [47, 1047, 1049];

/// Most parameters of one control sequence kept; past them, only a mode undone at the end
/// is kept (once each: the memory stays bounded), as a terminal taking more parameters
/// would set it.
const MOST_PARAMETERS: usize = 32;

/// Whether `param`, a parameter of a control sequence past [`MOST_PARAMETERS`], is kept:
/// a mode undone at the end not kept already.
fn kept_past_the_most(params: &[u32], param: u32) -> bool {
    u16::try_from(param).is_ok_and(|m| ALTERNATE_SCREENS.contains(&m) || INPUT_MODES.contains(&m))
        && !params[MOST_PARAMETERS..].contains(&param)
}

/// Where the reading is between two bytes of the command's output.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Text, or the rest of a sequence that matters to none of the below.
    Ground,
    /// After ESC.
    Escape,
    /// After ESC and an intermediate byte (`ESC %`, `ESC (`): the first such byte.
    EscapeIntermediate(u8),
    /// After CSI: its parameters so far, whether it is private (`?`), its last intermediate
    /// byte, and whether it began with the 8-bit CSI.
    Csi {
        private: bool,
        /// `<`, `=` or `>` before the parameters (kitty's keyboard protocol, xterm's
        /// modifyOtherKeys).
        marker: Option<u8>,
        params: Vec<u32>,
        current: Option<u32>,
        intermediate: Option<u8>,
        c1: bool,
    },
    /// After OSC: the number that says what it sets, so far.
    OscNumber { number: u32, digits: bool },
    /// After OSC, its number and `;`: what it sets the colours to, up to [`MOST_OSC_TEXT`]
    /// bytes (`long` when there was more).
    OscText {
        number: u32,
        text: Vec<u8>,
        long: bool,
    },
}

/// Most bytes of an OSC's text kept to tell a query (`?`) from a colour: a colour is a few
/// dozen bytes, and a longer text is taken as setting what its number names.
const MOST_OSC_TEXT: usize = 512;

/// The changes seen in a command's output that outlive the command, and what undoes them.
#[derive(Debug)]
pub(super) struct ScreenChanges {
    state: State,
    /// Whether the command wrote anything to its terminal.
    wrote: bool,
    /// Input modes of [`INPUT_MODES`] the command turned on at any time, whether or not it
    /// turned them off again: what the terminal made of a reset this reading saw is not
    /// known (written inside a string a terminal reads to its end differently, or undone by
    /// a restore of saved modes), and turning off a mode that is off does nothing.
    input_modes: Vec<u16>,
    /// The alternate screen the command switched to and did not leave, by its mode.
    alternate: Option<u16>,
    /// Whether the command switched to an alternate screen at any time: one it seemed to
    /// leave is left again at the end, without restoring the cursor (mode 1047, which does
    /// nothing on the normal screen).
    entered_alternate: bool,
    /// Dynamic colours (OSC 10-19: default foreground, background, cursor, ...) it set, as
    /// bits 0-9.
    dynamic: u16,
    /// Whether it set a colour of the palette (OSC 4) or a special colour (OSC 5).
    palette: bool,
    special: bool,
    /// Whether it sent what may set colours in ways not read here (an OSC not known to be
    /// harmless, kitty's OSC 21, a pop of saved colours): then every colour is put back.
    unknown_colours: bool,
    /// Whether it set a colour of the Linux console's palette (`ESC ] P`).
    console_palette: bool,
    /// Continuation bytes still due of the UTF-8 character being read, and its lead byte
    /// while the first is due.
    utf8_pending: u8,
    utf8_lead: u8,
    /// Whether it used kitty's keyboard protocol (flags pushed or set).
    keyboard_protocol: bool,
    /// Whether it set xterm's modifyOtherKeys.
    modify_other_keys: bool,
    /// Whether the terminal is off UTF-8 now (`ESC % @` and the like), so each byte is read
    /// alone and UTF-8 is chosen again at the end.
    not_utf8: bool,
    /// Whether it switched the terminal to VT52 mode at any time (`CSI ? 2 l`), where no
    /// control sequence flowhost writes is read until `ESC <`.
    vt52: bool,
}

impl Default for ScreenChanges {
    fn default() -> Self {
        ScreenChanges {
            state: State::Ground,
            wrote: false,
            input_modes: Vec::new(),
            alternate: None,
            entered_alternate: false,
            dynamic: 0,
            palette: false,
            special: false,
            unknown_colours: false,
            console_palette: false,
            utf8_pending: 0,
            utf8_lead: 0,
            keyboard_protocol: false,
            modify_other_keys: false,
            not_utf8: false,
            vt52: false,
        }
    }
}

/// OSC numbers that set no colour: window and icon titles (0-3), the working directory (7),
/// hyperlinks (8), notifications (9, 777), the pointer (22), the clipboard (52), shell
/// integration marks (133, 633), and the resets of colours (104, 105, 110-119).
fn harmless_osc(number: u32) -> bool {
    matches!(
        number,
        0..=3 | 7 | 8 | 9 | 22 | 52 | 104 | 105 | 110..=119 | 133 | 633 | 777
    )
}

const BEL: u8 = 0x07;
const ESC: u8 = 0x1b;
const CAN: u8 = 0x18;
const SUB: u8 = 0x1a;
/// The 8-bit forms of CSI and OSC.
const C1_CSI: u8 = 0x9b;
const C1_OSC: u8 = 0x9d;
/// The 8-bit string terminator.
const C1_ST: u8 = 0x9c;

impl ScreenChanges {
    /// Reads more of the command's output, in the order the terminal receives it; a
    /// sequence may be split anywhere between two calls.
    pub(super) fn see(&mut self, output: &[u8]) {
        self.wrote |= !output.is_empty();
        for &byte in output {
            // A byte of a UTF-8 character (the 0x9D of a closing quote, E2 80 9D) is text to
            // a UTF-8 terminal, never an 8-bit control.
            // But U+0080-U+009F written in UTF-8 (C2 80 - C2 9F) is the C1 control itself
            // to a terminal that decodes first (VTE, st): read as one.
            let c1_in_utf8 = self.utf8_lead == 0xc2 && (0x80..=0x9f).contains(&byte);
            let continuation =
                self.utf8_pending > 0 && (0x80..=0xbf).contains(&byte) && !c1_in_utf8;
            (self.utf8_pending, self.utf8_lead) = match byte {
                // Off UTF-8, each byte is read alone: a raw 0x9B is a CSI.
                _ if self.not_utf8 => (0, 0),
                // C0 and C1 lead only overlong forms, F5-F7 nothing: not UTF-8.
                0xc2..=0xdf => (1, byte),
                0xe0..=0xef => (2, byte),
                0xf0..=0xf4 => (3, byte),
                _ if continuation => (self.utf8_pending - 1, 0),
                _ => (0, 0),
            };
            // A C1 control in UTF-8 inside an OSC: ST ends it (below, as the 8-bit ST
            // does); CSI and OSC cancel it and start their own; any other cancels it.
            if c1_in_utf8 && matches!(self.state, State::OscText { .. } | State::OscNumber { .. }) {
                match byte {
                    C1_ST => {}
                    C1_CSI | C1_OSC => self.state = State::Ground,
                    _ => {
                        self.state = State::Ground;
                        continue;
                    }
                }
            }
            if continuation {
                match &mut self.state {
                    State::Ground => continue,
                    State::OscText { text, long, .. } => {
                        if text.len() < MOST_OSC_TEXT {
                            text.push(byte);
                        } else {
                            *long = true;
                        }
                        continue;
                    }
                    _ => {}
                }
            }
            self.state = self.next(byte);
        }
    }

    fn next(&mut self, byte: u8) -> State {
        let state = std::mem::replace(&mut self.state, State::Ground);
        if let State::OscText {
            number,
            mut text,
            long,
        } = state
        {
            return match byte {
                // Cancelled: the terminal sets nothing.
                CAN | SUB => State::Ground,
                BEL | ESC | C1_ST => {
                    self.set_colours(number, &text, long);
                    // The default colours' text cut short (past what is kept, or at an 8-bit
                    // ST a terminal may read on past): what it set further on is unknown.
                    if (10..=19).contains(&number) && (long || byte == C1_ST) {
                        self.unknown_colours = true;
                    }
                    if byte == ESC {
                        State::Escape
                    } else {
                        State::Ground
                    }
                }
                _ if text.len() < MOST_OSC_TEXT => {
                    text.push(byte);
                    State::OscText { number, text, long }
                }
                _ => State::OscText {
                    number,
                    text,
                    long: true,
                },
            };
        }
        if let State::OscNumber { number, digits } = state {
            return match byte {
                b'0'..=b'9' => State::OscNumber {
                    number: number
                        .saturating_mul(10)
                        .saturating_add(u32::from(byte - b'0')),
                    digits: true,
                },
                b';' if digits => State::OscText {
                    number,
                    text: Vec::new(),
                    long: false,
                },
                CAN | SUB => State::Ground,
                // Ended with no text: a reset (OSC 104) or kitty's pop of saved colours
                // (OSC 30101), among others.
                BEL | ESC | C1_ST => {
                    if digits {
                        self.set_colours(number, b"", false);
                    } else {
                        self.unknown_colours = true;
                    }
                    if byte == ESC {
                        State::Escape
                    } else {
                        State::Ground
                    }
                }
                // The Linux console's palette: `ESC ] P nrrggbb`, with no terminator.
                b'P' if !digits => {
                    self.console_palette = true;
                    State::Ground
                }
                _ => {
                    self.unknown_colours = true;
                    State::Ground
                }
            };
        }
        match (state, byte) {
            // A terminal cancels any sequence on CAN or SUB and starts another on ESC,
            // wherever it is.
            (_, CAN | SUB) => State::Ground,
            (_, ESC) => State::Escape,
            (State::Escape, b'[') | (_, C1_CSI) => State::Csi {
                private: false,
                marker: None,
                params: Vec::new(),
                current: None,
                intermediate: None,
                c1: byte == C1_CSI,
            },
            (State::Escape, b']') | (_, C1_OSC) => State::OscNumber {
                number: 0,
                digits: false,
            },
            // A terminal acts on a C0 control, or ignores NUL and DEL, and goes on reading
            // the sequence (CAN, SUB and ESC are taken above).
            (State::Escape, 0x00..=0x1f | 0x7f) => State::Escape,
            (State::Escape, 0x20..=0x2f) => State::EscapeIntermediate(byte),
            (State::EscapeIntermediate(first), 0x00..=0x2f | 0x7f) => {
                State::EscapeIntermediate(first)
            }
            (State::EscapeIntermediate(first), 0x30..=0x7e) => {
                if first == b'%' {
                    // `ESC % G` chooses UTF-8; any other final another encoding.
                    self.not_utf8 = byte != b'G';
                }
                State::Ground
            }
            (
                State::Csi {
                    mut private,
                    mut marker,
                    mut params,
                    mut current,
                    mut intermediate,
                    c1,
                },
                byte,
            ) => {
                match byte {
                    b'?' if params.is_empty() && current.is_none() && intermediate.is_none() => {
                        private = true
                    }
                    b'0'..=b'9' => {
                        current = Some(
                            current
                                .unwrap_or(0)
                                .saturating_mul(10)
                                .saturating_add(u32::from(byte - b'0')),
                        )
                    }
                    b';' | b':' => {
                        let param = current.unwrap_or(0);
                        if params.len() < MOST_PARAMETERS || kept_past_the_most(&params, param) {
                            params.push(param);
                        }
                        current = None;
                    }
                    0x20..=0x2f => intermediate = Some(byte),
                    // Other parameter bytes (`<`, `=`, `>`, a `?` not first) make a
                    // sequence that is not a private mode.
                    b'<' | b'=' | b'>'
                        if params.is_empty() && current.is_none() && marker.is_none() =>
                    {
                        marker = Some(byte);
                        private = false;
                    }
                    0x3c..=0x3f => private = false,
                    0x40..=0x7e => {
                        if let Some(last) = current
                            && (params.len() < MOST_PARAMETERS || kept_past_the_most(&params, last))
                        {
                            params.push(last);
                        }
                        if intermediate.is_none() && byte == b'u' && marker.is_some() {
                            // kitty's keyboard protocol: pushed, set or popped flags.
                            self.keyboard_protocol = true;
                        } else if marker == Some(b'>') && byte == b'm' && params.first() == Some(&4)
                        {
                            // xterm's modifyOtherKeys: Ctrl-C may come as a sequence.
                            self.modify_other_keys = true;
                        } else {
                            self.csi_final(private, params, intermediate, c1, byte);
                        }
                        return State::Ground;
                    }
                    // C0 controls inside a sequence are acted on, DEL is ignored, and the
                    // sequence goes on.
                    0x00..=0x1f | 0x7f => {}
                    _ => return State::Ground,
                }
                State::Csi {
                    private,
                    marker,
                    params,
                    current,
                    intermediate,
                    c1,
                }
            }
            // Handled above, before any of these.
            (
                State::Escape
                | State::EscapeIntermediate(_)
                | State::Ground
                | State::OscText { .. }
                | State::OscNumber { .. },
                _,
            ) => State::Ground,
        }
    }

    /// A control sequence ended with `byte`.
    fn csi_final(
        &mut self,
        private: bool,
        params: Vec<u32>,
        intermediate: Option<u8>,
        c1: bool,
        byte: u8,
    ) {
        match (private, intermediate, byte) {
            // Set, or restored from what was saved (which may be on).
            (true, None, b'h' | b'r') => {
                for mode in params {
                    self.set_mode(mode, true);
                }
            }
            // An 8-bit CSI sets what it names, but never clears it: a UTF-8 terminal shows
            // the byte as text, and the mode would stay on unseen. It may switch to VT52
            // mode, though: leaving that when it was not entered does nothing.
            (true, None, b'l') => {
                for mode in params {
                    if !c1 || mode == u32::from(VT52_MODE) {
                        self.set_mode(mode, false);
                    }
                }
            }
            // XTPOPCOLORS: colours saved earlier come back, whatever they were.
            (false, Some(b'#'), b'Q') => self.unknown_colours = true,
            _ => {}
        }
    }

    fn set_mode(&mut self, mode: u32, on: bool) {
        let Ok(mode) = u16::try_from(mode) else {
            return;
        };
        if mode == VT52_MODE && !on {
            self.vt52 = true;
        } else if ALTERNATE_SCREENS.contains(&mode) {
            self.alternate = on.then_some(mode);
            self.entered_alternate |= on;
        } else if INPUT_MODES.contains(&mode) && on && !self.input_modes.contains(&mode) {
            self.input_modes.push(mode);
        }
    }

    /// OSC `number` ended with `text`: which colours it set. A colour asked for (`?`) is
    /// not set; a text too long to read sets what the number names.
    fn set_colours(&mut self, number: u32, text: &[u8], long: bool) {
        let mut specs = text.split(|b| *b == b';');
        match number {
            // Pairs of a colour's index and what it becomes.
            4 | 5 => {
                let set = long || specs.skip(1).step_by(2).any(|spec| spec != b"?");
                if number == 4 {
                    self.palette |= set;
                } else {
                    self.special |= set;
                }
            }
            // Each next text sets the next colour: OSC 10 `fg;bg` sets 10 and 11.
            10..=19 if !text.is_empty() || long => {
                if long {
                    self.dynamic |= 1 << (number - 10);
                }
                for n in number..=19 {
                    match specs.next() {
                        Some(spec) if spec != b"?" => self.dynamic |= 1 << (n - 10),
                        Some(_) => {}
                        None => break,
                    }
                }
            }
            n if harmless_osc(n) => {}
            // Anything else may set colours (kitty's OSC 21, iTerm2's 1337, a pop of saved
            // colours): every colour is put back.
            _ => self.unknown_colours = true,
        }
    }

    /// What to write before a batch of flowhost's messages while the command runs:
    /// [`BEFORE_MESSAGES`], then the default foreground and background colours back if the
    /// command set them, or may have (text could be the colour of the background); once
    /// set, before every batch until the end, since the command can set them again in ways
    /// not read here (a pop of colours it saved).
    pub(super) fn before_messages(&self) -> Vec<u8> {
        let mut reset = self.back_to_ansi();
        reset.extend_from_slice(BEFORE_MESSAGES);
        for n in [10, 11] {
            if self.unknown_colours || self.dynamic & (1 << (n - 10)) != 0 {
                reset.extend_from_slice(format!("\x1b]{}\x1b\\", 100 + n).as_bytes());
            }
        }
        if self.console_palette {
            reset.extend_from_slice(CONSOLE_PALETTE_RESET);
        }
        reset
    }

    /// `ESC <` if the command switched the terminal to VT52 mode, where no sequence written
    /// after it would be read; in ANSI mode a terminal ignores it. Twice: a VT52 cursor move
    /// the command left pending (`ESC Y`) takes the next two bytes, whatever they are, as
    /// its row and column (at worst a `<` is shown).
    fn back_to_ansi(&self) -> Vec<u8> {
        if self.vt52 {
            b"\x1b<\x1b<".to_vec()
        } else {
            Vec::new()
        }
    }

    /// What to write once the command has ended, after the last of its output: everything
    /// [`ScreenChanges::before_messages`] writes and UTF-8 chosen again if the command
    /// switched the terminal off it, then the alternate screen left, the input
    /// modes it left on turned off, a soft reset, and every colour it changed put back to
    /// the terminal's default. Empty when the command wrote nothing. What it returns is
    /// undone: a later call returns only what the command changed since.
    pub(super) fn at_end(&mut self) -> Vec<u8> {
        if !std::mem::take(&mut self.wrote) {
            return Vec::new();
        }
        let mut reset = self.back_to_ansi();
        if std::mem::take(&mut self.not_utf8) {
            // UTF-8 again, for flowhost's last words and the shell after them.
            reset.extend_from_slice(b"\x1b%G");
        }
        self.vt52 = false;
        reset.extend_from_slice(BEFORE_MESSAGES);
        // Before the soft reset, which forgets the cursor that leaving the alternate screen
        // (1049) puts back: where the command started.
        if let Some(mode) = self.alternate.take() {
            reset.extend_from_slice(format!("\x1b[?{mode}l").as_bytes());
        } else if self.entered_alternate {
            reset.extend_from_slice(b"\x1b[?1047l");
        }
        self.entered_alternate = false;
        for mode in std::mem::take(&mut self.input_modes) {
            reset.extend_from_slice(format!("\x1b[?{mode}l").as_bytes());
        }
        // Left on, the shell after the run reads keys (Ctrl-C among them) as sequences.
        if std::mem::take(&mut self.keyboard_protocol) {
            reset.extend_from_slice(b"\x1b[<99u\x1b[=0;1u");
        }
        if std::mem::take(&mut self.modify_other_keys) {
            reset.extend_from_slice(b"\x1b[>4;0m");
        }
        reset.extend_from_slice(SOFT_RESET);
        let unknown = std::mem::take(&mut self.unknown_colours);
        // Unknown: the default foreground, background and cursor colours.
        let dynamic = std::mem::take(&mut self.dynamic) | if unknown { 0b111 } else { 0 };
        for n in 10..=19u32 {
            // OSC `100 + n` resets dynamic colour `n` (OSC 110 the foreground OSC 10 sets).
            if dynamic & (1 << (n - 10)) != 0 {
                reset.extend_from_slice(format!("\x1b]{}\x1b\\", 100 + n).as_bytes());
            }
        }
        if std::mem::take(&mut self.palette) || unknown {
            reset.extend_from_slice(b"\x1b]104\x1b\\");
        }
        if std::mem::take(&mut self.special) || unknown {
            reset.extend_from_slice(b"\x1b]105\x1b\\");
        }
        if std::mem::take(&mut self.console_palette) {
            reset.extend_from_slice(CONSOLE_PALETTE_RESET);
        }
        reset
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn changes(output: &[&[u8]]) -> ScreenChanges {
        let mut screen = ScreenChanges::default();
        for part in output {
            screen.see(part);
        }
        screen
    }

    fn end_of(output: &[&[u8]]) -> String {
        String::from_utf8(changes(output).at_end()).unwrap()
    }

    #[test]
    fn a_command_that_changed_nothing_gets_nothing_of_the_users_undone() {
        let end = end_of(&[b"plain text\r\n\x1b[1;31mred\x1b[0m \x1b]0;a title\x07"]);
        assert_eq!(end.as_bytes(), [BEFORE_MESSAGES, SOFT_RESET].concat());
        assert!(end_of(&[]).is_empty(), "a command that wrote nothing");
    }

    #[test]
    fn colours_the_command_set_are_put_back_and_only_those() {
        let end = end_of(&[b"\x1b]11;#000000\x07\x1b]4;1;rgb:00/00/00\x1b\\\x1b]12;red\x07"]);
        assert!(end.contains("\x1b]111\x1b\\"), "{end:?}");
        assert!(end.contains("\x1b]112\x1b\\"), "{end:?}");
        assert!(end.contains("\x1b]104\x1b\\"), "{end:?}");
        assert!(
            !end.contains("\x1b]110"),
            "the foreground was not set: {end:?}"
        );
        assert!(!end.contains("\x1b]105"), "{end:?}");
    }

    #[test]
    fn a_sequence_split_between_reads_is_still_seen() {
        let end = end_of(&[b"\x1b", b"]1", b"0;white\x07\x1b[", b"?100", b"0h"]);
        assert!(end.contains("\x1b]110\x1b\\"), "{end:?}");
        assert!(end.contains("\x1b[?1000l"), "{end:?}");
    }

    /// Every input mode the command turned on is turned off at the end, also one it seemed
    /// to turn off itself: a reset written inside a string (an APC or OSC a terminal such as
    /// kitty reads to its ST, ESC and CAN included) or undone by a restore of saved modes
    /// (`CSI ? r`) leaves the mode on there. Before, only modes this reading thought still
    /// on were undone, and the shell after the run read mouse reports as typed text.
    #[test]
    fn every_input_mode_turned_on_is_turned_off_at_the_end() {
        let end = end_of(&[b"\x1b[?1000;1006h\x1b[?2004h\x1b[?1004h\x1b[?1004l\x9b?2026h"]);
        for mode in [1000, 1006, 2004, 2026, 1004] {
            assert!(end.contains(&format!("\x1b[?{mode}l")), "{mode}: {end:?}");
        }
        let hidden = end_of(&[
            b"\x1b[?1000h\x1b[?2048h\x1b[?2031h\x1b_x\x1b[?1000l\x1b[?2048l\x1b[?2031l\x1b\\",
        ]);
        for mode in [1000, 2031, 2048] {
            assert!(
                hidden.contains(&format!("\x1b[?{mode}l")),
                "{mode}: {hidden:?}"
            );
        }
        // Modes never turned on are left alone.
        assert!(!hidden.contains("\x1b[?1004l"), "{hidden:?}");
        // Not private modes, or not set: nothing to undo.
        let end = end_of(&[b"\x1b[1000h\x1b[>1000h\x1b[?1000$p\x1b[?25l"]);
        assert!(!end.contains("1000l"), "{end:?}");
    }

    #[test]
    fn the_alternate_screen_is_left_the_way_it_was_entered_before_the_soft_reset() {
        let end = end_of(&[b"\x1b[?1049h\x1b[2J\x1b[10;1Hediting"]);
        let left = end
            .find("\x1b[?1049l")
            .expect("the alternate screen is left");
        assert!(left < end.find("\x1b[!p").unwrap(), "{end:?}");
        // One it seemed to leave itself (the reset may have been inside a string the
        // terminal read to its end) is left again, without restoring the cursor.
        let end = end_of(&[b"\x1b[?1049h", b"\x1b]0;\x1b[?1049l\x07"]);
        assert!(
            end.contains("\x1b[?1047l") && !end.contains("1049l"),
            "{end:?}"
        );
        assert!(!end_of(&[b"plain"]).contains("1047l"));
    }

    /// Colours the command set are put back before every batch of messages until the end,
    /// not once: it can bring them back in ways not read here (a pop of colours it saved).
    /// Before, the reset was written once, and later verdicts could be black on black.
    #[test]
    fn colours_once_set_are_put_back_before_every_batch_until_the_end() {
        let mut screen = changes(&[b"\x1b]10;#000\x07\x1b]11;#000\x07\x1b[#P\x1b]4;1;red\x07"]);
        for _ in 0..2 {
            let before = String::from_utf8(screen.before_messages()).unwrap();
            assert!(before.contains("\x1b]110\x1b\\") && before.contains("\x1b]111\x1b\\"));
            assert!(
                !before.contains("104"),
                "the palette waits for the end: {before:?}"
            );
        }
        let end = String::from_utf8(screen.at_end()).unwrap();
        assert!(
            end.contains("\x1b]104") && end.contains("\x1b]110"),
            "{end:?}"
        );
        assert!(screen.at_end().is_empty());
        assert_eq!(screen.before_messages(), BEFORE_MESSAGES);
    }

    /// What may set colours in ways not read here (kitty's OSC 21, a pop of saved colours,
    /// an OSC of unknown meaning) has every colour put back; titles and links do not.
    #[test]
    fn what_may_set_colours_unread_has_every_colour_put_back() {
        for output in [
            b"\x1b]21;foreground=#000;background=#000\x1b\\".as_slice(),
            b"\x1b[#Q",
            b"\x1b]30101\x1b\\",
            b"\x1b]1337;SetColors=bg=000\x07",
        ] {
            let mut screen = changes(&[output]);
            let before = String::from_utf8(screen.before_messages()).unwrap();
            assert!(before.contains("\x1b]111"), "{output:?}: {before:?}");
            let end = String::from_utf8(screen.at_end()).unwrap();
            for reset in ["\x1b]110", "\x1b]111", "\x1b]104"] {
                assert!(end.contains(reset), "{output:?}: {end:?}");
            }
        }
        for harmless in [
            b"\x1b]0;title\x07".as_slice(),
            b"\x1b]8;;https://example.org\x1b\\link\x1b]8;;\x1b\\",
            b"\x1b]52;c;aGk=\x07",
            b"\x1b]104\x07",
        ] {
            assert_eq!(changes(&[harmless]).before_messages(), BEFORE_MESSAGES);
        }
        // The Linux console's palette, which its own sequence puts back.
        let end = end_of(&[b"\x1b]P7000000"]);
        assert!(end.contains("\x1b]R\x1b\\"), "{end:?}");
    }

    /// Text in UTF-8 is text, whatever bytes its characters are made of: a closing quote
    /// (E2 80 9D) starts no OSC. And what a terminal may read further than the scanner does
    /// (the default colours' text past what is kept, or ended by an 8-bit ST), modes
    /// restored from what was saved, and keyboard modes are undone.
    #[test]
    fn utf8_is_text_and_what_is_read_short_is_undone() {
        // U+009D, OSC itself, written in UTF-8 (C2 9D): a control to a terminal that
        // decodes UTF-8 first.
        let end = end_of(&[b"\xc2\x9d11;#000000\x07\xc2\x9b?1049h"]);
        assert!(
            end.contains("\x1b]111") && end.contains("\x1b[?1049l"),
            "{end:?}"
        );
        // Also inside a title, which they cancel to start their own.
        let end = end_of(&[b"\x1b]0;x\xc2\x9d10;#000000\x07\x1b]0;x\xc2\x9b?1000h\x07"]);
        assert!(
            end.contains("\x1b]110") && end.contains("\x1b[?1000l"),
            "{end:?}"
        );
        let quoted = "“quoted” 来 Ν".as_bytes();
        assert_eq!(changes(&[quoted]).before_messages(), BEFORE_MESSAGES);
        assert_eq!(
            end_of(&[quoted]).as_bytes(),
            [BEFORE_MESSAGES, SOFT_RESET].concat()
        );
        let long = [b"\x1b]10;".as_slice(), &[b'x'; 600], b";#000\x07"].concat();
        for output in [long.as_slice(), b"\x1b]10;?\x9c;#000\x07"] {
            let before = String::from_utf8(changes(&[output]).before_messages()).unwrap();
            assert!(before.contains("\x1b]111"), "{before:?}");
        }
        let end = end_of(&[b"\x1b[?1000s\x1b[?1000l\x1b[?1000r"]);
        assert!(end.contains("\x1b[?1000l"), "{end:?}");
        let end = end_of(&[b"\x1b[>1u\x1b[>4;2m"]);
        assert!(
            end.contains("\x1b[<99u") && end.contains("\x1b[>4;0m"),
            "{end:?}"
        );
    }

    /// Modes named past the 32nd parameter are seen, and undone: before, they were dropped,
    /// and a terminal taking more parameters was left on the alternate screen with mouse
    /// reports on.
    #[test]
    fn modes_past_many_parameters_are_undone() {
        let mut seq = b"\x1b[?".to_vec();
        seq.extend_from_slice("0;".repeat(40).as_bytes());
        seq.extend_from_slice("1000;".repeat(100).as_bytes());
        seq.extend_from_slice(b"1049;2004h");
        let end = end_of(&[&seq]);
        for mode in ["1049", "1000", "2004"] {
            assert!(end.contains(&format!("\x1b[?{mode}l")), "{mode}: {end:?}");
        }
    }

    /// A mode an 8-bit CSI turns off is taken to stay on (a UTF-8 terminal shows the byte as
    /// text): it is turned off at the end all the same.
    #[test]
    fn an_eight_bit_csi_never_clears_a_mode() {
        let end = end_of(&[b"\x1b[?1049h\x1b[?1000h\x9b?1049;1000l"]);
        assert!(
            end.contains("\x1b[?1049l") && end.contains("\x1b[?1000l"),
            "{end:?}"
        );
    }

    #[test]
    fn a_colour_asked_for_is_not_set() {
        let end = end_of(&[b"\x1b]11;?\x07\x1b]4;1;?;2;?\x1b\\\x1b]10;?;?\x07"]);
        assert!(!end.contains("\x1b]1"), "only queries: {end:?}");
        let end = end_of(&[b"\x1b]10;?;#000\x07\x1b]4;1;?;2;red\x07"]);
        assert!(
            end.contains("\x1b]111") && !end.contains("\x1b]110"),
            "{end:?}"
        );
        assert!(end.contains("\x1b]104"), "{end:?}");
        let long = [b"\x1b]12;".as_slice(), &[b'x'; 600], b"\x07"].concat();
        assert!(end_of(&[&long]).contains("\x1b]112"));
    }

    /// A terminal ignores NUL and DEL, and acts on other C0 controls, between ESC and what
    /// follows it or inside a control sequence, and goes on reading the sequence. Before,
    /// such a byte ended the reading here: `ESC NUL [ ? 1049 h` left the alternate screen,
    /// mouse reports or modifyOtherKeys on unseen, and black-on-black colours hid flowhost's
    /// messages.
    #[test]
    fn controls_a_terminal_ignores_inside_a_sequence_do_not_hide_it() {
        let end =
            end_of(&[b"\x1b\0[?1049h\x1b\r[?1000h\x1b[?2004\x7fh\x1b\0[>4;2m\x1b\x7f]11;#000\x07"]);
        for undo in [
            "\x1b[?1049l",
            "\x1b[?1000l",
            "\x1b[?2004l",
            "\x1b[>4;0m",
            "\x1b]111",
        ] {
            assert!(end.contains(undo), "{undo:?}: {end:?}");
        }
        let mut screen = changes(&[b"\x1b\0]10;#000\x07"]);
        let before = String::from_utf8(screen.before_messages()).unwrap();
        assert!(before.contains("\x1b]110\x1b\\"), "{before:?}");
        assert!(screen.at_end().ends_with(b"\x1b]110\x1b\\"));
    }

    /// A command that switches how the terminal reads bytes (`ESC % @`, off UTF-8: a raw
    /// 0x9B is then a CSI) or into VT52 mode (`CSI ? 2 l`: no `ESC [` is read any more) is
    /// followed, and switched back, before flowhost's messages and at the end. Before, a
    /// mode set after the switch went unseen, and the undoing was read as text.
    #[test]
    fn a_switch_of_encoding_or_to_vt52_is_followed_and_undone() {
        let mut screen = changes(&[b"\x1b%@\xc3\x9b?1000h"]);
        let end = String::from_utf8(screen.at_end()).unwrap();
        assert!(
            end.starts_with("\x1b%G") && end.contains("\x1b[?1000l"),
            "{end:?}"
        );
        // Back on UTF-8, the bytes of a character are text again.
        let end = end_of(&[b"\x1b%@\x1b%G\xc3\x9b?1000h"]);
        assert!(!end.contains("1000l"), "{end:?}");
        let screen = changes(&[b"\x1b[?2l"]);
        assert!(screen.before_messages().starts_with(b"\x1b<\x1b<"));
        // Twice: a pending VT52 cursor move takes the first as its row and column.
        assert!(end_of(&[b"\x1b[?2l\x1bY"]).starts_with("\x1b<\x1b<"));
        // An 8-bit CSI switches to VT52 too (off UTF-8, or read as C1 in UTF-8).
        assert!(end_of(&[b"\x1b%@\x9b?2l"]).starts_with("\x1b<\x1b<"));
        assert!(end_of(&[b"\xc2\x9b?2l"]).starts_with("\x1b<\x1b<"));
        // Windows Terminal's win32-input-mode sends every key as a sequence.
        assert!(end_of(&[b"\x1b[?9001h"]).contains("\x1b[?9001l"));
    }

    #[test]
    fn a_cancelled_sequence_sets_nothing() {
        let end = end_of(&[b"\x1b[?1000\x18h\x1b]1\x1a1;red"]);
        assert!(!end.contains("1000l") && !end.contains("111"), "{end:?}");
    }
}
