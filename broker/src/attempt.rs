//! Egress attempts: what an executor asked the kernel to do, as seen by the broker before it
//! happened, and the verdict the host returns.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;

use tokio::sync::oneshot;

use crate::escaped::Escaped;

/// The intercepted syscall.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EgressSyscall {
    /// `connect(2)`.
    Connect,
    /// `sendto(2)` with a destination address.
    Sendto,
    /// `sendmsg(2)` (with or without `msg_name`).
    Sendmsg,
    /// One message of a `sendmmsg(2)` batch.
    Sendmmsg,
    /// `bind(2)`.
    Bind,
    /// `listen(2)` on a socket that was never bound: the kernel would bind it itself, to
    /// the wildcard address and an ephemeral port, without a `bind` the broker could decide.
    Listen,
}

impl EgressSyscall {
    /// The syscall's name.
    pub fn as_str(self) -> &'static str {
        match self {
            EgressSyscall::Connect => "connect",
            EgressSyscall::Sendto => "sendto",
            EgressSyscall::Sendmsg => "sendmsg",
            EgressSyscall::Sendmmsg => "sendmmsg",
            EgressSyscall::Bind => "bind",
            EgressSyscall::Listen => "listen",
        }
    }
}

/// The socket the syscall operates on, read from the socket itself (`SO_DOMAIN`, `SO_TYPE`,
/// `SO_PROTOCOL`), not from what the executor claimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SocketInfo {
    /// AF_* family.
    pub family: i32,
    /// SOCK_* type.
    pub socket_type: i32,
    /// Protocol number.
    pub protocol: i32,
}

impl SocketInfo {
    /// Whether it is a ping socket (ICMP or ICMPv6 echo, `SOCK_DGRAM`).
    pub fn is_icmp(&self) -> bool {
        matches!(
            (self.family, self.protocol),
            (libc::AF_INET | libc::AF_INET6, libc::IPPROTO_ICMP)
                | (libc::AF_INET6, libc::IPPROTO_ICMPV6)
        )
    }

    /// The family's conventional name (`inet`, `inet6`, `unix`, `netlink`, or `af<N>`).
    pub fn family_name(&self) -> String {
        family_name(self.family)
    }

    /// The type's conventional name (`stream`, `dgram`, `seqpacket`, `raw`, or `type<N>`).
    pub fn type_name(&self) -> String {
        match self.socket_type {
            libc::SOCK_STREAM => "stream".into(),
            libc::SOCK_DGRAM => "dgram".into(),
            libc::SOCK_SEQPACKET => "seqpacket".into(),
            libc::SOCK_RAW => "raw".into(),
            other => format!("type{other}"),
        }
    }

    /// The protocol's conventional name for IP sockets (`tcp`, `udp`, ...), else `proto<N>`.
    pub fn protocol_name(&self) -> String {
        match (self.family, self.protocol) {
            (libc::AF_INET | libc::AF_INET6, libc::IPPROTO_TCP) => "tcp".into(),
            (libc::AF_INET | libc::AF_INET6, libc::IPPROTO_UDP) => "udp".into(),
            (libc::AF_INET | libc::AF_INET6, libc::IPPROTO_ICMP) => "icmp".into(),
            (libc::AF_INET6, libc::IPPROTO_ICMPV6) => "icmpv6".into(),
            (libc::AF_UNIX, 0) => "unix".into(),
            (_, p) => format!("proto{p}"),
        }
    }
}

/// The conventional name of an AF_* family.
pub fn family_name(family: i32) -> String {
    match family {
        libc::AF_UNIX => "unix".into(),
        libc::AF_INET => "inet".into(),
        libc::AF_INET6 => "inet6".into(),
        libc::AF_NETLINK => "netlink".into(),
        libc::AF_UNSPEC => "unspec".into(),
        other => format!("af{other}"),
    }
}

/// Where the executor asked to send or connect, decoded from the broker's own copy of the
/// address.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Destination {
    /// An IPv4 or IPv6 socket address.
    Inet(SocketAddr),
    /// A pathname unix socket, as an absolute path in the executor's filesystem view
    /// (relative paths are resolved against the executor's working directory).
    UnixPath(PathBuf),
    /// An abstract unix socket name (without the leading NUL).
    UnixAbstract(Vec<u8>),
    /// An unnamed unix address (autobind).
    UnixUnnamed,
    /// A netlink address.
    Netlink {
        /// Destination port id (0 = the kernel).
        port_id: u32,
        /// Multicast groups.
        groups: u32,
    },
    /// AF_UNSPEC passed to `connect` (dissolves a socket's association).
    Unspecified,
    /// An address whose family the kernel would not read as written for this socket and
    /// syscall (AF_UNSPEC outside `connect`, an AF_UNIX address on an inet socket, ...).
    /// Never decoded further and never allowed.
    Foreign {
        /// The address's AF_* family.
        family: i32,
        /// The socket's AF_* family.
        socket_family: i32,
    },
    /// The unspecified address given to connect or send to: the kernel substitutes an
    /// address from the socket's own state, so no rule can be checked on it. Never allowed.
    AnyAddress(SocketAddr),
    /// An IPv6 address naming an interface (`sin6_scope_id`): the kernel binds the socket
    /// to that interface (as `SO_BINDTODEVICE` would), which no rule names. Never allowed.
    Scoped {
        /// The address, without its interface.
        address: SocketAddr,
        /// The interface index.
        scope_id: u32,
    },
    /// A family the broker does not decode.
    Other {
        /// The AF_* family.
        family: i32,
    },
    /// An address too short or malformed for its family.
    Malformed {
        /// The family field, if present.
        family: Option<i32>,
        /// The address length.
        len: usize,
    },
}

impl Destination {
    /// Decodes the address an executor passed to `syscall` on a socket of `socket_family`.
    ///
    /// The kernel interprets some families differently per socket: a UDP send or an inet
    /// bind with AF_UNSPEC is carried out as AF_INET. So an address is decoded only when its
    /// family is one the socket's own family reads as written; anything else is
    /// [`Destination::Foreign`], which no rule allows.
    pub fn for_socket(raw: &[u8], socket_family: i32, syscall: EgressSyscall) -> Destination {
        let decoded = Destination::from_sockaddr(raw);
        let family = match &decoded {
            // (from_sockaddr never produces AnyAddress; it is decided below.)
            Destination::Malformed { .. } | Destination::AnyAddress(_) => return decoded,
            Destination::Unspecified if syscall == EgressSyscall::Connect => return decoded,
            Destination::Unspecified => libc::AF_UNSPEC,
            Destination::Inet(SocketAddr::V4(_)) => libc::AF_INET,
            Destination::Inet(SocketAddr::V6(_)) | Destination::Scoped { .. } => libc::AF_INET6,
            Destination::UnixPath(_) | Destination::UnixAbstract(_) | Destination::UnixUnnamed => {
                libc::AF_UNIX
            }
            Destination::Netlink { .. } => libc::AF_NETLINK,
            Destination::Other { family } | Destination::Foreign { family, .. } => *family,
        };
        // An IPv6 socket also reaches IPv4 destinations (unless IPV6_V6ONLY, in which case
        // the kernel refuses them).
        let readable =
            family == socket_family || (socket_family == libc::AF_INET6 && family == libc::AF_INET);
        if readable {
            match decoded {
                // As a connect or send destination, the unspecified address stands for an
                // address the kernel takes from the socket's state (its bound source address,
                // a PKTINFO source, or loopback). (For bind it means every local address.)
                Destination::Inet(addr)
                    if syscall != EgressSyscall::Bind && is_unspecified(addr.ip()) =>
                {
                    Destination::AnyAddress(addr)
                }
                other => other,
            }
        } else {
            Destination::Foreign {
                family,
                socket_family,
            }
        }
    }

    /// Whether the address was decoded into something a rule can be checked against.
    /// Malformed, foreign and undecoded families are refused whatever the rules say.
    pub fn is_decidable(&self) -> bool {
        !matches!(
            self,
            Destination::Malformed { .. }
                | Destination::Foreign { .. }
                | Destination::Scoped { .. }
                | Destination::Other { .. }
                | Destination::AnyAddress(_)
        )
    }

    /// Decodes a raw `struct sockaddr` copy as written, whatever socket it is for.
    pub fn from_sockaddr(raw: &[u8]) -> Destination {
        if raw.len() < 2 {
            return Destination::Malformed {
                family: None,
                len: raw.len(),
            };
        }
        let family = i32::from(u16::from_ne_bytes([raw[0], raw[1]]));
        let malformed = Destination::Malformed {
            family: Some(family),
            len: raw.len(),
        };
        match family {
            libc::AF_INET => {
                if raw.len() < 16 {
                    return malformed;
                }
                let port = u16::from_be_bytes([raw[2], raw[3]]);
                let ip = Ipv4Addr::new(raw[4], raw[5], raw[6], raw[7]);
                Destination::Inet(SocketAddr::new(IpAddr::V4(ip), port))
            }
            libc::AF_INET6 => {
                // 24 bytes is the RFC 2133 form without sin6_scope_id, which the kernel
                // still accepts.
                if raw.len() < 24 {
                    return malformed;
                }
                let port = u16::from_be_bytes([raw[2], raw[3]]);
                let mut octets = [0u8; 16];
                octets.copy_from_slice(&raw[8..24]);
                let address = SocketAddr::new(IpAddr::V6(Ipv6Addr::from(octets)), port);
                match raw.get(24..28) {
                    Some(&[a, b, c, d]) if u32::from_ne_bytes([a, b, c, d]) != 0 => {
                        Destination::Scoped {
                            address,
                            scope_id: u32::from_ne_bytes([a, b, c, d]),
                        }
                    }
                    _ => Destination::Inet(address),
                }
            }
            libc::AF_UNIX => {
                let path = &raw[2..];
                if path.is_empty() {
                    return Destination::UnixUnnamed;
                }
                if path[0] == 0 {
                    return Destination::UnixAbstract(path[1..].to_vec());
                }
                let end = path.iter().position(|b| *b == 0).unwrap_or(path.len());
                use std::os::unix::ffi::OsStrExt;
                Destination::UnixPath(PathBuf::from(std::ffi::OsStr::from_bytes(&path[..end])))
            }
            libc::AF_NETLINK => {
                if raw.len() < 12 {
                    return malformed;
                }
                let port_id = u32::from_ne_bytes([raw[4], raw[5], raw[6], raw[7]]);
                let groups = u32::from_ne_bytes([raw[8], raw[9], raw[10], raw[11]]);
                Destination::Netlink { port_id, groups }
            }
            libc::AF_UNSPEC => Destination::Unspecified,
            other => Destination::Other { family: other },
        }
    }
}

/// `ip`, an IPv4-mapped IPv6 address as the IPv4 address it carries (what an IPv4 peer of
/// an IPv6 socket reads back as, and what a connect to it reaches).
pub(crate) fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

/// `0.0.0.0`, `::` or `::ffff:0.0.0.0`.
fn is_unspecified(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_unspecified(),
        IpAddr::V6(v6) => {
            v6.is_unspecified() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_unspecified())
        }
    }
}

/// The destination as a person reads it (a log line, a terminal): socket paths and names,
/// which the executor chose, have their control characters escaped (see [`Escaped`]). Records
/// are made from the destination itself and keep the exact bytes.
impl fmt::Display for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Destination::Inet(addr) => write!(f, "{addr}"),
            // The executor chose these bytes: shown escaped, never raw (see `Escaped`).
            Destination::UnixPath(p) => write!(f, "unix:{}", Escaped(p.display())),
            Destination::UnixAbstract(name) => {
                write!(f, "unix:@{}", Escaped(String::from_utf8_lossy(name)))
            }
            Destination::UnixUnnamed => f.write_str("unix:(unnamed)"),
            Destination::Netlink { port_id, groups } => {
                write!(f, "netlink:{port_id}/{groups:#x}")
            }
            Destination::Unspecified => f.write_str("unspec"),
            Destination::AnyAddress(addr) => write!(f, "{addr} (unspecified destination)"),
            Destination::Foreign {
                family,
                socket_family,
            } => write!(
                f,
                "{} address on an {} socket",
                family_name(*family),
                family_name(*socket_family)
            ),
            Destination::Scoped { address, scope_id } => {
                write!(f, "[{}%{scope_id}]:{}", address.ip(), address.port())
            }
            Destination::Other { family } => write!(f, "{}:?", family_name(*family)),
            Destination::Malformed { family, len } => match family {
                Some(fam) => write!(f, "malformed {} address ({len} bytes)", family_name(*fam)),
                None => write!(f, "malformed address ({len} bytes)"),
            },
        }
    }
}

/// Everything the broker learned about one outbound operation before performing it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptInfo {
    /// Which syscall.
    pub syscall: EgressSyscall,
    /// Thread id of the caller (host pid namespace).
    pub pid: i32,
    /// The caller's executable, from `/proc/<pid>/exe`.
    pub executable: Option<PathBuf>,
    /// The socket, as the kernel describes it.
    pub socket: SocketInfo,
    /// Where the data or connection would go. For a send without an address this is the
    /// socket's connected peer (`connected` is true), or `None` if it has none.
    pub destination: Option<Destination>,
    /// True when no address was given and the destination is the connected peer.
    pub connected: bool,
    /// Payload size in bytes for sends; `None` for connect and bind.
    pub bytes: Option<usize>,
    /// Position in a `sendmmsg` batch.
    pub message_index: Option<usize>,
    /// Number of descriptors the message passes (SCM_RIGHTS).
    pub passed_fds: usize,
}

impl AttemptInfo {
    /// The caller's executable: the one the broker read, or (for an attempt given to a
    /// synchronous judge, which gets none) read now from `/proc/<pid>/exe`. Informational:
    /// the caller is blocked in the notified syscall while a judge runs, but another
    /// thread of its process can exec meanwhile.
    pub fn executable_now(&self) -> Option<PathBuf> {
        self.executable
            .clone()
            .or_else(|| crate::sys::executable_of(self.pid))
    }
}

/// The host's answer to an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Carry the operation out (the broker performs it and returns its result).
    Allow,
    /// Refuse it; the executor's syscall fails with this errno.
    Deny {
        /// errno returned to the executor (EACCES by default).
        errno: i32,
    },
}

impl Verdict {
    /// The default refusal: `EACCES`.
    pub const DENY: Verdict = Verdict::Deny {
        errno: libc::EACCES,
    };
}

/// A synchronous first look at each attempt, taken on the supervisor's own thread the
/// moment the attempt is known (its address and payload copied, the copy being what is
/// judged and later sent): `Some(verdict)` decides it there, `None` hands it to the
/// executor's attempt stream ([`crate::Executor::take_attempts`]) as if there were no judge.
///
/// A judge must be cheap and must not block: it runs while the executor's thread waits in
/// its syscall, and no other notification of that executor is received meanwhile. It sees
/// the attempt without its `executable`, which the broker reads only for attempts handed to
/// the stream (whose consumers record it); a judge that needs it reads it with
/// [`AttemptInfo::executable_now`]. A verdict
/// it gives is final and obeyed exactly as one from the stream. The caller was last proven
/// to be waiting when the judged copy was taken (nothing waited since): an operation that
/// then waits its socket's turn may be carried out after the caller is gone, as decided
/// and recorded.
pub type Judge = std::sync::Arc<dyn Fn(&AttemptInfo) -> Option<Verdict> + Send + Sync>;

/// One attempt awaiting a verdict. Dropping it without answering refuses it (fail closed).
#[derive(Debug)]
pub struct EgressAttempt {
    info: AttemptInfo,
    responder: oneshot::Sender<Verdict>,
}

impl EgressAttempt {
    pub(crate) fn new(info: AttemptInfo) -> (Self, oneshot::Receiver<Verdict>) {
        let (responder, rx) = oneshot::channel();
        (Self { info, responder }, rx)
    }

    /// What was asked.
    pub fn info(&self) -> &AttemptInfo {
        &self.info
    }

    /// Answers the attempt.
    pub fn respond(self, verdict: Verdict) {
        // A closed receiver means the executor is gone; there is nobody left to answer.
        let _ = self.responder.send(verdict);
    }

    /// Allows the attempt.
    pub fn allow(self) {
        self.respond(Verdict::Allow)
    }

    /// Refuses the attempt with `EACCES`.
    pub fn deny(self) {
        self.respond(Verdict::DENY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sockaddr_in(ip: [u8; 4], port: u16) -> Vec<u8> {
        let mut v = vec![0u8; 16];
        v[..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
        v[2..4].copy_from_slice(&port.to_be_bytes());
        v[4..8].copy_from_slice(&ip);
        v
    }

    /// An IPv6 address with an interface (`sin6_scope_id`) is refused: the kernel binds the
    /// socket to that interface, as `SO_BINDTODEVICE` would, and no rule names one. Before, the
    /// scope was dropped from what was decided and passed on to the kernel.
    #[test]
    fn an_ipv6_address_with_an_interface_is_not_decidable() {
        let mut raw = vec![0u8; 28];
        raw[..2].copy_from_slice(&(libc::AF_INET6 as u16).to_ne_bytes());
        raw[2..4].copy_from_slice(&443u16.to_be_bytes());
        raw[8..24].copy_from_slice(&"fe80::1".parse::<Ipv6Addr>().unwrap().octets());
        raw[24..28].copy_from_slice(&1u32.to_ne_bytes());
        let d = Destination::for_socket(&raw, libc::AF_INET6, EgressSyscall::Connect);
        assert!(!d.is_decidable(), "{d:?}");
        assert!(d.to_string().contains("%1"), "{d}");
        raw[24..28].copy_from_slice(&0u32.to_ne_bytes());
        assert!(
            Destination::for_socket(&raw, libc::AF_INET6, EgressSyscall::Connect).is_decidable()
        );
    }

    #[test]
    fn decodes_families() {
        assert_eq!(
            Destination::from_sockaddr(&sockaddr_in([127, 0, 0, 1], 8080)).to_string(),
            "127.0.0.1:8080"
        );
        let mut six = vec![0u8; 28];
        six[..2].copy_from_slice(&(libc::AF_INET6 as u16).to_ne_bytes());
        six[2..4].copy_from_slice(&443u16.to_be_bytes());
        six[23] = 1;
        assert_eq!(Destination::from_sockaddr(&six).to_string(), "[::1]:443");
        let mut unix = (libc::AF_UNIX as u16).to_ne_bytes().to_vec();
        unix.extend_from_slice(b"/run/x.sock\0garbage");
        assert_eq!(
            Destination::from_sockaddr(&unix),
            Destination::UnixPath("/run/x.sock".into())
        );
        let mut abs = (libc::AF_UNIX as u16).to_ne_bytes().to_vec();
        abs.extend_from_slice(b"\0name");
        assert_eq!(
            Destination::from_sockaddr(&abs),
            Destination::UnixAbstract(b"name".to_vec())
        );
        assert!(matches!(
            Destination::from_sockaddr(&sockaddr_in([1, 2, 3, 4], 1)[..8]),
            Destination::Malformed { len: 8, .. }
        ));
        assert!(matches!(
            Destination::from_sockaddr(&[1]),
            Destination::Malformed { family: None, .. }
        ));
    }

    #[test]
    fn decodes_by_the_socket_family() {
        let mut unspec = sockaddr_in([8, 8, 8, 8], 53);
        unspec[..2].copy_from_slice(&(libc::AF_UNSPEC as u16).to_ne_bytes());
        // connect(AF_UNSPEC) dissolves an association; a send or bind would reach 8.8.8.8.
        assert_eq!(
            Destination::for_socket(&unspec, libc::AF_INET, EgressSyscall::Connect),
            Destination::Unspecified
        );
        for syscall in [
            EgressSyscall::Sendto,
            EgressSyscall::Sendmsg,
            EgressSyscall::Sendmmsg,
            EgressSyscall::Bind,
        ] {
            let d = Destination::for_socket(&unspec, libc::AF_INET, syscall);
            assert_eq!(
                d,
                Destination::Foreign {
                    family: libc::AF_UNSPEC,
                    socket_family: libc::AF_INET
                }
            );
            assert!(!d.is_decidable());
            assert_eq!(d.to_string(), "unspec address on an inet socket");
        }
        // The unspecified address as a destination is not decidable; for bind it is.
        let any = sockaddr_in([0, 0, 0, 0], 8080);
        let d = Destination::for_socket(&any, libc::AF_INET, EgressSyscall::Connect);
        assert_eq!(d.to_string(), "0.0.0.0:8080 (unspecified destination)");
        assert!(!d.is_decidable());
        assert_eq!(
            Destination::for_socket(&any, libc::AF_INET, EgressSyscall::Bind).to_string(),
            "0.0.0.0:8080"
        );
        let mut any6 = vec![0u8; 24];
        any6[..2].copy_from_slice(&(libc::AF_INET6 as u16).to_ne_bytes());
        any6[2..4].copy_from_slice(&80u16.to_be_bytes());
        assert_eq!(
            Destination::for_socket(&any6, libc::AF_INET6, EgressSyscall::Bind).to_string(),
            "[::]:80",
            "a 24-byte RFC 2133 sockaddr_in6 decodes"
        );
        assert!(
            !Destination::for_socket(&any6, libc::AF_INET6, EgressSyscall::Sendto).is_decidable()
        );
        let v4 = sockaddr_in([10, 0, 0, 5], 443);
        assert!(matches!(
            Destination::for_socket(&v4, libc::AF_INET6, EgressSyscall::Sendto),
            Destination::Inet(_)
        ));
        assert!(matches!(
            Destination::for_socket(&v4, libc::AF_UNIX, EgressSyscall::Connect),
            Destination::Foreign { .. }
        ));
        let mut unix = (libc::AF_UNIX as u16).to_ne_bytes().to_vec();
        unix.extend_from_slice(b"/run/x.sock\0");
        assert!(matches!(
            Destination::for_socket(&unix, libc::AF_INET, EgressSyscall::Connect),
            Destination::Foreign { .. }
        ));
        assert!(
            Destination::for_socket(&unix, libc::AF_UNIX, EgressSyscall::Connect).is_decidable()
        );
    }

    /// A socket name or path is the executor's choice: shown to a person (a log line, a
    /// terminal), its control bytes must not retitle, erase or rewrite what they see.
    #[test]
    fn a_destination_shown_to_a_person_carries_no_control_characters() {
        let shown = [
            Destination::UnixAbstract(b"\x1b]0;pwned\x07\x1b[2J\r\x05\x0e\x0f\x7f".to_vec()),
            Destination::UnixPath("/tmp/\x1b]0;pwned\x07\r\u{9b}2J".into()),
        ]
        .map(|d| d.to_string());
        for text in &shown {
            assert!(!text.chars().any(char::is_control), "{text:?}");
            assert!(
                text.contains("pwned") && text.contains("\\u{1b}"),
                "{text:?}"
            );
        }
        assert_eq!(
            shown[0],
            "unix:@\\u{1b}]0;pwned\\u{7}\\u{1b}[2J\\u{d}\\u{5}\\u{e}\\u{f}\\u{7f}"
        );
    }

    #[test]
    fn dropped_attempt_is_a_refusal() {
        let info = AttemptInfo {
            syscall: EgressSyscall::Connect,
            pid: 1,
            executable: None,
            socket: SocketInfo {
                family: libc::AF_INET,
                socket_type: libc::SOCK_STREAM,
                protocol: libc::IPPROTO_TCP,
            },
            destination: None,
            connected: false,
            bytes: None,
            message_index: None,
            passed_fds: 0,
        };
        let (attempt, mut rx) = EgressAttempt::new(info);
        drop(attempt);
        assert!(
            rx.try_recv().is_err(),
            "no verdict means the supervisor refuses"
        );
    }
}
