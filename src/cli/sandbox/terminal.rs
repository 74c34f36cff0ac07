//! The command's own terminal in `flowhost sandbox run`.
//!
//! When any of flowhost's stdin, stdout and stderr is a terminal, the command gets a new
//! pseudo-terminal in its place (for exactly those streams; files and pipes stay as they
//! are), made like the caller's terminal (modes and window size, and the size follows
//! SIGWINCH) and made the command's controlling terminal. The caller's terminal is never
//! passed to the command: a terminal in another session is not that session's controlling
//! terminal, so the kernel's job control would never stop the command from reading what is
//! typed to the foreground job, and the command could stop its output (`tcflow`) under
//! flowhost.
//!
//! flowhost relays on threads of their own, so that a terminal that takes no output never
//! holds up the run: what the command writes goes to the caller's terminal, and so do
//! flowhost's own messages while stderr is that terminal (queued, up to a bound); what is typed
//! goes to the command only while flowhost is the terminal's foreground process group,
//! looked at before every read, and every read is bounded (a poll with a timeout, then a
//! read that does not wait: the modes flowhost sets ask for none). While it relays in the
//! foreground, the caller's terminal is in a raw mode that keeps ISIG: Ctrl-C, Ctrl-Z and
//! Ctrl-\ still reach flowhost as signals. The caller's modes come back on Ctrl-Z (before
//! flowhost stops) and when the run ends, however it ends.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use flowhost_broker::terminal::{Pty, TerminalError};

use super::to_stderr;
use flowhost_broker::{SpawnSpec, StdioMode};
use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, poll};
use nix::sys::termios::{
    InputFlags, LocalFlags, OutputFlags, SetArg, SpecialCharacterIndices, Termios, tcgetattr,
    tcsetattr,
};

/// How long a relay thread waits at most before it looks again at the terminal's foreground,
/// and at whether the run has ended.
const LOOK_AGAIN: u16 = 100;

/// How long the end of a run waits for the command's last output to reach the caller's
/// terminal (a terminal that takes none is left behind).
const DRAIN: Duration = Duration::from_secs(2);

/// Most bytes of flowhost's own messages that wait for a terminal that takes no output; what
/// comes beyond is dropped, and counted.
const PENDING_LIMIT: usize = 64 * 1024;

/// flowhost's own messages on their way to the caller's terminal.
#[derive(Debug, Default)]
struct Pending {
    text: Vec<u8>,
    /// Bytes dropped since the last [`Pending::take`].
    dropped: usize,
}

impl Pending {
    /// Queues `message` whole, or drops it whole when the queue is full.
    fn push(&mut self, message: &str) {
        if self.text.len() + message.len() > PENDING_LIMIT {
            self.dropped += message.len();
        } else {
            self.text.extend_from_slice(message.as_bytes());
        }
    }

    /// Everything queued, in order, then a line saying what was dropped. With `crlf` (the
    /// terminal takes output unprocessed while flowhost relays), each line feed comes with a
    /// carriage return, as output processing would have added.
    fn take(&mut self, crlf: bool) -> Vec<u8> {
        let mut text = std::mem::take(&mut self.text);
        if self.dropped > 0 {
            text.extend_from_slice(
                format!(
                    "flowhost sandbox: {} bytes of messages were dropped while the terminal \
                     took no output\n",
                    std::mem::take(&mut self.dropped)
                )
                .as_bytes(),
            );
        }
        if !crlf {
            return text;
        }
        let mut out = Vec::with_capacity(text.len() + text.len() / 32);
        for byte in text {
            if byte == b'\n' {
                out.push(b'\r');
            }
            out.push(byte);
        }
        out
    }
}

/// flowhost's own messages while the relay writes them, and the pipe that wakes the relay.
struct Messages {
    pending: Mutex<Pending>,
    wake_r: OwnedFd,
    wake_w: OwnedFd,
}

impl Messages {
    fn pending(&self) -> MutexGuard<'_, Pending> {
        // A push or take that panicked left whole messages behind.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Where flowhost's messages go instead of a direct write to stderr, while the relay runs.
static MESSAGES: Mutex<Option<Arc<Messages>>> = Mutex::new(None);

fn messages_registry() -> MutexGuard<'static, Option<Arc<Messages>>> {
    MESSAGES.lock().unwrap_or_else(|p| p.into_inner())
}

/// Hands `text` to the relay when it writes flowhost's messages (stderr is the caller's
/// terminal and the relay runs): it is queued, never written here, so a terminal that takes
/// no output cannot hold up the caller. `false` when the caller writes it itself.
pub(super) fn relayed_message(text: &str) -> bool {
    let Some(messages) = messages_registry().clone() else {
        return false;
    };
    messages.pending().push(text);
    // A full pipe already wakes the relay.
    let _ = nix::unistd::write(&messages.wake_w, b"m");
    true
}

/// Which of flowhost's standard streams are terminals, and what follows for the command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Streams {
    /// The command's stdin, stdout and stderr.
    modes: [StdioMode; 3],
    /// The caller's terminal whose modes, size and foreground are followed: the first of
    /// flowhost's stdin, stdout and stderr that is a terminal.
    caller: usize,
    /// Where what the command writes on its terminal goes: flowhost's stdout if that is a
    /// terminal, else its stderr, else its stdin (only the terminal's echo, then).
    output: usize,
    /// Whether what is typed is relayed (flowhost's stdin is a terminal).
    input: bool,
    /// Whether flowhost's own messages go through the relay (its stderr is a terminal).
    messages: bool,
}

/// What the command gets for each of flowhost's streams, given which are terminals; `None`
/// when none is (then nothing changes: the command inherits all three).
fn streams(terminals: [bool; 3]) -> Option<Streams> {
    let caller = terminals.iter().position(|t| *t)?;
    let output = [1, 2, 0].into_iter().find(|&i| terminals[i])?;
    Some(Streams {
        modes: terminals.map(|t| {
            if t {
                StdioMode::Terminal
            } else {
                StdioMode::Inherit
            }
        }),
        caller,
        output,
        input: terminals[0],
        messages: terminals[2],
    })
}

/// The modes flowhost relays in: no line editing, no echo, no input or output processing
/// (the command's own terminal does all of that, as the command set it), reads that never
/// wait, and the rest as the caller had it: ISIG above all, so that the terminal's keys
/// still signal flowhost.
fn relaying_modes(saved: &Termios) -> Termios {
    let mut raw = saved.clone();
    raw.input_flags.remove(
        InputFlags::BRKINT
            | InputFlags::ICRNL
            | InputFlags::INLCR
            | InputFlags::IGNCR
            | InputFlags::ISTRIP
            | InputFlags::IXON
            | InputFlags::PARMRK,
    );
    raw.output_flags.remove(OutputFlags::OPOST);
    raw.local_flags.remove(
        LocalFlags::ICANON
            | LocalFlags::ECHO
            | LocalFlags::ECHOE
            | LocalFlags::ECHOK
            | LocalFlags::ECHONL
            | LocalFlags::IEXTEN,
    );
    raw.control_chars[SpecialCharacterIndices::VMIN as usize] = 0;
    raw.control_chars[SpecialCharacterIndices::VTIME as usize] = 0;
    raw
}

/// Whether two sets of modes are the same (the flags and characters a terminal keeps).
fn same_modes(a: &Termios, b: &Termios) -> bool {
    a.input_flags == b.input_flags
        && a.output_flags == b.output_flags
        && a.control_flags == b.control_flags
        && a.local_flags == b.local_flags
        && a.control_chars == b.control_chars
}

/// Where flowhost stands on the caller's terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Standing {
    /// flowhost is the terminal's foreground process group.
    Foreground,
    /// Another process group is.
    Background,
    /// The terminal is not flowhost's controlling terminal: no job control applies to it.
    NotOurs,
}

fn standing(terminal: BorrowedFd<'_>) -> Standing {
    match nix::unistd::tcgetpgrp(terminal) {
        Ok(group) if group == nix::unistd::getpgrp() => Standing::Foreground,
        Err(Errno::ENOTTY) => Standing::NotOurs,
        // Any doubt (a terminal gone) is the background: nothing is read.
        _ => Standing::Background,
    }
}

/// What the relay threads and the run share.
struct Shared {
    /// The pseudo-terminal's master (non-blocking, ours alone).
    master: OwnedFd,
    /// The caller's terminal ([`Streams::caller`]).
    caller: OwnedFd,
    /// Whether flowhost sets the relaying modes (it reads the caller's terminal).
    raw: bool,
    modes: Mutex<Modes>,
    /// Set when the run ends: the relays finish, the command's last output given until
    /// then to reach the caller.
    ending: OnceLock<Instant>,
}

/// The caller's terminal modes, who may change them, and what flowhost last did to them.
struct Modes {
    /// The caller's terminal as the run found it, put back when it ends.
    saved: Termios,
    /// [`relaying_modes`] of `saved`.
    raw: Termios,
    /// The relaying modes are set by flowhost, since it last came to the foreground.
    relaying: bool,
    /// flowhost is stopping (Ctrl-Z) or the run is ending: the modes stay the caller's.
    held: bool,
}

impl Shared {
    fn modes(&self) -> MutexGuard<'_, Modes> {
        // A relay thread that panicked left nothing half-done: the modes are replaced whole.
        self.modes.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn ending(&self) -> bool {
        self.ending.get().is_some()
    }

    /// The run ended more than [`DRAIN`] ago.
    fn drained(&self) -> bool {
        self.ending.get().is_some_and(|end| Instant::now() >= *end)
    }

    /// Sets the relaying modes once per stay in the foreground (whatever sets other modes
    /// meanwhile, in the same process group, is not fought), and the window size with them
    /// (it may have changed while flowhost was in the background, where SIGWINCH does not
    /// reach it). Whether flowhost may read the terminal now.
    fn relay_here(&self) -> bool {
        let mut modes = self.modes();
        if modes.held {
            return false;
        }
        if standing(self.caller.as_fd()) != Standing::Foreground {
            modes.relaying = false;
            return false;
        }
        if !modes.relaying {
            if tcsetattr(&self.caller, SetArg::TCSANOW, &modes.raw).is_err() {
                return false;
            }
            modes.relaying = true;
            self.follow_size();
        }
        true
    }

    /// Puts the caller's modes back (if flowhost changed them and is in the foreground: a
    /// background job setting them would change them under the job in front); with `hold`,
    /// they stay so until [`Shared::release`].
    fn restore(&self, hold: bool) {
        let mut modes = self.modes();
        modes.held |= hold;
        if modes.relaying
            && standing(self.caller.as_fd()) == Standing::Foreground
            && tcgetattr(&self.caller).is_ok_and(|now| !same_modes(&now, &modes.saved))
        {
            // TCSANOW: waiting for the output to drain would wait forever on a terminal
            // that takes none. A terminal that went away has no modes left to restore.
            let _ = tcsetattr(&self.caller, SetArg::TCSANOW, &modes.saved);
        }
        modes.relaying = false;
    }

    fn release(&self) {
        self.modes().held = false;
        if self.raw {
            self.relay_here();
        }
    }

    /// Gives the command's terminal the caller's window size (the kernel then signals
    /// SIGWINCH to the command's foreground job).
    fn follow_size(&self) {
        if let Ok(size) = flowhost_broker::terminal::window_size(&self.caller) {
            let _ = flowhost_broker::terminal::set_window_size(&self.master, &size);
        }
    }

    /// Whether what the command writes may go to the caller's terminal now: in the
    /// foreground, or in the background unless the terminal stops background jobs that
    /// write (TOSTOP). Held back, the command's writes block on its own full terminal, as
    /// a stopped job's would.
    fn may_write(&self) -> bool {
        match standing(self.caller.as_fd()) {
            Standing::Foreground | Standing::NotOurs => true,
            Standing::Background => {
                tcgetattr(&self.caller).is_ok_and(|m| !m.local_flags.contains(LocalFlags::TOSTOP))
            }
        }
    }
}

/// Blocks SIGTTIN and SIGTTOU on the calling thread: a read in the background then fails
/// (EIO) instead of stopping flowhost, and a write the thread decided to make is made.
fn without_job_control_stops() {
    let mut set = nix::sys::signal::SigSet::empty();
    set.add(nix::sys::signal::Signal::SIGTTIN);
    set.add(nix::sys::signal::Signal::SIGTTOU);
    let _ = nix::sys::signal::pthread_sigmask(
        nix::sys::signal::SigmaskHow::SIG_BLOCK,
        Some(&set),
        None,
    );
}

/// Waits at most [`LOOK_AGAIN`] ms for `events` on `fd`; the events that came.
fn wait_for(fd: BorrowedFd<'_>, events: PollFlags) -> PollFlags {
    let mut fds = [PollFd::new(fd, events)];
    match poll(&mut fds, LOOK_AGAIN) {
        Ok(n) if n > 0 => fds[0].revents().unwrap_or(PollFlags::empty()),
        _ => PollFlags::empty(),
    }
}

/// Writes all of `bytes` to `to`, waiting as long as it takes (on a relay thread, never the
/// run's) unless `give_up` says otherwise. `false` when `to` takes no more (a terminal gone,
/// the command's terminal closed) or it gave up.
fn write_all(to: BorrowedFd<'_>, mut bytes: &[u8], give_up: &dyn Fn() -> bool) -> bool {
    while !bytes.is_empty() {
        match nix::unistd::write(to, bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(Errno::EINTR) => {}
            Err(Errno::EAGAIN) => {
                wait_for(to, PollFlags::POLLOUT);
                if give_up() {
                    return false;
                }
            }
            Err(_) => return false,
        }
    }
    true
}

/// Command -> caller: what the command's terminal shows goes to the caller's terminal, and
/// flowhost's messages (`messages`, written to its stderr), as they come. It ends once the run
/// has ended and the command's terminal closed (everything on it ended) and the messages are
/// out, or [`DRAIN`] after the run ended, whatever is left.
fn relay_output(shared: &Shared, to: OwnedFd, messages: Option<(Arc<Messages>, OwnedFd)>) {
    without_job_control_stops();
    let mut buf = vec![0u8; 16 * 1024];
    let (mut master_open, mut to_caller) = (true, true);
    let give_up = || shared.drained();
    loop {
        if shared.drained() {
            return;
        }
        let may_write = shared.may_write();
        let mut fds = Vec::with_capacity(2);
        if may_write && master_open {
            fds.push(PollFd::new(shared.master.as_fd(), PollFlags::POLLIN));
        }
        if let Some((messages, _)) = &messages {
            fds.push(PollFd::new(messages.wake_r.as_fd(), PollFlags::POLLIN));
        }
        if fds.is_empty() {
            std::thread::sleep(Duration::from_millis(LOOK_AGAIN.into()));
        } else {
            let _ = poll(&mut fds, LOOK_AGAIN);
        }
        drop(fds);
        if may_write && master_open {
            match nix::unistd::read(&shared.master, &mut buf) {
                Ok(0) | Err(Errno::EIO) => master_open = false,
                // A caller's terminal that went away: the rest is read and dropped, so the
                // command never blocks on its own terminal.
                Ok(n) => to_caller = to_caller && write_all(to.as_fd(), &buf[..n], &give_up),
                Err(Errno::EAGAIN | Errno::EINTR) => {}
                Err(_) => master_open = false,
            }
        }
        let mut left = false;
        if let Some((messages, stderr)) = &messages {
            let mut wake = [0u8; 64];
            while matches!(nix::unistd::read(&messages.wake_r, &mut wake), Ok(n) if n > 0) {}
            if may_write {
                let crlf =
                    tcgetattr(stderr).is_ok_and(|m| !m.output_flags.contains(OutputFlags::OPOST));
                let text = messages.pending().take(crlf);
                write_all(stderr.as_fd(), &text, &give_up);
            }
            left = !messages.pending().text.is_empty();
        }
        if shared.ending() && !master_open && !left {
            return;
        }
        if !master_open && messages.is_none() {
            return;
        }
    }
}

/// Caller -> command: what is typed goes to the command, only while flowhost is in the
/// foreground, until the run ends or the caller's terminal goes away.
fn relay_input(shared: &Shared, from: OwnedFd) {
    without_job_control_stops();
    let mut buf = vec![0u8; 4096];
    while !shared.ending() {
        if !shared.relay_here() {
            std::thread::sleep(Duration::from_millis(LOOK_AGAIN.into()));
            continue;
        }
        let came = wait_for(from.as_fd(), PollFlags::POLLIN);
        if came.intersects(PollFlags::POLLHUP | PollFlags::POLLERR | PollFlags::POLLNVAL) {
            return;
        }
        // Looked at again right before reading: moved to the background since, the read
        // fails (EIO, SIGTTIN being blocked) rather than take the foreground's input.
        if !came.contains(PollFlags::POLLIN) || !shared.relay_here() {
            continue;
        }
        match nix::unistd::read(&from, &mut buf) {
            // The relaying modes make a read return what there is, possibly nothing.
            Ok(n) => {
                if !write_all(shared.master.as_fd(), &buf[..n], &|| shared.ending()) {
                    return;
                }
            }
            Err(Errno::EINTR | Errno::EAGAIN | Errno::EIO) => {}
            Err(_) => return,
        }
    }
}

/// Why the relay of the command's terminal could not start.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// A descriptor of the caller's terminal could not be duplicated for the relay.
    #[error("cannot relay the command's terminal ({what}): {source}")]
    Relay {
        /// What was being done.
        what: &'static str,
        /// Why.
        source: std::io::Error,
    },
    /// The pseudo-terminal could not be made.
    #[error(transparent)]
    Terminal(#[from] TerminalError),
}

/// The command's own terminal for one run, and its relay. Dropping it ends the relay (after
/// at most [`DRAIN`] for the command's last output) and puts the caller's modes back.
pub(super) struct CommandTerminal {
    shared: Arc<Shared>,
    streams: Streams,
    /// The slave, until given to the command.
    slave: Option<OwnedFd>,
    /// The relay threads say here that they ended.
    ended: Option<std::sync::mpsc::Receiver<()>>,
    threads: usize,
}

/// Flowhost's stream `i` (0 to 2), duplicated.
fn standard(i: usize) -> std::io::Result<OwnedFd> {
    match i {
        0 => std::io::stdin().as_fd().try_clone_to_owned(),
        1 => std::io::stdout().as_fd().try_clone_to_owned(),
        _ => std::io::stderr().as_fd().try_clone_to_owned(),
    }
}

/// [`standard`], for the relay.
fn duplicate(i: usize) -> Result<OwnedFd, RelayError> {
    standard(i).map_err(|source| RelayError::Relay {
        what: "duplicating a standard stream",
        source,
    })
}

impl CommandTerminal {
    /// A pseudo-terminal for the command when any of flowhost's standard streams is a
    /// terminal (`None` when none is). Fails, naming why, when none can be made: the
    /// caller's terminal is never handed over instead.
    pub(super) fn open() -> Result<Option<CommandTerminal>, RelayError> {
        let terminals =
            [0, 1, 2].map(|i| standard(i).is_ok_and(|fd| nix::unistd::isatty(fd).unwrap_or(false)));
        let Some(streams) = streams(terminals) else {
            return Ok(None);
        };
        let caller = duplicate(streams.caller)?;
        let pty = Pty::open_like(caller.as_fd())?;
        let saved = tcgetattr(&caller).map_err(|e| RelayError::Relay {
            what: "reading the caller's terminal modes",
            source: e.into(),
        })?;
        let shared = Arc::new(Shared {
            master: pty.master,
            caller,
            raw: streams.input,
            modes: Mutex::new(Modes {
                raw: relaying_modes(&saved),
                saved,
                relaying: false,
                held: false,
            }),
            ending: OnceLock::new(),
        });
        Ok(Some(CommandTerminal {
            shared,
            streams,
            slave: Some(pty.slave),
            ended: None,
            threads: 0,
        }))
    }

    /// Gives the command its terminal: the slave for each stream that was a terminal.
    pub(super) fn give_to(&mut self, spec: &mut SpawnSpec) {
        [spec.stdin, spec.stdout, spec.stderr] = self.streams.modes;
        spec.terminal = self.slave.take();
    }

    /// Starts relaying, once the command runs.
    pub(super) fn relay(&mut self) -> Result<(), RelayError> {
        let (done, ended) = std::sync::mpsc::channel();
        self.ended = Some(ended);
        let messages = if self.streams.messages {
            let (wake_r, wake_w) =
                nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK)
                    .map_err(|e| RelayError::Relay {
                        what: "creating the pipe that wakes the relay",
                        source: e.into(),
                    })?;
            let messages = Arc::new(Messages {
                pending: Mutex::new(Pending::default()),
                wake_r,
                wake_w,
            });
            Some((messages, duplicate(2)?))
        } else {
            None
        };
        let to = duplicate(self.streams.output)?;
        let registered = messages.as_ref().map(|(m, _)| m.clone());
        self.start("flowhost-tty-out", &done, move |shared| {
            relay_output(shared, to, messages)
        })?;
        // From here flowhost's messages are queued for the relay.
        *messages_registry() = registered;
        if self.streams.input {
            if standing(self.shared.caller.as_fd()) == Standing::NotOurs {
                say!(
                    "flowhost sandbox: stdin is a terminal that is not flowhost's controlling \
                     terminal, so flowhost cannot tell whether it is in the foreground: \
                     nothing typed reaches the command"
                );
            } else {
                let from = duplicate(0)?;
                self.start("flowhost-tty-in", &done, move |shared| {
                    relay_input(shared, from)
                })?;
            }
        }
        Ok(())
    }

    /// Runs `relay` on a thread of its own.
    fn start(
        &mut self,
        name: &str,
        done: &std::sync::mpsc::Sender<()>,
        relay: impl FnOnce(&Shared) + Send + 'static,
    ) -> Result<(), RelayError> {
        let (shared, done) = (self.shared.clone(), done.clone());
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                relay(&shared);
                let _ = done.send(());
            })
            .map_err(|source| RelayError::Relay {
                what: "starting a relay thread",
                source,
            })?;
        self.threads += 1;
        Ok(())
    }

    /// The master of the command's terminal: what a key's signal goes through.
    pub(super) fn master(&self) -> BorrowedFd<'_> {
        self.shared.master.as_fd()
    }

    /// Ctrl-Z: the caller's modes go back before flowhost stops, and stay until
    /// [`CommandTerminal::resume`].
    pub(super) fn suspend(&self) {
        self.shared.restore(true);
    }

    /// flowhost continued: the relaying modes come back if it is in the foreground.
    pub(super) fn resume(&self) {
        self.shared.release();
    }

    /// SIGWINCH: the command's terminal takes the caller's new size.
    pub(super) fn resized(&self) {
        self.shared.follow_size();
    }
}

impl Drop for CommandTerminal {
    fn drop(&mut self) {
        let _ = self.shared.ending.set(Instant::now() + DRAIN);
        let mut all_ended = true;
        if let Some(ended) = &self.ended {
            let deadline = Instant::now() + DRAIN + Duration::from_millis(LOOK_AGAIN.into());
            for _ in 0..self.threads {
                let left = deadline.saturating_duration_since(Instant::now());
                if ended.recv_timeout(left).is_err() {
                    all_ended = false;
                    break;
                }
            }
        }
        // A relay still writing to a terminal that takes no output keeps the messages: a
        // later one is queued (and lost when flowhost exits), never written here, where it
        // would wait with it.
        if all_ended {
            *messages_registry() = None;
        }
        self.shared.restore(true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_streams_that_are_terminals_get_the_commands_terminal() {
        use StdioMode::{Inherit, Terminal};
        assert_eq!(streams([false; 3]), None);
        let all = streams([true; 3]).expect("terminals");
        assert_eq!(all.modes, [Terminal; 3]);
        assert_eq!((all.caller, all.output, all.input), (0, 1, true));
        // `cmd < file`: stdin stays the file, nothing typed is relayed.
        let out = streams([false, true, true]).expect("terminals");
        assert_eq!(out.modes, [Inherit, Terminal, Terminal]);
        assert_eq!((out.caller, out.output, out.input), (1, 1, false));
        // `cmd > file 2>&1`: only stdin; the terminal's echo goes back to it.
        let input = streams([true, false, false]).expect("terminals");
        assert_eq!(input.modes, [Terminal, Inherit, Inherit]);
        assert_eq!((input.caller, input.output, input.input), (0, 0, true));
        // `cmd 2> file`.
        let err = streams([true, true, false]).expect("terminals");
        assert_eq!(err.modes, [Terminal, Terminal, Inherit]);
        assert_eq!(err.output, 1);
        assert!(all.messages && !err.messages);
    }

    /// flowhost's messages wait whole, up to a bound, and what was dropped is said.
    #[test]
    fn messages_wait_whole_up_to_a_bound_and_the_dropped_are_counted() {
        let mut pending = Pending::default();
        pending.push("one\n");
        pending.push("two\n");
        assert_eq!(pending.take(false), b"one\ntwo\n");
        assert_eq!(pending.take(true), b"");
        pending.push("raw\n");
        assert_eq!(pending.take(true), b"raw\r\n");
        let line = "x".repeat(1000) + "\n";
        for _ in 0..100 {
            pending.push(&line);
        }
        let text = String::from_utf8(pending.take(false)).expect("text");
        let kept = PENDING_LIMIT / line.len();
        assert_eq!(text.matches(&line).count(), kept);
        assert!(
            text.ends_with(&format!(
                "{} bytes of messages were dropped while the terminal took no output\n",
                (100 - kept) * line.len()
            )),
            "{}",
            &text[text.len() - 200..]
        );
        assert_eq!(pending.dropped, 0);
    }

    /// The relaying modes pass every byte on as typed and never wait in a read, and keep
    /// ISIG with the caller's keys: Ctrl-C still signals flowhost.
    #[test]
    fn relaying_modes_keep_the_keys_that_signal() {
        let pty = nix::pty::openpty(None, None).expect("a pseudo-terminal");
        let saved = tcgetattr(&pty.slave).expect("modes");
        assert!(
            saved
                .local_flags
                .contains(LocalFlags::ISIG | LocalFlags::ICANON)
        );
        let raw = relaying_modes(&saved);
        assert!(raw.local_flags.contains(LocalFlags::ISIG));
        assert!(
            !raw.local_flags
                .intersects(LocalFlags::ICANON | LocalFlags::ECHO | LocalFlags::IEXTEN)
        );
        assert!(
            !raw.input_flags
                .intersects(InputFlags::ICRNL | InputFlags::IXON)
        );
        assert!(!raw.output_flags.contains(OutputFlags::OPOST));
        let cc = |t: &Termios, i: SpecialCharacterIndices| t.control_chars[i as usize];
        for key in [
            SpecialCharacterIndices::VINTR,
            SpecialCharacterIndices::VQUIT,
            SpecialCharacterIndices::VSUSP,
        ] {
            assert_eq!(cc(&raw, key), cc(&saved, key));
        }
        assert_eq!(cc(&raw, SpecialCharacterIndices::VMIN), 0);
        assert_eq!(cc(&raw, SpecialCharacterIndices::VTIME), 0);
        // What the terminal keeps of them is what was set.
        tcsetattr(&pty.slave, SetArg::TCSANOW, &raw).expect("set");
        assert!(same_modes(&tcgetattr(&pty.slave).expect("modes"), &raw));
        assert!(!same_modes(&raw, &saved));
    }
}
