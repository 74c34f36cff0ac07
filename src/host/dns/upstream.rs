//! The host's own resolvers: where the mediator asks the names it allows. Configurable
//! (`[host] dns_upstream`), by default the `nameserver` lines of the host's
//! `/etc/resolv.conf`.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};

use super::wire;

/// How long one upstream server has to answer one query.
const PER_SERVER: Duration = Duration::from_secs(2);

/// The upstream resolvers, tried in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    servers: Vec<SocketAddr>,
}

impl Upstream {
    /// These servers, in order (empty: every lookup fails with SERVFAIL).
    pub fn new(servers: Vec<SocketAddr>) -> Upstream {
        Upstream { servers }
    }

    /// The `nameserver` lines of a resolv.conf file (port 53). A file that cannot be read
    /// gives no servers: lookups then fail (SERVFAIL), and the reason is logged.
    pub fn from_resolv_conf(path: &Path) -> Upstream {
        match std::fs::read_to_string(path) {
            Ok(text) => Upstream::new(parse_resolv_conf(&text)),
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "cannot read the host's resolver configuration; executors' lookups will fail");
                Upstream::new(Vec::new())
            }
        }
    }

    /// The servers.
    pub fn servers(&self) -> &[SocketAddr] {
        &self.servers
    }

    /// Asks `query` of each server in turn until one answers; over TCP when the UDP answer
    /// is truncated. Over UDP, only a datagram for which `is_answer` holds is the answer:
    /// any other (a late answer to an earlier query, a forged one naming another question)
    /// is passed over, and neither ends the wait nor sends the query over TCP.
    pub async fn ask(
        &self,
        query: &[u8],
        is_answer: impl Fn(&[u8]) -> bool,
    ) -> Result<Vec<u8>, String> {
        let mut why = String::from("no upstream resolver is configured");
        for server in &self.servers {
            let answer = async {
                let udp = ask_udp(*server, query, &is_answer).await?;
                if wire::truncated(&udp) {
                    ask_tcp(*server, query).await
                } else {
                    Ok(udp)
                }
            };
            match tokio::time::timeout(PER_SERVER, answer).await {
                Ok(Ok(a)) => return Ok(a),
                Ok(Err(e)) => why = format!("{server}: {e}"),
                Err(_) => why = format!("{server}: no answer within {PER_SERVER:?}"),
            }
        }
        Err(why)
    }
}

fn parse_resolv_conf(text: &str) -> Vec<SocketAddr> {
    text.lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            (words.next() == Some("nameserver"))
                .then(|| words.next())
                .flatten()
                .and_then(nameserver)
        })
        .collect()
}

/// A `nameserver` address, port 53. A scoped IPv6 address (`fe80::1%eth0`, as
/// NetworkManager writes a router's link-local resolver) keeps its scope: without it, a
/// link-local address cannot be reached (EINVAL at connect) and every lookup would fail. A
/// scope naming no interface drops the line, saying so.
fn nameserver(word: &str) -> Option<SocketAddr> {
    let (address, scope) = match word.split_once('%') {
        Some((address, scope)) => (address, Some(scope)),
        None => (word, None),
    };
    let ip = address.parse::<IpAddr>().ok()?;
    let (IpAddr::V6(v6), Some(scope)) = (ip, scope) else {
        return Some(SocketAddr::new(ip, 53));
    };
    let scope_id = match scope.parse::<u32>() {
        Ok(index) => index,
        Err(_) => match nix::net::if_::if_nametoindex(scope) {
            Ok(index) => index,
            Err(e) => {
                tracing::warn!(nameserver = %flowhost_broker::Escaped(word), error = %e, "a resolv.conf nameserver names an interface this host does not have; it is not asked");
                return None;
            }
        },
    };
    Some(SocketAddr::V6(std::net::SocketAddrV6::new(
        v6, 53, 0, scope_id,
    )))
}

async fn ask_udp(
    server: SocketAddr,
    query: &[u8],
    is_answer: impl Fn(&[u8]) -> bool,
) -> std::io::Result<Vec<u8>> {
    let local: SocketAddr = if server.is_ipv4() {
        "0.0.0.0:0".parse().map_err(std::io::Error::other)?
    } else {
        "[::]:0".parse().map_err(std::io::Error::other)?
    };
    let sock = UdpSocket::bind(local).await?;
    // Connected: the kernel drops datagrams from anyone but the server.
    sock.connect(server).await?;
    sock.send(query).await?;
    let mut buf = vec![0u8; 65535];
    loop {
        let n = sock.recv(&mut buf).await?;
        if is_answer(&buf[..n]) {
            buf.truncate(n);
            return Ok(buf);
        }
    }
}

async fn ask_tcp(server: SocketAddr, query: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut s = TcpStream::connect(server).await?;
    let len = u16::try_from(query.len()).map_err(std::io::Error::other)?;
    s.write_all(&len.to_be_bytes()).await?;
    s.write_all(query).await?;
    let mut len = [0u8; 2];
    s.read_exact(&mut len).await?;
    let mut buf = vec![0u8; usize::from(u16::from_be_bytes(len))];
    s.read_exact(&mut buf).await?;
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::{Message, OpCode, Query, ResponseCode};
    use hickory_proto::rr::{Name, RecordType};

    /// Asks a query for `a.test` (upstream id `id`) of a real UDP server on loopback, which
    /// answers the query it receives with the datagrams `reply` makes of it, in order.
    /// Returns what the wait took as the answer, how long it took, and the question.
    async fn asked_of(
        id: u16,
        reply: impl FnOnce(Message) -> Vec<Message> + Send + 'static,
    ) -> (Vec<u8>, std::time::Duration, wire::Question) {
        let server = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let upstream = Upstream::new(vec![server.local_addr().unwrap()]);
        let q = wire::question(&wire::tests::query(3, "a.test.")).unwrap();
        let asked = wire::upstream_query(&q, id).unwrap();
        let responder = std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            let (n, client) = server.recv_from(&mut buf).unwrap();
            for m in reply(Message::from_vec(&buf[..n]).unwrap()) {
                server.send_to(&m.to_vec().unwrap(), client).unwrap();
            }
        });
        let started = std::time::Instant::now();
        let got = upstream
            .ask(&asked, |r| wire::answers(&q, r, id))
            .await
            .unwrap();
        responder.join().unwrap();
        (got, started.elapsed(), q)
    }

    /// A datagram with the query's id that answers another question (here also truncated,
    /// which would have sent the query over TCP) is passed over, and the real answer that
    /// follows it is taken. Before, the first datagram with the right id was the answer, and
    /// the lookup failed with SERVFAIL once it was found to answer another question.
    #[tokio::test]
    async fn a_datagram_that_answers_another_question_is_passed_over() {
        let (got, _, q) = asked_of(4242, |query| {
            let mut forged = Message::response(query.metadata.id, OpCode::Query);
            forged.metadata.truncation = true;
            forged.add_query(Query::query(
                Name::from_ascii("b.test.").unwrap(),
                RecordType::A,
            ));
            vec![forged, query.into_response()]
        })
        .await;
        assert!(!wire::truncated(&got));
        assert!(wire::answer(&q, &got, 4242).is_ok());
    }

    /// An error answer with the query's id and no question (as some servers send a FORMERR or
    /// REFUSED) ends the wait at once; it hands out nothing.
    #[tokio::test]
    async fn an_error_answer_without_a_question_ends_the_wait() {
        let (got, took, q) = asked_of(4243, |query| {
            vec![Message::error_msg(
                query.metadata.id,
                OpCode::Query,
                ResponseCode::Refused,
            )]
        })
        .await;
        assert!(took < PER_SERVER / 2, "{took:?}");
        assert!(wire::answer(&q, &got, 4243).is_err());
    }

    /// A scoped link-local nameserver keeps its scope (before, `%eth0` was dropped, and a
    /// link-local address without one cannot be reached: every lookup failed); one naming
    /// no interface of this host is not asked.
    #[test]
    fn reads_nameserver_lines() {
        let lo = nix::net::if_::if_nametoindex("lo").unwrap();
        let text = "# comment\nsearch example.org\nnameserver 10.0.0.53\nnameserver fe80::1%lo\nnameserver fe80::2%7\nnameserver fe80::3%no-such-if0\nnameserver bogus\noptions ndots:2\n";
        let scoped = |ip: &str, scope| {
            SocketAddr::V6(std::net::SocketAddrV6::new(
                ip.parse().unwrap(),
                53,
                0,
                scope,
            ))
        };
        assert_eq!(
            parse_resolv_conf(text),
            vec![
                "10.0.0.53:53".parse::<SocketAddr>().unwrap(),
                scoped("fe80::1", lo),
                scoped("fe80::2", 7),
            ]
        );
    }
}
