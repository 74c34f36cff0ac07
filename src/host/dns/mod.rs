//! DNS mediation: each executor with a network path gets a resolver of its own, on a
//! loopback address (`127.53.x.y`, port 53) the host binds for it and writes into the
//! `/etc/resolv.conf` of the executor's view. Whatever the executor's resolver library
//! does (glibc's connected UDP sockets and parallel A/AAAA over `sendmmsg`, c-ares checking
//! that a reply comes from the server it asked, a retry over TCP), its queries reach that
//! address, and the answers come from it.
//!
//! Every query is judged and recorded by the judge ([`LookupJudge`]): a name no rule allows
//! is answered NXDOMAIN; an allowed one is asked of the host's upstream resolvers (once its
//! record is durable) and the answer passed on. The addresses handed out are remembered per executor
//! ([`ExecutorDns::name_of`]), so a later connect to one is judged against host-name rules,
//! and its record carries the name. The sends that reach this resolver are the host talking
//! to itself: they are allowed without an egress record (the lookup is what is judged).
//!
//! The address is the attribution: only this executor's lookups arrive at it (other
//! executors' sends to it are egress like any other, and no rule names it).

pub mod upstream;
pub mod wire;

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use hickory_proto::op::ResponseCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

use crate::destination::{HostName, canonical_ip};
pub use upstream::Upstream;

/// The port every executor resolver listens on (resolv.conf cannot name another).
pub const DNS_PORT: u16 = crate::destination::RESOLVER_PORT;
/// Most addresses remembered per executor; past it the oldest half is forgotten (a later
/// connect to a forgotten address is judged by address rules alone).
const MAX_REMEMBERED: usize = 4096;
/// Queries (and TCP connections) one executor's resolver handles at once; past it, UDP
/// queries are dropped (the client library retries) and TCP connections closed, so an
/// executor cannot make the host hold unbounded work.
const IN_FLIGHT: usize = 32;
/// Longest wait for a TCP client's next query, for the rest of one, or for it to take an
/// answer.
const TCP_IDLE: std::time::Duration = std::time::Duration::from_secs(10);

/// Why an executor's resolver could not be set up (the executor is not started).
#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    /// No loopback address in 127.53.0.0/16 was free on port 53, or binding failed.
    #[error(
        "cannot bind the executor's resolver on a 127.53.x.y:53 address: {0} (binding port 53 needs root or CAP_NET_BIND_SERVICE)"
    )]
    Bind(std::io::Error),
    /// The executor's resolv.conf could not be written.
    #[error("cannot write the executor's resolver configuration in {dir}: {source}")]
    Write {
        /// The directory.
        dir: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

impl DnsError {
    /// Whether binding failed for want of the right to bind port 53 (an unprivileged host).
    pub fn permission_denied(&self) -> bool {
        matches!(self, DnsError::Bind(e) if e.kind() == std::io::ErrorKind::PermissionDenied)
    }
}

/// One lookup an executor made, as the judge sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lookup {
    /// The name.
    pub name: HostName,
    /// The record type (`A`, `AAAA`, ...).
    pub record_type: String,
    /// `udp` or `tcp`.
    pub transport: &'static str,
    /// The query's size in bytes.
    pub bytes: usize,
    /// The resolver address the executor asked.
    pub resolver: SocketAddr,
}

/// Decides a lookup (recording it, answered or refused) and says whether it may be answered.
pub type LookupJudge =
    Arc<dyn Fn(Lookup) -> Pin<Box<dyn Future<Output = bool> + Send>> + Send + Sync>;

/// The host-wide DNS mediation settings.
#[derive(Debug, Clone)]
pub struct DnsMediation {
    /// Where allowed names are asked.
    pub upstream: Arc<Upstream>,
    /// Where the executors' resolv.conf files are written (read by the broker's bind mount,
    /// as root, before the executor runs).
    pub dir: PathBuf,
}

/// Remembered answers: which name each handed-out address was the answer for.
#[derive(Debug, Default)]
struct AddressBook {
    names: HashMap<IpAddr, HostName>,
    order: Vec<IpAddr>,
}

impl AddressBook {
    fn remember(&mut self, name: &HostName, addresses: &[IpAddr]) {
        for ip in addresses.iter().map(|ip| canonical_ip(*ip)) {
            if self.names.insert(ip, name.clone()).is_none() {
                self.order.push(ip);
            }
        }
        if self.order.len() > MAX_REMEMBERED {
            let forget: Vec<IpAddr> = self.order.drain(..MAX_REMEMBERED / 2).collect();
            for ip in forget {
                self.names.remove(&ip);
            }
        }
    }
}

/// One executor's resolver: its address, the answers it handed out, and the tasks serving
/// it (stopped when this is dropped, as is its resolv.conf file).
pub struct ExecutorDns {
    address: SocketAddr,
    book: Arc<Mutex<AddressBook>>,
    conf: tempfile::NamedTempFile,
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
    pub fn start(mediation: &DnsMediation, judge: LookupJudge) -> Result<ExecutorDns, DnsError> {
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
            upstream: mediation.upstream.clone(),
            judge,
            book: book.clone(),
            in_flight: Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT)),
        });
        let tasks = vec![
            tokio::spawn(serve_udp(server.clone(), Arc::new(udp))),
            tokio::spawn(serve_tcp(server, tcp)),
        ];
        Ok(ExecutorDns {
            address,
            book,
            conf,
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

    /// The name this executor's lookup got `ip` as an answer for, if any.
    pub fn name_of(&self, ip: IpAddr) -> Option<HostName> {
        self.book.lock().ok()?.names.get(&canonical_ip(ip)).cloned()
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
        spec.bind_files
            .push((self.resolv_conf().to_path_buf(), shown.clone()));
        spec.read_paths.push(shown);
        Ok(())
    }
}

/// What an executor's attempt is to its resolver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptView {
    /// A lookup reaching the executor's own resolver: the host talking to itself, allowed
    /// without judgment (the lookup is what is judged).
    ToResolver,
    /// Anything else, with the name the executor's lookup got its address as an answer
    /// for, if any (judged against host-name rules with it, and recorded with it).
    Egress(Option<HostName>),
}

/// How `info` stands with the executor's resolver `dns` (`None`: lookups not mediated).
/// Binding or listening on the resolver's address is not reaching it, and is judged.
pub fn attempt_view(dns: Option<&ExecutorDns>, info: &flowhost_broker::AttemptInfo) -> AttemptView {
    let (Some(dns), Some(flowhost_broker::Destination::Inet(addr))) = (dns, &info.destination)
    else {
        return AttemptView::Egress(None);
    };
    let reaches = !matches!(
        info.syscall,
        flowhost_broker::EgressSyscall::Bind | flowhost_broker::EgressSyscall::Listen
    );
    if reaches && dns.is_resolver(addr) {
        AttemptView::ToResolver
    } else {
        AttemptView::Egress(dns.name_of(addr.ip()))
    }
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
    upstream: Arc<Upstream>,
    judge: LookupJudge,
    book: Arc<Mutex<AddressBook>>,
    in_flight: Arc<tokio::sync::Semaphore>,
}

impl Server {
    /// The answer to one query (`None`: nothing can be answered).
    async fn answer(&self, query: &[u8], transport: &'static str) -> Option<Vec<u8>> {
        let q = match wire::question(query) {
            Ok(q) => q,
            Err(wire::WireError::Undecodable) => return None,
            Err(wire::WireError::Unserved { answer, why }) => {
                tracing::debug!(resolver = %self.address, why, "DNS query not served");
                return Some(answer);
            }
        };
        let lookup = Lookup {
            name: q.name.clone(),
            record_type: q.record_type.clone(),
            transport,
            bytes: query.len(),
            resolver: self.address,
        };
        if !(self.judge)(lookup).await {
            return Some(wire::refusal(query, ResponseCode::NXDomain));
        }
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
        match self.upstream.ask(&asked, id).await {
            Ok(response) => match wire::answer(&q, &response, id) {
                Ok(answer) => {
                    if let Ok(mut book) = self.book.lock() {
                        book.remember(&q.name, &answer.addresses);
                    }
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

async fn serve_udp(server: Arc<Server>, sock: Arc<UdpSocket>) {
    let mut buf = vec![0u8; 65535];
    // Owned here, so the queries in flight end with the resolver (this task is aborted
    // when its executor's resolver is dropped).
    let mut queries = tokio::task::JoinSet::new();
    loop {
        let Ok((n, from)) = sock.recv_from(&mut buf).await else {
            return;
        };
        while queries.try_join_next().is_some() {}
        let Ok(permit) = server.in_flight.clone().try_acquire_owned() else {
            continue;
        };
        let query = buf[..n].to_vec();
        let (server, sock) = (server.clone(), sock.clone());
        // Each query on its own: glibc sends A and AAAA together and waits for both.
        queries.spawn(async move {
            let _permit = permit;
            if let Some(answer) = server.answer(&query, "udp").await {
                let _ = sock.send_to(&answer, from).await;
            }
        });
    }
}

async fn serve_tcp(server: Arc<Server>, listener: TcpListener) {
    let mut clients = tokio::task::JoinSet::new();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        while clients.try_join_next().is_some() {}
        let Ok(permit) = server.in_flight.clone().try_acquire_owned() else {
            continue;
        };
        let server = server.clone();
        clients.spawn(async move {
            let _permit = permit;
            serve_tcp_client(server, stream).await;
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

    /// What the upstream resolver got of one query: the name, and whether anything but the
    /// question came with it (extra records, EDNS options).
    type Asked = Arc<Mutex<Vec<(String, bool)>>>;

    /// An upstream resolver on loopback: `known.test` is 192.0.2.7, every other name
    /// NXDOMAIN; it keeps what it got of each query.
    async fn upstream() -> (SocketAddr, Asked) {
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
                if name == "known.test." {
                    r.add_answer(Record::from_rdata(
                        Name::from_str("known.test.").unwrap(),
                        60,
                        RData::A(A::new(192, 0, 2, 7)),
                    ));
                } else {
                    r.metadata.response_code = ResponseCode::NXDomain;
                }
                let _ = sock.send_to(&r.to_vec().unwrap(), from).await;
            }
        });
        (addr, asked)
    }

    fn can_bind_53() -> bool {
        let root = nix::unistd::geteuid().is_root();
        if !root {
            eprintln!("SKIP: binding port 53 needs root (CI runs as root)");
        }
        root
    }

    #[tokio::test]
    async fn answers_allowed_names_over_udp_and_tcp_and_refuses_the_rest() {
        if !can_bind_53() {
            return;
        }
        let (up, asked) = upstream().await;
        let dir = tempfile::tempdir().unwrap();
        let mediation = DnsMediation {
            upstream: Arc::new(Upstream::new(vec![up])),
            dir: dir.path().to_path_buf(),
        };
        let judged = Arc::new(Mutex::new(Vec::new()));
        let log = judged.clone();
        let judge: LookupJudge = Arc::new(move |l: Lookup| {
            log.lock().unwrap().push((l.name.to_string(), l.transport));
            let allowed = l.name.as_str() == "known.test";
            Box::pin(async move { allowed })
        });
        let dns = ExecutorDns::start(&mediation, judge).unwrap();
        let conf = std::fs::read_to_string(dns.resolv_conf()).unwrap();
        assert!(
            conf.contains(&format!("nameserver {}", dns.address().ip())),
            "{conf}"
        );
        assert!(dns.is_resolver(&dns.address()));
        assert_eq!(dns.name_of("192.0.2.7".parse().unwrap()), None);

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
        assert_eq!(
            dns.name_of("192.0.2.7".parse().unwrap())
                .map(|n| n.to_string()),
            Some("known.test".into())
        );

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
