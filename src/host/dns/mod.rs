//! DNS mediation: each executor with a network path gets a resolver of its own, on a
//! loopback address (`127.53.x.y`, port 53) the host binds for it and writes into the
//! `/etc/resolv.conf` of the executor's view. Whatever the executor's resolver library
//! does (glibc's connected UDP sockets and parallel A/AAAA over `sendmmsg`, c-ares checking
//! that a reply comes from the server it asked, a retry over TCP), its queries reach that
//! address, and the answers come from it.
//!
//! Every query is judged and recorded by the judge ([`LookupJudge`]): a record type other
//! than A, AAAA, CNAME, HTTPS and SVCB is answered REFUSED; a name no rule allows is answered
//! NXDOMAIN; an allowed one is asked of the host's upstream resolvers (once its
//! record is durable) and the answer passed on. The addresses handed out are remembered per
//! executor ([`ExecutorDns::names_of`]), with every name each was handed out for and for as
//! long as the answer said (its TTL, kept within 60 s and an hour), so a later connect to one
//! is judged against host-name rules for all of them (a block rule naming any refuses it),
//! and its record carries the names. A name a block rule named is kept past its TTL, for
//! block judging only, while any other name holds its address, and always gets a place among
//! an address's names ([`MAX_NAMES_PER_ADDRESS`]). The sends that reach this resolver are the host talking
//! to itself: they are allowed without an egress record (the lookup is what is judged).
//!
//! A reload can narrow the rules a running executor's lookups were judged by (a principal's
//! per-origin rules: [`Narrowings`]). An address handed out before was screened against
//! fewer block rules than apply now, through a CNAME chain that is not kept: a connect to it
//! is refused until every name holding it is looked up again or has expired
//! ([`Naming::BeforeNarrowing`]; a connect whose names were looked at before a narrowing and
//! judged after it is refused too, by the count its rules carry).
//!
//! The address is the attribution: only this executor's lookups arrive at it (other
//! executors' sends to it are egress like any other, and no rule names it).
//!
//! An answer vouches for a name's public addresses only: a private one (loopback,
//! link-local such as 169.254.169.254, RFC 1918, ULA, CGNAT, multicast, unspecified,
//! reserved, one of the host's own addresses, or one on a network the host is directly
//! attached to: [`scope_on`]) is passed on to the executor
//! but not remembered under the name, unless the server opts in for that name and every name the answer's CNAME chain
//! leads through (`private_answers`). Otherwise whoever
//! controls an allowed name's zone (or the answer) could aim a host-name rule at the host
//! itself, its metadata service or the internal network. Nor does an answer whose CNAME
//! chain leads through a name a block rule names bind its addresses to the name asked.

pub mod on_link;
pub mod upstream;
pub mod wire;

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hickory_proto::op::ResponseCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

use crate::destination::{HostName, NameBlocks, NamePattern, canonical_ip, reached_ip as reached};
pub use upstream::Upstream;

/// The port every executor resolver listens on (resolv.conf cannot name another).
pub const DNS_PORT: u16 = crate::destination::RESOLVER_PORT;
/// Most addresses remembered per executor; past it the oldest half is forgotten (a later
/// connect to a forgotten address is judged by address rules alone).
const MAX_REMEMBERED: usize = 4096;
/// Most (address, name) bindings remembered per executor, over all its addresses; past it
/// the oldest addresses are forgotten, each with all its names, until it holds no more.
/// With [`MAX_REMEMBERED`], this bounds an executor's book to about 3 MB (a binding is a
/// name of at most 253 bytes, its expiry and the ports it is blocked on), however many
/// names its lookups share addresses between.
const MAX_BINDINGS: usize = 8192;
/// Most names remembered per address. Past it, a new name no block rule names is not
/// remembered for the address (dropping it only takes an allow away), while a name a block
/// rule names always gets a place: the oldest name no block rule names makes way, or, when
/// every kept name is blocked, the name is kept beyond the cap unless the kept names are
/// already blocked on each of its ports (so a flood of allowed names answered with the same
/// address never pushes out a block).
const MAX_NAMES_PER_ADDRESS: usize = 32;
/// The shortest time an answer binds an address to a name, whatever its TTL.
const MIN_BINDING: Duration = Duration::from_secs(60);
/// The longest time an answer binds an address to a name, whatever its TTL.
const MAX_BINDING: Duration = Duration::from_secs(3600);
/// Most addresses of one answer that may be bound to its name: an answer the executor's own
/// zone makes (thousands of records over TCP) would otherwise have every one looked at on
/// the runtime's thread and flush the executor's address book.
const MAX_ADDRESSES_PER_ANSWER: usize = 64;
/// Queries (and TCP connections) one executor's resolver handles at once; past it, UDP
/// queries are dropped (the client library retries) and TCP connections closed, so an
/// executor cannot make the host hold unbounded work.
const IN_FLIGHT: usize = 32;
/// Longest wait for a TCP client's next query, for the rest of one, or for it to take an
/// answer.
const TCP_IDLE: Duration = Duration::from_secs(10);

/// Why an executor's resolver could not be set up (the executor is not started).
#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    /// No loopback address in 127.53.0.0/16 was free on port 53, or binding failed.
    #[error(
        "cannot bind the executor's resolver on a 127.53.x.y:53 address: {0} ({hint})",
        hint = bind_hint(.0)
    )]
    Bind(std::io::Error),
    /// The executors run as this process's own uid: any process of that user could then ask
    /// a resolver and pass for its executor (judged under its call, recorded as its lookup).
    #[error(
        "executors run as this process's own uid ({uid}), so any process of that user could ask their resolver and pass for an executor"
    )]
    SharedUid {
        /// The uid.
        uid: u32,
    },
    /// The executor's resolv.conf could not be written.
    #[error("cannot write the executor's resolver configuration in {dir}: {source}")]
    Write {
        /// The directory.
        dir: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// What to do about a failed bind of an executor's resolver.
fn bind_hint(e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::AddrInUse => {
            "another socket holds port 53 on every address tried, such as a local DNS server \
             bound to all addresses (0.0.0.0:53, as dnsmasq does by default): bind it to the \
             addresses it serves instead (`ss -lunp 'sport = 53'` names it)"
        }
        _ => "binding port 53 needs root or CAP_NET_BIND_SERVICE",
    }
}

impl DnsError {
    /// Whether lookups cannot be mediated on this host as it runs (unprivileged: binding
    /// port 53 is refused, or executors share this process's uid). Every send to port 53 is
    /// then refused as a lookup past the executor's resolver, and host-name rules match
    /// nothing.
    pub fn not_mediated_here(&self) -> bool {
        match self {
            DnsError::Bind(e) => e.kind() == std::io::ErrorKind::PermissionDenied,
            DnsError::SharedUid { .. } => true,
            DnsError::Write { .. } => false,
        }
    }
}

impl DnsMediation {
    /// Refuses mediation where a resolver could not tell its executor's queries from other
    /// processes': executors running as this process's own uid (unprivileged, where a
    /// container lets anyone bind port 53).
    pub fn check_senders(&self) -> Result<(), DnsError> {
        for uid in [nix::unistd::getuid(), nix::unistd::geteuid()] {
            if self.senders.contains(uid.as_raw()) {
                return Err(DnsError::SharedUid { uid: uid.as_raw() });
            }
        }
        Ok(())
    }
}

/// One lookup an executor made, as the judge sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lookup {
    /// What the query asked.
    pub asked: Asked,
    /// `udp` or `tcp`.
    pub transport: &'static str,
    /// The query's size in bytes.
    pub bytes: usize,
    /// The resolver address the executor asked.
    pub resolver: SocketAddr,
}

/// What a query to an executor's resolver asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Asked {
    /// One name, in class IN: judged by the rules.
    Name {
        /// The name.
        name: HostName,
        /// The record type asked for (a lookup of a type not
        /// [served](wire::QueryType::served) is judged and recorded as refused, and answered
        /// REFUSED).
        record_type: wire::QueryType,
    },
    /// A query the resolver does not serve (not a standard query, several questions, a class
    /// other than IN, a name that is no host name): answered with a refusal whatever the
    /// judge says, and judged only to be recorded. `why` says what it is (a name in it is
    /// shown escaped).
    Unserved {
        /// What the query is, and why it is not served.
        why: String,
    },
}

impl Lookup {
    /// The name asked, when the query is one the resolver serves.
    pub fn name(&self) -> Option<&HostName> {
        match &self.asked {
            Asked::Name { name, .. } => Some(name),
            Asked::Unserved { .. } => None,
        }
    }

    /// The record type asked for, when the query is one the resolver serves.
    pub fn record_type(&self) -> Option<wire::QueryType> {
        match &self.asked {
            Asked::Name { record_type, .. } => Some(*record_type),
            Asked::Unserved { .. } => None,
        }
    }

    /// Why the lookup is refused whatever the rules say, as a record's rule states it, with
    /// the kind of refusal: a query not served, or a record type not served (`None`: the
    /// rules decide).
    pub fn refused_anyway(&self) -> Option<(crate::decision::Denial, String)> {
        match &self.asked {
            Asked::Unserved { why } => Some((
                crate::decision::Denial::QueryNotServed,
                format!("query not served: {why}"),
            )),
            Asked::Name { record_type, .. } => (!record_type.served()).then(|| {
                (
                    crate::decision::Denial::RecordTypeNotServed,
                    format!(
                        "record type {record_type} not served (only A, AAAA, CNAME, HTTPS, SVCB)"
                    ),
                )
            }),
        }
    }
}

/// The judge's word on one lookup.
#[derive(Debug, Clone)]
pub enum LookupVerdict {
    /// Refused: answered NXDOMAIN, and nothing is asked upstream.
    Refused,
    /// Asked upstream and the answer passed on; before its addresses are remembered under
    /// the name, the names its CNAME chain leads through are judged by these block rules.
    Answered(NameBlocks),
}

/// Decides a lookup (recording it, answered or refused) and says whether it may be answered.
/// A lookup of a type not served must be recorded as refused
/// ([`Lookup::refused_anyway`]); it is answered REFUSED whatever the judge says, and so
/// is a query not served ([`Asked::Unserved`]), judged only to be recorded.
pub type LookupJudge =
    Arc<dyn Fn(Lookup) -> Pin<Box<dyn Future<Output = LookupVerdict> + Send>> + Send + Sync>;

/// The DNS mediation settings of one server's executors.
#[derive(Debug, Clone)]
pub struct DnsMediation {
    /// Where allowed names are asked (the host's).
    pub upstream: Arc<Upstream>,
    /// Where the executors' resolv.conf files are written (read by the broker's bind mount,
    /// as root, before the executor runs).
    pub dir: PathBuf,
    /// The names whose answers may bind private addresses ([`private_scope`]) to the name
    /// (`[[server]] private_answers`); empty: none may.
    pub private_answers: Arc<[NamePattern]>,
    /// Where an answer's public addresses lie from the host ([`HostSide::LIVE`] but in tests).
    pub host: HostSide,
    /// The uids whose sockets a resolver answers: those executors run as
    /// ([`flowhost_broker::Broker::executor_uids`]). A query from any other local process
    /// is dropped: judged under the executor's call in flight, it would be recorded as the
    /// executor's lookup, and could fill the records with allows.
    pub senders: flowhost_broker::UidRange,
    /// How many times the rules judging these lookups have been narrowed.
    pub narrowings: Narrowings,
}

/// How many times a reload has narrowed the rules that judge one generation's lookups (a
/// principal's per-origin rules, which a reload narrows for the calls already running). An
/// address handed out while the count was lower was screened against fewer block rules than
/// apply now, through a CNAME chain the book does not keep, so the names it is remembered
/// under no longer vouch for it. Shared by the rules and every resolver they judge for.
#[derive(Debug, Clone, Default)]
pub struct Narrowings(Arc<AtomicU64>);

impl Narrowings {
    /// The count now.
    pub fn count(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }

    /// Counts one more narrowing; from now on every address handed out before is refused
    /// until looked up again.
    pub fn add_one(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Whose resolver it is, as its log lines name it.
#[derive(Debug, Clone, Default)]
pub struct ExecutorId {
    /// The server whose executor it serves (or what else runs it, like `sandbox`).
    pub server: String,
    /// The executor's pid, once it runs.
    pub pid: Arc<std::sync::OnceLock<i32>>,
}

impl ExecutorId {
    fn pid(&self) -> i32 {
        self.pid.get().copied().unwrap_or(0)
    }
}

/// What kind of address an answer may not bind to a name without the server's opt-in: one
/// that reaches the host itself, its link, its private networks or several hosts at once,
/// rather than the public service the name stands for (or where none is).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrivateScope {
    /// 0.0.0.0 or `::` (the kernel picks the host's own address).
    Unspecified,
    /// 127.0.0.0/8 or `::1`.
    Loopback,
    /// 169.254.0.0/16 (cloud metadata services among them) or fe80::/10.
    LinkLocal,
    /// 10.0.0.0/8, 172.16.0.0/12 or 192.168.0.0/16 (RFC 1918), or 64:ff9b:1::/48 (NAT64
    /// local use, RFC 8215: it reaches the operator's own translator).
    Private,
    /// fc00::/7 (IPv6 unique local addresses).
    UniqueLocal,
    /// 100.64.0.0/10 (carrier-grade NAT, RFC 6598).
    SharedAddressSpace,
    /// 224.0.0.0/4 or ff00::/8.
    Multicast,
    /// 0.0.0.0/8, 192.0.0.0/24 (IETF protocol assignments), 198.18.0.0/15 (benchmarking),
    /// 240.0.0.0/4 (the broadcast address among them), `::/96` (IPv4-compatible), Teredo's
    /// 2001::/32 (a tunnel through whatever IPv4 address it carries) or fec0::/10
    /// (site-local): no public service is there.
    Reserved,
    /// One of the host's own addresses ([`is_host_address`]), public ones included.
    Host,
    /// An address on a network the host is directly attached to ([`on_link`]), public ones
    /// included: a neighbour of the host.
    OnLink,
    /// 168.63.129.16: a public address where a cloud serves the machines it runs (Azure's
    /// platform endpoint: their configuration, extensions and health), reached through the
    /// host's gateway, so neither private nor on its link.
    Platform,
}

impl PrivateScope {
    /// The snake_case code the log names it by.
    pub fn as_str(self) -> &'static str {
        match self {
            PrivateScope::Unspecified => "unspecified",
            PrivateScope::Loopback => "loopback",
            PrivateScope::LinkLocal => "link_local",
            PrivateScope::Private => "private",
            PrivateScope::UniqueLocal => "unique_local",
            PrivateScope::SharedAddressSpace => "shared_address_space",
            PrivateScope::Multicast => "multicast",
            PrivateScope::Reserved => "reserved",
            PrivateScope::Host => "host",
            PrivateScope::OnLink => "on_link",
            PrivateScope::Platform => "platform",
        }
    }
}

/// The private scope `ip` is in, if any (the host's own addresses aside: [`scope_on`]). An
/// IPv6 address carrying an IPv4 one ([`reached`]) is judged as the IPv4 address it reaches;
/// an IPv4-compatible one (`::/96`, deprecated) that carries a public address is reserved.
pub fn private_scope(ip: IpAddr) -> Option<PrivateScope> {
    let compatible = matches!(ip, IpAddr::V6(v6) if crate::destination::ipv4_compatible(v6));
    let v6 = match reached(ip) {
        IpAddr::V4(v4) => {
            return private_v4(v4).or(compatible.then_some(PrivateScope::Reserved));
        }
        IpAddr::V6(v6) => v6,
    };
    let s = v6.segments();
    if v6.is_unspecified() {
        Some(PrivateScope::Unspecified)
    } else if v6.is_loopback() {
        Some(PrivateScope::Loopback)
    } else if s[..6] == [0; 6] || (s[0] == 0x2001 && s[1] == 0) {
        Some(PrivateScope::Reserved)
    } else if s[..3] == [0x64, 0xff9b, 1] {
        Some(PrivateScope::Private)
    } else if s[0] & 0xffc0 == 0xfe80 {
        Some(PrivateScope::LinkLocal)
    } else if s[0] & 0xffc0 == 0xfec0 {
        Some(PrivateScope::Reserved)
    } else if s[0] & 0xfe00 == 0xfc00 {
        Some(PrivateScope::UniqueLocal)
    } else if s[0] & 0xff00 == 0xff00 {
        Some(PrivateScope::Multicast)
    } else {
        None
    }
}

/// The private scope `ip` is in, seen from a host whose side `host` tells
/// ([`HostSide::scope`]): [`private_scope`], else where it lies from the host (one of its own
/// addresses or a neighbour's, public ones too: `<host-ip>.nip.io` must not aim a host-name
/// rule at the host).
pub fn scope_on(ip: IpAddr, host: impl Fn(IpAddr) -> Option<PrivateScope>) -> Option<PrivateScope> {
    private_scope(ip).or_else(|| host(reached(ip)))
}

/// How the resolver tells where a public address lies from the host: one of its own
/// addresses, or one on a network it is directly attached to. Each is asked of the host as
/// it is now, so an address or a network it gains after an answer counts at the next connect.
#[derive(Debug, Clone, Copy)]
pub struct HostSide {
    /// Whether an address is one of the host's own.
    pub is_host: fn(IpAddr) -> bool,
    /// Whether an address is on a network the host is directly attached to.
    pub on_link: fn(IpAddr) -> bool,
}

impl HostSide {
    /// The host this daemon runs on: [`is_host_address`] and [`on_link::on_host_network`].
    pub const LIVE: HostSide = HostSide {
        is_host: is_host_address,
        on_link: on_link::on_host_network,
    };

    /// [`PrivateScope::Host`] or [`PrivateScope::OnLink`] when `ip` (as it reaches the host:
    /// [`reached`]) is there, else none.
    pub fn scope(&self, ip: IpAddr) -> Option<PrivateScope> {
        if (self.is_host)(ip) {
            Some(PrivateScope::Host)
        } else if (self.on_link)(ip) {
            Some(PrivateScope::OnLink)
        } else {
            None
        }
    }
}

/// Whether `ip` is one of this host's own addresses now (see
/// [`flowhost_broker::is_host_address`]): asked for each answer, so an address the host
/// gained since it started counts, and asked as the broker asks it, so the two never
/// disagree on what the host is.
pub fn is_host_address(ip: IpAddr) -> bool {
    flowhost_broker::is_host_address(ip)
}

fn private_v4(ip: Ipv4Addr) -> Option<PrivateScope> {
    let [a, b, c, _] = ip.octets();
    if ip.is_unspecified() {
        Some(PrivateScope::Unspecified)
    } else if a == 0 || a >= 240 || [a, b, c] == [192, 0, 0] || (a == 198 && b & 0xfe == 18) {
        Some(PrivateScope::Reserved)
    } else if a == 127 {
        Some(PrivateScope::Loopback)
    } else if ip.is_link_local() {
        Some(PrivateScope::LinkLocal)
    } else if ip.is_private() {
        Some(PrivateScope::Private)
    } else if a == 100 && b & 0xc0 == 64 {
        Some(PrivateScope::SharedAddressSpace)
    } else if ip.is_multicast() {
        Some(PrivateScope::Multicast)
    } else if ip == Ipv4Addr::new(168, 63, 129, 16) {
        Some(PrivateScope::Platform)
    } else {
        None
    }
}

/// Why an address of an allowed name's answer is not remembered under the name (a connect
/// to it is judged by address rules alone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Withheld {
    /// A private address, and the server has not opted in for the name and every name the
    /// answer's CNAME chain leads through.
    Private(PrivateScope),
    /// The answer held more than [`MAX_ADDRESSES_PER_ANSWER`] addresses: this one and the
    /// `more` after it are not looked at (each costs a look at the host's addresses, on the
    /// runtime's thread).
    PastLimit {
        /// How many more addresses came after it.
        more: usize,
    },
    /// The answer's CNAME chain leads through `name`, which a block rule names.
    ChainNameBlocked {
        /// The blocked name on the chain.
        name: HostName,
        /// The block rule naming it.
        rule: String,
    },
}

impl std::fmt::Display for Withheld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Withheld::Private(scope) => write!(
                f,
                "{} address, and private_answers does not name the name and every name its CNAME chain leads through",
                scope.as_str()
            ),
            Withheld::ChainNameBlocked { name, rule } => {
                write!(f, "the answer's CNAME chain leads through {name} ({rule})")
            }
            Withheld::PastLimit { more } => write!(
                f,
                "the answer holds more than {MAX_ADDRESSES_PER_ANSWER} addresses: this one and the {more} after it are past them"
            ),
        }
    }
}

/// Whether `private_answers` lets `answer`, the answer for `name`, bind a private address
/// to it: when it names `name` and every name its CNAME chain leads through (an opted-in
/// name's CNAME to a name outside the opt-in would carry the opt-in to whatever that name's
/// zone answers).
fn opted_in(name: &HostName, answer: &wire::Answer, private_answers: &[NamePattern]) -> bool {
    std::iter::once(name)
        .chain(&answer.chain)
        .all(|n| private_answers.iter().any(|p| p.matches(n)))
}

/// Which addresses of `answer`, the answer to an allowed lookup of `name`, may be remembered
/// under it, and which are withheld and why: a private one only when `private_answers`
/// names `name` and every name its CNAME chain leads through.
fn screen(
    name: &HostName,
    answer: &wire::Answer,
    private_answers: &[NamePattern],
    host: impl Fn(IpAddr) -> Option<PrivateScope>,
    blocks: &NameBlocks,
) -> (Vec<wire::AnswerAddress>, Vec<(IpAddr, Withheld)>) {
    let opted_in = opted_in(name, answer, private_answers);
    let blocked = answer.chain.iter().find_map(|c| {
        let rule = blocks.naming(c)?;
        Some(Withheld::ChainNameBlocked {
            name: c.clone(),
            rule,
        })
    });
    let mut bound = Vec::new();
    let mut withheld = Vec::new();
    let looked_at = answer.addresses.len().min(MAX_ADDRESSES_PER_ANSWER);
    if let Some(first) = answer.addresses.get(looked_at) {
        let more = answer.addresses.len() - looked_at - 1;
        withheld.push((first.ip, Withheld::PastLimit { more }));
    }
    for &a in &answer.addresses[..looked_at] {
        match (&blocked, scope_on(a.ip, &host)) {
            (Some(why), _) => withheld.push((a.ip, why.clone())),
            (None, Some(scope)) if !opted_in => withheld.push((a.ip, Withheld::Private(scope))),
            _ => bound.push(a),
        }
    }
    (bound, withheld)
}

/// One name an address was handed out for, until when, and the ports on which a block rule
/// of the lookup's call named it ([`NameBlocks::ports_naming`]; empty: none did).
#[derive(Debug, Clone)]
struct Binding {
    name: HostName,
    expires: Instant,
    blocked_on: Vec<u16>,
    /// The [`Narrowings`] count read before its lookup was judged.
    narrowings: u64,
    /// `private_answers` named the name and its chain ([`opted_in`]): only then may the name
    /// judge a connect to an address that has become one of the host's own since.
    opted_in: bool,
}

impl Binding {
    /// Whether the binding still holds at `now` for a connect to `port`: until it expires,
    /// and after that, while its address is still held (by some live binding), on a port a
    /// block rule named it on. An expired name thus still meets the block rules it met, and
    /// never allows anything.
    fn holds(&self, port: u16, now: Instant) -> bool {
        self.expires > now || self.blocked_on.contains(&port)
    }
}

/// How long an answer binds an address to a name: its TTL, at least [`MIN_BINDING`] (the
/// executor connects after it looked up, and some answers say 0) and at most
/// [`MAX_BINDING`].
fn binding_lifetime(ttl: u32) -> Duration {
    Duration::from_secs(u64::from(ttl)).clamp(MIN_BINDING, MAX_BINDING)
}

/// Remembered answers: the names each handed-out address was the answer for, the last one
/// first, each until its answer's TTL ran out. A name a block rule named stays after its TTL
/// (for block judging only) as long as any other name holds the address, and an address is
/// only ever forgotten with all its names at once (a connect to it is then judged by address
/// rules alone).
#[derive(Debug, Default)]
struct AddressBook {
    names: HashMap<IpAddr, Vec<Binding>>,
    order: Vec<IpAddr>,
}

impl AddressBook {
    /// [`AddressBook::remember_judged`] of a lookup judged before any narrowing.
    #[cfg(test)]
    fn remember(
        &mut self,
        name: &HostName,
        blocked_on: &[u16],
        addresses: &[wire::AnswerAddress],
        opted_in: bool,
        now: Instant,
    ) -> Vec<IpAddr> {
        self.remember_judged(name, blocked_on, addresses, opted_in, 0, now)
    }

    /// Remembers `addresses` as handed out at `now` for `name`, which block rules name on
    /// the ports `blocked_on`, judged when the [`Narrowings`] count was `narrowings`;
    /// returns those it is not remembered for, as they already have as many names as are
    /// kept ([`MAX_NAMES_PER_ADDRESS`]).
    fn remember_judged(
        &mut self,
        name: &HostName,
        blocked_on: &[u16],
        addresses: &[wire::AnswerAddress],
        opted_in: bool,
        narrowings: u64,
        now: Instant,
    ) -> Vec<IpAddr> {
        let mut full = Vec::new();
        for a in addresses {
            let ip = canonical_ip(a.ip);
            let names = self.names.entry(ip).or_default();
            if names.iter().any(|b| b.expires > now) {
                // Expired names go, but those a block rule named (the address is held).
                names.retain(|b| b.expires > now || !b.blocked_on.is_empty());
            } else {
                // No live name holds the address: it goes with all its names, and comes
                // back as a new one.
                if !names.is_empty() {
                    self.order.retain(|o| *o != ip);
                }
                names.clear();
                self.order.push(ip);
            }
            let mut binding = Binding {
                name: name.clone(),
                expires: now + binding_lifetime(a.ttl),
                blocked_on: blocked_on.to_vec(),
                narrowings,
                opted_in,
            };
            if let Some(i) = names.iter().position(|b| b.name == *name) {
                // The executor may hold the earlier answer as long as it said, and a block
                // once met is not forgotten.
                let earlier = names.remove(i);
                binding.expires = binding.expires.max(earlier.expires);
                binding.blocked_on.extend(earlier.blocked_on);
                binding.blocked_on.sort_unstable();
                binding.blocked_on.dedup();
                binding.opted_in &= earlier.opted_in;
            } else if names.len() >= MAX_NAMES_PER_ADDRESS && !make_way(names, &binding) {
                full.push(ip);
                continue;
            }
            names.insert(0, binding);
        }
        self.trim(now);
        full
    }

    /// How many (address, name) bindings the book holds.
    fn bindings(&self) -> usize {
        self.names.values().map(Vec::len).sum()
    }

    /// Keeps the book within [`MAX_REMEMBERED`] addresses and [`MAX_BINDINGS`] bindings:
    /// first the addresses no live name holds go, then the oldest ones (the oldest half of
    /// them when there are too many addresses), each with all its names at once.
    fn trim(&mut self, now: Instant) {
        if self.order.len() <= MAX_REMEMBERED && self.bindings() <= MAX_BINDINGS {
            return;
        }
        let names = &mut self.names;
        names.retain(|_, bindings| bindings.iter().any(|b| b.expires > now));
        self.order.retain(|ip| names.contains_key(ip));
        if self.order.len() > MAX_REMEMBERED {
            for ip in self.order.drain(..MAX_REMEMBERED / 2) {
                names.remove(&ip);
            }
        }
        let mut held = self.bindings();
        let mut gone = 0;
        while held > MAX_BINDINGS
            && let Some(ip) = self.order.get(gone)
        {
            held -= self.names.remove(ip).map_or(0, |b| b.len());
            gone += 1;
        }
        self.order.drain(..gone);
    }

    /// The names that judge a connect to `addr` at `now` on a host whose side `host` tells
    /// ([`HostSide::scope`]): [`AddressBook::bindings_at`], then [`judging`], as
    /// [`ExecutorDns::names_of`] does.
    #[cfg(test)]
    fn names_at(
        &self,
        addr: SocketAddr,
        now: Instant,
        host: impl Fn(IpAddr) -> Option<PrivateScope>,
    ) -> Vec<HostName> {
        let bindings = self.bindings_at(addr, 0, now).unwrap_or_default();
        judging(addr, bindings, host)
    }

    /// The names `addr`'s address was handed out for that judge a connect to it at `now`,
    /// the last one first, each with whether `private_answers` opted it in: none once no
    /// name is live; else the live ones, and the expired ones a block rule named on `addr`'s
    /// port ([`Binding::holds`]). Whether the address is the host's own is for [`judging`].
    /// [`HandedOutBeforeNarrowing`] when a name whose TTL has not run out was judged before
    /// the [`Narrowings`] count reached `narrowings`.
    fn bindings_at(
        &self,
        addr: SocketAddr,
        narrowings: u64,
        now: Instant,
    ) -> Result<Vec<(HostName, bool)>, HandedOutBeforeNarrowing> {
        let Some(names) = self.names.get(&canonical_ip(addr.ip())) else {
            return Ok(Vec::new());
        };
        if !names.iter().any(|b| b.expires > now) {
            return Ok(Vec::new());
        }
        // A live name screened before the narrowing vouches for nothing; one kept past its
        // TTL only for the block it met still refuses, as blocks only grow.
        if names
            .iter()
            .any(|b| b.expires > now && b.narrowings < narrowings)
        {
            return Err(HandedOutBeforeNarrowing);
        }
        Ok(names
            .iter()
            .filter(|b| b.holds(addr.port(), now))
            .map(|b| (b.name.clone(), b.opted_in))
            .collect())
    }
}

/// An address the book holds under a name whose lookup was judged before the rules were
/// last narrowed ([`Narrowings`]).
#[derive(Debug)]
struct HandedOutBeforeNarrowing;

/// Of `bindings` ([`AddressBook::bindings_at`]), the names that judge a connect to `addr`:
/// when the address is one of the host's own now or on a network it is attached to now
/// (`host`: [`HostSide::scope`]), only those `private_answers` opted in, as when it was
/// already at the answer ([`screen`]); the host may have taken it or its network since (a
/// floating address moved to it, an interface came up).
fn judging(
    addr: SocketAddr,
    bindings: Vec<(HostName, bool)>,
    host: impl Fn(IpAddr) -> Option<PrivateScope>,
) -> Vec<HostName> {
    // Asked only when it matters: the question costs a socket.
    let host_now =
        bindings.iter().any(|(_, opted_in)| !opted_in) && host(reached(addr.ip())).is_some();
    bindings
        .into_iter()
        .filter(|(_, opted_in)| *opted_in || !host_now)
        .map(|(name, _)| name)
        .collect()
}

/// Makes room for `newcomer` among an address's `names`, which are full; whether it may be
/// added. Only a name a block rule named gets a place: the oldest name no block rule named
/// makes way (dropping it only takes an allow away). When every kept name is blocked, the
/// newcomer is kept beyond the cap unless the kept names are blocked on each of its ports
/// already (a connect on those is refused without it), which bounds them by the ports block
/// rules name.
fn make_way(names: &mut Vec<Binding>, newcomer: &Binding) -> bool {
    if newcomer.blocked_on.is_empty() {
        return false;
    }
    if let Some(i) = names.iter().rposition(|b| b.blocked_on.is_empty()) {
        names.remove(i);
        return true;
    }
    !newcomer
        .blocked_on
        .iter()
        .all(|p| names.iter().any(|b| b.blocked_on.contains(p)))
}

/// One executor's resolver: its address, the answers it handed out, and the tasks serving
/// it (stopped when this is dropped, as is its resolv.conf file).
pub struct ExecutorDns {
    address: SocketAddr,
    /// The host's upstream resolvers: a send to one, on any port, is a lookup past this
    /// resolver.
    upstream: Arc<Upstream>,
    book: Arc<Mutex<AddressBook>>,
    narrowings: Narrowings,
    host: HostSide,
    conf: tempfile::NamedTempFile,
    /// The host's `/etc/resolv.conf` as it was when the executor was shown this resolver
    /// over it ([`ExecutorDns::show_to`]), with its device and inode: held open so that its
    /// inode number cannot be given to a later file while the executor lives.
    shown_over: std::sync::OnceLock<(std::fs::File, (u64, u64))>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for ExecutorDns {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Where the next search for a free resolver address starts (spread by pid, so parallel
/// daemons on one machine rarely collide; a collision only costs a retry).
static NEXT: AtomicU32 = AtomicU32::new(0);

fn candidate(n: u32) -> Ipv4Addr {
    // 127.53.0.1 ..= 127.53.255.254: within `destination::RESOLVER_NET`, which no
    // destination rule reaches.
    let n = n % 65534 + 1;
    Ipv4Addr::new(127, 53, (n >> 8) as u8, (n & 0xff) as u8)
}

fn bind_pair() -> Result<(std::net::UdpSocket, std::net::TcpListener), DnsError> {
    let start = NEXT
        .fetch_add(1, Ordering::Relaxed)
        .wrapping_add(std::process::id().wrapping_mul(7919));
    let mut last = None;
    for i in 0..256 {
        let addr = SocketAddr::new(IpAddr::V4(candidate(start.wrapping_add(i))), DNS_PORT);
        let udp = match std::net::UdpSocket::bind(addr) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                last = Some(e);
                continue;
            }
            Err(e) => return Err(DnsError::Bind(e)),
        };
        match std::net::TcpListener::bind(addr) {
            Ok(tcp) => {
                NEXT.fetch_add(i, Ordering::Relaxed);
                return Ok((udp, tcp));
            }
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => last = Some(e),
            Err(e) => return Err(DnsError::Bind(e)),
        }
    }
    Err(DnsError::Bind(last.unwrap_or_else(|| {
        std::io::Error::from(std::io::ErrorKind::AddrInUse)
    })))
}

impl ExecutorDns {
    /// Binds a resolver for one executor and starts serving it, every lookup judged by
    /// `judge`. Must run inside a tokio runtime.
    pub fn start(
        mediation: &DnsMediation,
        owner: ExecutorId,
        judge: LookupJudge,
    ) -> Result<ExecutorDns, DnsError> {
        let (udp, tcp) = bind_pair()?;
        let address = udp.local_addr().map_err(DnsError::Bind)?;
        let conf = write_conf(&mediation.dir, address.ip())?;
        udp.set_nonblocking(true).map_err(DnsError::Bind)?;
        tcp.set_nonblocking(true).map_err(DnsError::Bind)?;
        let udp = UdpSocket::from_std(udp).map_err(DnsError::Bind)?;
        let tcp = TcpListener::from_std(tcp).map_err(DnsError::Bind)?;
        let book = Arc::new(Mutex::new(AddressBook::default()));
        let server = Arc::new(Server {
            address,
            owner,
            senders: mediation.senders,
            warned_of_a_stranger: Default::default(),
            private_answers: mediation.private_answers.clone(),
            host: mediation.host,
            upstream: mediation.upstream.clone(),
            judge,
            book: book.clone(),
            narrowings: mediation.narrowings.clone(),
            in_flight: Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT)),
        });
        let tasks = vec![
            tokio::spawn(serve_udp(server.clone(), Arc::new(udp))),
            tokio::spawn(serve_tcp(server, tcp)),
        ];
        Ok(ExecutorDns {
            address,
            upstream: mediation.upstream.clone(),
            book,
            narrowings: mediation.narrowings.clone(),
            host: mediation.host,
            conf,
            shown_over: std::sync::OnceLock::new(),
            tasks,
        })
    }

    /// The resolver address written into the executor's resolv.conf.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// The resolv.conf file to show the executor as `/etc/resolv.conf`.
    pub fn resolv_conf(&self) -> &Path {
        self.conf.path()
    }

    /// Whether `addr` is this executor's own resolver.
    pub fn is_resolver(&self, addr: &SocketAddr) -> bool {
        canonical_ip(addr.ip()) == self.address.ip() && addr.port() == DNS_PORT
    }

    /// Whether `addr` is one of the host's upstream resolvers (on whatever port it serves:
    /// a local unbound or dnscrypt-proxy is often on another than 53). An upstream on this
    /// host is reached by any of the host's addresses on its port, loopback ones included
    /// (it may listen on all of them): `127.0.0.2:5335` is the `127.0.0.1:5335` upstream.
    pub fn is_upstream(&self, addr: &SocketAddr) -> bool {
        reaches_upstream(&self.upstream, addr)
    }

    /// The names this executor's lookups got `addr`'s address as an answer for that judge a
    /// connect to `addr`, the last one first: those whose answers' TTLs have not run out and,
    /// while any has not, those whose TTLs ran out that a block rule named on `addr`'s port
    /// (so they still refuse it, and never allow anything). When the address has become one
    /// of the host's own since, only names `private_answers` opted in. Empty: none; a
    /// connect to it is judged by address rules alone. [`Naming::BeforeNarrowing`] when
    /// the address was handed out before the rules were last narrowed.
    pub fn names_of(&self, addr: SocketAddr) -> Naming {
        let counted = self.narrowings.count();
        let bindings = match self.book.lock() {
            Ok(book) => book.bindings_at(addr, counted, Instant::now()),
            Err(_) => Ok(Vec::new()),
        };
        match bindings {
            // Out of the book's lock: the host-address question binds a socket.
            Ok(bindings) => Naming::Names {
                names: judging(addr, bindings, |ip| self.host.scope(ip)),
                counted,
            },
            Err(HandedOutBeforeNarrowing) => Naming::BeforeNarrowing(addr),
        }
    }
}

/// Whether executors under `profile` get a resolver of their own: they share the host's
/// network (so their lookups would otherwise leave for the host's resolvers) and have a
/// mount namespace to show them their own `/etc/resolv.conf` in.
pub fn mediates_lookups(profile: &flowhost_broker::Profile) -> bool {
    profile.network == flowhost_broker::NetworkPath::Host && profile.mount_namespace
}

impl ExecutorDns {
    /// Shows the executor `spec` starts this resolver's configuration as the host's
    /// `/etc/resolv.conf` (where that leads, when it is a link: systemd-resolved's stub file,
    /// say). Fails when the host has no `/etc/resolv.conf` (an empty file will do).
    pub fn show_to(&self, spec: &mut flowhost_broker::SpawnSpec) -> Result<(), String> {
        let shown = std::fs::canonicalize("/etc/resolv.conf").map_err(|e| {
            format!(
                "DNS mediation shows executors their own /etc/resolv.conf, which must exist on the host (an empty file will do): {e}"
            )
        })?;
        let file = std::fs::File::open(&shown).map_err(|e| {
            format!(
                "DNS mediation shows executors their own /etc/resolv.conf over {}, which cannot be opened: {e}",
                shown.display()
            )
        })?;
        let id = file.metadata().map_err(|e| {
            format!(
                "DNS mediation shows executors their own /etc/resolv.conf over {}, which cannot be read: {e}",
                shown.display()
            )
        })?;
        let _ = self.shown_over.set((file, (id.dev(), id.ino())));
        spec.bind_files
            .push((self.resolv_conf().to_path_buf(), shown.clone()));
        spec.read_paths.push(shown);
        Ok(())
    }

    /// Whether an executor shown this resolver ([`ExecutorDns::show_to`]) still sees it:
    /// not once the host's `/etc/resolv.conf` leads to another file than it did then. A
    /// rename over the file (how systemd-resolved and NetworkManager write it) drops every
    /// bind mount on it, in the executor's namespace too, and a changed link leads past
    /// it; either way the executor now reads the host's file, and its lookups would go
    /// past its resolver (and be refused). True when it was never shown.
    pub fn still_shown(&self) -> bool {
        let Some((_, then)) = self.shown_over.get() else {
            return true;
        };
        std::fs::metadata("/etc/resolv.conf").is_ok_and(|now| (now.dev(), now.ino()) == *then)
    }
}

/// What an executor's attempt is to its resolver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptView {
    /// A lookup reaching the executor's own resolver: the host talking to itself, allowed
    /// without judgment (the lookup is what is judged).
    ToResolver,
    /// Anything else, with what the executor's lookups say of its destination.
    Egress(Naming),
}

/// What an executor's lookups say of an attempt's destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Naming {
    /// The names the executor's lookups got its address as an answer for, the last one
    /// first (judged against host-name rules with all of them, and recorded with them;
    /// empty: none), as they stood when the [`Narrowings`] count was `counted`: judged by
    /// rules narrowed since, they vouch for nothing.
    Names {
        /// The names.
        names: Vec<HostName>,
        /// The count they were looked at under.
        counted: u64,
    },
    /// A reach for port 53 of an address other than the executor's own resolver: a lookup
    /// past it, which nobody would judge by name (refused whatever the rules say). Its
    /// `/etc/resolv.conf` names its own resolver only; a lookup elsewhere is a client that
    /// ignores it, or a view of the host's file after a rename there replaced the file the
    /// executor was shown (the kernel then drops that bind mount in every namespace).
    PastResolver(SocketAddr),
    /// An address the executor's lookups handed out before a reload narrowed the rules
    /// that judged them ([`Narrowings`]): refused until it is looked up again.
    BeforeNarrowing(SocketAddr),
}

impl Naming {
    /// The names, if any (none for a lookup past the resolver, nor for an address handed
    /// out before a narrowing).
    pub fn names(&self) -> &[HostName] {
        match self {
            Naming::Names { names, .. } => names,
            Naming::PastResolver(_) | Naming::BeforeNarrowing(_) => &[],
        }
    }

    /// No name: a destination no lookup handed out (judged by address rules alone).
    pub fn unnamed() -> Self {
        Naming::Names {
            names: Vec::new(),
            counted: 0,
        }
    }
}

/// Whether `addr` reaches one of `upstream`'s servers (see [`ExecutorDns::is_upstream`]).
fn reaches_upstream(upstream: &Upstream, addr: &SocketAddr) -> bool {
    // Where the packets go: an IPv6 form carrying the upstream's IPv4 address (NAT64,
    // 6to4) reaches it too.
    let ip = reached(addr.ip());
    let on_this_host = |ip: IpAddr| ip.is_loopback() || is_host_address(ip);
    upstream.servers().iter().any(|s| {
        let server = reached(s.ip());
        s.port() == addr.port() && (server == ip || (on_this_host(server) && on_this_host(ip)))
    })
}

/// How `info` stands with the executor's resolver `dns` (`None`: lookups not mediated).
/// A send to port 53 anywhere but its own resolver, or to one of the host's upstream
/// resolvers on any port, is a lookup past it (the upstream would carry whatever the
/// executor asks, unjudged); without a resolver of its own, every send to port 53 is, and
/// every send reaching one of `upstream`'s servers (the host's, which it would have used). Binding or listening on the resolver's address, or on port 53,
/// is not reaching it, and is judged by the rules, by address alone. Another executor's resolver is an address the rules refuse
/// themselves ([`crate::destination::is_resolver_address`]).
pub fn attempt_view(
    dns: Option<&ExecutorDns>,
    upstream: Option<&Upstream>,
    info: &flowhost_broker::AttemptInfo,
) -> AttemptView {
    let reaches = !matches!(
        info.syscall,
        flowhost_broker::EgressSyscall::Bind | flowhost_broker::EgressSyscall::Listen
    );
    let Some(flowhost_broker::Destination::Inet(addr)) = &info.destination else {
        return AttemptView::Egress(Naming::unnamed());
    };
    let Some(dns) = dns else {
        // Lookups not mediated (the host could not bind the resolver's port): a query to
        // any resolver would carry whatever the executor asks, judged by the resolver's
        // address alone. None is let out.
        if reaches
            && (addr.port() == DNS_PORT || upstream.is_some_and(|u| reaches_upstream(u, addr)))
        {
            return AttemptView::Egress(Naming::PastResolver(*addr));
        }
        return AttemptView::Egress(Naming::unnamed());
    };
    if reaches && dns.is_resolver(addr) {
        AttemptView::ToResolver
    } else if reaches
        && (addr.port() == DNS_PORT && !crate::destination::is_resolver_address(addr)
            || dns.is_upstream(addr))
    {
        AttemptView::Egress(Naming::PastResolver(*addr))
    } else if reaches {
        AttemptView::Egress(dns.names_of(*addr))
    } else {
        // A bind or listen takes a local address, not a name's: an address a lookup handed
        // out (another host's, bound with IP_FREEBIND to send from it) is judged by address
        // rules alone, as for a lookup that never happened.
        AttemptView::Egress(Naming::unnamed())
    }
}

/// How the names an address was handed out for are shown after it in a log line:
/// ` (last, other, ...)`, or nothing when it has none. Host names are checked DNS syntax, so
/// nothing here needs escaping.
pub fn shown_names(names: &[HostName]) -> String {
    if names.is_empty() {
        return String::new();
    }
    let names: Vec<&str> = names.iter().map(HostName::as_str).collect();
    format!(" ({})", names.join(", "))
}

fn write_conf(dir: &Path, ip: IpAddr) -> Result<tempfile::NamedTempFile, DnsError> {
    let err = |source| DnsError::Write {
        dir: dir.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(err)?;
    let mut f = tempfile::Builder::new()
        .prefix("resolv-")
        .suffix(".conf")
        .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644))
        .tempfile_in(dir)
        .map_err(err)?;
    use std::io::Write;
    // No search domains: a short name is not tried under the host's domains (each try
    // would be another lookup to judge).
    writeln!(
        f,
        "# Written by flowhost: this executor's lookups are answered by the host.\nnameserver {ip}"
    )
    .map_err(err)?;
    f.as_file().sync_all().map_err(err)?;
    Ok(f)
}

struct Server {
    address: SocketAddr,
    owner: ExecutorId,
    senders: flowhost_broker::UidRange,
    warned_of_a_stranger: std::sync::atomic::AtomicBool,
    private_answers: Arc<[NamePattern]>,
    host: HostSide,
    upstream: Arc<Upstream>,
    judge: LookupJudge,
    book: Arc<Mutex<AddressBook>>,
    narrowings: Narrowings,
    in_flight: Arc<tokio::sync::Semaphore>,
}

impl Server {
    /// Whether a query from `from`, whose socket `owner` owns, is one to answer: only
    /// executors' sockets are (see [`DnsMediation::senders`]); one that cannot be told is
    /// not.
    fn sent_by_an_executor(&self, owner: Result<Option<u32>, String>, from: SocketAddr) -> bool {
        match owner {
            Ok(Some(uid)) if self.senders.contains(uid) => true,
            owner => {
                // Once per resolver as a warning (a flood of them must not flood the log).
                if self
                    .warned_of_a_stranger
                    .swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    tracing::debug!(resolver = %self.address, %from, owner = ?owner, "query from a socket no executor owns; dropped");
                    return false;
                }
                tracing::warn!(
                    server = %self.owner.server,
                    executor_pid = self.owner.pid(),
                    resolver = %self.address,
                    %from,
                    owner = ?owner,
                    "a query to an executor's resolver from a socket no executor owns; dropped"
                );
                false
            }
        }
    }

    /// The answer to one query (`None`: nothing can be answered).
    async fn answer(&self, query: &[u8], transport: &'static str) -> Option<Vec<u8>> {
        let q = match wire::question(query) {
            Ok(q) => q,
            Err(wire::WireError::Undecodable) => return None,
            Err(wire::WireError::Unserved { answer, why }) => {
                tracing::debug!(resolver = %self.address, why, "DNS query not served");
                let lookup = Lookup {
                    asked: Asked::Unserved { why },
                    transport,
                    bytes: query.len(),
                    resolver: self.address,
                };
                // Refused whatever the judge says: judged only to be recorded.
                let _ = (self.judge)(lookup).await;
                return Some(answer);
            }
        };
        let lookup = Lookup {
            asked: Asked::Name {
                name: q.name.clone(),
                record_type: q.record_type,
            },
            transport,
            bytes: query.len(),
            resolver: self.address,
        };
        // Read before the judge reads the rules: a narrowing meanwhile leaves what this
        // answer binds counted as before it, so refused until looked up again.
        let narrowings = self.narrowings.count();
        let verdict = (self.judge)(lookup).await;
        // Whatever the judge said: a type not served is refused here too (fail closed).
        if !q.record_type.served() {
            return Some(wire::refusal(query, ResponseCode::Refused));
        }
        let LookupVerdict::Answered(blocks) = verdict else {
            return Some(wire::refusal(query, ResponseCode::NXDomain));
        };
        // A fresh id per upstream query: the executor's own (which it may always set to 0)
        // would make a forged answer easy to match.
        let id = rand_core::RngCore::next_u32(&mut rand_core::OsRng) as u16;
        let asked = match wire::upstream_query(&q, id) {
            Ok(asked) => asked,
            Err(why) => {
                tracing::warn!(name = %q.name, why, "DNS query not asked upstream");
                return Some(wire::refusal(query, ResponseCode::ServFail));
            }
        };
        match self
            .upstream
            .ask(&asked, |response| wire::answers(&q, response, id))
            .await
        {
            Ok(response) => match wire::answer(&q, &response, id) {
                Ok(answer) => {
                    self.admit(&q.name, &answer, &blocks, narrowings);
                    if transport == "udp" && answer.bytes.len() > wire::udp_limit(&q) {
                        return Some(wire::truncated_answer(&q));
                    }
                    Some(answer.bytes)
                }
                Err(why) => {
                    tracing::warn!(name = %q.name, why, "upstream DNS answer refused");
                    Some(wire::refusal(query, ResponseCode::ServFail))
                }
            },
            Err(why) => {
                tracing::warn!(name = %q.name, why, "no upstream resolver answered");
                Some(wire::refusal(query, ResponseCode::ServFail))
            }
        }
    }
}

impl Server {
    /// Remembers the addresses of an allowed name's answer that may be bound to it, and logs
    /// those withheld, with why.
    fn admit(&self, name: &HostName, answer: &wire::Answer, blocks: &NameBlocks, narrowings: u64) {
        let (bound, withheld) = screen(
            name,
            answer,
            &self.private_answers,
            |ip| self.host.scope(ip),
            blocks,
        );
        if !withheld.is_empty() {
            let shown: Vec<String> = withheld
                .iter()
                .map(|(ip, why)| format!("{ip} ({why})"))
                .collect();
            tracing::warn!(
                server = %self.owner.server,
                executor_pid = self.owner.pid(),
                name = %name,
                withheld = %shown.join(", "),
                "DNS answer addresses withheld from the name: a connect to them is judged by address rules alone"
            );
        }
        let full = match self.book.lock() {
            Ok(mut book) => book.remember_judged(
                name,
                &blocks.ports_naming(name),
                &bound,
                opted_in(name, answer, &self.private_answers),
                narrowings,
                Instant::now(),
            ),
            Err(_) => Vec::new(),
        };
        if !full.is_empty() {
            let shown: Vec<String> = full.iter().map(IpAddr::to_string).collect();
            tracing::warn!(
                server = %self.owner.server,
                executor_pid = self.owner.pid(),
                name = %name,
                addresses = %shown.join(", "),
                "DNS answer addresses not remembered under the name: each already has {MAX_NAMES_PER_ADDRESS} names (which still judge a connect to it), and this one adds no block on their ports"
            );
        }
    }
}

/// The first pause after a transient failure to take a query or connection; it doubles
/// with each failure in a row, up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
/// The longest pause after a transient failure (so a lasting one is logged at most this
/// often).
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Whether `error`, from taking the next query or connection, passes: the host or the socket
/// ran out of descriptors, buffers or memory, or one connection failed before it was
/// accepted. Anything else means the socket itself is unusable.
fn transient(error: &std::io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(
            libc::EMFILE
                | libc::ENFILE
                | libc::ENOBUFS
                | libc::ENOMEM
                | libc::ECONNABORTED
                | libc::ECONNRESET
                | libc::ECONNREFUSED
                | libc::EPROTO
                | libc::EPERM
                | libc::ENETDOWN
                | libc::ENETUNREACH
                | libc::EHOSTDOWN
                | libc::EHOSTUNREACH
                | libc::ENONET
                | libc::ENOPROTOOPT
                | libc::EINTR
        )
    )
}

/// The pause after a transient failure that follows `failures` others in a row.
fn backoff(failures: u32) -> Duration {
    FIRST_BACKOFF
        .saturating_mul(1 << failures.min(16))
        .min(MAX_BACKOFF)
}

/// Whether a resolver goes on after its socket failed to take the next query or connection
/// with `error` (`failures`: how many in a row before this one; the caller resets it on
/// success). Logged either way, naming the executor: after a transient error it pauses
/// (longer with each failure in a row) and goes on; after any other, that transport of the
/// resolver stops (the executor's lookups over it then go unanswered, and fail).
async fn survive(
    owner: &ExecutorId,
    resolver: SocketAddr,
    transport: &'static str,
    error: &std::io::Error,
    failures: &mut u32,
) -> bool {
    if !transient(error) {
        tracing::error!(
            server = %owner.server,
            executor_pid = owner.pid(),
            resolver = %resolver,
            transport,
            error = %error,
            "the executor's resolver stops serving {transport}: its socket failed"
        );
        return false;
    }
    let pause = backoff(*failures);
    *failures = failures.saturating_add(1);
    tracing::warn!(
        server = %owner.server,
        executor_pid = owner.pid(),
        resolver = %resolver,
        transport,
        error = %error,
        failures_in_a_row = *failures,
        "the executor's resolver could not take a query; trying again in {pause:?}"
    );
    tokio::time::sleep(pause).await;
    true
}

async fn serve_udp(server: Arc<Server>, sock: Arc<UdpSocket>) {
    let mut buf = vec![0u8; 65535];
    // Owned here, so the queries in flight end with the resolver (this task is aborted
    // when its executor's resolver is dropped).
    let mut queries = tokio::task::JoinSet::new();
    let mut failures = 0;
    loop {
        let (n, from) = match sock.recv_from(&mut buf).await {
            Ok(got) => got,
            Err(e) => {
                if survive(&server.owner, server.address, "udp", &e, &mut failures).await {
                    continue;
                }
                return;
            }
        };
        failures = 0;
        while queries.try_join_next().is_some() {}
        let Ok(permit) = server.in_flight.clone().try_acquire_owned() else {
            continue;
        };
        let query = buf[..n].to_vec();
        let (server, sock) = (server.clone(), sock.clone());
        // Each query on its own: glibc sends A and AAAA together and waits for both.
        queries.spawn(async move {
            let _permit = permit;
            // The kernel's tables are files: read off the runtime's threads.
            let owner = tokio::task::spawn_blocking(move || crate::host::socket_owner::udp(from))
                .await
                .unwrap_or_else(|e| Err(e.to_string()));
            if !server.sent_by_an_executor(owner, from) {
                return;
            }
            if let Some(answer) = server.answer(&query, "udp").await {
                let _ = sock.send_to(&answer, from).await;
            }
        });
    }
}

async fn serve_tcp(server: Arc<Server>, listener: TcpListener) {
    let mut clients = tokio::task::JoinSet::new();
    let mut failures = 0;
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                if survive(&server.owner, server.address, "tcp", &e, &mut failures).await {
                    continue;
                }
                return;
            }
        };
        failures = 0;
        while clients.try_join_next().is_some() {}
        let Ok(permit) = server.in_flight.clone().try_acquire_owned() else {
            continue;
        };
        let server = server.clone();
        clients.spawn(async move {
            let _permit = permit;
            let Ok(local) = stream.local_addr() else {
                return;
            };
            let peer = stream.peer_addr().unwrap_or(local);
            // The kernel's tables are files: read off the runtime's threads.
            let owner =
                tokio::task::spawn_blocking(move || crate::host::socket_owner::tcp(peer, local))
                    .await
                    .unwrap_or_else(|e| Err(e.to_string()));
            if server.sent_by_an_executor(owner, peer) {
                serve_tcp_client(server, stream).await;
            }
        });
    }
}

/// Serves one TCP client's queries in turn. Every read and write has [`TCP_IDLE`] to finish,
/// so a client that stops half-way through a message (or stops reading) gives its slot back.
async fn serve_tcp_client(server: Arc<Server>, mut stream: TcpStream) {
    loop {
        let mut len = [0u8; 2];
        if !matches!(
            tokio::time::timeout(TCP_IDLE, stream.read_exact(&mut len)).await,
            Ok(Ok(_))
        ) {
            return;
        }
        let mut query = vec![0u8; usize::from(u16::from_be_bytes(len))];
        if !matches!(
            tokio::time::timeout(TCP_IDLE, stream.read_exact(&mut query)).await,
            Ok(Ok(_))
        ) {
            return;
        }
        let Some(answer) = server.answer(&query, "tcp").await else {
            return;
        };
        let Ok(n) = u16::try_from(answer.len()) else {
            return;
        };
        let mut framed = Vec::with_capacity(answer.len() + 2);
        framed.extend_from_slice(&n.to_be_bytes());
        framed.extend_from_slice(&answer);
        if !matches!(
            tokio::time::timeout(TCP_IDLE, stream.write_all(&framed)).await,
            Ok(Ok(()))
        ) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::Message;
    use hickory_proto::rr::rdata::A;
    use hickory_proto::rr::{Name, RData, Record};
    use std::str::FromStr;
    use std::sync::atomic::AtomicBool;

    /// What the upstream resolver got of one query: the name, and whether anything but the
    /// question came with it (extra records, EDNS options).
    type AskedUpstream = Arc<Mutex<Vec<(String, bool)>>>;

    /// An upstream resolver on loopback: `known.test` is 192.0.2.7, every other name
    /// NXDOMAIN; it keeps what it got of each query.
    async fn upstream() -> (SocketAddr, AskedUpstream) {
        upstream_answering(|name, r| {
            if name == "known.test." {
                r.add_answer(a(name, [192, 0, 2, 7]));
            } else {
                r.metadata.response_code = ResponseCode::NXDomain;
            }
        })
        .await
    }

    /// An upstream resolver on loopback whose response to a query for `name` (with the root's
    /// dot) is what `respond` makes of it; it keeps what it got of each query.
    async fn upstream_answering(
        respond: impl Fn(&str, &mut Message) + Send + 'static,
    ) -> (SocketAddr, AskedUpstream) {
        let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = sock.local_addr().unwrap();
        let asked = Arc::new(Mutex::new(Vec::new()));
        let log = asked.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            while let Ok((n, from)) = sock.recv_from(&mut buf).await {
                let q = Message::from_vec(&buf[..n]).unwrap();
                let name = q.queries[0].name().to_ascii();
                let extra = !q.additionals.is_empty()
                    || !q.answers.is_empty()
                    || !q.authorities.is_empty()
                    || q.edns
                        .as_ref()
                        .is_some_and(|e| !e.options().options.is_empty());
                log.lock().unwrap().push((name.clone(), extra));
                let mut r = q.into_response();
                respond(&name, &mut r);
                let _ = sock.send_to(&r.to_vec().unwrap(), from).await;
            }
        });
        (addr, asked)
    }

    fn a(owner: &str, ip: [u8; 4]) -> Record {
        Record::from_rdata(
            Name::from_str(owner).unwrap(),
            60,
            RData::A(A::new(ip[0], ip[1], ip[2], ip[3])),
        )
    }

    /// Asks `dns` for `name` (type A) over UDP and returns its answer.
    async fn ask(dns: &ExecutorDns, id: u16, name: &str) -> Message {
        let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        client.connect(dns.address()).await.unwrap();
        client.send(&wire::tests::query(id, name)).await.unwrap();
        let mut buf = [0u8; 4096];
        let n = tokio::time::timeout(std::time::Duration::from_secs(5), client.recv(&mut buf))
            .await
            .unwrap()
            .unwrap();
        Message::from_vec(&buf[..n]).unwrap()
    }

    /// The host's own addresses as they are, and no network it is attached to: the tests'
    /// public answers are in the documentation ranges, which a test machine's own link may
    /// use (this one's is 192.0.2.0/24).
    const AWAY: HostSide = HostSide {
        is_host: is_host_address,
        on_link: |_| false,
    };

    /// A port 53 held on every address by another server (dnsmasq's default) is named as
    /// the cause, not the right to bind it.
    #[test]
    fn a_port_held_by_another_server_is_told_apart_from_a_missing_right() {
        let held = DnsError::Bind(std::io::ErrorKind::AddrInUse.into()).to_string();
        assert!(held.contains("another socket holds port 53"), "{held}");
        let denied = DnsError::Bind(std::io::ErrorKind::PermissionDenied.into()).to_string();
        assert!(denied.contains("CAP_NET_BIND_SERVICE"), "{denied}");
    }

    /// Executors of this process's own uid (unprivileged, where a container lets anyone
    /// bind port 53): a resolver would take any process of that user for its executor, so
    /// lookups are not mediated. Before, the resolver started and answered them all.
    #[test]
    fn executors_of_this_processs_uid_get_no_resolver() {
        let up: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let me = nix::unistd::geteuid().as_raw();
        let mut m = mediation(up, dir.path());
        m.senders = flowhost_broker::UidRange {
            first: me,
            count: 1,
        };
        let e = m.check_senders().unwrap_err();
        assert!(e.not_mediated_here(), "{e}");
        assert!(e.to_string().contains(&format!("uid ({me})")), "{e}");
        m.senders = flowhost_broker::UidRange {
            first: me.wrapping_add(1_000_000),
            count: 16,
        };
        m.check_senders().unwrap();
    }

    /// Mediation asking `upstream`, writing resolv.conf files into `dir`, with no
    /// `private_answers`, on a host attached to no public network ([`AWAY`]).
    fn mediation(upstream: SocketAddr, dir: &Path) -> DnsMediation {
        DnsMediation {
            upstream: Arc::new(Upstream::new(vec![upstream])),
            dir: dir.to_path_buf(),
            private_answers: Arc::from([]),
            host: AWAY,
            // The test itself asks, as whatever user runs it.
            senders: ANYONE,
            narrowings: Default::default(),
        }
    }

    /// Every uid: the resolvers these tests start answer the test process.
    const ANYONE: flowhost_broker::UidRange = flowhost_broker::UidRange {
        first: 0,
        count: u32::MAX,
    };

    /// A judge allowing every lookup, with no block rules.
    fn allow_all() -> LookupJudge {
        allow_all_but(crate::destination::DestinationRules::default())
    }

    /// A judge allowing every lookup, the names its answers lead through judged by the
    /// block rules of `rules`.
    fn allow_all_but(rules: crate::destination::DestinationRules) -> LookupJudge {
        let blocks = NameBlocks::of(&rules, None);
        Arc::new(move |_: Lookup| {
            let blocks = blocks.clone();
            Box::pin(async move { LookupVerdict::Answered(blocks) })
        })
    }

    /// The names `dns` remembers for `ip`, the last one first.
    fn names(dns: &ExecutorDns, ip: &str) -> Vec<String> {
        dns.names_of(SocketAddr::new(ip.parse().unwrap(), 443))
            .names()
            .iter()
            .map(|n| n.to_string())
            .collect()
    }

    /// A send to one of the host's upstream resolvers is a lookup past the executor's own,
    /// on whatever port the upstream serves. Before, only port 53 was taken for one: with
    /// the upstream on 127.0.0.1:5335 (a local unbound) and a rule allowing 127.0.0.1 for
    /// another service, the executor's raw queries reached it unjudged and went on to the
    /// internet.
    #[tokio::test]
    async fn a_send_to_an_upstream_resolver_on_any_port_is_a_lookup_past_its_own() {
        if !can_bind_53() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let up: SocketAddr = "127.0.0.1:5335".parse().unwrap();
        let dns = ExecutorDns::start(
            &mediation(up, dir.path()),
            ExecutorId::default(),
            allow_all(),
        )
        .unwrap();
        let view = |addr: &str| {
            attempt_view(
                Some(&dns),
                None,
                &udp_attempt(flowhost_broker::EgressSyscall::Sendto, addr),
            )
        };
        // Another of the host's addresses on the upstream's port reaches it too, when it
        // listens on all of them (before, only its exact address was taken for it).
        for to in [
            "127.0.0.1:5335",
            "[::ffff:127.0.0.1]:5335",
            "192.0.2.9:53",
            "127.0.0.2:5335",
            "[::1]:5335",
        ] {
            assert!(
                matches!(view(to), AttemptView::Egress(Naming::PastResolver(_))),
                "{to}"
            );
        }
        // The same address on another port is another service, judged by the rules; so is
        // an address elsewhere on the upstream's port.
        for to in ["127.0.0.1:8080", "198.51.100.9:5335"] {
            assert!(
                matches!(view(to), AttemptView::Egress(Naming::Names { .. })),
                "{to}"
            );
        }
    }

    /// An attempt of executor pid 7 on a UDP socket to `addr`.
    fn udp_attempt(
        syscall: flowhost_broker::EgressSyscall,
        addr: &str,
    ) -> flowhost_broker::AttemptInfo {
        let addr: SocketAddr = addr.parse().unwrap();
        flowhost_broker::AttemptInfo {
            syscall,
            pid: 7,
            executable: None,
            socket: flowhost_broker::SocketInfo {
                family: if addr.is_ipv4() {
                    libc::AF_INET
                } else {
                    libc::AF_INET6
                },
                socket_type: libc::SOCK_DGRAM,
                protocol: 0,
            },
            destination: Some(flowhost_broker::Destination::Inet(addr)),
            connected: false,
            bytes: None,
            message_index: None,
            passed_fds: 0,
        }
    }

    /// Without a resolver of its own (the host could not bind port 53), every send to port
    /// 53 is a lookup past it: refused, never judged by the resolver's address alone.
    /// Before, an address rule allowing the host's resolver let any query out through it.
    /// So is a send reaching one of the host's upstream resolvers on its own port (a local
    /// unbound on 5335, by any of the host's addresses): before, only port 53 was.
    #[test]
    fn without_mediation_every_send_to_port_53_is_a_lookup_past_the_resolver() {
        let info = udp_attempt;
        use flowhost_broker::EgressSyscall::{Bind, Connect, Sendto};
        let upstream = Upstream::new(vec!["127.0.0.1:5335".parse().unwrap()]);
        let up = Some(&upstream);
        for (syscall, to) in [
            (Sendto, "10.0.0.2:53"),
            (Connect, "127.0.0.53:53"),
            (Sendto, "127.0.0.1:5335"),
            (Sendto, "127.0.0.2:5335"),
            (Connect, "[::1]:5335"),
            // The upstream's IPv4 address as NAT64 and 6to4 carry it: before, judged by
            // address alone.
            (Sendto, "[64:ff9b::7f00:1]:5335"),
            (Sendto, "[2002:7f00:1::]:5335"),
        ] {
            assert!(
                matches!(
                    attempt_view(None, up, &info(syscall, to)),
                    AttemptView::Egress(Naming::PastResolver(_))
                ),
                "{to}"
            );
        }
        for (syscall, to) in [
            (Sendto, "10.0.0.2:443"),
            (Bind, "0.0.0.0:53"),
            (Sendto, "127.0.0.1:5336"),
            (Bind, "127.0.0.1:5335"),
        ] {
            assert!(
                matches!(
                    attempt_view(None, up, &info(syscall, to)),
                    AttemptView::Egress(Naming::Names { .. })
                ),
                "{to}"
            );
        }
    }

    /// An executor's resolver answers executors' sockets only: a query from any other
    /// local process is dropped, never judged under the executor's call or recorded as its
    /// lookup. Before, any local user could make it look names up as the executor.
    #[tokio::test]
    async fn a_query_from_a_socket_no_executor_owns_is_dropped() {
        if !can_bind_53() {
            return;
        }
        let (up, asked) = upstream_answering(|name, r| {
            r.add_answer(a(name, [192, 0, 2, 7]));
        })
        .await;
        let dir = tempfile::tempdir().unwrap();
        let me = nix::unistd::geteuid().as_raw();
        let others = DnsMediation {
            senders: flowhost_broker::UidRange {
                first: me.wrapping_add(1).max(1),
                count: 1,
            },
            ..mediation(up, dir.path())
        };
        let dns = ExecutorDns::start(&others, ExecutorId::default(), allow_all()).unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        client.connect(dns.address()).await.unwrap();
        client
            .send(&wire::tests::query(1, "x.test."))
            .await
            .unwrap();
        let mut buf = [0u8; 512];
        let answered =
            tokio::time::timeout(std::time::Duration::from_millis(500), client.recv(&mut buf))
                .await;
        assert!(answered.is_err(), "a stranger's query was answered");
        let mut tcp = tokio::net::TcpStream::connect(dns.address()).await.unwrap();
        let query = wire::tests::query(2, "x.test.");
        let mut framed = (query.len() as u16).to_be_bytes().to_vec();
        framed.extend_from_slice(&query);
        let _ = tcp.write_all(&framed).await;
        let read = tokio::time::timeout(std::time::Duration::from_secs(5), tcp.read(&mut buf))
            .await
            .unwrap();
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        assert!(
            asked.lock().unwrap().is_empty(),
            "asked upstream for a stranger"
        );
        // The same resolver for the test's own uid answers.
        let mine = DnsMediation {
            senders: flowhost_broker::UidRange {
                first: me,
                count: 1,
            },
            ..mediation(up, dir.path())
        };
        let dns = ExecutorDns::start(&mine, ExecutorId::default(), allow_all()).unwrap();
        assert_eq!(ask(&dns, 3, "x.test.").await.answers.len(), 1);
    }

    #[tokio::test]
    async fn an_allowed_name_is_not_bound_to_a_private_address() {
        if !can_bind_53() {
            return;
        }
        let (up, _) = upstream_answering(|name, r| {
            let ip = match name {
                "meta.test." => [169, 254, 169, 254],
                "local.test." => [127, 0, 0, 1],
                "corp.test." => [10, 1, 2, 3],
                "cgnat.test." => [100, 64, 0, 1],
                "multi.test." => [224, 0, 0, 251],
                "zero.test." => [0, 0, 0, 0],
                _ => [192, 0, 2, 7],
            };
            r.add_answer(a(name, ip));
        })
        .await;
        let dir = tempfile::tempdir().unwrap();
        let mediation = mediation(up, dir.path());
        let dns = ExecutorDns::start(&mediation, ExecutorId::default(), allow_all()).unwrap();
        for (id, (name, ip)) in [
            ("meta.test.", "169.254.169.254"),
            ("local.test.", "127.0.0.1"),
            ("corp.test.", "10.1.2.3"),
            ("cgnat.test.", "100.64.0.1"),
            ("multi.test.", "224.0.0.251"),
            ("zero.test.", "0.0.0.0"),
        ]
        .into_iter()
        .enumerate()
        {
            let answer = ask(&dns, id as u16, name).await;
            // The executor still gets the answer: only the host-name binding is withheld.
            assert_eq!(answer.answers.len(), 1, "{name}");
            assert_eq!(names(&dns, ip), Vec::<String>::new(), "{name} -> {ip}");
        }
        ask(&dns, 99, "public.test.").await;
        assert_eq!(names(&dns, "192.0.2.7"), ["public.test"]);
        // A bind or listen to that address is judged by address alone: the name's rules
        // are for reaching it (before, a bind with IP_FREEBIND to send from another
        // host's address matched a rule naming the name).
        for syscall in [
            flowhost_broker::EgressSyscall::Bind,
            flowhost_broker::EgressSyscall::Listen,
        ] {
            let view = attempt_view(Some(&dns), None, &udp_attempt(syscall, "192.0.2.7:443"));
            assert!(
                matches!(&view, AttemptView::Egress(Naming::Names { names, .. }) if names.is_empty()),
                "{syscall:?}"
            );
        }
        let view = attempt_view(
            Some(&dns),
            None,
            &udp_attempt(flowhost_broker::EgressSyscall::Connect, "192.0.2.7:443"),
        );
        assert!(
            matches!(&view, AttemptView::Egress(Naming::Names { names, .. }) if names.len() == 1)
        );
        drop(dns);

        // The server's opt-in binds them for the names it names, and for those only.
        let mediation = DnsMediation {
            private_answers: Arc::from(["local.test".parse().unwrap()]),
            ..mediation
        };
        let dns = ExecutorDns::start(&mediation, ExecutorId::default(), allow_all()).unwrap();
        ask(&dns, 1, "local.test.").await;
        ask(&dns, 2, "meta.test.").await;
        assert_eq!(names(&dns, "127.0.0.1"), ["local.test"]);
        assert_eq!(names(&dns, "169.254.169.254"), Vec::<String>::new());
    }

    /// An upstream resolver for the `example.com` names of the address-sharing tests:
    /// `secret` and `www` share 192.0.2.50, `alias` is a CNAME of `secret2` (192.0.2.51),
    /// `other` is 192.0.2.60.
    async fn example_upstream() -> SocketAddr {
        upstream_answering(|name, r| match name {
            "secret.example.com." | "www.example.com." => {
                r.add_answer(a(name, [192, 0, 2, 50]));
            }
            "alias.example.com." => {
                r.add_answer(Record::from_rdata(
                    Name::from_str(name).unwrap(),
                    60,
                    RData::CNAME(hickory_proto::rr::rdata::CNAME(
                        Name::from_str("secret2.example.com.").unwrap(),
                    )),
                ));
                r.add_answer(a("secret2.example.com.", [192, 0, 2, 51]));
            }
            "other.example.com." => {
                r.add_answer(a(name, [192, 0, 2, 60]));
            }
            _ => r.metadata.response_code = ResponseCode::NXDomain,
        })
        .await
        .0
    }

    /// Allow `*.example.com:443`, block `secret.example.com:443` and `secret2.example.com:443`.
    fn example_rules() -> crate::destination::DestinationRules {
        let rule = |r: &str| r.parse().unwrap();
        crate::destination::DestinationRules {
            allow: vec![rule("*.example.com:443")],
            block: vec![
                rule("secret.example.com:443"),
                rule("secret2.example.com:443"),
            ],
            default: crate::destination::DefaultAction::Block,
        }
    }

    /// A resolver asking [`example_upstream`], its lookups' answers judged by the block rules
    /// of [`example_rules`] (returned too); its resolv.conf is written into `dir`.
    async fn example_dns(dir: &Path) -> (ExecutorDns, crate::destination::DestinationRules) {
        let mediation = mediation(example_upstream().await, dir);
        let rules = example_rules();
        let judge = allow_all_but(rules.clone());
        let dns = ExecutorDns::start(&mediation, ExecutorId::default(), judge).unwrap();
        (dns, rules)
    }

    /// Whether `rules` allow a connect to `addr`, judged as the daemon judges it: with the
    /// names the executor's resolver remembers for the address.
    fn connect_allowed(
        dns: &ExecutorDns,
        rules: &crate::destination::DestinationRules,
        addr: &str,
    ) -> bool {
        let addr: SocketAddr = addr.parse().unwrap();
        let dest = crate::daemon::judged_destination(
            &flowhost_broker::Destination::Inet(addr),
            &dns.names_of(addr),
            dns.narrowings.count(),
        );
        rules.decide(Some(&dest)).allowed
    }

    #[tokio::test]
    async fn a_blocked_name_sharing_an_address_with_an_allowed_one_keeps_it_blocked() {
        if !can_bind_53() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let (dns, rules) = example_dns(dir.path()).await;
        // The blocked name first, then an allowed one answered with the same address: the
        // later lookup does not launder the address.
        ask(&dns, 1, "secret.example.com.").await;
        ask(&dns, 2, "www.example.com.").await;
        assert!(!connect_allowed(&dns, &rules, "192.0.2.50:443"));
        assert_eq!(
            names(&dns, "192.0.2.50"),
            ["www.example.com", "secret.example.com"]
        );
        ask(&dns, 3, "other.example.com.").await;
        assert!(connect_allowed(&dns, &rules, "192.0.2.60:443"));
    }

    #[tokio::test]
    async fn a_cname_chain_through_a_blocked_name_binds_no_address() {
        if !can_bind_53() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let (dns, rules) = example_dns(dir.path()).await;
        let answer = ask(&dns, 1, "alias.example.com.").await;
        assert_eq!(answer.answers.len(), 2, "the executor gets the answer");
        assert!(!connect_allowed(&dns, &rules, "192.0.2.51:443"));
        assert_eq!(names(&dns, "192.0.2.51"), Vec::<String>::new());
    }

    /// A reload that adds a block rule naming a name a CNAME chain led through refuses a
    /// connect to the address that chain handed out before, though the name asked is still
    /// allowed: the chain is not kept, so every address handed out before the narrowing is
    /// refused until looked up again (and looked up again, the chain is screened anew).
    /// Before, the address stayed bound to the allowed name and the connect was allowed.
    #[tokio::test]
    async fn an_address_handed_out_before_a_narrowing_is_refused() {
        if !can_bind_53() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let mediation = mediation(example_upstream().await, dir.path());
        let narrowed = example_rules();
        let before = crate::destination::DestinationRules {
            block: Vec::new(),
            ..narrowed.clone()
        };
        let rules = Arc::new(Mutex::new(before.clone()));
        let judging = rules.clone();
        let judge: LookupJudge = Arc::new(move |_: Lookup| {
            let blocks = NameBlocks::of(&judging.lock().unwrap(), None);
            Box::pin(async move { LookupVerdict::Answered(blocks) })
        });
        let dns = ExecutorDns::start(&mediation, ExecutorId::default(), judge).unwrap();
        ask(&dns, 1, "alias.example.com.").await;
        assert!(connect_allowed(&dns, &before, "192.0.2.51:443"));
        // A connect whose names were looked at before the reload and judged after it (it
        // waited for the judge): refused by the count of the rules it is judged by.
        let to: SocketAddr = "192.0.2.51:443".parse().unwrap();
        let looked_at = dns.names_of(to);
        // The reload: the rules gain the block, then the count moves.
        *rules.lock().unwrap() = narrowed.clone();
        mediation.narrowings.add_one();
        let judged = crate::daemon::judged_destination(
            &flowhost_broker::Destination::Inet(to),
            &looked_at,
            mediation.narrowings.count(),
        );
        assert!(!narrowed.decide(Some(&judged)).allowed, "{judged:?}");
        assert!(!connect_allowed(&dns, &narrowed, "192.0.2.51:443"));
        assert_eq!(
            dns.names_of("192.0.2.51:443".parse().unwrap()),
            Naming::BeforeNarrowing("192.0.2.51:443".parse().unwrap())
        );
        // Looked up again, the chain meets the block: still refused.
        ask(&dns, 2, "alias.example.com.").await;
        assert!(!connect_allowed(&dns, &narrowed, "192.0.2.51:443"));
        // An address looked up since is judged as ever.
        ask(&dns, 3, "other.example.com.").await;
        assert!(connect_allowed(&dns, &narrowed, "192.0.2.60:443"));
    }

    /// `ip` as an answer hands it out for `ttl` seconds.
    fn handed(ip: &str, ttl: u32) -> [wire::AnswerAddress; 1] {
        [wire::AnswerAddress {
            ip: ip.parse().unwrap(),
            ttl,
        }]
    }

    fn host(n: &str) -> HostName {
        n.parse().unwrap()
    }

    /// Whether `rules` allow a connect to `addr` at `at`, judged with the names `book` holds
    /// for it then.
    fn book_allows(
        book: &AddressBook,
        rules: &crate::destination::DestinationRules,
        addr: &str,
        at: Instant,
    ) -> bool {
        let addr: SocketAddr = addr.parse().unwrap();
        let dest = crate::daemon::named_rules_destination(
            &flowhost_broker::Destination::Inet(addr),
            &book.names_at(addr, at, not_host),
        );
        rules.decide(Some(&dest)).allowed
    }

    /// No address is the host's own (the book's tests are about names and times).
    fn not_host(_: IpAddr) -> Option<PrivateScope> {
        None
    }

    /// A name whose answer bound an address that the host has taken since (a floating
    /// address moved to it, an interface came up) no longer judges a connect to it, unless
    /// `private_answers` opted it in, as at an answer that named the host's address already.
    /// Before, the binding made at the answer allowed the connect to the host for as long as
    /// the name was looked up again.
    #[test]
    fn an_address_the_host_took_after_the_answer_is_judged_as_the_hosts() {
        let now = Instant::now();
        let mut book = AddressBook::default();
        book.remember(
            &host("vip.test"),
            &[],
            &handed("203.0.113.5", 300),
            false,
            now,
        );
        book.remember(
            &host("own.test"),
            &[],
            &handed("203.0.113.6", 300),
            true,
            now,
        );
        let to = |ip: &str| format!("{ip}:80").parse::<SocketAddr>().unwrap();
        let taken = |ip: IpAddr| {
            ip.to_string()
                .starts_with("203.0.113.")
                .then_some(PrivateScope::Host)
        };
        assert_eq!(
            book.names_at(to("203.0.113.5"), now, not_host),
            [host("vip.test")]
        );
        assert!(book.names_at(to("203.0.113.5"), now, taken).is_empty());
        // An IPv4-mapped IPv6 destination reaches the same address.
        assert!(
            book.names_at(to("[::ffff:203.0.113.5]"), now, taken)
                .is_empty()
        );
        assert_eq!(
            book.names_at(to("203.0.113.6"), now, taken),
            [host("own.test")]
        );
        // Answered again without the opt-in (the configuration changed), the name loses it.
        book.remember(
            &host("own.test"),
            &[],
            &handed("203.0.113.6", 300),
            false,
            now,
        );
        assert!(book.names_at(to("203.0.113.6"), now, taken).is_empty());
        assert_eq!(
            book.names_at(to("203.0.113.6"), now, not_host),
            [host("own.test")]
        );
    }

    #[test]
    fn a_blocked_name_is_never_dropped_while_an_allowed_one_holds_its_address() {
        let rules = example_rules();
        let blocks = NameBlocks::of(&rules, None);
        let now = Instant::now();
        let secs = |s: u64| now + Duration::from_secs(s);
        let remember = |book: &mut AddressBook, name: &str, ttl: u32, at: Instant| {
            let name = host(name);
            book.remember(
                &name,
                &blocks.ports_naming(&name),
                &handed("192.0.2.50", ttl),
                false,
                at,
            )
        };
        // `secret` (blocked on 443) and `www` share an address; `secret`'s TTL runs out first.
        let mut book = AddressBook::default();
        remember(&mut book, "secret.example.com", 60, now);
        remember(&mut book, "www.example.com", 3600, now);
        assert!(!book_allows(&book, &rules, "192.0.2.50:443", secs(1)));
        assert!(
            !book_allows(&book, &rules, "192.0.2.50:443", secs(61)),
            "the block outlives the blocked name's TTL while www holds the address"
        );
        // Once every name has run out, the address goes, and address rules alone judge it.
        // It meets only the block rules it met: on another port it allows nothing.
        let s80: SocketAddr = "192.0.2.50:80".parse().unwrap();
        assert_eq!(
            book.names_at(s80, secs(61), not_host),
            [host("www.example.com")]
        );
        // Once every name has run out, the address goes, and address rules alone judge it.
        let s443: SocketAddr = "192.0.2.50:443".parse().unwrap();
        assert!(book.names_at(s443, secs(3601), not_host).is_empty());
        remember(&mut book, "other.example.com", 60, secs(3601));
        assert_eq!(
            book.names_at(s443, secs(3602), not_host),
            [host("other.example.com")]
        );

        // A full address still takes a blocked name (an allowed-only one makes way).
        let mut book = AddressBook::default();
        for i in 0..MAX_NAMES_PER_ADDRESS {
            assert!(remember(&mut book, &format!("n{i}.example.com"), 300, now).is_empty());
        }
        assert!(book_allows(&book, &rules, "192.0.2.50:443", secs(1)));
        assert!(remember(&mut book, "secret.example.com", 300, secs(1)).is_empty());
        assert!(
            !book_allows(&book, &rules, "192.0.2.50:443", secs(2)),
            "a blocked name always gets a place"
        );
        assert_eq!(
            book.names_at(s443, secs(2), not_host).len(),
            MAX_NAMES_PER_ADDRESS
        );
        // A full address of blocked names takes another only for a port not yet blocked.
        let mut book = AddressBook::default();
        let at = handed("192.0.2.50", 300);
        for i in 0..MAX_NAMES_PER_ADDRESS {
            assert!(
                book.remember(&host(&format!("b{i}.test")), &[443], &at, false, now)
                    .is_empty()
            );
        }
        let ip: IpAddr = "192.0.2.50".parse().unwrap();
        assert_eq!(
            book.remember(&host("late.test"), &[], &at, false, now),
            vec![ip]
        );
        assert_eq!(
            book.remember(&host("b99.test"), &[443], &at, false, now),
            vec![ip]
        );
        assert!(
            book.remember(&host("b98.test"), &[80], &at, false, now)
                .is_empty()
        );
        let s80: SocketAddr = "192.0.2.50:80".parse().unwrap();
        assert_eq!(
            book.names_at(s80, now, not_host).len(),
            MAX_NAMES_PER_ADDRESS + 1
        );
    }

    #[test]
    fn an_address_keeps_a_bounded_set_of_names_and_never_drops_one_for_a_newcomer() {
        let mut book = AddressBook::default();
        let now = Instant::now();
        let ip: IpAddr = "192.0.2.50".parse().unwrap();
        let to = SocketAddr::new(ip, 443);
        let at = handed("192.0.2.50", 300);
        assert!(
            book.remember(&host("secret.test"), &[], &at, false, now)
                .is_empty()
        );
        for i in 1..MAX_NAMES_PER_ADDRESS {
            let n = host(&format!("n{i}.test"));
            assert!(book.remember(&n, &[], &at, false, now).is_empty());
        }
        // Full: a newcomer is not remembered, and the first name stays.
        assert_eq!(
            book.remember(&host("late.test"), &[], &at, false, now),
            vec![ip]
        );
        let kept = book.names_at(to, now, not_host);
        assert_eq!(kept.len(), MAX_NAMES_PER_ADDRESS);
        assert!(kept.contains(&host("secret.test")));
        assert!(!kept.contains(&host("late.test")));
        // A name seen again moves to the front (the record names it first).
        assert!(
            book.remember(&host("secret.test"), &[], &at, false, now)
                .is_empty()
        );
        assert_eq!(book.names_at(to, now, not_host)[0].as_str(), "secret.test");
        // IPv4-mapped is the same address.
        book.remember(
            &host("n1.test"),
            &[],
            &handed("::ffff:192.0.2.50", 300),
            false,
            now,
        );
        assert_eq!(book.names_at(to, now, not_host)[0].as_str(), "n1.test");
        // Expired names make room.
        let later = now + Duration::from_secs(301);
        assert!(book.names_at(to, later, not_host).is_empty());
        assert!(
            book.remember(&host("late.test"), &[], &at, false, later)
                .is_empty()
        );
        assert_eq!(book.names_at(to, later, not_host), [host("late.test")]);
    }

    #[test]
    fn an_executors_book_holds_a_bounded_number_of_bindings_oldest_address_first() {
        let mut book = AddressBook::default();
        let now = Instant::now();
        let count = |book: &AddressBook| book.names.values().map(Vec::len).sum::<usize>();
        let addresses = MAX_BINDINGS / MAX_NAMES_PER_ADDRESS + 8;
        for a in 0..addresses {
            let at = handed(&format!("198.51.{}.{}", a / 256, a % 256), 300);
            for n in 0..MAX_NAMES_PER_ADDRESS {
                book.remember(&host(&format!("n{n}.a{a}.test")), &[], &at, false, now);
            }
            assert!(count(&book) <= MAX_BINDINGS, "{a}: {}", count(&book));
        }
        let first: SocketAddr = "198.51.0.0:443".parse().unwrap();
        let last = addresses - 1;
        let last: SocketAddr = format!("198.51.{}.{}:443", last / 256, last % 256)
            .parse()
            .unwrap();
        // The oldest addresses went, each with all its names; the newest keeps all of its.
        assert!(book.names_at(first, now, not_host).is_empty());
        assert_eq!(
            book.names_at(last, now, not_host).len(),
            MAX_NAMES_PER_ADDRESS
        );
        assert!(
            book.names
                .values()
                .all(|b| b.len() == MAX_NAMES_PER_ADDRESS)
        );
    }

    #[test]
    fn a_binding_lasts_its_answers_ttl_within_a_floor_and_a_cap() {
        let mut book = AddressBook::default();
        let now = Instant::now();
        let secs = |s: u64| now + Duration::from_secs(s);
        let live = |book: &AddressBook, ip: &str, at: Instant| {
            !book
                .names_at(format!("{ip}:443").parse().unwrap(), at, not_host)
                .is_empty()
        };
        book.remember(&host("zero.test"), &[], &handed("192.0.2.1", 0), false, now);
        book.remember(
            &host("five.test"),
            &[],
            &handed("192.0.2.2", 300),
            false,
            now,
        );
        book.remember(
            &host("long.test"),
            &[],
            &handed("192.0.2.3", 86_400),
            false,
            now,
        );
        assert!(live(&book, "192.0.2.1", secs(59)) && !live(&book, "192.0.2.1", secs(61)));
        assert!(live(&book, "192.0.2.2", secs(299)) && !live(&book, "192.0.2.2", secs(301)));
        assert!(live(&book, "192.0.2.3", secs(3599)) && !live(&book, "192.0.2.3", secs(3601)));
        // A later answer with a shorter TTL does not cut short what the executor was told.
        book.remember(
            &host("five.test"),
            &[],
            &handed("192.0.2.2", 0),
            false,
            secs(10),
        );
        assert!(live(&book, "192.0.2.2", secs(299)) && !live(&book, "192.0.2.2", secs(301)));
        // A later one with a longer TTL extends it.
        book.remember(
            &host("five.test"),
            &[],
            &handed("192.0.2.2", 600),
            false,
            secs(200),
        );
        assert!(live(&book, "192.0.2.2", secs(799)) && !live(&book, "192.0.2.2", secs(801)));
    }

    #[tokio::test]
    async fn only_address_and_service_record_types_are_served() {
        if !can_bind_53() {
            return;
        }
        let (up, asked) = upstream_answering(|name, r| {
            r.add_answer(a(name, [192, 0, 2, 7]));
        })
        .await;
        let dir = tempfile::tempdir().unwrap();
        let mediation = mediation(up, dir.path());
        let judged = Arc::new(Mutex::new(Vec::new()));
        let log = judged.clone();
        let judge: LookupJudge = Arc::new(move |l: Lookup| {
            log.lock().unwrap().push(
                l.record_type()
                    .map_or_else(|| "(not served)".to_string(), |t| t.to_string()),
            );
            Box::pin(async { LookupVerdict::Answered(NameBlocks::default()) })
        });
        let dns = ExecutorDns::start(&mediation, ExecutorId::default(), judge).unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        client.connect(dns.address()).await.unwrap();
        use hickory_proto::rr::RecordType as T;
        let mut buf = [0u8; 4096];
        for (id, (rtype, served)) in [
            (T::A, true),
            (T::AAAA, true),
            (T::CNAME, true),
            (T::HTTPS, true),
            (T::SVCB, true),
            (T::TXT, false),
            (T::MX, false),
            (T::NULL, false),
            (T::ANY, false),
            (T::Unknown(65_280), false),
        ]
        .into_iter()
        .enumerate()
        {
            let name = format!("q{id}.test.");
            let q = wire::tests::typed_query(id as u16, &name, rtype);
            client.send(&q).await.unwrap();
            let n = client.recv(&mut buf).await.unwrap();
            let answer = Message::from_vec(&buf[..n]).unwrap();
            let upstream_saw = asked.lock().unwrap().iter().any(|(n, _)| *n == name);
            if served {
                assert_eq!(
                    answer.metadata.response_code,
                    ResponseCode::NoError,
                    "{rtype}"
                );
                assert!(upstream_saw, "{rtype}");
            } else {
                assert_eq!(
                    answer.metadata.response_code,
                    ResponseCode::Refused,
                    "{rtype}"
                );
                assert!(answer.answers.is_empty(), "{rtype}");
                assert!(!upstream_saw, "{rtype}: its bits never leave the host");
            }
        }
        // Every query is judged (and so recorded), with its type.
        assert_eq!(
            *judged.lock().unwrap(),
            [
                "A",
                "AAAA",
                "CNAME",
                "HTTPS",
                "SVCB",
                "TXT",
                "MX",
                "NULL",
                "ANY",
                "TYPE65280"
            ]
        );
    }

    #[tokio::test]
    async fn a_resolver_outlives_running_out_of_descriptors_or_buffers() {
        let owner = ExecutorId::default();
        let at: SocketAddr = "127.53.0.1:53".parse().unwrap();
        let mut failures = 0;
        for errno in [
            libc::EMFILE,
            libc::ENFILE,
            libc::ENOBUFS,
            libc::ENOMEM,
            libc::ECONNABORTED,
        ] {
            let e = std::io::Error::from_raw_os_error(errno);
            let started = Instant::now();
            assert!(survive(&owner, at, "tcp", &e, &mut failures).await, "{e}");
            assert!(
                started.elapsed() >= Duration::from_millis(50),
                "{e}: backs off"
            );
        }
        assert_eq!(failures, 5);
        // The pause grows with failures in a row, up to its cap.
        assert_eq!(backoff(0), FIRST_BACKOFF);
        assert_eq!(backoff(1), FIRST_BACKOFF * 2);
        assert_eq!(backoff(40), MAX_BACKOFF);
        assert_eq!(backoff(u32::MAX), MAX_BACKOFF);
        // Anything else stops the resolver (its socket is gone), said in the log.
        let e = std::io::Error::from_raw_os_error(libc::EBADF);
        assert!(!survive(&owner, at, "udp", &e, &mut failures).await);
    }

    #[test]
    fn private_scopes_cover_what_reaches_the_host_its_link_and_its_networks() {
        use PrivateScope::*;
        for (ip, scope) in [
            ("0.0.0.0", Some(Unspecified)),
            ("0.1.2.3", Some(Reserved)),
            ("127.0.0.53", Some(Loopback)),
            ("169.254.169.254", Some(LinkLocal)),
            ("10.0.0.1", Some(Private)),
            ("172.16.0.1", Some(Private)),
            ("172.31.255.255", Some(Private)),
            ("192.168.1.1", Some(Private)),
            ("100.64.0.1", Some(SharedAddressSpace)),
            ("100.127.255.255", Some(SharedAddressSpace)),
            ("224.0.0.251", Some(Multicast)),
            ("239.255.255.250", Some(Multicast)),
            ("240.0.0.1", Some(Reserved)),
            ("255.255.255.255", Some(Reserved)),
            ("::", Some(Unspecified)),
            ("::1", Some(Loopback)),
            ("::ffff:169.254.169.254", Some(LinkLocal)),
            ("::ffff:10.0.0.1", Some(Private)),
            // IPv4-compatible: as the IPv4 address it carries (a `sit` tunnel sends it there).
            ("::10.0.0.1", Some(Private)),
            ("::a9fe:a9fe", Some(LinkLocal)),
            ("64:ff9b::a9fe:a9fe", Some(LinkLocal)),
            ("64:ff9b::7f00:1", Some(Loopback)),
            ("2002:a00:1::1", Some(Private)),
            ("fe80::1", Some(LinkLocal)),
            ("fec0::1", Some(Reserved)),
            ("fd00::1", Some(UniqueLocal)),
            ("fc00::1", Some(UniqueLocal)),
            ("ff02::1", Some(Multicast)),
            ("192.0.0.1", Some(Reserved)),
            ("198.18.0.1", Some(Reserved)),
            ("198.19.255.255", Some(Reserved)),
            ("64:ff9b:1::a9fe:a9fe", Some(Private)),
            ("64:ff9b:1:ffff::808:808", Some(Private)),
            ("::ffff:0:a9fe:a9fe", Some(LinkLocal)),
            ("::ffff:0:7f00:1", Some(Loopback)),
            ("2001::1", Some(Reserved)),
            ("2001:0:4136:e378:8000:63bf:3fff:fdd2", Some(Reserved)),
            ("168.63.129.16", Some(Platform)),
            ("::ffff:168.63.129.16", Some(Platform)),
            ("168.63.129.17", None),
            ("192.0.1.1", None),
            ("198.20.0.1", None),
            ("198.17.255.255", None),
            ("::ffff:0:808:808", None),
            // IPv4-compatible (`::/96`, reserved) even when what it carries is public.
            ("::808:808", Some(Reserved)),
            ("64:ff9b:2::1", None),
            ("2606:4700::1111", None),
            // Public ones (documentation ranges stand in for them).
            ("192.0.2.7", None),
            ("172.32.0.1", None),
            ("100.128.0.1", None),
            ("8.8.8.8", None),
            ("2001:db8::1", None),
            ("64:ff9b::808:808", None),
            ("2002:808:808::1", None),
        ] {
            assert_eq!(private_scope(ip.parse().unwrap()), scope, "{ip}");
        }
    }

    #[test]
    fn a_private_answer_binds_only_where_every_name_on_its_chain_opts_in() {
        let answer = |chain: &[&str]| wire::Answer {
            bytes: Vec::new(),
            addresses: handed("169.254.169.254", 60).to_vec(),
            chain: chain.iter().map(|c| host(c)).collect(),
        };
        let opted: Vec<NamePattern> = ["app.corp.internal", "*.svc.internal"]
            .iter()
            .map(|p| p.parse().unwrap())
            .collect();
        let blocks = NameBlocks::default();
        let bound = |name: &str, chain: &[&str]| {
            let (bound, _) = screen(&host(name), &answer(chain), &opted, |_| None, &blocks);
            !bound.is_empty()
        };
        assert!(bound("app.corp.internal", &[]));
        assert!(bound("app.corp.internal", &["db.svc.internal"]));
        assert!(
            !bound("app.corp.internal", &["x.vendor-cdn.com"]),
            "a CNAME out of the opted-in names does not carry the opt-in with it"
        );
        assert!(!bound(
            "app.corp.internal",
            &["db.svc.internal", "x.vendor-cdn.com"]
        ));
        assert!(!bound("other.corp.internal", &["db.svc.internal"]));
    }

    /// An answer of thousands of addresses (the executor's own zone, over TCP) binds at most
    /// [`MAX_ADDRESSES_PER_ANSWER`] of them, and looks at no more: the rest are withheld in
    /// one entry that counts them. Before, each was looked at on the runtime's thread, and
    /// the executor's whole address book was flushed.
    #[test]
    fn an_answer_binds_at_most_its_first_addresses() {
        let addresses: Vec<wire::AnswerAddress> = (0..4000u32)
            .map(|i| wire::AnswerAddress {
                ip: IpAddr::V4(Ipv4Addr::from(0xc633_6400 + i)),
                ttl: 60,
            })
            .collect();
        let answer = wire::Answer {
            bytes: Vec::new(),
            addresses,
            chain: Vec::new(),
        };
        let looked = std::sync::atomic::AtomicUsize::new(0);
        let (bound, withheld) = screen(
            &host("many.test"),
            &answer,
            &[],
            |_| {
                looked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                None
            },
            &NameBlocks::default(),
        );
        assert_eq!(bound.len(), MAX_ADDRESSES_PER_ANSWER);
        assert_eq!(looked.into_inner(), MAX_ADDRESSES_PER_ANSWER);
        assert_eq!(withheld.len(), 1);
        assert_eq!(
            withheld[0].1,
            Withheld::PastLimit {
                more: 4000 - MAX_ADDRESSES_PER_ANSWER - 1
            }
        );
    }

    #[test]
    fn the_hosts_own_addresses_are_private_in_any_form() {
        let host: Vec<IpAddr> = ["203.0.113.5", "2001:db8::5"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        for (ip, scope) in [
            ("203.0.113.5", Some(PrivateScope::Host)),
            ("::ffff:203.0.113.5", Some(PrivateScope::Host)),
            ("::ffff:0:cb00:7105", Some(PrivateScope::Host)),
            ("64:ff9b::cb00:7105", Some(PrivateScope::Host)),
            ("2002:cb00:7105::1", Some(PrivateScope::Host)),
            ("2001:db8::5", Some(PrivateScope::Host)),
            ("10.0.0.1", Some(PrivateScope::Private)),
            ("203.0.113.6", None),
            ("2001:db8::6", None),
        ] {
            assert_eq!(
                scope_on(ip.parse().unwrap(), |a| host
                    .contains(&a)
                    .then_some(PrivateScope::Host)),
                scope,
                "{ip}"
            );
        }
        // Asked of the host itself: loopback is always its own; a documentation address
        // never is.
        assert!(is_host_address(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        // Where any address binds, the interfaces are asked (see the broker's tests).
        let nonlocal = std::fs::read_to_string("/proc/sys/net/ipv4/ip_nonlocal_bind")
            .is_ok_and(|v| v.trim() != "0");
        if nonlocal {
            eprintln!("SKIP: net.ipv4.ip_nonlocal_bind is set: any address binds here");
        } else {
            assert!(!is_host_address("192.0.2.77".parse().unwrap()));
        }
    }

    /// Whether 198.51.100.0/24 is one of the host's connected networks, in
    /// [`an_answer_naming_a_neighbour_of_the_host_binds_it_to_no_name`].
    static ATTACHED: AtomicBool = AtomicBool::new(false);

    /// A host with no public address of its own, attached to 198.51.100.0/24 while
    /// [`ATTACHED`] says so.
    const NEIGHBOURED: HostSide = HostSide {
        is_host: |_| false,
        on_link: |ip| {
            ATTACHED.load(Ordering::SeqCst)
                && matches!(ip, IpAddr::V4(v4) if v4.octets()[..3] == [198, 51, 100])
        },
    };

    #[test]
    fn a_neighbour_of_the_host_is_private_in_any_form() {
        let host = HostSide {
            is_host: |ip| ip == IpAddr::V4(Ipv4Addr::new(203, 0, 113, 5)),
            on_link: |ip| matches!(ip, IpAddr::V4(v4) if v4.octets()[..3] == [203, 0, 113]),
        };
        for (ip, scope) in [
            ("203.0.113.9", Some(PrivateScope::OnLink)),
            ("::ffff:203.0.113.9", Some(PrivateScope::OnLink)),
            ("64:ff9b::cb00:7109", Some(PrivateScope::OnLink)),
            // The host's own address is on its link too; it is named for what it is.
            ("203.0.113.5", Some(PrivateScope::Host)),
            ("10.0.0.1", Some(PrivateScope::Private)),
            ("198.51.100.9", None),
        ] {
            assert_eq!(
                scope_on(ip.parse().unwrap(), |a| host.scope(a)),
                scope,
                "{ip}"
            );
        }
        assert_eq!(PrivateScope::OnLink.as_str(), "on_link");
    }

    /// Before, only the special ranges and the host's own addresses were screened: a
    /// wildcard host-name rule reached whichever neighbour of the host (a public subnet it
    /// is attached to) the name's zone answered with. Now such an answer binds the address
    /// to no name unless `private_answers` opts in; and a network the host is attached to
    /// after an answer counts at the next connect, as the host's own addresses do.
    #[tokio::test]
    async fn an_answer_naming_a_neighbour_of_the_host_binds_it_to_no_name() {
        if !can_bind_53() {
            return;
        }
        let (up, _) = upstream_answering(|name, r| {
            let ip = match name {
                "neighbour.test." => [198, 51, 100, 7],
                _ => [198, 51, 100, 8],
            };
            r.add_answer(a(name, ip));
        })
        .await;
        let dir = tempfile::tempdir().unwrap();
        let mediation = DnsMediation {
            host: NEIGHBOURED,
            ..mediation(up, dir.path())
        };
        let dns = ExecutorDns::start(&mediation, ExecutorId::default(), allow_all()).unwrap();
        ask(&dns, 1, "later.test.").await;
        assert_eq!(names(&dns, "198.51.100.8"), ["later.test"]);

        ATTACHED.store(true, Ordering::SeqCst);
        let answer = ask(&dns, 2, "neighbour.test.").await;
        // The executor still gets the answer: only the host-name binding is withheld.
        assert_eq!(answer.answers.len(), 1);
        assert_eq!(names(&dns, "198.51.100.7"), Vec::<String>::new());
        assert_eq!(
            names(&dns, "198.51.100.8"),
            Vec::<String>::new(),
            "bound before the host was attached to its network"
        );
        drop(dns);

        let mediation = DnsMediation {
            private_answers: Arc::from(["neighbour.test".parse().unwrap()]),
            ..mediation
        };
        let dns = ExecutorDns::start(&mediation, ExecutorId::default(), allow_all()).unwrap();
        ask(&dns, 3, "neighbour.test.").await;
        assert_eq!(names(&dns, "198.51.100.7"), ["neighbour.test"]);
    }

    fn can_bind_53() -> bool {
        let root = nix::unistd::geteuid().is_root();
        if !root {
            eprintln!("SKIP: binding port 53 needs root (CI runs as root)");
        }
        root
    }

    /// A query the resolver does not serve (two questions in one, class CH) is refused
    /// without being asked upstream, as before, and now goes to the judge too, which records
    /// it, whatever it says: before, it was logged at debug and left no record.
    #[tokio::test]
    async fn a_query_not_served_is_judged_for_its_record_and_refused() {
        if !can_bind_53() {
            return;
        }
        let (up, asked) = upstream().await;
        let dir = tempfile::tempdir().unwrap();
        let judged = Arc::new(Mutex::new(Vec::new()));
        let log = judged.clone();
        let judge: LookupJudge = Arc::new(move |l: Lookup| {
            log.lock().unwrap().push(l.asked.clone());
            // An allowing judge changes nothing for a query not served.
            Box::pin(async { LookupVerdict::Answered(NameBlocks::default()) })
        });
        let dns =
            ExecutorDns::start(&mediation(up, dir.path()), ExecutorId::default(), judge).unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        client.connect(dns.address()).await.unwrap();
        let mut two = Message::from_vec(&wire::tests::query(21, "known.test.")).unwrap();
        two.add_query(hickory_proto::op::Query::query(
            Name::from_str("other.test.").unwrap(),
            hickory_proto::rr::RecordType::A,
        ));
        let mut chaos = Message::from_vec(&wire::tests::query(22, "version.bind.")).unwrap();
        let mut q = chaos.queries[0].clone();
        q.set_query_class(hickory_proto::rr::DNSClass::CH);
        chaos.queries = vec![q];
        for (query, code) in [(two, ResponseCode::FormErr), (chaos, ResponseCode::Refused)] {
            client.send(&query.to_vec().unwrap()).await.unwrap();
            let mut buf = [0u8; 2048];
            let n = tokio::time::timeout(std::time::Duration::from_secs(5), client.recv(&mut buf))
                .await
                .unwrap()
                .unwrap();
            let answer = Message::from_vec(&buf[..n]).unwrap();
            assert_eq!(answer.metadata.response_code, code);
            assert!(answer.answers.is_empty());
        }
        let judged = judged.lock().unwrap().clone();
        assert_eq!(
            judged,
            [
                Asked::Unserved {
                    why: "2 questions in one query".into()
                },
                Asked::Unserved {
                    why: "class CH (only IN is answered)".into()
                },
            ]
        );
        assert_eq!(asked.lock().unwrap().len(), 0, "never asked upstream");
    }

    #[tokio::test]
    async fn answers_allowed_names_over_udp_and_tcp_and_refuses_the_rest() {
        if !can_bind_53() {
            return;
        }
        let (up, asked) = upstream().await;
        let dir = tempfile::tempdir().unwrap();
        let mediation = mediation(up, dir.path());
        let judged = Arc::new(Mutex::new(Vec::new()));
        let log = judged.clone();
        let judge: LookupJudge = Arc::new(move |l: Lookup| {
            log.lock().unwrap().push((
                l.name()
                    .map_or_else(|| "(not served)".to_string(), |n| n.to_string()),
                l.transport,
            ));
            let verdict = if l.name().is_some_and(|n| n.as_str() == "known.test") {
                LookupVerdict::Answered(NameBlocks::default())
            } else {
                LookupVerdict::Refused
            };
            Box::pin(async move { verdict })
        });
        let dns = ExecutorDns::start(&mediation, ExecutorId::default(), judge).unwrap();
        let conf = std::fs::read_to_string(dns.resolv_conf()).unwrap();
        assert!(
            conf.contains(&format!("nameserver {}", dns.address().ip())),
            "{conf}"
        );
        assert!(dns.is_resolver(&dns.address()));
        assert!(names(&dns, "192.0.2.7").is_empty());

        // UDP, from a connected socket as glibc does: the answer comes from the resolver,
        // under the query's id. The query carries a record of its own and an EDNS option:
        // only its question is asked upstream.
        let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        client.connect(dns.address()).await.unwrap();
        let mut smuggling = Message::from_vec(&wire::tests::query(11, "known.test.")).unwrap();
        let mut edns = hickory_proto::op::Edns::new();
        edns.options_mut()
            .insert(hickory_proto::rr::rdata::opt::EdnsOption::Unknown(
                65001,
                b"secret".to_vec(),
            ));
        smuggling.set_edns(edns);
        smuggling.add_additional(Record::from_rdata(
            Name::from_str("secret.invalid.").unwrap(),
            60,
            RData::A(A::new(10, 0, 0, 1)),
        ));
        client.send(&smuggling.to_vec().unwrap()).await.unwrap();
        let mut buf = [0u8; 2048];
        let n = client.recv(&mut buf).await.unwrap();
        let answer = Message::from_vec(&buf[..n]).unwrap();
        assert_eq!(answer.metadata.id, 11);
        assert_eq!(answer.answers.len(), 1);
        assert_eq!(names(&dns, "192.0.2.7"), ["known.test"]);

        // TCP, length-prefixed: a refused name gets NXDOMAIN and is never asked upstream.
        let mut tcp = TcpStream::connect(dns.address()).await.unwrap();
        let q = wire::tests::query(12, "secret.other.test.");
        tcp.write_all(&(q.len() as u16).to_be_bytes())
            .await
            .unwrap();
        tcp.write_all(&q).await.unwrap();
        let mut len = [0u8; 2];
        tcp.read_exact(&mut len).await.unwrap();
        let mut answer = vec![0u8; usize::from(u16::from_be_bytes(len))];
        tcp.read_exact(&mut answer).await.unwrap();
        let answer = Message::from_vec(&answer).unwrap();
        assert_eq!(answer.metadata.id, 12);
        assert_eq!(answer.metadata.response_code, ResponseCode::NXDomain);
        assert_eq!(
            *asked.lock().unwrap(),
            vec![("known.test.".to_string(), false)],
            "only the allowed name reached the upstream resolver, and nothing but its question"
        );
        assert_eq!(
            *judged.lock().unwrap(),
            vec![
                ("known.test".to_string(), "udp"),
                ("secret.other.test".to_string(), "tcp")
            ]
        );
        let path = dns.resolv_conf().to_path_buf();
        drop(dns);
        assert!(!path.exists(), "the resolv.conf goes with the executor");
    }
}
