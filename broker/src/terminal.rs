//! A pseudo-terminal of its own for an executor run from a terminal, so the caller's
//! terminal is never the executor's.
//!
//! A terminal passed to a process in another session is not that process's controlling
//! terminal: the kernel's job control (SIGTTIN, SIGTTOU) never applies to it, so it can read
//! what is typed to whatever job is in the foreground, and it can stop the terminal's output
//! (`tcflow`) under its caller. An executor given the slave of a [`Pty`] (see
//! [`crate::StdioMode::Terminal`]) reaches only that pseudo-terminal, which becomes its
//! controlling terminal; the host relays between the master and its own terminal as it
//! decides.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use crate::sys;

/// Why a pseudo-terminal could not be made or kept in step with the caller's terminal.
#[derive(Debug, thiserror::Error)]
pub enum TerminalError {
    /// A step of opening the pseudo-terminal failed.
    #[error("cannot open a pseudo-terminal for the command ({step}): {source}")]
    Open {
        /// What was being done (`opening /dev/ptmx`, reading the caller's modes, ...).
        step: &'static str,
        /// The error.
        source: io::Error,
    },
}

/// The window size of a terminal (rows, columns and pixels), as `TIOCGWINSZ` gives it.
pub type WindowSize = libc::winsize;

/// A new pseudo-terminal: the host keeps the master; the slave is for the executor.
#[derive(Debug)]
pub struct Pty {
    /// The master side, close-on-exec and non-blocking: what the executor writes is read
    /// here, and what is written here is the executor's input.
    pub master: OwnedFd,
    /// The slave side, close-on-exec and opened without becoming anyone's controlling
    /// terminal: give it to [`crate::SpawnSpec::terminal`].
    pub slave: OwnedFd,
}

impl Pty {
    /// Opens a pseudo-terminal whose modes (termios) and window size are those of `like`,
    /// the caller's terminal. Fails when no pseudo-terminal can be had (no `/dev/ptmx`, no
    /// devpts) or `like` is not a terminal; never falls back to anything else.
    pub fn open_like(like: BorrowedFd<'_>) -> Result<Pty, TerminalError> {
        let open = |step: &'static str| {
            move |e: nix::errno::Errno| TerminalError::Open {
                step,
                source: e.into(),
            }
        };
        let modes = nix::sys::termios::tcgetattr(like)
            .map_err(open("reading the caller's terminal modes"))?;
        let size = sys::window_size(like).map_err(|source| TerminalError::Open {
            step: "reading the caller's window size",
            source,
        })?;
        let pair = nix::pty::openpty(&size, &modes).map_err(open("opening /dev/ptmx"))?;
        for fd in [&pair.master, &pair.slave] {
            nix::fcntl::fcntl(
                fd,
                nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
            )
            .map_err(open("marking the pseudo-terminal close-on-exec"))?;
        }
        // Only the host holds the master: nobody else's reads or writes change with it.
        let nonblocking = open("making the pseudo-terminal's master non-blocking");
        let flags =
            nix::fcntl::fcntl(&pair.master, nix::fcntl::FcntlArg::F_GETFL).map_err(nonblocking)?;
        nix::fcntl::fcntl(
            &pair.master,
            nix::fcntl::FcntlArg::F_SETFL(
                nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK,
            ),
        )
        .map_err(nonblocking)?;
        Ok(Pty {
            master: pair.master,
            slave: pair.slave,
        })
    }
}

/// The window size of the terminal `fd`.
pub fn window_size(fd: impl AsFd) -> io::Result<WindowSize> {
    sys::window_size(fd.as_fd())
}

/// Sets the window size of the terminal `fd` (on a pseudo-terminal's master, the kernel
/// then signals SIGWINCH to the slave's foreground process group).
pub fn set_window_size(fd: impl AsFd, size: &WindowSize) -> io::Result<()> {
    sys::set_window_size(fd.as_fd(), size)
}

/// Whether `signal` is ignored in this process. Asked at a host's start, before it takes any
/// signal, it tells the caller's choice (`nohup` ignores SIGHUP; a shell without job control
/// ignores SIGINT and SIGQUIT in the jobs it starts in the background), which a host keeps:
/// it does not take such a signal, so never passes it on, and its command starts ignoring it
/// too (`SpawnSpec::ignored_signals`).
pub fn is_ignored(signal: libc::c_int) -> io::Result<bool> {
    sys::is_ignored(signal).map_err(|e| io::Error::new(e.kind(), format!("signal {signal}: {e}")))
}

/// Gives SIGINT, SIGQUIT, SIGTERM, SIGHUP and SIGTSTP their default actions again, for a
/// host whose run is over and that has only its terminal left to write to: the terminal's
/// keys and `kill` then end or stop it wherever it waits (a terminal that takes no output),
/// as they would any program. One that is ignored stays ignored: the host never took it,
/// so it is still the caller's choice (see [`is_ignored`]). Fails naming the first signal
/// that could not be given back.
pub fn interrupts_take_their_default_action() -> io::Result<()> {
    for signal in [
        libc::SIGINT,
        libc::SIGQUIT,
        libc::SIGTERM,
        libc::SIGHUP,
        libc::SIGTSTP,
    ] {
        if !is_ignored(signal)? {
            sys::default_action(signal)
                .map_err(|e| io::Error::new(e.kind(), format!("signal {signal}: {e}")))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pseudo-terminal starts as the terminal it is made like: same modes, same size.
    #[test]
    fn a_pty_is_made_like_the_callers_terminal() {
        let caller = nix::pty::openpty(None, None).expect("a pseudo-terminal for the test");
        let size = WindowSize {
            ws_row: 41,
            ws_col: 117,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        set_window_size(&caller.master, &size).expect("TIOCSWINSZ");
        let mut modes = nix::sys::termios::tcgetattr(&caller.slave).expect("tcgetattr");
        modes
            .local_flags
            .remove(nix::sys::termios::LocalFlags::ECHO);
        nix::sys::termios::tcsetattr(&caller.slave, nix::sys::termios::SetArg::TCSANOW, &modes)
            .expect("tcsetattr");

        let pty = Pty::open_like(caller.slave.as_fd()).expect("a pseudo-terminal");
        let got = window_size(&pty.slave).expect("TIOCGWINSZ");
        assert_eq!((got.ws_row, got.ws_col), (41, 117));
        let copied = nix::sys::termios::tcgetattr(&pty.slave).expect("tcgetattr");
        assert!(
            !copied
                .local_flags
                .contains(nix::sys::termios::LocalFlags::ECHO)
        );
        assert!(nix::unistd::isatty(&pty.slave).expect("isatty"));
        let flags = nix::fcntl::fcntl(&pty.master, nix::fcntl::FcntlArg::F_GETFL).expect("F_GETFL");
        assert!(
            nix::fcntl::OFlag::from_bits_truncate(flags).contains(nix::fcntl::OFlag::O_NONBLOCK)
        );
    }

    /// Something that is not a terminal gives a typed error naming the step.
    #[test]
    fn a_pty_like_a_non_terminal_is_refused_with_the_step() {
        let file = tempfile::tempfile().expect("a file");
        let e = Pty::open_like(file.as_fd()).expect_err("a file is not a terminal");
        assert!(e.to_string().contains("caller's terminal modes"), "{e}");
    }
}
