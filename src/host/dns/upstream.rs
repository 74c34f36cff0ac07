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

    /// Asks `query` (whose id is `id`) of each server in turn until one answers; over TCP
    /// when the UDP answer is truncated.
    pub async fn ask(&self, query: &[u8], id: u16) -> Result<Vec<u8>, String> {
        let mut why = String::from("no upstream resolver is configured");
        for server in &self.servers {
            let answer = async {
                let udp = ask_udp(*server, query, id).await?;
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
                // A scoped IPv6 address (fe80::1%eth0) keeps only the address.
                .and_then(|a| a.split('%').next()?.parse::<IpAddr>().ok())
                .map(|ip| SocketAddr::new(ip, 53))
        })
        .collect()
}

async fn ask_udp(server: SocketAddr, query: &[u8], id: u16) -> std::io::Result<Vec<u8>> {
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
        if n >= 2 && u16::from_be_bytes([buf[0], buf[1]]) == id {
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

    #[test]
    fn reads_nameserver_lines() {
        let text = "# comment\nsearch example.org\nnameserver 10.0.0.53\nnameserver fe80::1%eth0\nnameserver bogus\noptions ndots:2\n";
        assert_eq!(
            parse_resolv_conf(text),
            vec![
                "10.0.0.53:53".parse::<SocketAddr>().unwrap(),
                "[fe80::1]:53".parse().unwrap()
            ]
        );
    }
}
