//! A minimal HTTP/1.1 client for the Streamable HTTP tests: one request per connection
//! (`Connection: close`), the whole response read, chunked bodies decoded, SSE events
//! parsed.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde_json::Value;

/// A response.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    /// A header's value (name case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The JSON-RPC messages of the body: the SSE events' data, or the JSON body.
    pub fn messages(&self) -> Vec<Value> {
        if self
            .header("content-type")
            .is_some_and(|c| c.contains("text/event-stream"))
        {
            self.body
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter_map(|d| serde_json::from_str(d).ok())
                .collect()
        } else {
            serde_json::from_str(&self.body).into_iter().collect()
        }
    }

    /// The JSON-RPC response among the messages (the one with an id and no method).
    pub fn response(&self) -> Value {
        self.messages()
            .into_iter()
            .find(|m| m.get("method").is_none() && m.get("id").is_some())
            .unwrap_or_else(|| panic!("no JSON-RPC response in {self:?}"))
    }
}

/// Sends one request to `addr`; `headers` may override `Host`.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    request_over(stream, &addr.to_string(), method, path, headers, body)
}

/// Sends one request over `stream` (plain or TLS) to `host`.
pub fn request_over(
    mut stream: impl Read + Write,
    host: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let mut head = format!("{method} {path} HTTP/1.1\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        head.push_str(&format!("Host: {host}\r\n"));
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!(
        "Connection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    ));
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(body.as_bytes()).unwrap();
    let mut raw = Vec::new();
    // A TLS peer may close without close_notify once the answer is sent: what was read counts.
    let _ = stream.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let chunked = headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    });
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    Reply {
        status,
        headers,
        body,
    }
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}

/// An MCP client over Streamable HTTP with a bearer credential.
pub struct McpHttp {
    pub addr: SocketAddr,
    pub path: String,
    pub auth: Option<String>,
    pub session: Option<String>,
    next_id: u64,
}

impl McpHttp {
    pub fn new(addr: SocketAddr, auth: Option<&str>) -> McpHttp {
        McpHttp {
            addr,
            path: "/mcp".into(),
            auth: auth.map(|t| format!("Bearer {t}")),
            session: None,
            next_id: 0,
        }
    }

    /// POSTs one message with this client's credential and session.
    pub fn post(&self, message: &Value) -> Reply {
        let mut headers = vec![
            ("Content-Type", "application/json"),
            ("Accept", "application/json, text/event-stream"),
        ];
        if let Some(a) = &self.auth {
            headers.push(("Authorization", a));
        }
        if let Some(s) = &self.session {
            headers.push(("Mcp-Session-Id", s));
        }
        request(
            self.addr,
            "POST",
            &self.path,
            &headers,
            &message.to_string(),
        )
    }

    /// Sends a request and returns the reply.
    pub fn call(&mut self, method: &str, params: Value) -> Reply {
        self.next_id += 1;
        self.post(&serde_json::json!({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params}))
    }

    /// `initialize` then `notifications/initialized`; returns the initialize reply.
    pub fn initialize(&mut self) -> Reply {
        let r = self.call(
            "initialize",
            serde_json::json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}),
        );
        if r.status == 200 {
            self.session = r.header("mcp-session-id").map(ToString::to_string);
            let n = self.post(
                &serde_json::json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
            );
            assert_eq!(n.status, 202, "{n:?}");
        }
        r
    }
}

/// A TCP connection to `addr` from `source` (any loopback address names this host), so a
/// test can stand for several remote hosts.
pub fn connect_from(source: std::net::Ipv4Addr, addr: SocketAddr) -> TcpStream {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrIn, bind, connect, socket};
    use std::os::fd::AsRawFd;
    let SocketAddr::V4(to) = addr else {
        panic!("{addr} is no IPv4 address");
    };
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap();
    bind(
        fd.as_raw_fd(),
        &SockaddrIn::from(std::net::SocketAddrV4::new(source, 0)),
    )
    .unwrap();
    connect(fd.as_raw_fd(), &SockaddrIn::from(to)).unwrap();
    TcpStream::from(fd)
}
