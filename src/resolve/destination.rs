//! Operator destination rules: allow and block lists of addresses, CIDRs, ports and unix
//! socket paths, with a default. Used for every egress attempt the broker reports (after the
//! flow checks, in the daemon) and by `flowhost sandbox run --allow`.
//!
//! Rule syntax (one string per rule):
//!
//! | rule | matches |
//! |---|---|
//! | `127.0.0.1` / `::1` | that address, any port |
//! | `127.0.0.1:8080` / `[::1]:8080` | that address and port |
//! | `10.0.0.0/8` / `10.0.0.0/8:443` | addresses in the CIDR (on that port) |
//! | `*:53` | any address on that port |
//! | `api.example.com:443` | addresses the host handed out for that name, on that port |
//! | `*.example.com:443` | addresses handed out for any name beneath `example.com` |
//! | `unix:/run/app.sock` | that unix socket path (exact) |
//! | `unix:/run/app/` | unix socket paths beneath that directory |
//! | `unix:@name` | that abstract unix socket |
//!
//! Block rules win over allow rules; with neither matching, the default applies (block unless
//! configured otherwise). An AF_UNSPEC "connect" only dissolves a socket's association, sends
//! nothing, and is always allowed; an address the broker could not decode for its socket (an
//! AF_UNSPEC send or bind, a family the socket does not speak, a truncated address) is always
//! refused, even under `default = "allow"`. Unix paths are matched after `.` and `..` are
//! resolved, so `unix:/run/app/` does not match `/run/app/../docker.sock`.
//!
//! Host-name rules need a port. They match an address only where the host itself answered
//! the executor's lookup of a matching name with it (the daemon's DNS mediation remembers
//! which); an address the executor never got from such a lookup is judged by address rules
//! alone. Names are compared in lower case, without a trailing dot.

use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use ipnet::IpNet;
use serde::{Deserialize, Deserializer};

/// A destination as the rules see it: what an outbound operation would reach. The daemon and
/// the sandbox CLI map the broker's decoding into it (the rules know nothing of the broker).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// An IPv4 or IPv6 socket address.
    Inet(std::net::SocketAddr),
    /// An IPv4 or IPv6 socket address the host handed out as an answer to the executor's
    /// lookups of `name` and of every name in `also`: matched by address rules and by
    /// host-name rules for any of those names (so a block rule naming one of them refuses
    /// it, however many allowed names share the address).
    Named {
        /// The address and port.
        addr: std::net::SocketAddr,
        /// The name the executor last looked up and got the address for.
        name: HostName,
        /// The other names it got the address for (still remembered).
        also: Vec<HostName>,
    },
    /// A pathname unix socket (`.` and `..` resolved by the broker where it could).
    UnixPath(PathBuf),
    /// An abstract unix socket name.
    UnixAbstract(Vec<u8>),
    /// An unnamed unix address (autobind; no rule names one: the default decides).
    UnixUnnamed,
    /// A netlink address (no rule names one: the default decides).
    Netlink {
        /// Destination port id.
        port_id: u32,
    },
    /// An AF_UNSPEC connect: dissolves a socket's association and reaches nothing.
    Disconnect,
    /// An address on port 53 an executor whose lookups the host answers tried to reach
    /// past the resolver it was given: a lookup nobody would judge by name. Never allowed,
    /// whatever the rules say.
    LookupPastResolver(std::net::SocketAddr),
    /// An address the executor's lookups handed out before a reload narrowed the rules that
    /// judged them: the names it was bound to were screened (their CNAME chains included)
    /// against fewer block rules than apply now. Never allowed; looked up again, it is
    /// judged anew.
    HandedOutBeforeNarrowing(std::net::SocketAddr),
    /// An address no rule can be checked on (unnamed, foreign to its socket, an unspecified
    /// IP, undecodable, malformed), described. Never allowed, whatever the default.
    Undecidable(String),
}

/// Why a rule string is not valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("destination rule {rule:?}: {reason}")]
pub struct RuleError {
    /// The rule as written.
    pub rule: String,
    /// What is wrong with it.
    pub reason: String,
}

/// One destination rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DestinationRule {
    /// An address range, optionally limited to one port.
    Inet {
        /// The network (a single address is a /32 or /128).
        net: IpNet,
        /// The port, or any.
        port: Option<u16>,
    },
    /// Any address on this port.
    Port(u16),
    /// A unix socket path, exactly.
    UnixPath(PathBuf),
    /// Unix socket paths beneath this directory.
    UnixDir(PathBuf),
    /// An abstract unix socket name.
    UnixAbstract(Vec<u8>),
    /// A host name (or, with `subdomains`, every name beneath it) on one port.
    Name {
        /// The name.
        name: HostName,
        /// Whether the rule is `*.NAME` (names strictly beneath `name`, not `name` itself).
        subdomains: bool,
        /// The port.
        port: u16,
    },
}

/// A DNS host name: lower case, no trailing dot, 1 to 253 characters of labels of 1 to 63
/// letters, digits, `-` and `_` (not starting or ending with `-`), not all digits and dots
/// (that would be an address).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostName(String);

impl HostName {
    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `self` is `parent` or, with `strictly`, a name strictly beneath it.
    pub fn within(&self, parent: &HostName, strictly: bool) -> bool {
        match self.0.strip_suffix(parent.as_str()) {
            Some("") => !strictly,
            Some(prefix) => strictly && prefix.ends_with('.'),
            None => false,
        }
    }
}

impl fmt::Display for HostName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for HostName {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let lower = s.strip_suffix('.').unwrap_or(s).to_ascii_lowercase();
        if lower.is_empty() || lower.len() > 253 {
            return Err("a host name has 1 to 253 characters".into());
        }
        for label in lower.split('.') {
            let ok_chars = label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if label.is_empty()
                || label.len() > 63
                || !ok_chars
                || label.starts_with('-')
                || label.ends_with('-')
            {
                return Err(format!(
                    "{label:?} is not a host-name label (1 to 63 letters, digits, '-' or '_', not starting or ending with '-')"
                ));
            }
        }
        if lower.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
            return Err("all digits and dots is an address, not a host name".into());
        }
        Ok(HostName(lower))
    }
}

/// A host-name pattern without a port, written as host-name rules write their names: `NAME`
/// (that name) or `*.NAME` (every name strictly beneath it, not `NAME` itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamePattern {
    name: HostName,
    subdomains: bool,
}

impl NamePattern {
    /// Whether `name` is the pattern's name or, for `*.NAME`, strictly beneath it.
    pub fn matches(&self, name: &HostName) -> bool {
        name.within(&self.name, self.subdomains)
    }
}

impl FromStr for NamePattern {
    type Err = String;

    /// Strict: a port, an address, a wildcard anywhere but a leading `*.`, or anything that
    /// is not a host name is refused (a pattern that means something else than it seems
    /// would widen what it opts in).
    fn from_str(s: &str) -> Result<Self, String> {
        let (subdomains, rest) = match s.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        if rest.contains(':') || rest.parse::<IpAddr>().is_ok() {
            return Err(format!(
                "{s:?} is not a host-name pattern (NAME or *.NAME, without a port or an address)"
            ));
        }
        let name = rest
            .parse::<HostName>()
            .map_err(|e| format!("{s:?} is not a host-name pattern (NAME or *.NAME): {e}"))?;
        Ok(NamePattern { name, subdomains })
    }
}

impl fmt::Display for NamePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.subdomains {
            f.write_str("*.")?;
        }
        write!(f, "{}", self.name)
    }
}

impl FromStr for DestinationRule {
    type Err = RuleError;

    fn from_str(s: &str) -> Result<Self, RuleError> {
        let err = |reason: &str| RuleError {
            rule: s.to_string(),
            reason: reason.to_string(),
        };
        if let Some(rest) = s.strip_prefix("unix:") {
            if let Some(name) = rest.strip_prefix('@') {
                return Ok(DestinationRule::UnixAbstract(name.as_bytes().to_vec()));
            }
            if !rest.starts_with('/') {
                return Err(err(
                    "unix paths must be absolute (unix:/path or unix:@abstract)",
                ));
            }
            // The broker reports paths with `..` resolved: a rule written with it would
            // never name one (a block silently dropped). (A `.` is dropped when paths are
            // compared, so it names what it seems to.)
            if std::path::Path::new(rest)
                .components()
                .any(|c| c == std::path::Component::ParentDir)
            {
                return Err(err(
                    "unix paths may not contain .. (write the path it leads to)",
                ));
            }
            return Ok(if rest.ends_with('/') {
                DestinationRule::UnixDir(PathBuf::from(rest))
            } else {
                DestinationRule::UnixPath(PathBuf::from(rest))
            });
        }
        if let Some(port) = s.strip_prefix("*:") {
            return port
                .parse()
                .map(DestinationRule::Port)
                .map_err(|_| err("expected *:PORT with a port from 0 to 65535"));
        }
        if let Some(rule) = parse_name_rule(s) {
            return rule.map_err(|reason| err(&reason));
        }
        let parse_net = |t: &str| -> Result<IpNet, RuleError> {
            if let Ok(net) = t.parse::<IpNet>() {
                return Ok(canonical_net(net.trunc()));
            }
            t.parse::<IpAddr>()
                .map(|ip| canonical_net(IpNet::from(ip)))
                .map_err(|_| {
                    err("expected an IP address or CIDR, optionally with :PORT ([v6]:PORT for IPv6)")
                })
        };
        // [v6]:port, [v6/len]:port
        if let Some(rest) = s.strip_prefix('[') {
            let (inner, after) = rest.split_once(']').ok_or_else(|| err("missing ']'"))?;
            let port = match after {
                "" => None,
                p => Some(
                    p.strip_prefix(':')
                        .and_then(|p| p.parse().ok())
                        .ok_or_else(|| err("expected :PORT after ']'"))?,
                ),
            };
            return Ok(DestinationRule::Inet {
                net: parse_net(inner)?,
                port,
            });
        }
        // Bare IPv6 (several colons) has no port. One whose last group could be a port
        // after a shorter address (`2001:db8::1:443`) is refused: read as an address it would
        // allow every port of another host than the one the writer may have meant.
        if s.matches(':').count() > 1 {
            if let Some((before, last)) = port_like_last_group(s) {
                return Err(err(&format!(
                    "ambiguous: write [{before}]:{last} for port {last} of {before}, or \
                     [{s}] for that address on every port"
                )));
            }
            return Ok(DestinationRule::Inet {
                net: parse_net(s)?,
                port: None,
            });
        }
        match s.rsplit_once(':') {
            Some((host, port)) => Ok(DestinationRule::Inet {
                net: parse_net(host)?,
                port: Some(
                    port.parse()
                        .map_err(|_| err("the port must be a number from 0 to 65535"))?,
                ),
            }),
            None => Ok(DestinationRule::Inet {
                net: parse_net(s)?,
                port: None,
            }),
        }
    }
}

/// `NAME:PORT` or `*.NAME:PORT`; `None` when `s` is not written as a host-name rule (an
/// address, a CIDR, IPv6).
fn parse_name_rule(s: &str) -> Option<Result<DestinationRule, String>> {
    let (subdomains, rest) = match s.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, s),
    };
    let (host, port) = match rest.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') && !h.contains('/') => (h, Some(p)),
        Some(_) => return None,
        None if rest.contains('/') => return None,
        None => (rest, None),
    };
    // An address (or something that only looks like one) is the address parser's to judge.
    let addressy = host.bytes().all(|b| b.is_ascii_digit() || b == b'.');
    if !subdomains && (addressy || host.parse::<IpAddr>().is_ok()) {
        return None;
    }
    let name = match host.parse::<HostName>() {
        Ok(n) => n,
        Err(e) if subdomains => return Some(Err(e)),
        Err(_) => return None,
    };
    Some(match port {
        None => Err(format!(
            "a host-name rule needs a port: {}{name}:PORT",
            if subdomains { "*." } else { "" }
        )),
        Some(p) => p
            .parse()
            .map(|port| DestinationRule::Name {
                name,
                subdomains,
                port,
            })
            .map_err(|_| "the port must be a number from 0 to 65535".into()),
    })
}

/// The address and port a bare IPv6 text would also read as, when its last group could be a
/// port after a shorter address (`2001:db8::1:443`: `2001:db8::1` port 443).
fn port_like_last_group(s: &str) -> Option<(&str, &str)> {
    let (before, last) = s.rsplit_once(':')?;
    (!last.is_empty()
        && last.bytes().all(|b| b.is_ascii_digit())
        && last.parse::<u16>().is_ok()
        && before.parse::<std::net::Ipv6Addr>().is_ok())
    .then_some((before, last))
}

impl fmt::Display for DestinationRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DestinationRule::Inet { net, port } => {
                let host = if net.prefix_len() == net.max_prefix_len() {
                    net.addr().to_string()
                } else {
                    net.to_string()
                };
                match (port, net) {
                    (Some(p), IpNet::V6(_)) => write!(f, "[{host}]:{p}"),
                    (Some(p), IpNet::V4(_)) => write!(f, "{host}:{p}"),
                    // Written so that it reads back as the address it is.
                    (None, IpNet::V6(_)) if port_like_last_group(&host).is_some() => {
                        write!(f, "[{host}]")
                    }
                    (None, _) => f.write_str(&host),
                }
            }
            DestinationRule::Port(p) => write!(f, "*:{p}"),
            DestinationRule::UnixPath(p) | DestinationRule::UnixDir(p) => {
                write!(f, "unix:{}", p.display())
            }
            DestinationRule::UnixAbstract(n) => write!(f, "unix:@{}", String::from_utf8_lossy(n)),
            DestinationRule::Name {
                name,
                subdomains,
                port,
            } => write!(f, "{}{name}:{port}", if *subdomains { "*." } else { "" }),
        }
    }
}

impl<'de> Deserialize<'de> for DestinationRule {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

fn path_within(path: &Path, dir: &Path) -> bool {
    // Compared component-wise, so /run/app2 is not beneath /run/app/; a path that still
    // holds `..` (the broker resolves them before deciding) is beneath nothing.
    !climbs(path) && path.starts_with(dir)
}

fn climbs(path: &Path) -> bool {
    path.components()
        .any(|c| c == std::path::Component::ParentDir)
}

impl DestinationRule {
    /// Whether the rule matches `dest`.
    pub fn matches(&self, dest: &Destination) -> bool {
        if let Destination::Named { addr, name, also } = dest {
            return match self {
                DestinationRule::Name {
                    name: rule,
                    subdomains,
                    port,
                } => {
                    *port == addr.port()
                        && std::iter::once(name)
                            .chain(also)
                            .any(|n| n.within(rule, *subdomains))
                }
                other => other.matches(&Destination::Inet(*addr)),
            };
        }
        match (self, dest) {
            (DestinationRule::Inet { net, port }, Destination::Inet(addr)) => {
                net.contains(&canonical_ip(addr.ip())) && port.is_none_or(|p| p == addr.port())
            }
            (DestinationRule::Port(p), Destination::Inet(addr)) => *p == addr.port(),
            (DestinationRule::UnixPath(p), Destination::UnixPath(d)) => !climbs(d) && p == d,
            (DestinationRule::UnixDir(p), Destination::UnixPath(d)) => path_within(d, p),
            (DestinationRule::UnixAbstract(n), Destination::UnixAbstract(d)) => n == d,
            _ => false,
        }
    }
}

impl DestinationRule {
    /// Whether this rule, as a block, refuses `dest`: it matches it, or the IPv4 address an
    /// IPv6 one carries ([`reached_ip`]: NAT64, 6to4), which is where the packets go on a
    /// host that translates them. A block of 10.0.0.0/8 so refuses 64:ff9b::a00:5. Within
    /// NAT64's local-use prefix (64:ff9b:1::/48), where the operator's translator chose
    /// where the IPv4 address sits, any block of IPv4 addresses refuses every address.
    pub fn blocks(&self, dest: &Destination) -> bool {
        if self.matches(dest) {
            return true;
        }
        match dest {
            Destination::Inet(addr) | Destination::Named { addr, .. } => {
                if let (
                    DestinationRule::Inet {
                        net: IpNet::V4(_),
                        port,
                    },
                    IpAddr::V6(v6),
                ) = (self, addr.ip())
                    && v6.segments()[..3] == [0x64, 0xff9b, 1]
                    && port.is_none_or(|p| p == addr.port())
                {
                    return true;
                }
                let reached = reached_ip(addr.ip());
                reached != canonical_ip(addr.ip())
                    && self.matches(&Destination::Inet(std::net::SocketAddr::new(
                        reached,
                        addr.port(),
                    )))
            }
            _ => false,
        }
    }

    /// Whether this is a host-name rule matching `name` (on its port).
    pub fn names(&self, name: &HostName) -> bool {
        matches!(self, DestinationRule::Name { name: rule, subdomains, .. } if name.within(rule, *subdomains))
    }
}

/// An IPv4-mapped IPv6 address is matched as the IPv4 address it carries, so an allow or
/// block rule for 10.0.0.1 also governs ::ffff:10.0.0.1.
pub fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

/// The address `ip` reaches: the IPv4 address an IPv6 one carries (IPv4-mapped
/// `::ffff:0:0/96`, IPv4-translated `::ffff:0:0:0/96`, NAT64's 64:ff9b::/96, 6to4's
/// 2002::/16, IPv4-compatible `::a.b.c.d`, which a host with a `sit` tunnel up sends to
/// `a.b.c.d`), else `ip` itself.
pub fn reached_ip(ip: IpAddr) -> IpAddr {
    let IpAddr::V6(v6) = canonical_ip(ip) else {
        return canonical_ip(ip);
    };
    let s = v6.segments();
    let embedded = |hi: u16, lo: u16| {
        IpAddr::V4(std::net::Ipv4Addr::new(
            (hi >> 8) as u8,
            hi as u8,
            (lo >> 8) as u8,
            lo as u8,
        ))
    };
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0]
        || s[..6] == [0, 0, 0, 0, 0xffff, 0]
        || ipv4_compatible(v6)
    {
        embedded(s[6], s[7])
    } else if s[0] == 0x2002 {
        embedded(s[1], s[2])
    } else {
        IpAddr::V6(v6)
    }
}

/// Whether `v6` is an IPv4-compatible address (`::a.b.c.d`, deprecated): `::` and `::1`
/// (and the rest of `::/112`) are IPv6's own, not IPv4-compatible.
pub fn ipv4_compatible(v6: std::net::Ipv6Addr) -> bool {
    let s = v6.segments();
    s[..6] == [0; 6] && s[6] != 0
}

/// A network written in the IPv4-mapped IPv6 form (within `::ffff:0:0/96`) as the IPv4
/// network it carries: destinations are matched in that form ([`canonical_ip`]), so kept as
/// IPv6 it would match nothing. Any other network is returned unchanged. Public so that
/// everything judging addresses (the diff too) uses the same forms as enforcement.
pub fn canonical_net(net: IpNet) -> IpNet {
    if let IpNet::V6(v6) = net
        && v6.prefix_len() >= 96
        && let Some(v4) = v6.network().to_ipv4_mapped()
        && let Ok(mapped) = ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96)
    {
        return IpNet::V4(mapped);
    }
    net
}

/// The network executors' own resolvers listen in (127.53.0.0/16), on port
/// [`RESOLVER_PORT`]: each executor whose lookups the host answers gets one address in it.
pub const RESOLVER_NET: &str = "127.53.0.0/16";
/// The port executors' own resolvers listen on (resolv.conf cannot name another).
pub const RESOLVER_PORT: u16 = 53;

/// Whether `addr` is where an executor's own resolver may listen. No rule reaches one: an
/// executor's sends to its own resolver are its lookups, judged as lookups before any rule
/// is consulted, and a lookup sent to another executor's resolver would be judged under that
/// executor's call and charged to it.
pub fn is_resolver_address(addr: &std::net::SocketAddr) -> bool {
    addr.port() == RESOLVER_PORT
        && matches!(canonical_ip(addr.ip()), IpAddr::V4(v4) if v4.octets()[..2] == [127, 53])
}

/// What to do when no rule matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DefaultAction {
    /// Refuse (the default).
    #[default]
    Block,
    /// Allow.
    Allow,
}

/// The outcome of checking a destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleDecision {
    /// Whether the destination may be reached.
    pub allowed: bool,
    /// The rule that decided (`"default"` when none matched).
    pub rule: String,
}

/// Allow and block lists with a default.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DestinationRules {
    /// Destinations that may be reached.
    #[serde(default)]
    pub allow: Vec<DestinationRule>,
    /// Destinations that are never reached (wins over `allow`).
    #[serde(default)]
    pub block: Vec<DestinationRule>,
    /// When nothing matches.
    #[serde(default)]
    pub default: DefaultAction,
}

impl DestinationRules {
    /// Rules allowing exactly `allow`, blocking the rest.
    pub fn allow_only(allow: Vec<DestinationRule>) -> Self {
        DestinationRules {
            allow,
            block: Vec::new(),
            default: DefaultAction::Block,
        }
    }

    /// Whether a lookup of `name` may be answered: some allow rule names it on a port no
    /// block rule names it on, or no block rule names it (on any port) and the default
    /// allows. Whether a connection to what it resolves to is allowed is decided per port
    /// when it is attempted; the lookup itself sends the name out, so a name blocked on
    /// every port an allow gives it is not looked up.
    pub fn decide_name(&self, name: &HostName) -> RuleDecision {
        decide_lookup(self, None, name)
    }

    /// Decides `dest` (`None`: a send on an unconnected socket, which reaches nothing).
    pub fn decide(&self, dest: Option<&Destination>) -> RuleDecision {
        let Some(dest) = dest else {
            return RuleDecision {
                allowed: false,
                rule: "no destination".into(),
            };
        };
        if *dest == Destination::Disconnect {
            return RuleDecision {
                allowed: true,
                rule: "AF_UNSPEC disconnect".into(),
            };
        }
        // An address the broker could not decode for its socket is never reached, whatever
        // the default: what the kernel would make of it is not what a rule was checked on.
        if matches!(dest, Destination::Undecidable(_)) {
            return RuleDecision {
                allowed: false,
                rule: "undecodable address".into(),
            };
        }
        if let Destination::HandedOutBeforeNarrowing(addr) = dest {
            return RuleDecision {
                allowed: false,
                rule: format!(
                    "an address handed out before a reload narrowed the rules ({addr}): its names were screened against fewer block rules than apply now; looked up again, it is judged anew"
                ),
            };
        }
        if let Destination::LookupPastResolver(addr) = dest {
            return RuleDecision {
                allowed: false,
                rule: format!(
                    "a lookup past the executor's own resolver ({addr}): lookups leave only through the resolver the host gives the executor, judged by name, and none at all where the host gives it none"
                ),
            };
        }
        if let Destination::Inet(addr) | Destination::Named { addr, .. } = dest
            && is_resolver_address(addr)
        {
            return RuleDecision {
                allowed: false,
                rule: format!("another executor's resolver ({RESOLVER_NET} port {RESOLVER_PORT})"),
            };
        }
        if let Some(r) = self.block.iter().find(|r| r.blocks(dest)) {
            return RuleDecision {
                allowed: false,
                rule: format!("block {r}"),
            };
        }
        if let Some(r) = self.allow.iter().find(|r| r.matches(dest)) {
            return RuleDecision {
                allowed: true,
                rule: format!("allow {r}"),
            };
        }
        RuleDecision {
            allowed: self.default == DefaultAction::Allow,
            rule: "default".into(),
        }
    }
}

/// Per-origin rules: destination rules for the calls of one principal (the call's origin),
/// on top of the server's rules. No default of their own: what they do not match, the
/// server's rules decide.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OriginRules {
    /// Destinations this principal's calls may reach even where the server's allow list or
    /// default would refuse them (never past a block rule).
    #[serde(default)]
    pub allow: Vec<DestinationRule>,
    /// Destinations this principal's calls never reach, whatever the server allows.
    #[serde(default)]
    pub block: Vec<DestinationRule>,
}

/// Decides `dest` for a call of `origin` (a principal id and its rules, if any) against a
/// server's `rules`. Precedence, first match wins: what the server's rules refuse whatever
/// the lists say (no destination, an undecodable address, an executor resolver's address, a
/// lookup past the executor's own resolver);
/// the origin's block; the server's
/// block; the origin's allow; the server's allow; the server's default. The decision names
/// the rule and whose it is (`principal <id> block ...`, `server allow ...`).
pub fn decide_with_origin(
    rules: &DestinationRules,
    origin: Option<(&str, &OriginRules)>,
    dest: Option<&Destination>,
) -> RuleDecision {
    let server = |d: RuleDecision| RuleDecision {
        rule: format!("server {}", d.rule),
        ..d
    };
    let Some((who, o)) = origin else {
        return server(rules.decide(dest));
    };
    let Some(d) = dest.filter(|d| match d {
        Destination::Disconnect
        | Destination::Undecidable(_)
        | Destination::LookupPastResolver(_)
        | Destination::HandedOutBeforeNarrowing(_) => false,
        Destination::Inet(addr) | Destination::Named { addr, .. } => !is_resolver_address(addr),
        _ => true,
    }) else {
        return server(rules.decide(dest));
    };
    if let Some(r) = o.block.iter().find(|r| r.blocks(d)) {
        return RuleDecision {
            allowed: false,
            rule: format!("principal {who} block {r}"),
        };
    }
    if let Some(r) = rules.block.iter().find(|r| r.blocks(d)) {
        return RuleDecision {
            allowed: false,
            rule: format!("server block {r}"),
        };
    }
    if let Some(r) = o.allow.iter().find(|r| r.matches(d)) {
        return RuleDecision {
            allowed: true,
            rule: format!("principal {who} allow {r}"),
        };
    }
    server(rules.decide(dest))
}

/// The block rules of one call (its principal's and its server's), against which the names
/// an answer leads through (its CNAME chain) are judged before its addresses are remembered
/// under the name asked.
#[derive(Debug, Clone, Default)]
pub struct NameBlocks {
    /// Each rule with whose it is (`principal <id>`, `server`).
    rules: Vec<(String, DestinationRule)>,
}

impl NameBlocks {
    /// The block rules of `rules` and of `origin` (a principal id and its rules), if any.
    pub fn of(rules: &DestinationRules, origin: Option<(&str, &OriginRules)>) -> NameBlocks {
        let origin = origin
            .into_iter()
            .flat_map(|(who, o)| o.block.iter().map(move |r| (format!("principal {who}"), r)));
        let server = rules.block.iter().map(|r| ("server".to_string(), r));
        NameBlocks {
            rules: origin.chain(server).map(|(w, r)| (w, r.clone())).collect(),
        }
    }

    /// The ports on which a block rule names `name`, each once, in order (empty: none
    /// does).
    pub fn ports_naming(&self, name: &HostName) -> Vec<u16> {
        let mut ports: Vec<u16> = self
            .rules
            .iter()
            .filter_map(|(_, r)| match r {
                DestinationRule::Name { port, .. } if r.names(name) => Some(*port),
                _ => None,
            })
            .collect();
        ports.sort_unstable();
        ports.dedup();
        ports
    }

    /// The first block rule naming `name` on any port, described as
    /// [`decide_with_origin`] describes it (`server block NAME:PORT`): a name an answer leads
    /// through is judged without knowing the port a connect will use.
    pub fn naming(&self, name: &HostName) -> Option<String> {
        self.rules
            .iter()
            .find(|(_, r)| r.names(name))
            .map(|(who, r)| format!("{who} block {r}"))
    }
}

/// Whether a lookup of `name` may be answered for a call of `origin`, on top of the server's
/// `rules`, with each decision named as [`decide_with_origin`] names it.
pub fn decide_name_with_origin(
    rules: &DestinationRules,
    origin: Option<(&str, &OriginRules)>,
    name: &HostName,
) -> RuleDecision {
    decide_lookup(rules, Some(origin), name)
}

/// A lookup of `name` is answered when a connection to it could be allowed on some port: an
/// allow rule (the origin's, then the server's) names it on a port that no block rule (the
/// origin's or the server's) names it on. Otherwise the first block rule naming it (on any
/// port) refuses it, and failing that the server's default decides. `origin` is `None` for
/// the server's rules alone (decisions then not prefixed with whose they are).
fn decide_lookup(
    rules: &DestinationRules,
    origin: Option<Option<(&str, &OriginRules)>>,
    name: &HostName,
) -> RuleDecision {
    let (who, theirs) = match origin {
        Some(Some((who, o))) => (Some(who), Some(o)),
        _ => (None, None),
    };
    let server = |what: &str, r: &dyn std::fmt::Display| match origin {
        None => format!("{what} {r}"),
        Some(_) => format!("server {what} {r}"),
    };
    let principal = |what: &str, r: &DestinationRule| {
        format!("principal {} {what} {r}", who.unwrap_or_default())
    };
    let origin_blocks = theirs.map(|o| o.block.as_slice()).unwrap_or_default();
    let blocks = || origin_blocks.iter().chain(&rules.block);
    // Blocks refuse every connection to the name on `port` when one names the name there,
    // or blocks every address there: a port rule, or networks of every IPv4 and every IPv6
    // address (a name may resolve to either family, so one family's alone leaves the other).
    let every = |port: u16, v6: bool| {
        blocks().any(|b| {
            matches!(b, DestinationRule::Inet { net, port: p }
                if net.prefix_len() == 0
                    && matches!(net, IpNet::V6(_)) == v6
                    && p.is_none_or(|p| p == port))
        })
    };
    let blocked_on = |port: u16| {
        blocks().any(|b| match b {
            DestinationRule::Name { port: p, .. } => *p == port && b.names(name),
            DestinationRule::Port(p) => *p == port,
            _ => false,
        }) || (every(port, false) && every(port, true))
    };
    let unblocked = |r: &&DestinationRule| match r {
        DestinationRule::Name { port, .. } if r.names(name) => !blocked_on(*port),
        _ => false,
    };
    if let Some(r) = theirs.and_then(|o| o.allow.iter().find(unblocked)) {
        return RuleDecision {
            allowed: true,
            rule: principal("allow", r),
        };
    }
    if let Some(r) = rules.allow.iter().find(unblocked) {
        return RuleDecision {
            allowed: true,
            rule: server("allow", r),
        };
    }
    // A block refuses the lookup when it names the name, and so does one of every address
    // when blocks of every address of both families on every port leave no connection the
    // default could allow (the lookup would only carry the name out).
    let everywhere = |b: &DestinationRule, v6: bool| {
        matches!(b, DestinationRule::Inet { net, port: None }
            if net.prefix_len() == 0 && matches!(net, IpNet::V6(_)) == v6)
    };
    let of_family = |v6: bool| blocks().any(|b| everywhere(b, v6));
    let nothing_left = rules.default == DefaultAction::Allow && of_family(false) && of_family(true);
    let refuses = |r: &&DestinationRule| {
        r.names(name) || (nothing_left && (everywhere(r, false) || everywhere(r, true)))
    };
    if let Some(r) = origin_blocks.iter().find(refuses) {
        return RuleDecision {
            allowed: false,
            rule: principal("block", r),
        };
    }
    if let Some(r) = rules.block.iter().find(refuses) {
        return RuleDecision {
            allowed: false,
            rule: server("block", r),
        };
    }
    RuleDecision {
        allowed: rules.default == DefaultAction::Allow,
        rule: match origin {
            None => "default".into(),
            Some(_) => "server default".into(),
        },
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn name_patterns_are_names_or_subdomain_wildcards_and_nothing_else() {
        use super::*;
        let name = |n: &str| n.parse::<HostName>().unwrap();
        let exact: NamePattern = "Fetch.Test".parse().unwrap();
        assert!(exact.matches(&name("fetch.test")));
        assert!(!exact.matches(&name("a.fetch.test")));
        let beneath: NamePattern = "*.corp.internal".parse().unwrap();
        assert!(beneath.matches(&name("db.corp.internal")));
        assert!(beneath.matches(&name("a.b.corp.internal")));
        assert!(!beneath.matches(&name("corp.internal")));
        assert!(!beneath.matches(&name("evilcorp.internal")));
        assert_eq!(beneath.to_string(), "*.corp.internal");
        for bad in [
            "",
            "*",
            "*.",
            "fetch.test:80",
            "127.0.0.1",
            "::1",
            "[::1]",
            "10.0.0.0/8",
            "a.*.test",
            "*fetch.test",
            "**.test",
            "unix:/x",
        ] {
            assert!(bad.parse::<NamePattern>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn origin_rules_combine_with_the_servers_in_the_documented_order() {
        use super::*;
        let rule = |s: &str| s.parse::<DestinationRule>().unwrap();
        let server = DestinationRules {
            allow: vec![rule("10.0.0.0/8")],
            block: vec![rule("10.9.9.9")],
            default: DefaultAction::Block,
        };
        let origin = OriginRules {
            allow: vec![rule("192.0.2.1:443"), rule("10.9.9.9")],
            block: vec![rule("10.1.1.1")],
        };
        let at = |a: &str, port: u16| Destination::Inet(format!("{a}:{port}").parse().unwrap());
        let d = |o: Option<(&str, &OriginRules)>, a: &str, port: u16| {
            let r = decide_with_origin(&server, o, Some(&at(a, port)));
            (r.allowed, r.rule)
        };
        let alice = Some(("alice", &origin));
        assert_eq!(
            d(alice, "10.1.1.1", 80),
            (false, "principal alice block 10.1.1.1".into())
        );
        // The server's block wins over the origin's allow.
        assert_eq!(
            d(alice, "10.9.9.9", 80),
            (false, "server block 10.9.9.9".into())
        );
        // The origin's allow reaches past the server's default.
        assert_eq!(
            d(alice, "192.0.2.1", 443),
            (true, "principal alice allow 192.0.2.1:443".into())
        );
        assert_eq!(
            d(alice, "10.2.3.4", 80),
            (true, "server allow 10.0.0.0/8".into())
        );
        assert_eq!(d(alice, "192.0.2.1", 80), (false, "server default".into()));
        // Without origin rules, the server's alone.
        assert_eq!(d(None, "192.0.2.1", 443), (false, "server default".into()));
        assert_eq!(
            d(None, "10.1.1.1", 80),
            (true, "server allow 10.0.0.0/8".into())
        );
        // Nothing overrides an undecodable destination.
        let r = decide_with_origin(&server, alice, None);
        assert!(!r.allowed);
    }

    use super::*;
    use std::net::SocketAddr;

    fn inet(s: &str) -> Destination {
        Destination::Inet(s.parse::<SocketAddr>().unwrap())
    }
    fn rule(s: &str) -> DestinationRule {
        s.parse().unwrap()
    }

    #[test]
    fn parses_and_round_trips() {
        for s in [
            "127.0.0.1",
            "127.0.0.1:8080",
            "10.0.0.0/8",
            "10.0.0.0/8:443",
            "[::1]:80",
            "::1",
            "fd00::/8",
            "*:53",
            "unix:/run/x.sock",
            "unix:/run/app/",
            "unix:@bus",
            "api.example.com:443",
            "*.example.com:443",
            "fetch.test:8080",
        ] {
            assert_eq!(rule(s).to_string(), s);
        }
        assert_eq!(
            rule("API.Example.COM.:443").to_string(),
            "api.example.com:443"
        );
        assert_eq!(rule("10.1.2.3/8").to_string(), "10.0.0.0/8");
    }

    #[test]
    fn rejects_bad_rules() {
        for s in [
            "",
            "localhost",
            "1.2.3.4:99999",
            "unix:relative",
            "unix:/run/app/../docker.sock",
            "[::1",
            "*:x",
            "1.2.3.4/40",
            "api.example.com",
            "*.example.com",
            "api.example.com:https",
            "bad_-.example.com:-1",
            "-bad.example.com:443",
            "*.:443",
            "ex ample.com:443",
            "1.2.3.4.5:80",
        ] {
            assert!(s.parse::<DestinationRule>().is_err(), "{s}");
        }
    }

    /// A bare IPv6 rule whose last group could be a port after a shorter address is refused,
    /// naming both readings; bracketed, it is the address, and it is written back so.
    /// Before, `2001:db8::1:443` was taken as that address on every port, though its writer
    /// may have meant port 443 of `2001:db8::1`.
    #[test]
    fn a_bare_ipv6_rule_ending_like_a_port_is_refused() {
        let e = "2001:db8::1:443".parse::<DestinationRule>().unwrap_err();
        assert!(
            e.to_string().contains("[2001:db8::1]:443")
                && e.to_string().contains("[2001:db8::1:443]"),
            "{e}"
        );
        for unambiguous in ["[2001:db8::1:443]", "[2001:db8::1]:443", "fe80::443", "::1"] {
            let r = rule(unambiguous);
            assert_eq!(rule(&r.to_string()), r, "{unambiguous}");
        }
        assert_eq!(rule("[2001:db8::1:443]").to_string(), "[2001:db8::1:443]");
        assert_eq!(
            rule("[2001:db8::1:443]"),
            rule("2001:db8:0:0:0:0:1:443"),
            "written out in full, it is unambiguous"
        );
    }

    #[test]
    fn matching() {
        assert!(rule("127.0.0.1").matches(&inet("127.0.0.1:9")));
        assert!(rule("127.0.0.1:9").matches(&inet("127.0.0.1:9")));
        assert!(!rule("127.0.0.1:9").matches(&inet("127.0.0.1:10")));
        assert!(rule("10.0.0.0/8:443").matches(&inet("10.9.8.7:443")));
        assert!(!rule("10.0.0.0/8:443").matches(&inet("11.0.0.1:443")));
        assert!(rule("*:53").matches(&inet("[2001:db8::1]:53")));
        assert!(
            rule("10.0.0.1").matches(&inet("[::ffff:10.0.0.1]:80")),
            "mapped v4"
        );
        // A rule written in the mapped form governs the IPv4 addresses it carries: matched
        // as IPv6, it would match nothing (destinations are matched as IPv4), and a block
        // rule would silently block nothing.
        for (written, to) in [
            ("::ffff:169.254.169.254", "169.254.169.254:80"),
            ("[::ffff:169.254.169.254]:80", "169.254.169.254:80"),
            ("[::ffff:10.0.0.0/104]:443", "10.1.2.3:443"),
            ("::ffff:10.0.0.0/104", "[::ffff:10.1.2.3]:443"),
        ] {
            assert!(rule(written).matches(&inet(to)), "{written} -> {to}");
        }
        assert!(!rule("[::ffff:10.0.0.0/104]:443").matches(&inet("11.0.0.1:443")));
        assert!(rule("unix:/run/app/").matches(&Destination::UnixPath("/run/app/s.sock".into())));
        assert!(!rule("unix:/run/app/").matches(&Destination::UnixPath("/run/app2/s.sock".into())));
        assert!(
            !rule("unix:/run/app/")
                .matches(&Destination::UnixPath("/run/app/../docker.sock".into()))
        );
        assert!(!rule("unix:/run/x.sock").matches(&inet("127.0.0.1:1")));
    }

    #[test]
    fn name_rules_match_only_named_destinations() {
        let named = |n: &str, a: &str| Destination::Named {
            addr: a.parse().unwrap(),
            name: n.parse().unwrap(),
            also: Vec::new(),
        };
        let exact = rule("api.example.com:443");
        assert!(exact.matches(&named("api.example.com", "192.0.2.1:443")));
        assert!(!exact.matches(&named("api.example.com", "192.0.2.1:80")));
        assert!(!exact.matches(&named("x.api.example.com", "192.0.2.1:443")));
        assert!(
            !exact.matches(&inet("192.0.2.1:443")),
            "an address never handed out for the name is judged by address rules alone"
        );
        let wild = rule("*.example.com:443");
        assert!(wild.matches(&named("a.example.com", "192.0.2.1:443")));
        assert!(wild.matches(&named("a.b.example.com", "192.0.2.1:443")));
        assert!(!wild.matches(&named("example.com", "192.0.2.1:443")));
        assert!(!wild.matches(&named("badexample.com", "192.0.2.1:443")));
        // Address rules still see the address of a named destination.
        assert!(rule("192.0.2.0/24").matches(&named("other.test", "192.0.2.9:1")));
        let rules = DestinationRules {
            allow: vec![exact, wild],
            block: vec![rule("192.0.2.66")],
            default: DefaultAction::Block,
        };
        assert!(
            rules
                .decide(Some(&named("api.example.com", "192.0.2.1:443")))
                .allowed
        );
        assert!(
            !rules
                .decide(Some(&named("api.example.com", "192.0.2.66:443")))
                .allowed
        );
        let name = |n: &str| n.parse::<HostName>().unwrap();
        assert!(rules.decide_name(&name("API.example.com")).allowed);
        assert!(rules.decide_name(&name("deep.x.example.com")).allowed);
        let other = rules.decide_name(&name("example.com"));
        assert_eq!((other.allowed, other.rule.as_str()), (false, "default"));
        let origin = OriginRules {
            allow: vec![rule("only.alice.test:80")],
            block: vec![],
        };
        assert!(
            decide_name_with_origin(&rules, Some(("alice", &origin)), &name("only.alice.test"))
                .allowed
        );
        assert!(!decide_name_with_origin(&rules, None, &name("only.alice.test")).allowed);
    }

    /// Under a default that allows, blocks of every address of both families on every port
    /// leave no connection a lookup could be for: the lookup is refused, and the name does
    /// not leave the host in it. Before, it fell through to the default and was asked of the
    /// upstream resolvers (a name can spell a secret).
    #[test]
    fn blocks_of_every_address_refuse_lookups_under_a_default_that_allows() {
        let name = |n: &str| n.parse::<HostName>().unwrap();
        let open = DestinationRules {
            allow: vec![],
            block: vec![],
            default: DefaultAction::Allow,
        };
        let everything = OriginRules {
            allow: vec![],
            block: vec![rule("0.0.0.0/0"), rule("::/0")],
        };
        let d = decide_name_with_origin(
            &open,
            Some(("bob", &everything)),
            &name("c2VjcmV0.attacker.example"),
        );
        assert_eq!(
            (d.allowed, d.rule.as_str()),
            (false, "principal bob block 0.0.0.0/0")
        );
        let server = DestinationRules {
            block: vec![rule("::/0"), rule("0.0.0.0/0")],
            ..open.clone()
        };
        let d = server.decide_name(&name("c2VjcmV0.attacker.example"));
        assert_eq!((d.allowed, d.rule.as_str()), (false, "block ::/0"));
        // One family, or every address on one port only, leaves connections the default
        // allows.
        for some in [&["0.0.0.0/0"][..], &["0.0.0.0/0:443", "[::/0]:443"]] {
            let some = DestinationRules {
                block: some.iter().map(|b| rule(b)).collect(),
                ..open.clone()
            };
            assert!(some.decide_name(&name("www.example.com")).allowed);
        }
    }

    /// A lookup sends the name out: it is answered only where a connection to the name
    /// could be allowed on some port. An allow on the very port a block names (the server's
    /// or the principal's) does not let it be looked up; an allow on another port does.
    #[test]
    fn a_name_blocked_on_the_port_an_allow_gives_it_is_not_looked_up() {
        let name = |n: &str| n.parse::<HostName>().unwrap();
        let rules = DestinationRules {
            allow: vec![rule("*.example.com:443")],
            block: vec![rule("*.partner.example.com:443")],
            default: DefaultAction::Block,
        };
        let d = rules.decide_name(&name("secret.partner.example.com"));
        assert_eq!(
            (d.allowed, d.rule.as_str()),
            (false, "block *.partner.example.com:443")
        );
        assert!(rules.decide_name(&name("www.example.com")).allowed);
        let origin = OriginRules {
            allow: vec![rule("x.test:443"), rule("x.partner.example.com:443")],
            block: vec![rule("y.example.com:443")],
        };
        let server = DestinationRules {
            block: vec![rule("x.test:443"), rule("*.partner.example.com:443")],
            ..rules.clone()
        };
        let with = |n: &str| decide_name_with_origin(&server, Some(("alice", &origin)), &name(n));
        let d = with("x.test");
        assert_eq!(
            (d.allowed, d.rule.as_str()),
            (false, "server block x.test:443")
        );
        assert!(!with("x.partner.example.com").allowed);
        let d = with("y.example.com");
        assert_eq!(
            (d.allowed, d.rule.as_str()),
            (false, "principal alice block y.example.com:443")
        );
        // Allowed on another port than the one blocked: a connection there could be.
        let on_80 = DestinationRules {
            allow: vec![rule("*.example.com:443"), rule("*.partner.example.com:80")],
            ..rules.clone()
        };
        let d = on_80.decide_name(&name("secret.partner.example.com"));
        assert_eq!(
            (d.allowed, d.rule.as_str()),
            (true, "allow *.partner.example.com:80")
        );
        // Under a default that allows, a name some block names is not looked up.
        let open = DestinationRules {
            allow: vec![],
            default: DefaultAction::Allow,
            ..rules
        };
        assert!(
            !open
                .decide_name(&name("secret.partner.example.com"))
                .allowed
        );
        assert!(open.decide_name(&name("other.test")).allowed);
        // A block of every address on the allow's port refuses every connection there too;
        // one family's alone leaves the other.
        let wide = |block: &[&str]| DestinationRules {
            allow: vec![rule("*.example.com:443")],
            block: block.iter().map(|b| rule(b)).collect(),
            default: DefaultAction::Block,
        };
        for every in [&["0.0.0.0/0", "::/0"][..], &["0.0.0.0/0:443", "[::/0]:443"]] {
            assert!(
                !wide(every).decide_name(&name("www.example.com")).allowed,
                "{every:?}"
            );
        }
        for one in [&["0.0.0.0/0"][..], &["::/0"], &["0.0.0.0/0:443", "::/0"]] {
            let d = wide(one).decide_name(&name("www.example.com"));
            assert_eq!(d.allowed, one.len() == 1, "{one:?}");
        }
        let port_wide = DestinationRules {
            allow: vec![rule("*.example.com:443")],
            block: vec![DestinationRule::Port(443)],
            default: DefaultAction::Block,
        };
        assert!(!port_wide.decide_name(&name("www.example.com")).allowed);
        let narrow = DestinationRules {
            allow: vec![rule("*.example.com:443")],
            block: vec![rule("10.0.0.0/8"), DestinationRule::Port(80)],
            default: DefaultAction::Block,
        };
        assert!(narrow.decide_name(&name("www.example.com")).allowed);
    }

    /// A block of an IPv4 network also refuses the IPv6 forms that carry its addresses to
    /// it (NAT64, 6to4): on a host that translates them, that is where the packets go.
    #[test]
    fn a_block_covers_the_ipv4_an_ipv6_address_carries() {
        let rules = DestinationRules {
            allow: vec![rule("[64:ff9b::/96]:443"), rule("2002::/16")],
            block: vec![rule("10.0.0.0/8")],
            default: DefaultAction::Block,
        };
        let to = |a: &str| Destination::Inet(a.parse().unwrap());
        for inside in ["[64:ff9b::a00:5]:443", "[2002:a00:5::1]:443"] {
            let d = rules.decide(Some(&to(inside)));
            assert_eq!(
                (d.allowed, d.rule.as_str()),
                (false, "block 10.0.0.0/8"),
                "{inside}"
            );
        }
        assert!(rules.decide(Some(&to("[64:ff9b::c000:201]:443"))).allowed);
        let origin = OriginRules {
            allow: vec![],
            block: vec![rule("192.0.2.0/24")],
        };
        let d = decide_with_origin(
            &rules,
            Some(("alice", &origin)),
            Some(&to("[64:ff9b::c000:201]:443")),
        );
        assert!(!d.allowed, "{d:?}");
    }

    /// Where the operator's own translator (NAT64's local-use 64:ff9b:1::/48) or a `sit`
    /// tunnel (IPv4-compatible `::a.b.c.d`) would carry an IPv6 destination to IPv4, a
    /// block of IPv4 addresses refuses it. Before, both were judged as IPv6 only, and a
    /// `default = "allow"` reached 169.254.169.254 past its block.
    #[test]
    fn a_block_covers_the_local_nat64_prefix_and_ipv4_compatible_addresses() {
        let rules = DestinationRules {
            allow: vec![],
            block: vec![rule("169.254.0.0/16"), rule("[192.0.2.0/24]:8080")],
            default: DefaultAction::Allow,
        };
        let to = |a: &str| Destination::Inet(a.parse().unwrap());
        for (inside, by) in [
            ("[64:ff9b:1::a9fe:a9fe]:80", "block 169.254.0.0/16"),
            ("[64:ff9b:1:a9fe:a9:fe00::]:80", "block 169.254.0.0/16"),
            ("[::a9fe:a9fe]:80", "block 169.254.0.0/16"),
        ] {
            let d = rules.decide(Some(&to(inside)));
            assert_eq!((d.allowed, d.rule.as_str()), (false, by), "{inside}");
        }
        // A port the IPv4 block does not name, IPv6's own `::1`, and other IPv6 are not
        // IPv4's.
        let v4_port = DestinationRules {
            block: vec![rule("[192.0.2.0/24]:8080")],
            ..rules.clone()
        };
        assert!(
            v4_port
                .decide(Some(&to("[64:ff9b:1::c000:201]:443")))
                .allowed
        );
        assert!(
            !v4_port
                .decide(Some(&to("[64:ff9b:1::c000:201]:8080")))
                .allowed
        );
        assert_eq!(
            reached_ip("::1".parse().unwrap()),
            "::1".parse::<IpAddr>().unwrap()
        );
        assert!(rules.decide(Some(&to("[2001:db8::a9fe:a9fe]:80"))).allowed);
    }

    #[test]
    fn a_block_rule_naming_any_name_of_an_address_refuses_it() {
        let rules = DestinationRules {
            allow: vec![rule("*.example.com:443")],
            block: vec![rule("secret.example.com:443")],
            default: DefaultAction::Block,
        };
        let shared = |names: &[&str]| Destination::Named {
            addr: "192.0.2.50:443".parse().unwrap(),
            name: names[0].parse().unwrap(),
            also: names[1..].iter().map(|n| n.parse().unwrap()).collect(),
        };
        assert!(rules.decide(Some(&shared(&["www.example.com"]))).allowed);
        for names in [
            ["www.example.com", "secret.example.com"],
            ["secret.example.com", "www.example.com"],
        ] {
            let d = rules.decide(Some(&shared(&names)));
            assert_eq!(
                (d.allowed, d.rule.as_str()),
                (false, "block secret.example.com:443"),
                "{names:?}"
            );
        }
        // Any allowed name of the address allows it (on the rule's port).
        let other = DestinationRules::allow_only(vec![rule("b.test:443")]);
        assert!(other.decide(Some(&shared(&["a.test", "b.test"]))).allowed);

        // The names an answer leads through are judged by every block rule, on any port.
        let origin = OriginRules {
            allow: vec![],
            block: vec![rule("*.alice-blocked.test:80")],
        };
        let blocks = NameBlocks::of(&rules, Some(("alice", &origin)));
        let name = |n: &str| n.parse::<HostName>().unwrap();
        assert_eq!(
            blocks.naming(&name("secret.example.com")).as_deref(),
            Some("server block secret.example.com:443")
        );
        assert_eq!(
            blocks.naming(&name("x.alice-blocked.test")).as_deref(),
            Some("principal alice block *.alice-blocked.test:80")
        );
        assert_eq!(blocks.naming(&name("www.example.com")), None);
        assert_eq!(
            NameBlocks::default().naming(&name("secret.example.com")),
            None
        );
    }

    #[test]
    fn no_rule_reaches_an_executors_resolver() {
        // A lookup sent to another executor's resolver would be judged under that
        // executor's call: no allow list, default or principal's rule lets it through.
        let rules = DestinationRules {
            allow: vec![rule("127.0.0.0/8"), rule("*:53")],
            block: vec![],
            default: DefaultAction::Allow,
        };
        let origin = OriginRules {
            allow: vec![rule("127.53.0.0/16:53")],
            block: vec![],
        };
        for to in ["127.53.1.2:53", "[::ffff:127.53.9.9]:53"] {
            let addr: std::net::SocketAddr = to.parse().unwrap();
            for dest in [
                Destination::Inet(addr),
                Destination::Named {
                    addr,
                    name: "x.test".parse().unwrap(),
                    also: Vec::new(),
                },
            ] {
                let d = rules.decide(Some(&dest));
                assert!(
                    !d.allowed && d.rule.contains("resolver"),
                    "{to}: {}",
                    d.rule
                );
                let d = decide_with_origin(&rules, Some(("alice", &origin)), Some(&dest));
                assert!(
                    !d.allowed && d.rule.contains("resolver"),
                    "{to}: {}",
                    d.rule
                );
            }
        }
        // Its other ports, and port 53 elsewhere on loopback, are addresses like any other.
        for to in ["127.53.1.2:54", "127.0.0.53:53"] {
            let dest = Destination::Inet(to.parse().unwrap());
            assert!(rules.decide(Some(&dest)).allowed, "{to}");
        }
        // Unless the host answers the executor's lookups: then a query there is one past
        // its resolver, which no rule reaches either.
        let dest = Destination::LookupPastResolver("127.0.0.53:53".parse().unwrap());
        let d = decide_with_origin(&rules, Some(("alice", &origin)), Some(&dest));
        assert_eq!(
            (d.allowed, d.rule.as_str()),
            (
                false,
                "server a lookup past the executor's own resolver (127.0.0.53:53): lookups leave only through the resolver the host gives the executor, judged by name, and none at all where the host gives it none"
            )
        );
    }

    #[test]
    fn block_wins_and_default_blocks() {
        let rules = DestinationRules {
            allow: vec![rule("10.0.0.0/8")],
            block: vec![rule("10.0.0.5")],
            default: DefaultAction::Block,
        };
        assert!(rules.decide(Some(&inet("10.0.0.4:1"))).allowed);
        let d = rules.decide(Some(&inet("10.0.0.5:1")));
        assert_eq!(
            d,
            RuleDecision {
                allowed: false,
                rule: "block 10.0.0.5".into()
            }
        );
        assert_eq!(rules.decide(Some(&inet("8.8.8.8:53"))).rule, "default");
        assert!(!rules.decide(Some(&inet("8.8.8.8:53"))).allowed);
        assert!(!rules.decide(None).allowed);
        assert!(rules.decide(Some(&Destination::Disconnect)).allowed);
        let open = DestinationRules {
            default: DefaultAction::Allow,
            ..DestinationRules::default()
        };
        for undecodable in [
            Destination::Undecidable("foreign_family_0_on_socket_family_2".into()),
            Destination::Undecidable("malformed_family_2_len_8".into()),
        ] {
            let d = open.decide(Some(&undecodable));
            assert!(!d.allowed, "{undecodable:?} allowed under default allow");
            assert_eq!(d.rule, "undecodable address");
        }
    }
}
