//! One handler per notified syscall (connect, bind, listen, sendto, sendmsg, sendmmsg): take
//! the socket, copy what the executor points at, report the attempt and wait for the
//! verdict, then carry the operation out on the executor's behalf and answer as the kernel
//! would.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::AsFd;

use super::as_executor::unix_op;
use super::memory::{Budget, MAX_IOV, MMSGHDR_SIZE, MSGHDR_SIZE, addr_len};
use super::socket::{TakenSocket, is_datagram_order, peer};
use super::unix_path::Target;
use super::{Caller, Outcome, Step, errno_of, to_outcome};
use crate::attempt::{AttemptInfo, Destination, EgressSyscall, Verdict};
use crate::sys::{self, OwnedMessage};

impl Caller<'_> {
    /// The attempt this caller makes on `sock`, before its destination is known (and
    /// before its executable is read: see `Caller::decide`).
    fn attempt(&self, syscall: EgressSyscall, sock: &TakenSocket) -> AttemptInfo {
        AttemptInfo {
            syscall,
            pid: self.n.pid,
            executable: None,
            socket: sock.info,
            destination: None,
            connected: false,
            bytes: None,
            message_index: None,
            passed_fds: 0,
        }
    }

    /// For a call whose arguments are (socket, address, length): takes the socket, copies
    /// and resolves the address, and has the host decide. Returns the socket and what to
    /// pass to the syscall once allowed and the caller still waits; otherwise the answer
    /// (the host's errno, or the caller is gone).
    async fn decided_address(&self, syscall: EgressSyscall) -> Step<(TakenSocket, Target)> {
        let [fd, addr, len, ..] = self.n.args;
        let len = addr_len(len)?;
        let (_pidfd, sock) = self.socket(fd)?;
        let raw = self.copy(addr, len)?;
        let mut info = self.attempt(syscall, &sock);
        let (destination, target) = self.resolve(&raw, &sock, syscall);
        if syscall == EgressSyscall::Connect
            && let Destination::UnixPath(path) = &destination
            && self.ctx.absent_unix_sockets.contains(path)
        {
            // Not there, as far as the executor can tell; nothing to report or decide.
            self.still_waiting()?;
            return Err(Outcome::Errno(libc::ENOENT));
        }
        if syscall != EgressSyscall::Bind {
            self.keep_from_the_host(&destination, &sock, &target)?;
        }
        // Connected to port 0, a UDP socket has a peer `getpeername` does not tell
        // (ENOTCONN), so its turn (see `datagram_order`) could not check it; no service
        // answers there. Refused before anything is decided or recorded.
        if syscall == EgressSyscall::Connect
            && is_datagram_order(&sock)
            && matches!(&destination, Destination::Inet(a) if a.port() == 0)
        {
            self.still_waiting()?;
            return Err(Outcome::Errno(libc::EINVAL));
        }
        let privileged = match syscall {
            EgressSyscall::Connect => needs_network_privilege(&destination),
            EgressSyscall::Bind => joins_netlink_groups(&destination),
            _ => false,
        };
        info.destination = Some(destination);
        if let Verdict::Deny { errno } = self.decide(info).await {
            return Err(Outcome::Errno(errno));
        }
        if privileged {
            return Err(Outcome::Errno(libc::EPERM));
        }
        let target = target?;
        // Nothing is performed for a caller that went away while the host decided.
        self.performing()?;
        Ok((sock, target))
    }

    /// Refuses, as if nothing listened there (ECONNREFUSED, nothing decided), a connect or
    /// an addressed send (a TCP Fast Open send connects) to `destination`, pinned as
    /// `target`, on `sock`, that would reach one of the host's own listeners (see
    /// `Broker::keep_executors_from`).
    pub(super) fn keep_from_the_host(
        &self,
        destination: &Destination,
        sock: &TakenSocket,
        target: &Step<Target>,
    ) -> Step<()> {
        if !self.reaches_the_host(destination, sock, target) {
            return Ok(());
        }
        self.still_waiting()?;
        tracing::warn!(
            pid = self.n.pid,
            destination = ?destination,
            "an executor tried to reach the host's own listener; refused as if nothing listened"
        );
        Err(Outcome::Errno(libc::ECONNREFUSED))
    }

    /// Whether a connect or send to `destination` (pinned as `target`) on `sock` would reach
    /// one of the host's own listeners.
    fn reaches_the_host(
        &self,
        destination: &Destination,
        sock: &TakenSocket,
        target: &Step<Target>,
    ) -> bool {
        match destination {
            Destination::UnixPath(_) => target
                .as_ref()
                .ok()
                .and_then(|t| t.pin.as_ref())
                .is_some_and(|pin| self.ctx.host_endpoints.holds_unix(pin)),
            // The unspecified address stands for one the kernel picks: loopback, here.
            Destination::Inet(addr) | Destination::AnyAddress(addr) => {
                sock.info.socket_type == libc::SOCK_STREAM
                    && self.ctx.host_endpoints.holds_tcp(*addr)
            }
            _ => false,
        }
    }

    pub(super) async fn connect(&self) -> Step<Outcome> {
        let (sock, target) = self.decided_address(EgressSyscall::Connect).await?;
        // A datagram socket's peer changes only in its turn (see `datagram_order`).
        let _turn = self.datagram_order(&sock).await;
        let result = self.connect_on(&sock, &target.addr).await?;
        Ok(to_outcome(result.map(|()| 0)))
    }

    pub(super) async fn bind(&self) -> Step<Outcome> {
        let (sock, target) = self.decided_address(EgressSyscall::Bind).await?;
        // The broker may hold CAP_NET_BIND_SERVICE; the executor holds no capability, so the
        // kernel would refuse it a privileged port, and so does the broker.
        if privileged_port(&target.addr) {
            return Ok(Outcome::Errno(libc::EACCES));
        }
        let bind = || sys::bind_raw(sock.fd.as_fd(), &target.addr);
        if let Err(e) = unix_op(self.ctx.identity, &sock, bind) {
            return Ok(Outcome::Errno(errno_of(&e)));
        }
        self.remember_bound(&sock);
        Ok(Outcome::Value(0))
    }

    /// `listen` on a socket the broker bound exposes only the address that (decided) bind
    /// chose, and is carried out. On any other IP socket the kernel may bind it itself, to
    /// an address and ephemeral port no `bind` decided: `getsockname` cannot tell (a failed
    /// or dissolved connect leaves a stale port in it), so that is a `listen` attempt on the
    /// socket family's wildcard address, port 0, carried out only if allowed. Any other unix
    /// socket may have been named by the kernel without a `bind` (a connect or send with
    /// `SO_PASSCRED` set autobinds it, even one that then fails): that is a `listen` attempt
    /// on its name, carried out only if allowed; an unnamed one is refused as the kernel
    /// would (EINVAL), since a name given to it meanwhile was decided by no one. A socket of
    /// any other family is refused (EOPNOTSUPP): what its `listen` exposes is decided by no
    /// rule (an SMC socket's binds itself to every address). The broker
    /// performs the `listen` on its own copy of the socket, so the descriptor number cannot
    /// be swapped for another socket between check and effect.
    pub(super) async fn listen(&self) -> Step<Outcome> {
        let [fd, backlog, ..] = self.n.args;
        let (_pidfd, sock) = self.socket(fd)?;
        // Nothing copied: this check is what proves the socket is the waiting thread's.
        self.still_waiting()?;
        let exposed = match sock.info.family {
            libc::AF_INET => {
                Destination::Inet(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0))
            }
            libc::AF_INET6 => {
                Destination::Inet(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0))
            }
            libc::AF_UNIX => match sys::local_address(sock.fd.as_fd()) {
                // A unix socket's name, once given, never changes.
                Ok(raw) => match Destination::from_sockaddr(&raw) {
                    Destination::UnixUnnamed => return Ok(Outcome::Errno(libc::EINVAL)),
                    named => named,
                },
                Err(e) => return Ok(Outcome::Errno(errno_of(&e))),
            },
            _ => return Ok(Outcome::Errno(libc::EOPNOTSUPP)),
        };
        if !self.was_bound_by_broker(&sock) {
            let mut info = self.attempt(EgressSyscall::Listen, &sock);
            info.destination = Some(exposed);
            if let Verdict::Deny { errno } = self.decide(info).await {
                return Ok(Outcome::Errno(errno));
            }
            self.performing()?;
        }
        // A unix listener hands its credentials to every client that connects.
        let listen = || sys::listen_raw(sock.fd.as_fd(), backlog as i32);
        Ok(to_outcome(
            unix_op(self.ctx.identity, &sock, listen).map(|()| 0),
        ))
    }

    pub(super) async fn sendto(&self) -> Step<Outcome> {
        let [fd, buf, len, flags, addr, addrlen] = self.n.args;
        let flags = flags as i32;
        let (_pidfd, sock) = self.socket(fd)?;
        if let Some(outcome) = self.after_handshake(&sock, flags).await? {
            return Ok(outcome);
        }
        let payload = self.payload_len(&sock, len as usize)?;
        // The payload and the address in one copy (one read, one pair of validity checks).
        let (data, raw) = if addr == 0 {
            (self.copy(buf, payload)?, None)
        } else {
            let (data, raw) = self.copy_two((buf, payload), (addr, addr_len(addrlen)?))?;
            (data, Some(raw))
        };
        let mut message = OwnedMessage {
            data,
            ..OwnedMessage::default()
        };
        let mut info = self.attempt(EgressSyscall::Sendto, &sock);
        info.bytes = Some(message.data.len());
        let mut pin = None;
        match raw {
            Some(raw) if !ignores_address(&sock, flags) => {
                let (destination, target) = self.resolve(&raw, &sock, EgressSyscall::Sendto);
                self.keep_from_the_host(&destination, &sock, &target)?;
                info.destination = Some(destination);
                if let Ok(t) = &target {
                    message.name = t.addr.clone();
                }
                pin = Some(target);
            }
            _ => {
                info.connected = true;
                info.destination = peer(&sock);
            }
        }
        let privileged = info
            .destination
            .as_ref()
            .is_some_and(needs_network_privilege);
        // An addressed datagram goes only to its socket's peer if it has one: said before it
        // is decided, and checked again in the socket's turn, taken once the broker-wide
        // permit is let go (the turn's holder may wait on the network).
        let addressed = (!info.connected).then(|| info.destination.clone());
        if let Some(destination) = &addressed
            && is_datagram_order(&sock)
        {
            self.refuse_other_than_peer(&sock, destination.as_ref())?;
        }
        if let Verdict::Deny { errno } = self.decide(info).await {
            return Ok(Outcome::Errno(errno));
        }
        if privileged {
            return Ok(Outcome::Errno(libc::EPERM));
        }
        // Held until the send is done: the name sent to is this descriptor's
        // `/proc/self/fd` path, which must not come to name another socket meanwhile.
        let _pinned = pin.transpose()?;
        self.performing()?;
        let _turn = match &addressed {
            Some(destination) => self.datagram_turn(&sock, destination.as_ref()).await?,
            None => None,
        };
        Ok(to_outcome(
            self.send(&sock, message, flags).await?.map(|n| n as i64),
        ))
    }

    pub(super) async fn sendmsg(&self) -> Step<Outcome> {
        let [fd, msg_ptr, flags, ..] = self.n.args;
        let flags = flags as i32;
        let (pidfd, sock) = self.socket(fd)?;
        if let Some(outcome) = self.after_handshake(&sock, flags).await? {
            return Ok(outcome);
        }
        let header = self.copy(msg_ptr, MSGHDR_SIZE)?;
        let mut budget = Budget::default();
        let copied = self.message(
            &pidfd,
            &sock,
            &header,
            (EgressSyscall::Sendmsg, flags),
            &mut budget,
        )?;
        if !copied.connected && is_datagram_order(&sock) {
            self.refuse_other_than_peer(&sock, copied.destination.as_ref())?;
        }
        let mut info = self.attempt(EgressSyscall::Sendmsg, &sock);
        info.bytes = Some(copied.msg.data.len());
        info.destination = copied.destination.clone();
        info.connected = copied.connected;
        info.passed_fds = copied.passed_count;
        if let Verdict::Deny { errno } = self.decide(info).await {
            return Ok(Outcome::Errno(errno));
        }
        if let Some(errno) = copied.unreachable {
            return Ok(Outcome::Errno(errno));
        }
        self.performing()?;
        let _turn = match copied.connected {
            true => None,
            false => {
                self.datagram_turn(&sock, copied.destination.as_ref())
                    .await?
            }
        };
        Ok(to_outcome(
            self.send(&sock, copied.msg.clone(), flags)
                .await?
                .map(|n| n as i64),
        ))
    }

    pub(super) async fn sendmmsg(&self) -> Step<Outcome> {
        let [fd, vec_ptr, vlen, flags, ..] = self.n.args;
        let flags = flags as i32;
        let vlen = (vlen as u32 as usize).min(MAX_IOV);
        if vlen == 0 {
            return Ok(Outcome::Value(0));
        }
        let memory = self.memory()?;
        let (pidfd, sock) = self.socket(fd)?;
        if let Some(outcome) = self.after_handshake(&sock, flags).await? {
            return Ok(outcome);
        }
        // With `MSG_FASTOPEN` on TCP the first message may be a connect to its address, and
        // the later ones then go to that peer whatever they name: the batch ends after the
        // first, as a batch may end early, so that each message is decided by where it goes.
        let vlen = if flags & libc::MSG_FASTOPEN != 0 && is_tcp(&sock) {
            1
        } else {
            vlen
        };
        let headers = self.copy(vec_ptr, vlen * MMSGHDR_SIZE)?;
        let mut messages = Vec::with_capacity(vlen);
        let mut budget = Budget::default();
        for i in 0..vlen {
            let h = &headers[i * MMSGHDR_SIZE..i * MMSGHDR_SIZE + MSGHDR_SIZE];
            match self.message(
                &pidfd,
                &sock,
                h,
                (EgressSyscall::Sendmmsg, flags),
                &mut budget,
            ) {
                Ok(m) => messages.push(m),
                Err(Outcome::Abandon) => return Err(Outcome::Abandon),
                // Like the kernel, a batch that fails part-way reports the messages before
                // the failure; the failure itself is reported only if it is the first.
                Err(first) if i == 0 => return Err(first),
                Err(_) => break,
            }
        }
        // Addressed datagrams go only to the socket's peer if it has one: the batch ends
        // before the first that names another (refused if it is the first); checked again
        // in the socket's turn before the sends.
        if is_datagram_order(&sock)
            && let Some(other) = messages.iter().position(|m| {
                !m.connected
                    && self
                        .refuse_other_than_peer(&sock, m.destination.as_ref())
                        .is_err()
            })
        {
            if other == 0 {
                return Err(Outcome::Errno(libc::EISCONN));
            }
            messages.truncate(other);
        }
        // Every message is reported and decided before any is sent.
        let mut verdicts = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            let mut info = self.attempt(EgressSyscall::Sendmmsg, &sock);
            info.bytes = Some(m.msg.data.len());
            info.destination = m.destination.clone();
            info.connected = m.connected;
            info.message_index = Some(i);
            info.passed_fds = m.passed_count;
            verdicts.push(self.decide(info).await);
        }
        self.performing()?;
        let _turn = match messages.iter().find(|m| !m.connected) {
            Some(m) => self.datagram_turn(&sock, m.destination.as_ref()).await?,
            None => None,
        };
        let other_than_peer = |m: &super::memory::CopiedMessage| {
            !m.connected
                && self
                    .refuse_other_than_peer(&sock, m.destination.as_ref())
                    .is_err()
        };
        if _turn.is_some() && messages.iter().any(other_than_peer) {
            return Err(Outcome::Errno(libc::EISCONN));
        }
        let mut sent = 0usize;
        for (i, (m, verdict)) in messages.iter().zip(verdicts).enumerate() {
            let result = match verdict {
                Verdict::Deny { errno } => Err(io::Error::from_raw_os_error(errno)),
                Verdict::Allow => match m.unreachable {
                    Some(errno) => Err(io::Error::from_raw_os_error(errno)),
                    None => self.send(&sock, m.msg.clone(), flags).await?,
                },
            };
            match result {
                Ok(n) => {
                    let at = vec_ptr + (i * MMSGHDR_SIZE + MSGHDR_SIZE) as u64;
                    // The kernel reports each message's length in its msg_len field. Written
                    // through the memory file opened before the first copy, so it reaches
                    // the caller even if its thread id is reused meanwhile, and nothing else.
                    use std::os::unix::fs::FileExt;
                    let _ = memory.write_all_at(&(n as u32).to_ne_bytes(), at);
                    sent += 1;
                    // A message sent only in part ends the batch, as in the kernel: what
                    // follows must not be written after a gap in a stream.
                    if n < m.msg.data.len() {
                        break;
                    }
                }
                Err(e) if sent == 0 => return Ok(Outcome::Errno(errno_of(&e))),
                Err(_) => break,
            }
        }
        Ok(Outcome::Value(sent as i64))
    }
}

/// Whether the kernel ignores the address a send on `sock` with `flags` gives, so that the
/// socket's peer is what the host decides and the record names:
/// - TCP sends to the peer of its connection whatever address it is given, and so it does
///   while its handshake is under way (the bytes wait for it, then go to the address the
///   connect named, which `getpeername` does not tell until then: see
///   [`Caller::after_handshake`]). Only `MSG_FASTOPEN` on a socket that is not connected or
///   connecting makes the send a connect to the address.
/// - A seqpacket socket drops the address once connected.
///
/// (A connected unix stream socket refuses an address with EISCONN, which the send then
/// returns as the kernel would.)
pub(super) fn ignores_address(sock: &TakenSocket, flags: i32) -> bool {
    if is_tcp(sock) {
        // A state that cannot be read is taken as a connection: the send is then decided by
        // the peer, or refused for having none, never by an address the kernel may ignore.
        return flags & libc::MSG_FASTOPEN == 0
            || sys::tcp_state(sock.fd.as_fd()).is_none_or(|s| s != sys::TCP_CLOSE);
    }
    sock.info.socket_type == libc::SOCK_SEQPACKET && peer(sock).is_some()
}

/// Whether `sock` is a TCP socket (the only stream protocol an IP socket may have here).
pub(super) fn is_tcp(sock: &TakenSocket) -> bool {
    sock.info.socket_type == libc::SOCK_STREAM
        && matches!(sock.info.family, libc::AF_INET | libc::AF_INET6)
}

/// Whether a send or connect to `dest` needs a capability the executor lacks and the broker,
/// which performs it, may hold: a netlink message to another socket (a port id other than
/// the kernel's 0) or to a multicast group. The kernel lets only a holder of `CAP_NET_ADMIN`
/// do that for every netlink family a profile may allow, and it stamps the message with the
/// sender's credentials, which a listener such as a uevent consumer trusts; so the broker
/// refuses it with EPERM, as the kernel would refuse the executor.
pub(super) fn needs_network_privilege(dest: &Destination) -> bool {
    matches!(dest, Destination::Netlink { port_id, groups } if *port_id != 0 || *groups != 0)
}

/// Whether a bind to `dest` joins netlink multicast groups. The kernel checks some groups
/// against the binding task's capabilities (`CAP_NET_ADMIN`, `CAP_SYS_ADMIN`), which would be
/// the broker's, so such a bind is refused with EPERM; `NETLINK_ADD_MEMBERSHIP` joins a group
/// with the executor's own capabilities checked, since the executor makes that call itself.
fn joins_netlink_groups(dest: &Destination) -> bool {
    matches!(dest, Destination::Netlink { groups, .. } if *groups != 0)
}

/// Whether `addr` (a raw IPv4 or IPv6 socket address) names a port below the host's
/// `ip_unprivileged_port_start` (1024 if it cannot be read), port 0 excepted.
fn privileged_port(addr: &[u8]) -> bool {
    let family = addr
        .get(..2)
        .map(|f| i32::from(u16::from_ne_bytes([f[0], f[1]])));
    if !matches!(family, Some(libc::AF_INET | libc::AF_INET6)) {
        return false;
    }
    let Some(&[hi, lo]) = addr.get(2..4) else {
        return false;
    };
    let port = u16::from_be_bytes([hi, lo]);
    let start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_unprivileged_port_start")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(1024);
    port != 0 && u32::from(port) < start
}
