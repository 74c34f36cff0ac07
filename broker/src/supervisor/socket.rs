//! The executor's socket in the broker's hands: what the kernel says it is, and carrying an
//! operation out on it with the semantics of the executor's own (blocking or not) call,
//! without blocking a worker of the host's runtime for longer than [`CONNECT_BLOCK_LIMIT`].

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::fcntl::{FcntlArg, OFlag, fcntl};
use tokio::io::unix::AsyncFd;

use super::as_executor::unix_op;
use super::pidfds::Opened;
use super::{Caller, Outcome, Step, errno_of};
use crate::attempt::{Destination, SocketInfo};
use crate::sys::{self, OwnedMessage};

/// How often a handler waiting on the network (a send to a peer that does not read, a
/// connect that does not complete) checks that its caller is still waiting.
const CALLER_CHECK: Duration = Duration::from_millis(100);
/// How often a unix connect to a full backlog is retried.
const UNIX_CONNECT_RETRY: Duration = Duration::from_millis(10);
/// Most sockets per executor remembered as bound by the broker.
const MAX_REMEMBERED_BINDS: usize = 4096;
/// How long the broker waits inline for a connect to complete before awaiting it.
const INLINE_CONNECT_WAIT: Duration = Duration::from_micros(250);

/// The longest a connect the broker makes may block its thread. It is started with
/// O_NONBLOCK, but the flag lives on the file description the executor shares, and another
/// of its threads can clear it just before the call, which then blocks after all (for a
/// peer that never answers, for minutes; for a unix listener whose backlog stays full, for
/// good). Cut off there with EINTR, the connect is then awaited like any other under way.
const CONNECT_BLOCK_LIMIT: Duration = Duration::from_millis(2);

/// The `SCM_CREDENTIALS` control message naming the executor's uid and gid (and the broker's
/// pid, the only one the kernel lets it give) for a send on a socket the broker uses as the
/// executor (see [`unix_op`]); empty when the broker has no identity to set aside.
fn sender_credentials(identity: Option<(u32, u32)>, sock: &TakenSocket) -> Vec<u8> {
    match identity {
        Some((uid, gid)) if super::as_executor::as_the_executor(sock.info.family) => {
            super::cmsg::credentials(std::process::id(), uid, gid)
        }
        _ => Vec::new(),
    }
}

/// Most sockets per executor whose facts are kept; at the bound all are forgotten.
const MAX_KNOWN_SOCKETS: usize = 1024;

/// What the kernel said each of an executor's sockets is (`SO_DOMAIN`, `SO_TYPE`,
/// `SO_PROTOCOL`), by socket cookie. A cookie names one socket for as long as the system
/// runs and is never given to another, and a socket's family, type and protocol never
/// change, so a socket met again (however its descriptor is numbered, in whichever
/// process) is classified with one `getsockopt` instead of three; a different socket at the
/// same descriptor number has another cookie.
#[derive(Default)]
pub(crate) struct KnownSockets {
    known: std::sync::Mutex<std::collections::HashMap<u64, SocketInfo>>,
}

impl KnownSockets {
    /// The socket's cookie and what it is.
    fn info(&self, fd: BorrowedFd<'_>) -> io::Result<(u64, SocketInfo)> {
        let cookie = sys::socket_cookie(fd)?;
        if let Some(info) = self.known.lock().ok().and_then(|k| k.get(&cookie).copied()) {
            return Ok((cookie, info));
        }
        let opt = |name| sys::getsockopt_int(fd, libc::SOL_SOCKET, name);
        let info = SocketInfo {
            family: opt(libc::SO_DOMAIN)?,
            socket_type: opt(libc::SO_TYPE)?,
            protocol: opt(libc::SO_PROTOCOL)?,
        };
        if let Ok(mut known) = self.known.lock() {
            if known.len() >= MAX_KNOWN_SOCKETS {
                known.clear();
            }
            known.insert(cookie, info);
        }
        Ok((cookie, info))
    }
}

/// A socket taken from the executor, with what the kernel says it is.
#[derive(Clone)]
pub(super) struct TakenSocket {
    pub(super) fd: Arc<OwnedFd>,
    /// Its cookie: names this socket and no other for as long as the system runs.
    pub(super) cookie: u64,
    pub(super) info: SocketInfo,
}

/// The broker's temporary O_NONBLOCK on an executor's sockets, by socket cookie. The flag
/// belongs to the file description, which the executor shares: handlers toggling one socket
/// at once must leave it as the executor had it, and a handler asking whether the executor's
/// call may block must see the executor's flags, not the broker's. The lock is held only
/// while flags are read or written, never across the call made between (which blocks after
/// all if the executor clears the flag meanwhile: see [`CONNECT_BLOCK_LIMIT`]). An executor's
/// own change of the flags while a toggle is in force is undone when it ends.
#[derive(Default)]
pub(crate) struct Toggles {
    active: std::sync::Mutex<std::collections::HashMap<u64, Toggle>>,
}

struct Toggle {
    /// Handlers relying on the toggle.
    holders: usize,
    /// The executor's flags, put back when the last holder is done.
    saved: OFlag,
}

impl Toggles {
    fn active(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<u64, Toggle>> {
        // Only fcntl calls run under the lock; a poisoned map is still accurate.
        self.active
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether the executor's socket is in blocking mode (false if that cannot be read).
    fn blocking(&self, sock: &TakenSocket) -> bool {
        let active = self.active();
        if let Some(toggle) = active.get(&sock.cookie) {
            return !toggle.saved.contains(OFlag::O_NONBLOCK);
        }
        fcntl(&*sock.fd, FcntlArg::F_GETFL)
            .map(|flags| OFlag::from_bits_retain(flags).contains(OFlag::O_NONBLOCK))
            .is_ok_and(|nonblocking| !nonblocking)
    }

    /// Runs `op` with the socket non-blocking, telling it whether the executor's socket was
    /// in blocking mode (if not, nothing is toggled), and puts the executor's flags back
    /// once no handler relies on the toggle.
    fn with_nonblocking<T>(
        &self,
        sock: &TakenSocket,
        op: impl FnOnce(bool) -> io::Result<T>,
    ) -> io::Result<T> {
        let fd = sock.fd.as_fd();
        {
            let mut active = self.active();
            match active.get_mut(&sock.cookie) {
                Some(toggle) => toggle.holders += 1,
                None => {
                    let flags = OFlag::from_bits_retain(fcntl(fd, FcntlArg::F_GETFL)?);
                    if flags.contains(OFlag::O_NONBLOCK) {
                        drop(active);
                        return op(false);
                    }
                    fcntl(fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
                    active.insert(
                        sock.cookie,
                        Toggle {
                            holders: 1,
                            saved: flags,
                        },
                    );
                }
            }
        }
        let result = op(true);
        let mut active = self.active();
        let restore = match active.get_mut(&sock.cookie) {
            Some(toggle) if toggle.holders > 1 => {
                toggle.holders -= 1;
                None
            }
            Some(_) => active.remove(&sock.cookie).map(|toggle| toggle.saved),
            None => None,
        };
        if let Some(saved) = restore {
            fcntl(fd, FcntlArg::F_SETFL(saved))?;
        }
        result
    }
}

impl Caller<'_> {
    /// A pidfd for the caller and its socket `fd`, taken with it. Callers take them before
    /// their first [`Caller::copy`] (or [`Caller::still_waiting`]): the validity check after
    /// that proves the pidfd (and any descriptor taken with it) belongs to the thread still
    /// waiting on this notification, not to a task that reused its id. Nothing taken with it
    /// is used before that check.
    pub(super) fn socket(&self, fd: u64) -> Step<(Arc<OwnedFd>, TakenSocket)> {
        let fd = i32::try_from(fd as i64).map_err(|_| Outcome::Errno(libc::EBADF))?;
        let (pidfd, taken) = self.ctx.pidfds.take(self.n.pid, fd).map_err(|e| match e {
            Opened::Failed(e) => self.failure(&e),
            Opened::Taking(e) => Outcome::Errno(errno_of(&e)),
        })?;
        let (cookie, info) = self
            .ctx
            .sockets
            .info(taken.as_fd())
            .map_err(|e| Outcome::Errno(errno_of(&e)))?;
        Ok((
            pidfd,
            TakenSocket {
                fd: Arc::new(taken),
                cookie,
                info,
            },
        ))
    }
}

/// Where the socket is connected, as its connect was decided: a ping socket's port is
/// zero, the kernel ignoring it (see `Caller::resolve`).
pub(super) fn peer(sock: &TakenSocket) -> Option<Destination> {
    sys::peer_address(sock.fd.as_fd())
        .ok()
        .map(|raw| match Destination::from_sockaddr(&raw) {
            Destination::Inet(addr) if sock.info.is_icmp() => {
                Destination::Inet(std::net::SocketAddr::new(addr.ip(), 0))
            }
            other => other,
        })
}

/// Where a connect the broker started non-blocking stands.
enum Connecting {
    /// It ended: connected, or failed with this error.
    Ended(io::Result<()>),
    /// The handshake is still under way.
    Pending,
}

/// Asks the kernel again about a connect started non-blocking (the socket must still be in
/// non-blocking mode). A failed one is then left unconnected, as a failed blocking connect
/// leaves it, so it can be connected again; reading `SO_ERROR` instead would take the error
/// but leave the socket marked as connecting, and a later connect on it would fail with
/// ECONNABORTED.
fn connect_again(sock: &TakenSocket, addr: &[u8], identity: Identity) -> Connecting {
    match connect_bounded(sock, addr, identity) {
        Err(e) if matches!(e.raw_os_error(), Some(libc::EALREADY | libc::EINTR)) => {
            Connecting::Pending
        }
        Err(e) if e.raw_os_error() == Some(libc::EISCONN) => Connecting::Ended(Ok(())),
        other => Connecting::Ended(other),
    }
}

/// Starts the executor's connect (the socket non-blocking for the broker; `blocking`:
/// whether the executor's call blocks). A blocking IP connect is asked about again at once:
/// a nearby peer (loopback) has completed the handshake by then, so it ends there, with the
/// socket connected as a blocking connect leaves it. A blocking unix connect to a full
/// backlog is pending (EAGAIN); a non-blocking call ends with whatever the kernel said.
fn start_connect(
    sock: &TakenSocket,
    addr: &[u8],
    blocking: bool,
    identity: Identity,
) -> Connecting {
    let inet = matches!(sock.info.family, libc::AF_INET | libc::AF_INET6);
    match connect_bounded(sock, addr, identity) {
        Err(e) if blocking && inet && e.raw_os_error() == Some(libc::EINPROGRESS) => {
            connect_again(sock, addr, identity)
        }
        // Cut off at the bound (an IP connect goes on in the kernel, a unix one is tried
        // again), or a unix listener's backlog is full (tried again).
        Err(e)
            if blocking
                && (e.raw_os_error() == Some(libc::EINTR)
                    || (!inet && e.raw_os_error() == Some(libc::EAGAIN))) =>
        {
            Connecting::Pending
        }
        other => Connecting::Ended(other),
    }
}

/// `connect(2)` on the broker's copy of the executor's socket, blocking this thread at most
/// [`CONNECT_BLOCK_LIMIT`] (EINTR past it) whatever the executor did to its flags; a unix
/// socket's with the executor's identity (see `as_executor`).
fn connect_bounded(sock: &TakenSocket, addr: &[u8], identity: Identity) -> io::Result<()> {
    let fd = sock.fd.as_fd();
    unix_op(identity, sock, || {
        crate::bound::bounded(CONNECT_BLOCK_LIMIT, || sys::connect_raw(fd, addr)).and_then(|r| r)
    })
}

/// The executor's uid and gid, when unix socket operations need them (`Context::identity`).
type Identity = Option<(u32, u32)>;

/// When a wait on behalf of a blocking call gives up: the socket's own send timeout
/// (`SO_SNDTIMEO`), as the kernel's blocking call would; without one, never (the wait still
/// ends when the caller is gone).
fn give_up_at(sock: &TakenSocket) -> Option<Instant> {
    sys::send_timeout(sock.fd.as_fd())
        .ok()
        .flatten()
        .map(|t| Instant::now() + t)
}

fn timed_out(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

impl Caller<'_> {
    /// Whether the executor's socket is in blocking mode (its own flags, not a toggle of the
    /// broker's in force).
    pub(super) fn is_blocking(&self, sock: &TakenSocket) -> bool {
        self.ctx.toggles.blocking(sock)
    }

    /// Runs `op` on `sock` with O_NONBLOCK set for the broker (see [`Toggles`]), telling it
    /// whether the executor's socket was in blocking mode. (Calls with a per-call flag, sends
    /// with `MSG_DONTWAIT`, need none of this.)
    fn nonblocking<T>(&self, sock: &TakenSocket, op: impl FnOnce(bool) -> T) -> io::Result<T> {
        self.ctx
            .toggles
            .with_nonblocking(sock, |blocking| Ok(op(blocking)))
    }

    /// Waits until `watch` may have turned writable, for at most [`CALLER_CHECK`] (or until
    /// `deadline`), then confirms the caller is still waiting. Every network wait of a
    /// handler goes through here or [`Caller::pause`], so a handler whose caller is gone
    /// (killed, retired) ends and frees its permit instead of waiting on a peer forever.
    async fn writable_or_gone(
        &self,
        watch: &AsyncFd<OwnedFd>,
        deadline: Option<Instant>,
    ) -> Step<()> {
        let nap = deadline.map_or(CALLER_CHECK, |d| {
            d.saturating_duration_since(Instant::now())
                .min(CALLER_CHECK)
        });
        tokio::select! {
            ready = watch.writable() => match ready {
                Ok(mut guard) => guard.clear_ready(),
                Err(e) => return Err(Outcome::Errno(errno_of(&e))),
            },
            _ = tokio::time::sleep(nap) => {}
        }
        self.still_waiting()
    }

    /// Sleeps `nap` (no longer than until `deadline`), then confirms the caller waits.
    async fn pause(&self, nap: Duration, deadline: Option<Instant>) -> Step<()> {
        let nap = deadline.map_or(nap, |d| {
            d.saturating_duration_since(Instant::now()).min(nap)
        });
        tokio::time::sleep(nap).await;
        self.still_waiting()
    }

    /// Performs the executor's connect with the semantics of its own call, without blocking
    /// a thread for longer than [`CONNECT_BLOCK_LIMIT`] (see [`start_connect`]). A blocking IP
    /// connect that did not end at once is awaited, returning the socket's final error
    /// exactly as a blocking connect would have (EINPROGRESS once `SO_SNDTIMEO` expires). A
    /// blocking unix connect to a full backlog goes to [`Caller::connect_unix`].
    pub(super) async fn connect_on(&self, sock: &TakenSocket, addr: &[u8]) -> Step<io::Result<()>> {
        let inet = matches!(sock.info.family, libc::AF_INET | libc::AF_INET6);
        let identity = self.ctx.identity;
        match self.nonblocking(sock, |blocking| {
            start_connect(sock, addr, blocking, identity)
        }) {
            Ok(Connecting::Ended(result)) => return Ok(result),
            Err(e) => return Ok(Err(e)),
            Ok(Connecting::Pending) if !inet => return self.connect_unix(sock, addr).await,
            Ok(Connecting::Pending) => {}
        }
        let fd = sock.fd.as_fd();
        // Not complete yet: wait for that inline, for at most INLINE_CONNECT_WAIT, before
        // paying for a reactor registration.
        match sys::wait_writable(fd, INLINE_CONNECT_WAIT) {
            Ok(true) => {
                if let Some(result) = self.connect_ended(sock, addr) {
                    return Ok(result);
                }
            }
            Ok(false) => {}
            Err(e) => return Ok(Err(e)),
        }
        let deadline = give_up_at(sock);
        let watch = match fd.try_clone_to_owned().and_then(sys::async_fd_writable) {
            Ok(w) => w,
            Err(e) => return Ok(Err(e)),
        };
        loop {
            self.writable_or_gone(&watch, deadline).await?;
            if let Some(result) = self.connect_ended(sock, addr) {
                return Ok(result);
            }
            if timed_out(deadline) {
                return Ok(Err(io::Error::from_raw_os_error(libc::EINPROGRESS)));
            }
        }
    }

    /// The result of a connect under way once it has ended; `None` while it has not.
    fn connect_ended(&self, sock: &TakenSocket, addr: &[u8]) -> Option<io::Result<()>> {
        match self.nonblocking(sock, |_| connect_again(sock, addr, self.ctx.identity)) {
            Ok(Connecting::Ended(result)) => Some(result),
            Ok(Connecting::Pending) => None,
            Err(e) => Some(Err(e)),
        }
    }

    /// A blocking unix connect: a full backlog makes the non-blocking form fail with EAGAIN
    /// and offers no readiness to await, so it is retried until it succeeds, fails
    /// otherwise, `SO_SNDTIMEO` expires (EAGAIN, as the kernel reports), or the caller is
    /// gone.
    pub(super) async fn connect_unix(
        &self,
        sock: &TakenSocket,
        addr: &[u8],
    ) -> Step<io::Result<()>> {
        let deadline = give_up_at(sock);
        loop {
            match self
                .nonblocking(sock, |_| connect_bounded(sock, addr, self.ctx.identity))
                .and_then(|r| r)
            {
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EINTR)) => {}
                other => return Ok(other),
            }
            if timed_out(deadline) {
                return Ok(Err(io::Error::from_raw_os_error(libc::EAGAIN)));
            }
            self.pause(UNIX_CONNECT_RETRY, deadline).await?;
        }
    }

    /// What the kernel's send on `sock`, if it is a TCP socket, does while its handshake is
    /// under way
    /// (its peer not yet known, so nothing could be decided by it), before anything leaves:
    /// a non-blocking send answers EAGAIN (EALREADY with `MSG_FASTOPEN`); a blocking one
    /// waits for the handshake (bounded by the socket's send timeout and by the caller's
    /// death, as every wait here), then answers the handshake's error if it failed. `None`:
    /// the send goes on to be decided, by the peer it now has. A connect deferred to the
    /// first send (`TCP_FASTOPEN_CONNECT` with a cookie: the kernel then reports the socket
    /// writable before any handshake) is not waited for: nothing is under way, and its send
    /// is decided as it stands.
    pub(super) async fn after_handshake(
        &self,
        sock: &TakenSocket,
        flags: i32,
    ) -> Step<Option<Outcome>> {
        let handshaking = |sock: &TakenSocket| {
            matches!(
                sys::tcp_state(sock.fd.as_fd()),
                Some(sys::TCP_SYN_SENT | sys::TCP_SYN_RECV)
            )
        };
        if !super::perform::is_tcp(sock) || peer(sock).is_some() || !handshaking(sock) {
            return Ok(None);
        }
        // The socket is used further only once it is proven the waiting thread's.
        self.still_waiting()?;
        if sys::wait_writable(sock.fd.as_fd(), Duration::ZERO).unwrap_or(false) {
            return Ok(None);
        }
        let not_yet = if flags & libc::MSG_FASTOPEN != 0 {
            libc::EALREADY
        } else {
            libc::EAGAIN
        };
        if flags & libc::MSG_DONTWAIT != 0 || !self.is_blocking(sock) {
            return Ok(Some(Outcome::Errno(not_yet)));
        }
        let deadline = give_up_at(sock);
        let watch = match sock.fd.try_clone().and_then(sys::async_fd_writable) {
            Ok(w) => w,
            Err(e) => return Ok(Some(Outcome::Errno(errno_of(&e)))),
        };
        // A silent peer keeps the handshake going for minutes (SYN retries): waited for
        // without the broker-wide permit.
        let ended: Step<Option<Outcome>> = self
            .unshared(async {
                while handshaking(sock) {
                    if timed_out(deadline) {
                        return Ok(Some(Outcome::Errno(not_yet)));
                    }
                    self.writable_or_gone(&watch, deadline).await?;
                }
                Ok(None)
            })
            .await;
        if let Some(outcome) = ended? {
            return Ok(Some(outcome));
        }
        if peer(sock).is_some() {
            return Ok(None);
        }
        // The handshake failed: the kernel's send answers its error (and takes it), or EPIPE.
        self.still_waiting()?;
        Ok(Some(Outcome::Errno(
            match sys::getsockopt_int(sock.fd.as_fd(), libc::SOL_SOCKET, libc::SO_ERROR) {
                Ok(e) if e > 0 => e,
                _ => libc::EPIPE,
            },
        )))
    }

    /// Sends a copied message with the semantics of the executor's own call, without ever
    /// blocking a thread: a blocking socket's send waits for room (on a stream socket it
    /// sends everything unless an error or `SO_SNDTIMEO` ends it early, then reports what
    /// was sent); a non-blocking one returns EAGAIN. `MSG_NOSIGNAL` is always set: a broken
    /// pipe must not signal the broker. `MSG_ZEROCOPY` is never passed on: the kernel would
    /// go on sending from the broker's copy of the data after the broker has freed it (its
    /// heap then holds other data, another executor's included); the send is made as on a
    /// socket without `SO_ZEROCOPY`, which the kernel allows. `MSG_MORE` is never passed on
    /// for a datagram: the kernel would hold it open, addressed as decided, for whatever
    /// the socket sends next without an address (a plain `write`, never notified); each
    /// datagram goes out whole, as decided and recorded.
    pub(super) async fn send(
        &self,
        sock: &TakenSocket,
        mut msg: OwnedMessage,
        flags: i32,
    ) -> Step<io::Result<usize>> {
        let mut flags = (flags | libc::MSG_NOSIGNAL) & !libc::MSG_ZEROCOPY;
        if sock.info.socket_type != libc::SOCK_STREAM {
            flags &= !libc::MSG_MORE;
        }
        // A UDP datagram the executor corked itself (`MSG_MORE` on a send without an
        // address, which is never notified) would take this send's data, addressed as that
        // send was: pushed out first, as it stands, it leaves this one to go alone.
        if sock.info.protocol == libc::IPPROTO_UDP
            && let Err(e) =
                sys::setsockopt_int(sock.fd.as_fd(), libc::IPPROTO_UDP, libc::UDP_CORK, 0)
        {
            return Ok(Err(e));
        }
        // What a unix receiver is told of the sender (`SO_PASSCRED`): the executor's ids,
        // given with each send rather than taken by the kernel from the thread's real ids,
        // which then stay the broker's (see `as_executor`).
        let sender = sender_credentials(self.ctx.identity, sock);
        msg.control.extend_from_slice(&sender);
        let dontwait = flags & libc::MSG_DONTWAIT != 0;
        // A Fast Open send that started the handshake without its bytes, waiting for it.
        let mut connecting = false;
        // Whether the executor's call may block, read only when it matters (a send that did
        // not go out whole): most sends complete at once, without the flag read.
        let mut blocking = None;
        let mut may_block = || *blocking.get_or_insert_with(|| !dontwait && self.is_blocking(sock));
        let stream = sock.info.socket_type == libc::SOCK_STREAM;
        let mut sent = 0usize;
        let mut watch = None;
        let mut deadline = None;
        loop {
            // A unix receiver may ask who sent each message (`SO_PASSCRED`).
            let send = || sys::sendmsg_owned(sock.fd.as_fd(), &msg, flags | libc::MSG_DONTWAIT);
            match unix_op(self.ctx.identity, sock, send) {
                Ok(n) => {
                    sent += n;
                    // Whatever Fast Open began, the rest goes on the connection: sent again
                    // with the flag, it would be refused (EISCONN) once connected, or
                    // (EALREADY) while the handshake that carried the first bytes is on.
                    flags &= !libc::MSG_FASTOPEN;
                    if !(stream && n < msg.data.len() && may_block()) {
                        return Ok(Ok(sent));
                    }
                    msg.data.drain(..n);
                    // The control data (and any name) went with the first bytes; who sends
                    // goes with every one.
                    msg.control.clone_from(&sender);
                    msg.name.clear();
                }
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && may_block() => {}
                // A Fast Open send started the connect without carrying the bytes (no
                // cookie yet). A blocking call waits for the handshake, as the kernel's
                // would, then sends them: again with `MSG_FASTOPEN` and no address, which
                // marks the socket connected as the kernel's own wait does (a later
                // connect then fails with EISCONN); until the handshake ends, that send
                // answers EALREADY.
                Err(e)
                    if e.raw_os_error() == Some(libc::EINPROGRESS)
                        && flags & libc::MSG_FASTOPEN != 0
                        && sent == 0
                        && !connecting
                        && may_block() =>
                {
                    connecting = true;
                    msg.name.clear();
                }
                Err(e) if connecting && e.raw_os_error() == Some(libc::EALREADY) => {}
                Err(_) if sent > 0 => return Ok(Ok(sent)),
                Err(e) => return Ok(Err(e)),
            }
            let deadline = *deadline.get_or_insert_with(|| give_up_at(sock));
            if timed_out(deadline) {
                return Ok(if sent > 0 {
                    Ok(sent)
                } else if connecting {
                    // As the kernel's blocking Fast Open send reports a handshake it
                    // stopped waiting for.
                    Err(io::Error::from_raw_os_error(libc::EINPROGRESS))
                } else {
                    Err(io::Error::from_raw_os_error(libc::EAGAIN))
                });
            }
            if watch.is_none() {
                match sock.fd.try_clone().and_then(sys::async_fd_writable) {
                    Ok(w) => watch = Some(w),
                    Err(_) if sent > 0 => return Ok(Ok(sent)),
                    Err(e) => return Ok(Err(e)),
                }
            }
            if let Some(w) = &watch {
                match self.writable_or_gone(w, deadline).await {
                    Ok(()) => {}
                    // What was sent is reported, as the kernel reports a send cut short.
                    Err(Outcome::Errno(_)) if sent > 0 => return Ok(Ok(sent)),
                    Err(other) => return Err(other),
                }
            }
        }
    }

    /// Notes that the broker bound this socket (by its cookie, which the kernel never
    /// reuses), so a later `listen` on it is known to expose only the decided address.
    pub(super) fn remember_bound(&self, sock: &TakenSocket) {
        if let Ok(cookie) = sys::socket_cookie(sock.fd.as_fd())
            && let Ok(mut bound) = self.ctx.bound.lock()
        {
            if bound.len() >= MAX_REMEMBERED_BINDS {
                // Forgetting is safe: a forgotten socket's listen is decided again.
                bound.clear();
            }
            bound.insert(cookie);
        }
    }

    /// For a UDP (or UDP-Lite) socket, waits its turn among the socket's connects and
    /// addressed sends, which then run one at a time (`None`: another kind of socket).
    ///
    /// Why: the executor can cork a datagram to its connected peer without the broker
    /// (`send(MSG_MORE)` names no address, so it is never notified), and the kernel then
    /// adds whatever the socket sends next to that datagram, addressed to the peer whatever
    /// the send names. An addressed send is therefore made only while the socket's peer,
    /// checked under this turn, is none or the very address decided
    /// ([`Caller::refuse_other_than_peer`]), and no connect can change the peer until it is
    /// made. Only the broker connects a socket, so holding the turn fixes the peer.
    pub(super) async fn datagram_order(&self, sock: &TakenSocket) -> Option<OrderTurn<'_>> {
        if !is_datagram_order(sock) {
            return None;
        }
        let cookie = sys::socket_cookie(sock.fd.as_fd()).ok()?;
        let lock = self
            .ctx
            .datagram_order
            .0
            .lock()
            .ok()?
            .entry(cookie)
            .or_default()
            .clone();
        let guard = lock.clone().lock_owned().await;
        Some(OrderTurn {
            order: &self.ctx.datagram_order,
            cookie,
            lock,
            _guard: guard,
        })
    }

    /// The socket's turn for an addressed send to `destination` (`None`: no turn needed),
    /// with its peer checked in it ([`Caller::refuse_other_than_peer`]).
    pub(super) async fn datagram_turn(
        &self,
        sock: &TakenSocket,
        destination: Option<&Destination>,
    ) -> Step<Option<OrderTurn<'_>>> {
        let turn = self.datagram_order(sock).await;
        if turn.is_some() {
            self.refuse_other_than_peer(sock, destination)?;
        }
        Ok(turn)
    }

    /// With a datagram socket's turn held: refuses (EISCONN, as BSD and POSIX allow for a
    /// connected datagram socket) a send to `destination` on a socket connected to another
    /// peer, whose corked datagram it could join (see [`Caller::datagram_order`]).
    pub(super) fn refuse_other_than_peer(
        &self,
        sock: &TakenSocket,
        destination: Option<&Destination>,
    ) -> Step<()> {
        let (Some(destination), Ok(raw)) = (destination, sys::peer_address(sock.fd.as_fd())) else {
            return Ok(());
        };
        // An IPv4 peer of an IPv6 socket reads back as `::ffff:a.b.c.d`.
        let canonical = |d: &Destination| match d {
            Destination::Inet(a) if crate::attempt::canonical_ip(a.ip()) != a.ip() => {
                Destination::Inet(std::net::SocketAddr::new(
                    crate::attempt::canonical_ip(a.ip()),
                    a.port(),
                ))
            }
            _ => d.clone(),
        };
        if canonical(&Destination::from_sockaddr(&raw)) == canonical(destination) {
            Ok(())
        } else {
            Err(Outcome::Errno(libc::EISCONN))
        }
    }

    pub(super) fn was_bound_by_broker(&self, sock: &TakenSocket) -> bool {
        match (sys::socket_cookie(sock.fd.as_fd()), self.ctx.bound.lock()) {
            (Ok(cookie), Ok(bound)) => bound.contains(&cookie),
            _ => false,
        }
    }
}

/// Whether `sock` is a UDP or UDP-Lite socket, whose addressed sends and connects take
/// turns (see [`Caller::datagram_order`]).
pub(super) fn is_datagram_order(sock: &TakenSocket) -> bool {
    sock.info.socket_type == libc::SOCK_DGRAM
        && matches!(
            sock.info.protocol,
            libc::IPPROTO_UDP | libc::IPPROTO_UDPLITE
        )
}

/// Each datagram socket's turn (see [`Caller::datagram_order`]), by cookie; an entry lives
/// while a turn of it is held or awaited.
#[derive(Default)]
pub(crate) struct DatagramOrder(
    std::sync::Mutex<std::collections::HashMap<u64, std::sync::Arc<tokio::sync::Mutex<()>>>>,
);

/// A datagram socket's turn, held until dropped.
pub(super) struct OrderTurn<'a> {
    order: &'a DatagramOrder,
    cookie: u64,
    lock: std::sync::Arc<tokio::sync::Mutex<()>>,
    _guard: tokio::sync::OwnedMutexGuard<()>,
}

impl Drop for OrderTurn<'_> {
    fn drop(&mut self) {
        // The map's own reference, this one and the guard's: nobody else holds or awaits
        // the turn, so its entry goes (under the map's lock, where a new taker would add one).
        if let Ok(mut map) = self.order.0.lock()
            && std::sync::Arc::strong_count(&self.lock) <= 3
        {
            map.remove(&self.cookie);
        }
    }
}
