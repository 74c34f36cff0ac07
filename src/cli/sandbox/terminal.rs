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
//!
//! Once the run has ended (its records closed, its health written, its gate judged), nothing
//! is left that a terminal could hold up, and nothing that was meant for the caller is
//! dropped: what the relay could not write yet, what is still on the command's terminal and
//! the messages still queued are written by the run's own thread, with the caller's modes
//! back, as any program writes to its terminal. A background flowhost on a terminal that
//! stops background jobs that write (`stty tostop`) is then stopped by the kernel (SIGTTOU)
//! until `fg`, and a terminal that takes no output (XOFF) is waited for; the terminal's keys
//! and `kill` end or stop flowhost meanwhile, as they would any program.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use flowhost_broker::terminal::{Pty, TerminalError};

use super::to_stderr;
use flowhost_broker::{SpawnSpec, StdioMode};
use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::termios::{
    InputFlags, LocalFlags, OutputFlags, SetArg, SpecialCharacterIndices, Termios, tcgetattr,
    tcsetattr,
};
use screen::ScreenChanges;

mod screen;

/// The name of the thread that relays the command's output (the one the end of a run waits
/// for, however long it takes).
const OUTPUT_RELAY: &str = "flowhost-tty-out";

/// How long a relay thread waits at most before it looks again at the terminal's foreground,
/// and at whether the run has ended.
const LOOK_AGAIN: u16 = 100;

/// Most bytes the end of a run reads from the command's terminal: everything the command
/// left there fits many times over; more could come only from a process that outlived the run
/// (none should: the run ends everything in the command's cgroup), which is not the run's.
const TAIL_LIMIT: usize = 1024 * 1024;

/// Most bytes of flowhost's own messages that wait for a terminal that takes no output; what
/// comes beyond is dropped, and counted.
const PENDING_LIMIT: usize = 64 * 1024;

/// flowhost's own messages on their way to the caller's terminal.
#[derive(Debug, Default)]
struct Pending {
    text: Vec<u8>,
    /// Bytes dropped since the last [`Pending::take`].
    dropped: usize,
    /// Set once the command has ended (see [`CommandTerminal::hold`]): what flowhost says
    /// then (how the run ended, the gate's report) is its last words, written by the end of
    /// the run whatever their size, and never dropped for a bound meant for a terminal that
    /// takes no output while the command runs.
    unbounded: bool,
}

impl Pending {
    /// Queues `message` whole, or drops it whole when the queue is full.
    fn push(&mut self, message: &str) {
        if !self.unbounded && self.text.len() + message.len() > PENDING_LIMIT {
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
    /// Where what the command writes goes ([`Streams::output`]).
    output: OwnedFd,
    /// flowhost's stdin, when what is typed is relayed ([`Streams::input`]).
    input: Option<OwnedFd>,
    /// flowhost's messages and its stderr, when they go through the relay
    /// ([`Streams::messages`]).
    messages: Option<(Arc<Messages>, OwnedFd)>,
    /// Whether flowhost sets the relaying modes (it reads the caller's terminal).
    raw: bool,
    modes: Mutex<Modes>,
    /// Set when the run ends: the relays stop, and the run writes what is left.
    ending: AtomicBool,
    /// Set once the command has ended: flowhost's messages wait for the end of the run,
    /// which writes them after the command's last output (see [`CommandTerminal::hold`]).
    holding: AtomicBool,
    /// What the output relay took but had not written when the run ended, and what the
    /// caller's terminal refused.
    unwritten: Mutex<Unwritten>,
    /// What the command's output changed on the caller's terminal, seen as it is relayed.
    screen: Mutex<ScreenChanges>,
}

/// Bytes the output relay handed back, for the end of the run to write, and those nobody
/// will see.
#[derive(Debug, Default)]
struct Unwritten {
    /// The command's output, for [`Shared::output`].
    output: Vec<u8>,
    /// flowhost's messages, for its stderr.
    messages: Vec<u8>,
    /// Bytes the caller's terminal refused (it went away).
    refused: usize,
    /// Why it refused them, the last time.
    refusal: Option<Errno>,
}

impl Unwritten {
    fn refuse(&mut self, bytes: usize, why: Errno) {
        self.refused += bytes;
        self.refusal = Some(why);
    }
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
        self.ending.load(Ordering::SeqCst)
    }

    fn unwritten(&self) -> MutexGuard<'_, Unwritten> {
        // Bytes are appended whole, under the lock.
        self.unwritten.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn screen(&self) -> MutexGuard<'_, ScreenChanges> {
        // At worst a panic mid-read leaves one sequence half read: what it set is missed,
        // as a terminal that lost those bytes would have missed it.
        self.screen.lock().unwrap_or_else(|p| p.into_inner())
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

/// Why [`write_all`] did not write everything.
#[derive(Debug, PartialEq, Eq)]
enum Short<'a> {
    /// `to` takes no more (a terminal gone, the command's terminal closed), and why.
    Gone(Errno),
    /// It gave up: what was not written, in order.
    Left(&'a [u8]),
}

/// Writes all of `bytes` to `to`, waiting as long as it takes (on a relay thread, never the
/// run's) unless `give_up` says otherwise; what it gave up on is handed back, never dropped.
fn write_all<'a>(
    to: BorrowedFd<'_>,
    mut bytes: &'a [u8],
    give_up: &dyn Fn() -> bool,
) -> Result<(), Short<'a>> {
    while !bytes.is_empty() {
        match nix::unistd::write(to, bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(Errno::EINTR) => {}
            Err(Errno::EAGAIN) => {
                wait_for(to, PollFlags::POLLOUT);
                if give_up() {
                    return Err(Short::Left(bytes));
                }
            }
            Err(e) => return Err(Short::Gone(e)),
        }
    }
    Ok(())
}

/// Writes all of `bytes` to the caller's terminal `to` as any program writes to its
/// terminal: a terminal that takes no output is waited for, and a background flowhost on a
/// terminal that stops background jobs that write (TOSTOP) is stopped by the kernel until it
/// is continued (the calling thread must not block SIGTTOU). A description someone else
/// made non-blocking is waited on as a blocking one would be, and left as it is. Fails,
/// with how many bytes were not written, only when the terminal refuses them (gone, or
/// flowhost's process group orphaned).
fn write_out(to: BorrowedFd<'_>, mut bytes: &[u8]) -> Result<(), (usize, Errno)> {
    while !bytes.is_empty() {
        match nix::unistd::write(to, bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(Errno::EINTR) => {}
            Err(Errno::EAGAIN) => {
                let mut fds = [PollFd::new(to, PollFlags::POLLOUT)];
                let _ = poll(&mut fds, PollTimeout::NONE);
            }
            Err(e) => return Err((bytes.len(), e)),
        }
    }
    Ok(())
}

/// What is still on the command's terminal: read from its (non-blocking) master until it has
/// nothing more (EAGAIN) or nothing holds the terminal any more (EIO), at most `limit` bytes;
/// `true` when it stopped at `limit` (something still writes there, or had written more).
fn drain(master: BorrowedFd<'_>, limit: usize) -> (Vec<u8>, bool) {
    let mut tail = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let room = limit - tail.len();
        match nix::unistd::read(master, &mut buf[..room.clamp(1, 16 * 1024)]) {
            Ok(0) => return (tail, false),
            Ok(_) if room == 0 => return (tail, true),
            Ok(n) => tail.extend_from_slice(&buf[..n]),
            Err(Errno::EINTR) => {}
            Err(_) => return (tail, false),
        }
    }
}

/// Command -> caller: what the command's terminal shows goes to the caller's terminal, and
/// flowhost's messages (written to its stderr), as they come, until the run ends or there is
/// nothing more to relay. What it took and could not write when the run ended is handed back
/// ([`Shared::unwritten`]) for the end of the run to write.
fn relay_output(shared: &Shared) {
    without_job_control_stops();
    let mut buf = vec![0u8; 16 * 1024];
    let (mut master_open, mut to_caller) = (true, true);
    let give_up = || shared.ending();
    let messages = shared.messages.as_ref();
    while !shared.ending() {
        let may_write = shared.may_write();
        let mut fds = Vec::with_capacity(2);
        if may_write && master_open {
            fds.push(PollFd::new(shared.master.as_fd(), PollFlags::POLLIN));
        }
        if let Some((messages, _)) = messages {
            fds.push(PollFd::new(messages.wake_r.as_fd(), PollFlags::POLLIN));
        }
        if fds.is_empty() {
            std::thread::sleep(Duration::from_millis(LOOK_AGAIN.into()));
        } else {
            let _ = poll(&mut fds, LOOK_AGAIN);
        }
        drop(fds);
        if may_write && master_open {
            let read = nix::unistd::read(&shared.master, &mut buf);
            if let Ok(n) = read {
                shared.screen().see(&buf[..n]);
            }
            match read {
                Ok(0) | Err(Errno::EIO) => master_open = false,
                // A caller's terminal that went away: the rest is read and dropped, so the
                // command never blocks on its own terminal.
                Ok(n) if to_caller => match write_all(shared.output.as_fd(), &buf[..n], &give_up) {
                    Ok(()) => {}
                    Err(Short::Gone(why)) => {
                        shared.unwritten().refuse(n, why);
                        to_caller = false;
                    }
                    Err(Short::Left(left)) => {
                        shared.unwritten().output.extend_from_slice(left);
                        return;
                    }
                },
                Ok(n) => shared.unwritten().refused += n,
                Err(Errno::EAGAIN | Errno::EINTR) => {}
                Err(_) => master_open = false,
            }
        }
        if let Some((messages, stderr)) = messages {
            let mut wake = [0u8; 64];
            while matches!(nix::unistd::read(&messages.wake_r, &mut wake), Ok(n) if n > 0) {}
            if may_write && !shared.holding.load(Ordering::SeqCst) {
                let crlf =
                    tcgetattr(stderr).is_ok_and(|m| !m.output_flags.contains(OutputFlags::OPOST));
                let mut text = messages.pending().take(crlf);
                if !text.is_empty() {
                    text.splice(0..0, shared.screen().before_messages());
                }
                match write_all(stderr.as_fd(), &text, &give_up) {
                    Ok(()) => {}
                    Err(Short::Gone(why)) => shared.unwritten().refuse(text.len(), why),
                    Err(Short::Left(left)) => {
                        shared.unwritten().messages.extend_from_slice(left);
                        return;
                    }
                }
            }
        } else if !master_open {
            return;
        }
    }
}

/// Caller -> command: what is typed goes to the command, only while flowhost is in the
/// foreground, until the run ends or the caller's terminal goes away.
fn relay_input(shared: &Shared) {
    without_job_control_stops();
    let Some(from) = &shared.input else {
        return;
    };
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
        match nix::unistd::read(from, &mut buf) {
            // The relaying modes make a read return what there is, possibly nothing. What is
            // typed after the run ended is nobody's.
            Ok(n) => {
                if write_all(shared.master.as_fd(), &buf[..n], &|| shared.ending()).is_err() {
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

/// Why some of the command's output or of flowhost's messages never reached the caller's
/// terminal: it refused them (it went away, or flowhost's process group was orphaned).
#[derive(Debug, thiserror::Error)]
#[error(
    "{bytes} bytes of the command's output or of flowhost's messages were not shown: the \
     caller's terminal refused them ({why}); the run itself ended as it did (its records, \
     health and gate stand)"
)]
pub struct NotShown {
    /// How many bytes.
    pub bytes: usize,
    /// The last refusal.
    pub why: Errno,
}

/// The command's own terminal for one run, and its relay. [`CommandTerminal::finish`] (or
/// dropping it) ends the relay, puts the caller's modes back and writes what is left.
pub(super) struct CommandTerminal {
    shared: Arc<Shared>,
    streams: Streams,
    /// The slave, until given to the command.
    slave: Option<OwnedFd>,
    /// The relay threads say here that they ended.
    ended: Option<std::sync::mpsc::Receiver<&'static str>>,
    threads: usize,
    /// [`CommandTerminal::finish`] ran.
    finished: bool,
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

/// The end of a run may wait on the caller's terminal as long as it takes no output: the
/// interrupts flowhost took to pass them to the command end or stop it again, as they would
/// any program (a Ctrl-C or a `kill` would otherwise be taken and the write go on waiting).
fn interrupts_end_flowhost(taken: &mut dyn FnMut() -> Vec<libc::c_int>) {
    raise(default_actions_back(taken));
}

/// Gives the interrupts their default actions back (once), and returns those flowhost's
/// own handlers took after the command ended and before that, which nobody acted on: each
/// is to take its default action before flowhost waits, as it would have at once.
fn default_actions_back(taken: &mut dyn FnMut() -> Vec<libc::c_int>) -> Vec<libc::c_int> {
    static DONE: std::sync::Once = std::sync::Once::new();
    let mut late = Vec::new();
    DONE.call_once(|| {
        if let Err(e) = flowhost_broker::terminal::interrupts_take_their_default_action() {
            say!(
                "flowhost sandbox: cannot give the interrupts their default action back ({e}): \
                 while flowhost waits for the terminal to take its last output, only SIGKILL \
                 ends it"
            );
            return;
        }
        late = taken();
    });
    late
}

/// Whether the caller's terminal takes `out` without flowhost waiting: flowhost is in its
/// foreground (in the background a write may stop it, SIGTTOU), each descriptor can be
/// written now (not stopped by XOFF, nor full), and it is short enough to fit what a
/// terminal holds. An interrupt already taken must not wait behind a write that blocks.
fn taken_at_once(caller: BorrowedFd<'_>, out: &[(BorrowedFd<'_>, Vec<u8>)]) -> bool {
    /// Bytes a terminal that can be written takes without blocking, with room to spare.
    const AT_ONCE: usize = 2048;
    let writable = |fd: BorrowedFd<'_>| {
        let mut fds = [PollFd::new(fd, PollFlags::POLLOUT)];
        poll(&mut fds, PollTimeout::ZERO).is_ok_and(|n| n == 1)
            && fds[0].revents().is_some_and(|r| r == PollFlags::POLLOUT)
    };
    standing(caller) == Standing::Foreground
        && out.iter().map(|(_, text)| text.len()).sum::<usize>() <= AT_ONCE
        && out
            .iter()
            .all(|(fd, text)| text.is_empty() || writable(*fd))
}

/// Raises `signals`, each with its default action (see [`default_actions_back`]).
fn raise(signals: Vec<libc::c_int>) {
    for signal in signals {
        if let Ok(signal) = nix::sys::signal::Signal::try_from(signal) {
            let _ = nix::sys::signal::raise(signal);
        }
    }
}

impl CommandTerminal {
    /// A pseudo-terminal for the command when any of flowhost's standard streams is a
    /// terminal (`None` when none is), with everything its relay needs. Fails, naming why,
    /// when any of that cannot be had: the caller's terminal is never handed over instead.
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
        let messages = if streams.messages {
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
        let shared = Arc::new(Shared {
            master: pty.master,
            caller,
            output: duplicate(streams.output)?,
            input: streams.input.then(|| duplicate(0)).transpose()?,
            messages,
            raw: streams.input,
            modes: Mutex::new(Modes {
                raw: relaying_modes(&saved),
                saved,
                relaying: false,
                held: false,
            }),
            ending: AtomicBool::new(false),
            holding: AtomicBool::new(false),
            unwritten: Mutex::new(Unwritten::default()),
            screen: Mutex::new(ScreenChanges::default()),
        });
        Ok(Some(CommandTerminal {
            shared,
            streams,
            slave: Some(pty.slave),
            ended: None,
            threads: 0,
            finished: false,
        }))
    }

    /// Gives the command its terminal: the slave for each stream that was a terminal.
    pub(super) fn give_to(&mut self, spec: &mut SpawnSpec) {
        [spec.stdin, spec.stdout, spec.stderr] = self.streams.modes;
        spec.terminal = self.slave.take();
    }

    /// Starts relaying. Called before the command is spawned, so that a relay that cannot
    /// start refuses a run in which nothing ran yet: until the command holds its terminal,
    /// its output relay finds nothing to read, and what is typed waits on it for the command.
    pub(super) fn relay(&mut self) -> Result<(), RelayError> {
        let (done, ended) = std::sync::mpsc::channel();
        self.ended = Some(ended);
        self.start(OUTPUT_RELAY, &done, relay_output)?;
        // From here flowhost's messages are queued for the relay.
        *messages_registry() = self.shared.messages.as_ref().map(|(m, _)| m.clone());
        if self.streams.input {
            if standing(self.shared.caller.as_fd()) == Standing::NotOurs {
                say!(
                    "flowhost sandbox: stdin is a terminal that is not flowhost's controlling \
                     terminal, so flowhost cannot tell whether it is in the foreground: \
                     nothing typed reaches the command"
                );
            } else {
                self.start("flowhost-tty-in", &done, relay_input)?;
            }
        }
        Ok(())
    }

    /// Runs `relay` on a thread of its own.
    fn start(
        &mut self,
        name: &'static str,
        done: &std::sync::mpsc::Sender<&'static str>,
        relay: fn(&Shared),
    ) -> Result<(), RelayError> {
        let (shared, done) = (self.shared.clone(), done.clone());
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                relay(&shared);
                let _ = done.send(name);
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

    /// The command has ended: flowhost's messages from here (how the run ended, the gate's
    /// verdict) are written by [`CommandTerminal::finish`], after everything the command
    /// left on its terminal. Relayed as they came, they could be written before the rest of
    /// its output, which could then move the cursor over them and write over them.
    pub(super) fn hold(&self) {
        self.shared.holding.store(true, Ordering::SeqCst);
        if let Some((messages, _)) = &self.shared.messages {
            messages.pending().unbounded = true;
        }
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

    /// Ends the relay once the run has ended, and puts the caller's modes back; then writes,
    /// on the calling thread, what is left for the caller's terminal: what the relay took
    /// and could not write, what is still on the command's terminal, and flowhost's queued
    /// messages, in that order. It waits as long as the terminal takes no output, and in the
    /// background on a terminal with TOSTOP flowhost is stopped (SIGTTOU) until continued;
    /// meanwhile the interrupts end or stop flowhost as any program (see
    /// [`interrupts_end_flowhost`]). Fails, counting them, when some of those bytes (or of
    /// what the relay wrote before) were refused by the caller's terminal. Later calls do
    /// nothing.
    pub(super) fn finish(
        &mut self,
        taken: &mut dyn FnMut() -> Vec<libc::c_int>,
    ) -> Result<(), NotShown> {
        if std::mem::replace(&mut self.finished, true) {
            return Ok(());
        }
        self.shared.ending.store(true, Ordering::SeqCst);
        if let Some((messages, _)) = &self.shared.messages {
            // The output relay sees the end at once rather than at its next look.
            let _ = nix::unistd::write(&messages.wake_w, b"e");
        }
        // Before anything below can stop flowhost or wait: never left raw meanwhile.
        self.shared.restore(true);
        if let Some(ended) = self.ended.take() {
            let mut running = self.threads;
            let mut output_ended = false;
            let mut input_looks = 0;
            while running > 0 {
                match ended.recv_timeout(Duration::from_millis(u64::from(LOOK_AGAIN) * 3)) {
                    Ok(name) => {
                        running -= 1;
                        output_ended |= name == OUTPUT_RELAY;
                    }
                    // Every relay thread is gone (one that panicked sends nothing).
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                    // Only the input relay is left, in a read that waits for a key (another
                    // process of the job changed the terminal's modes under it): what it
                    // would read is nobody's now, so it is left behind.
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) if output_ended => {
                        input_looks += 1;
                        if input_looks >= 3 {
                            break;
                        }
                    }
                    // The output relay is in a write the terminal does not take (XOFF): it
                    // finishes it, however long that takes.
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                        interrupts_end_flowhost(taken)
                    }
                }
            }
        }
        // From here flowhost's messages are written where they are said, after these.
        *messages_registry() = None;
        let shared = &self.shared;
        let mut unwritten = std::mem::take(&mut *shared.unwritten());
        let (tail, cut) = drain(shared.master.as_fd(), TAIL_LIMIT);
        let mut screen = shared.screen();
        screen.see(&tail);
        unwritten.output.extend(tail);
        // What the command left changed is undone after its last output, wherever that
        // went, and before flowhost's last words.
        unwritten.output.extend(screen.at_end());
        if let Some((messages, stderr)) = &shared.messages {
            let crlf =
                tcgetattr(stderr).is_ok_and(|m| !m.output_flags.contains(OutputFlags::OPOST));
            unwritten.messages.extend(messages.pending().take(crlf));
        }
        // An interrupt taken since the command ended ends or stops flowhost once the
        // terminal has its end (the command's modes undone, the run's verdict), when the
        // terminal takes that at once; else (below) before flowhost would wait for it.
        // Before, one always ended flowhost before this was written, leaving the alternate
        // screen or mouse reports on and the verdict unsaid.
        let mut late = if !unwritten.output.is_empty() || !unwritten.messages.is_empty() {
            default_actions_back(taken)
        } else {
            Vec::new()
        };
        let mut out = vec![(shared.output.as_fd(), std::mem::take(&mut unwritten.output))];
        if let Some((_, stderr)) = &shared.messages {
            // What flowhost says from here (the run's end, the gate) is written after the
            // command's last output, which may have left a sequence open (a message the
            // relay had begun to write may have left one too).
            let mut messages = std::mem::take(&mut unwritten.messages);
            if !messages.is_empty() {
                messages.splice(0..0, screen.before_messages());
            }
            out.push((stderr.as_fd(), messages));
        }
        drop(screen);
        if !late.is_empty() && !taken_at_once(shared.caller.as_fd(), &out) {
            raise(std::mem::take(&mut late));
        }
        for (to, text) in out {
            if let Err((left, why)) = write_out(to, &text) {
                unwritten.refuse(left, why);
            }
        }
        // A query in the command's last output (its cursor position, its attributes) has
        // the caller's terminal answer with bytes the shell would read as typed: what was
        // sent to the terminal's input and not read goes, whether or not flowhost relayed
        // that input. (A remote terminal's late answer can still come after.) Only in the
        // foreground: the input is the foreground job's otherwise, and a background job
        // that flushes it is stopped by the terminal (SIGTTOU) until brought back.
        if standing(shared.caller.as_fd()) == Standing::Foreground {
            let _ = nix::sys::termios::tcflush(
                shared.caller.as_fd(),
                nix::sys::termios::FlushArg::TCIFLUSH,
            );
        }
        if cut {
            say!(
                "flowhost sandbox: the command's terminal was still being written to after the \
                 run ended (something it started goes on running there); the first {} KiB of \
                 what was left are shown above, the rest is not",
                TAIL_LIMIT / 1024
            );
        }
        raise(late);
        match unwritten.refusal {
            Some(why) if unwritten.refused > 0 => Err(NotShown {
                bytes: unwritten.refused,
                why,
            }),
            _ => Ok(()),
        }
    }
}

impl Drop for CommandTerminal {
    /// A run that ended early (an error) still gets its terminal's end.
    fn drop(&mut self) {
        if let Err(e) = self.finish(&mut Vec::new) {
            say!("flowhost sandbox: {e}");
        }
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
        // Once the command has ended, flowhost's last words (a gate report of hundreds of
        // findings) are kept whole: before, they were dropped for the bound, and the caller
        // was told the terminal took no output.
        pending.unbounded = true;
        for _ in 0..100 {
            pending.push(&line);
        }
        let text = String::from_utf8(pending.take(false)).expect("text");
        assert_eq!(text.matches(&line).count(), 100);
        assert!(!text.contains("dropped"));
    }

    /// What the relay gives up on is handed back whole, in order, never dropped.
    #[test]
    fn a_write_given_up_hands_back_what_it_did_not_write() {
        let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_NONBLOCK).expect("a pipe");
        let bytes: Vec<u8> = (0..256 * 1024).map(|i| (i % 251) as u8).collect();
        let Err(Short::Left(left)) = write_all(w.as_fd(), &bytes, &|| true) else {
            panic!("a full pipe took everything");
        };
        assert!(!left.is_empty() && left.len() < bytes.len());
        let mut got = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n) = nix::unistd::read(&r, &mut buf) {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        got.extend_from_slice(left);
        assert!(
            got == bytes,
            "written and handed back differ from what was given"
        );
        drop(r);
        assert_eq!(
            write_all(w.as_fd(), b"x", &|| false),
            Err(Short::Gone(Errno::EPIPE))
        );
    }

    /// The end of a run writes everything to a description someone else made non-blocking,
    /// waiting for room as a blocking write would, and counts what is refused.
    #[test]
    fn the_end_of_a_run_waits_for_room_and_counts_what_is_refused() {
        let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_NONBLOCK).expect("a pipe");
        let bytes: Vec<u8> = (0..512 * 1024).map(|i| (i % 253) as u8).collect();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match nix::unistd::read(&r, &mut buf) {
                    Ok(0) => return got,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(Errno::EAGAIN) => std::thread::sleep(Duration::from_millis(5)),
                    Err(e) => panic!("read: {e}"),
                }
            }
        });
        assert_eq!(write_out(w.as_fd(), &bytes), Ok(()));
        drop(w);
        assert!(reader.join().expect("the reader") == bytes);
        let (r, w) = nix::unistd::pipe().expect("a pipe");
        drop(r);
        assert_eq!(write_out(w.as_fd(), b"abc"), Err((3, Errno::EPIPE)));
    }

    /// What the command left on its terminal is read to the end, and reading stops when the
    /// terminal has nothing more, whether or not the command's side is still open.
    #[test]
    fn what_is_left_on_the_commands_terminal_is_read_to_the_end() {
        let pty = nix::pty::openpty(None, None).expect("a pseudo-terminal");
        let flags = nix::fcntl::fcntl(&pty.master, nix::fcntl::FcntlArg::F_GETFL).expect("flags");
        nix::fcntl::fcntl(
            &pty.master,
            nix::fcntl::FcntlArg::F_SETFL(
                nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK,
            ),
        )
        .expect("non-blocking");
        assert_eq!(drain(pty.master.as_fd(), TAIL_LIMIT), (vec![], false));
        // More than the limit: the limit's worth, and word that there was more.
        nix::unistd::write(&pty.slave, b"first words\n").expect("write");
        let (head, cut) = drain(pty.master.as_fd(), 5);
        assert_eq!((head.as_slice(), cut), (&b"first"[..], true));
        nix::unistd::write(&pty.slave, b"last words\n").expect("write");
        drop(pty.slave);
        let (tail, cut) = drain(pty.master.as_fd(), TAIL_LIMIT);
        assert!(!cut);
        assert!(
            tail.ends_with(b"last words\r\n"),
            "{:?}",
            String::from_utf8_lossy(&tail)
        );
        assert_eq!(drain(pty.master.as_fd(), TAIL_LIMIT), (vec![], false));
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
