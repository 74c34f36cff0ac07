//! A keep-alive MCP client over Streamable HTTP for the daemon benchmark: one TCP
//! connection, each request's SSE answer read (chunked) up to its end.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};

use serde_json::{Value, json};

/// The bearer token the benchmark's `[http]` table accepts.
pub(crate) const TOKEN: &str = "bench-token";

/// The `[http]` table for `listen`, mapping [`TOKEN`] to `principal`.
pub(crate) fn http_table(listen: SocketAddr, principal: &str) -> String {
    use sha2::Digest;
    format!(
        "\n[http]\nlisten = \"{listen}\"\n[[http.token]]\nprincipal = \"{principal}\"\nsha256 = \"{}\"\n",
        hex::encode(sha2::Sha256::digest(TOKEN.as_bytes()))
    )
}

/// An MCP session over one keep-alive HTTP connection.
pub(crate) struct HttpRpc {
    addr: SocketAddr,
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    session: Option<String>,
    next: u64,
}

impl HttpRpc {
    /// Connects and initializes.
    pub(crate) fn connect(addr: SocketAddr) -> HttpRpc {
        let stream = TcpStream::connect(addr).expect("connect to the HTTP listener");
        stream.set_nodelay(true).expect("nodelay");
        let mut c = HttpRpc {
            addr,
            reader: BufReader::new(stream.try_clone().expect("clone")),
            writer: stream,
            session: None,
            next: 0,
        };
        c.call(
            "initialize",
            json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "bench", "version": "0"}}),
        );
        c.post(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        c
    }

    /// Sends a request and returns its response.
    pub(crate) fn call(&mut self, method: &str, params: Value) -> Value {
        self.next += 1;
        let body = self
            .post(&json!({"jsonrpc": "2.0", "id": self.next, "method": method, "params": params}));
        body.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .find(|m| m.get("id").is_some() && m.get("method").is_none())
            .expect("a JSON-RPC response")
    }

    fn post(&mut self, message: &Value) -> String {
        let body = message.to_string();
        let mut head = format!(
            "POST /mcp HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        if let Some(s) = &self.session {
            head.push_str(&format!("Mcp-Session-Id: {s}\r\n"));
        }
        head.push_str("\r\n");
        head.push_str(&body);
        self.writer.write_all(head.as_bytes()).expect("send");
        let (mut length, mut chunked) = (0usize, false);
        loop {
            let mut line = String::new();
            self.reader.read_line(&mut line).expect("read a header");
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
                match k.as_str() {
                    "content-length" => length = v.parse().unwrap_or(0),
                    "transfer-encoding" => chunked = v.eq_ignore_ascii_case("chunked"),
                    "mcp-session-id" => self.session = Some(v.to_string()),
                    _ => {}
                }
            }
        }
        let mut out = Vec::new();
        if chunked {
            loop {
                let mut size = String::new();
                self.reader.read_line(&mut size).expect("chunk size");
                let n = usize::from_str_radix(size.trim(), 16).expect("a chunk size");
                let mut chunk = vec![0; n + 2];
                self.reader.read_exact(&mut chunk).expect("chunk");
                if n == 0 {
                    break;
                }
                out.extend_from_slice(&chunk[..n]);
            }
        } else {
            out.resize(length, 0);
            self.reader.read_exact(&mut out).expect("body");
        }
        String::from_utf8_lossy(&out).into_owned()
    }
}
