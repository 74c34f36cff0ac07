//! MCP framing: newline-delimited JSON-RPC 2.0 messages, read with a size limit.
//!
//! Used on both sides: the daemon's socket (clients) and the executors' stdio (the daemon as
//! client). Nothing here knows about labels or policy.

use serde_json::{Value, json};
use tokio::io::{AsyncBufRead, AsyncBufReadExt};

/// The newest MCP protocol revision the host speaks (offered to executors, and answered to
/// clients that ask for a revision the host does not speak).
pub const PROTOCOL_VERSION: &str = "2025-06-18";

/// Every MCP protocol revision the host speaks, newest first.
pub const SUPPORTED_PROTOCOL_VERSIONS: &[&str] = &["2025-06-18", "2025-03-26", "2024-11-05"];

/// The revision to speak with a peer that asked for (or, answering, chose) `requested`:
/// that revision when the host speaks it; otherwise `None` (a client is then answered with
/// [`PROTOCOL_VERSION`], and may disconnect; an executor is refused).
pub fn negotiate(requested: &str) -> Option<&'static str> {
    SUPPORTED_PROTOCOL_VERSIONS
        .iter()
        .copied()
        .find(|v| *v == requested)
}

/// JSON-RPC and flowhost error codes.
///
/// flowhost's own codes stay clear of those the official MCP SDKs give a meaning: -32000
/// (connection closed), -32001 (request timeout), -32002 (resource not found) and -32042
/// (URL elicitation required). Every refusal also carries `data.denial`.
pub mod code {
    /// Invalid JSON.
    pub const PARSE_ERROR: i64 = -32700;
    /// Not a valid request object (wrong `jsonrpc`, missing `method`, bad `id`), or too large.
    pub const INVALID_REQUEST: i64 = -32600;
    /// Unknown method.
    pub const METHOD_NOT_FOUND: i64 = -32601;
    /// Bad parameters: unknown tool, arguments failing the signed input schema.
    pub const INVALID_PARAMS: i64 = -32602;
    /// The host failed (state or record store); the call was refused.
    pub const INTERNAL_ERROR: i64 = -32603;
    /// The caller may not use this tool.
    pub const ACCESS_DENIED: i64 = -32010;
    /// The information-flow check refused the call.
    pub const FLOW_DENIED: i64 = -32011;
    /// The request arrived before `initialize`.
    pub const NOT_INITIALIZED: i64 = -32012;
}

/// A JSON-RPC error: one flowhost sends back, or one a peer answered with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RpcError {
    /// Error code (see [`code`]).
    pub code: i64,
    /// Human-readable message.
    pub message: String,
    /// Structured detail.
    pub data: Option<Value>,
}

impl RpcError {
    /// An error without data.
    pub fn new(code: i64, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
            data: None,
        }
    }

    /// Adds structured data.
    pub fn with_data(mut self, data: Value) -> Self {
        self.data = Some(data);
        self
    }

    /// The error a peer answered with, read strictly: an integer `code`, a string `message`
    /// and any `data`; `None` for an object that is not a JSON-RPC error. `data.denial` and
    /// the codes of flowhost's own refusals ([`code::ACCESS_DENIED`], [`code::FLOW_DENIED`],
    /// [`code::NOT_INITIALIZED`]) are what mark a refusal by the host, so a peer's
    /// `data.denial` is renamed `data.peer_denial`, and a peer's error with one of those
    /// codes is passed on as [`code::INTERNAL_ERROR`], its code kept in `data.peer_code`:
    /// a peer's error never reads as a refusal by the host.
    pub fn from_answer(error: &Value) -> Option<RpcError> {
        let object = error.as_object()?;
        let mut data = object.get("data").cloned();
        if let Some(Value::Object(fields)) = &mut data
            && let Some(denial) = fields.remove("denial")
        {
            fields.insert("peer_denial".into(), denial);
        }
        let mut code = object.get("code")?.as_i64()?;
        let message = object.get("message")?.as_str()?.to_string();
        if matches!(
            code,
            code::ACCESS_DENIED | code::FLOW_DENIED | code::NOT_INITIALIZED
        ) {
            let peer_code = serde_json::json!(code);
            code = code::INTERNAL_ERROR;
            match &mut data {
                Some(Value::Object(fields)) => {
                    fields.insert("peer_code".into(), peer_code);
                }
                Some(other) => {
                    data = Some(
                        serde_json::json!({"peer_code": peer_code, "peer_data": other.take()}),
                    );
                }
                None => data = Some(serde_json::json!({"peer_code": peer_code})),
            }
        }
        Some(RpcError {
            code,
            message,
            data,
        })
    }

    /// The refusal code in `data.denial`, when the error carries one.
    pub fn data_denial(&self) -> Option<&str> {
        self.data.as_ref()?.get("denial")?.as_str()
    }
}

impl std::fmt::Display for RpcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "error {}: {}", self.code, self.message)
    }
}

/// A parsed inbound message.
#[derive(Debug, Clone, PartialEq)]
pub enum Incoming {
    /// A request (has an id; needs an answer).
    Request {
        /// The id, echoed in the answer.
        id: Value,
        /// Method name.
        method: String,
        /// Parameters (`null` when absent).
        params: Value,
    },
    /// A notification (no id; never answered).
    Notification {
        /// Method name.
        method: String,
        /// Parameters.
        params: Value,
    },
    /// A response (to a request we sent).
    Response {
        /// The id of our request.
        id: Value,
        /// `Ok(result)` or `Err(error object)`.
        outcome: Result<Value, Value>,
    },
}

/// Parses one line. Errors carry the id when one could be read, so the answer can use it.
pub fn parse(line: &[u8]) -> Result<Incoming, (Value, RpcError)> {
    let value: Value = serde_json::from_slice(line).map_err(|e| {
        (
            Value::Null,
            RpcError::new(code::PARSE_ERROR, format!("parse error: {e}")),
        )
    })?;
    classify_owned(value)
}

/// What a message already read as JSON is, checked as [`parse`] checks a line.
pub fn classify(value: &Value) -> Result<Incoming, (Value, RpcError)> {
    classify_owned(value.clone())
}

/// [`classify`], taking the message apart instead of copying its parameters or result.
fn classify_owned(value: Value) -> Result<Incoming, (Value, RpcError)> {
    let Value::Object(mut obj) = value else {
        let why = match value {
            // JSON-RPC batches (which MCP's 2025-03-26 revision allowed and 2025-06-18
            // took out) are not served: said so, rather than as any other shape.
            Value::Array(_) => "a message must be a JSON object: batches are not accepted",
            _ => "a message must be a JSON object",
        };
        return Err((Value::Null, RpcError::new(code::INVALID_REQUEST, why)));
    };
    let id = obj.remove("id");
    let echo = id.clone().unwrap_or(Value::Null);
    if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err((
            echo,
            RpcError::new(code::INVALID_REQUEST, "\"jsonrpc\" must be \"2.0\""),
        ));
    }
    if let Some(id) = &id
        && !(id.is_string() || id.is_i64() || id.is_u64() || id.is_null())
    {
        return Err((
            Value::Null,
            RpcError::new(
                code::INVALID_REQUEST,
                "\"id\" must be a string, an integer or null",
            ),
        ));
    }
    match obj.remove("method") {
        Some(Value::String(method)) => {
            let params = obj.remove("params").unwrap_or(Value::Null);
            if !(params.is_object() || params.is_array() || params.is_null()) {
                return Err((
                    echo,
                    RpcError::new(
                        code::INVALID_REQUEST,
                        "\"params\" must be an object or an array",
                    ),
                ));
            }
            Ok(match id {
                // A request's id must not be null (MCP): the host's own answers to what it
                // cannot read carry a null id, and the client would take one of those for
                // this request's answer.
                Some(Value::Null) => {
                    return Err((
                        Value::Null,
                        RpcError::new(code::INVALID_REQUEST, "a request's \"id\" must not be null"),
                    ));
                }
                Some(id) => Incoming::Request { id, method, params },
                None => Incoming::Notification { method, params },
            })
        }
        Some(_) => Err((
            echo,
            RpcError::new(code::INVALID_REQUEST, "\"method\" must be a string"),
        )),
        None => match (id, obj.remove("result"), obj.remove("error")) {
            (Some(id), Some(result), None) => Ok(Incoming::Response {
                id,
                outcome: Ok(result),
            }),
            (Some(id), None, Some(error)) => Ok(Incoming::Response {
                id,
                outcome: Err(error),
            }),
            _ => Err((
                echo,
                RpcError::new(code::INVALID_REQUEST, "missing \"method\""),
            )),
        },
    }
}

/// The error a line longer than `limit` (`n` bytes) is refused with (with a null id): its
/// data names the length, which `flowhost connect` reads back ([`too_large_length`]) to
/// tell which of the client's requests it was.
pub fn too_large(n: usize, limit: usize) -> RpcError {
    RpcError::new(
        code::INVALID_REQUEST,
        format!("message of {n} bytes exceeds the limit of {limit} bytes"),
    )
    .with_data(serde_json::json!({ "message_bytes": n }))
}

/// The length a [`too_large`] error (as received: its JSON object) names: one with that
/// code and no data but the length (what a tool answers passes through as it is, and must
/// not pass for the host's refusal).
pub fn too_large_length(error: &Value) -> Option<usize> {
    if error.get("code").and_then(Value::as_i64) != Some(code::INVALID_REQUEST) {
        return None;
    }
    let data = error.get("data")?.as_object()?;
    if data.len() != 1 {
        return None;
    }
    usize::try_from(data.get("message_bytes")?.as_u64()?).ok()
}

/// One outgoing JSON-RPC message, serialised straight from borrowed parts. Its members are
/// declared in name order, the order a `json!` object (a sorted map) writes them in, so a
/// line is byte for byte what building a `Value` first would give, without the map.
#[derive(serde::Serialize)]
struct Outgoing<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<OutgoingId<'a>>,
    jsonrpc: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    method: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    params: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    result: Option<&'a Value>,
}

#[derive(serde::Serialize)]
#[serde(untagged)]
enum OutgoingId<'a> {
    Echoed(&'a Value),
    Own(u64),
}

impl Outgoing<'_> {
    const EMPTY: Outgoing<'static> = Outgoing {
        error: None,
        id: None,
        jsonrpc: "2.0",
        method: None,
        params: None,
        result: None,
    };

    fn line(&self) -> String {
        // Serialising strings, numbers and `Value`s (whose maps have string keys) into memory
        // does not fail; were it ever to, the peer is told of an internal error rather than
        // sent a torn line.
        serde_json::to_string(self).unwrap_or_else(|e| {
            tracing::error!(error = %e, "cannot serialise an outgoing JSON-RPC message");
            format!(
                "{{\"error\":{{\"code\":{},\"message\":\"the host could not serialise a \
                 message\"}},\"id\":null,\"jsonrpc\":\"2.0\"}}",
                code::INTERNAL_ERROR
            )
        })
    }
}

/// A success response line (without the newline).
pub fn response(id: &Value, result: Value) -> String {
    Outgoing {
        id: Some(OutgoingId::Echoed(id)),
        result: Some(&result),
        ..Outgoing::EMPTY
    }
    .line()
}

/// An error response line (without the newline).
pub fn error_response(id: &Value, error: &RpcError) -> String {
    let mut e = json!({"code": error.code, "message": error.message});
    if let Some(data) = &error.data {
        e["data"] = data.clone();
    }
    Outgoing {
        error: Some(&e),
        id: Some(OutgoingId::Echoed(id)),
        ..Outgoing::EMPTY
    }
    .line()
}

/// A request line (without the newline).
pub fn request(id: u64, method: &str, params: Value) -> String {
    Outgoing {
        id: Some(OutgoingId::Own(id)),
        method: Some(method),
        params: Some(&params),
        ..Outgoing::EMPTY
    }
    .line()
}

/// A notification line (without the newline).
pub fn notification(method: &str, params: Value) -> String {
    Outgoing {
        method: Some(method),
        params: Some(&params),
        ..Outgoing::EMPTY
    }
    .line()
}

/// One line read under a size limit.
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    /// A complete line (without its newline).
    Message(Vec<u8>),
    /// A line longer than the limit: its length, and its first bytes (at most
    /// [`OVERSIZED_HEAD`], enough to name the id of a message that puts it first); the rest
    /// was discarded up to its newline.
    TooLarge {
        /// The line's length.
        bytes: usize,
        /// Its first bytes.
        head: Vec<u8>,
    },
    /// End of stream.
    Eof,
}

/// How many bytes of an oversized line [`read_line`] keeps.
pub const OVERSIZED_HEAD: usize = 256;

/// Reads one newline-terminated line of at most `limit` bytes. An oversized line is
/// consumed and discarded (never buffered whole), so one bad message cannot exhaust memory or
/// desynchronize the stream. A final line without a newline counts as a line.
pub async fn read_line<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    limit: usize,
) -> std::io::Result<Line> {
    let mut buf = Vec::new();
    let mut seen = 0usize;
    let mut oversized = false;
    loop {
        let chunk = reader.fill_buf().await?;
        if chunk.is_empty() {
            return Ok(if seen == 0 {
                Line::Eof
            } else if oversized {
                Line::TooLarge {
                    bytes: seen,
                    head: buf,
                }
            } else {
                Line::Message(buf)
            });
        }
        let (take, done) = match chunk.iter().position(|b| *b == b'\n') {
            Some(i) => (i + 1, true),
            None => (chunk.len(), false),
        };
        let body = if done {
            &chunk[..take - 1]
        } else {
            &chunk[..take]
        };
        seen += body.len();
        if oversized || seen > limit {
            // Past the limit only the line's start is kept (at most OVERSIZED_HEAD bytes).
            if !oversized {
                oversized = true;
                buf.truncate(OVERSIZED_HEAD);
                buf.shrink_to_fit();
            }
            let room = OVERSIZED_HEAD.saturating_sub(buf.len());
            buf.extend_from_slice(&body[..body.len().min(room)]);
        } else {
            buf.extend_from_slice(body);
        }
        reader.consume(take);
        if done {
            return Ok(if oversized {
                Line::TooLarge {
                    bytes: seen,
                    head: buf,
                }
            } else {
                Line::Message(buf)
            });
        }
    }
}

/// Reads lines of at most `limit` bytes from `reader` into `lines` until the end of the
/// stream (sent as [`Line::Eof`]) or until nobody receives them. Run as its own task, it
/// makes reading cancellation-safe for the receiver: a line read is not.
pub async fn forward_lines<R: AsyncBufRead + Unpin>(
    mut reader: R,
    limit: usize,
    lines: tokio::sync::mpsc::Sender<Line>,
) {
    loop {
        let line = read_line(&mut reader, limit).await.unwrap_or(Line::Eof);
        let eof = line == Line::Eof;
        if lines.send(line).await.is_err() || eof {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Outgoing lines are the bytes a `json!` object of the same members writes: clients
    /// and records see no change from how a line is built.
    #[test]
    fn outgoing_lines_are_the_sorted_objects_bytes() {
        let ids = [json!(7), json!("a\"b"), Value::Null, json!(-1.5)];
        let result = json!({"z": [1, {"b": "\u{1}é", "a": null}], "content": []});
        for id in &ids {
            assert_eq!(
                response(id, result.clone()),
                json!({"jsonrpc": "2.0", "id": id, "result": result}).to_string()
            );
            let mut e = RpcError::new(code::INVALID_PARAMS, "bad \n input");
            assert_eq!(
                error_response(id, &e),
                json!({"jsonrpc": "2.0", "id": id, "error": {"code": e.code, "message": e.message}})
                    .to_string()
            );
            e.data = Some(json!({"denial": "x"}));
            assert_eq!(
                error_response(id, &e),
                json!({"jsonrpc": "2.0", "id": id, "error":
                    {"code": e.code, "message": e.message, "data": {"denial": "x"}}})
                .to_string()
            );
        }
        assert_eq!(
            request(u64::MAX, "tools/call", result.clone()),
            json!({"jsonrpc": "2.0", "id": u64::MAX, "method": "tools/call", "params": result})
                .to_string()
        );
        assert_eq!(
            notification("notifications/cancelled", json!({"requestId": 3})),
            json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 3}})
                .to_string()
        );
    }

    #[tokio::test]
    async fn reads_lines_and_discards_oversized_ones() {
        let data = b"{\"a\":1}\n0123456789ABCDEF\n{\"b\":2}";
        let mut r = tokio::io::BufReader::with_capacity(4, &data[..]);
        assert_eq!(
            read_line(&mut r, 10).await.unwrap(),
            Line::Message(b"{\"a\":1}".to_vec())
        );
        assert_eq!(
            read_line(&mut r, 10).await.unwrap(),
            Line::TooLarge {
                bytes: 16,
                head: b"0123456789ABCDEF".to_vec()
            }
        );
        assert_eq!(
            read_line(&mut r, 10).await.unwrap(),
            Line::Message(b"{\"b\":2}".to_vec())
        );
        assert_eq!(read_line(&mut r, 10).await.unwrap(), Line::Eof);
    }

    #[test]
    fn parses_requests_notifications_and_responses() {
        assert_eq!(
            parse(br#"{"jsonrpc":"2.0","id":7,"method":"ping"}"#).unwrap(),
            Incoming::Request {
                id: json!(7),
                method: "ping".into(),
                params: Value::Null
            }
        );
        assert!(matches!(
            parse(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#).unwrap(),
            Incoming::Notification { .. }
        ));
        assert!(matches!(
            parse(br#"{"jsonrpc":"2.0","id":"x","result":{}}"#).unwrap(),
            Incoming::Response { outcome: Ok(_), .. }
        ));
    }

    #[test]
    fn a_peers_error_is_read_strictly() {
        let e = RpcError::from_answer(&json!({"code": -32002, "message": "gone", "data": [1]}));
        assert_eq!(e, Some(RpcError::new(-32002, "gone").with_data(json!([1]))));
        // A peer cannot pose as the host refusing.
        let posing = RpcError::from_answer(
            &json!({"code": code::FLOW_DENIED, "message": "x", "data": {"denial": "flow_denied"}}),
        )
        .unwrap();
        assert_eq!(posing.data_denial(), None);
        // Nor with the host's refusal codes alone (before, -32011 passed on as it was).
        assert_eq!(posing.code, code::INTERNAL_ERROR);
        assert_eq!(
            posing.data,
            Some(json!({"peer_denial": "flow_denied", "peer_code": code::FLOW_DENIED}))
        );
        for (own, data) in [
            (code::ACCESS_DENIED, None),
            (code::NOT_INITIALIZED, Some(json!([1]))),
        ] {
            let mut answer = json!({"code": own, "message": "x"});
            if let Some(d) = &data {
                answer["data"] = d.clone();
            }
            let e = RpcError::from_answer(&answer).unwrap();
            assert_eq!(e.code, code::INTERNAL_ERROR);
            assert_eq!(e.data.as_ref().unwrap()["peer_code"], own);
            if let Some(d) = data {
                assert_eq!(e.data.unwrap()["peer_data"], d);
            }
        }
        for bad in [
            json!({"message": "no code"}),
            json!({"code": "-32002", "message": "a string code"}),
            json!({"code": 1.5, "message": "a fractional code"}),
            json!({"code": -32002}),
            json!("not an object"),
        ] {
            assert_eq!(RpcError::from_answer(&bad), None, "{bad}");
        }
    }

    #[test]
    fn rejects_malformed_messages_with_the_right_codes() {
        assert_eq!(parse(b"{not json").unwrap_err().1.code, code::PARSE_ERROR);
        assert_eq!(parse(b"[1,2]").unwrap_err().1.code, code::INVALID_REQUEST);
        let (id, e) = parse(br#"{"jsonrpc":"1.0","id":3,"method":"ping"}"#).unwrap_err();
        assert_eq!((id, e.code), (json!(3), code::INVALID_REQUEST));
        assert_eq!(
            parse(br#"{"jsonrpc":"2.0","id":{},"method":"x"}"#)
                .unwrap_err()
                .1
                .code,
            code::INVALID_REQUEST
        );
        assert_eq!(
            parse(br#"{"jsonrpc":"2.0","id":1,"method":5}"#)
                .unwrap_err()
                .1
                .code,
            code::INVALID_REQUEST
        );
        assert_eq!(
            parse(br#"{"jsonrpc":"2.0","id":1,"method":"x","params":3}"#)
                .unwrap_err()
                .1
                .code,
            code::INVALID_REQUEST
        );
        assert_eq!(
            parse(br#"{"jsonrpc":"2.0","id":1}"#).unwrap_err().1.code,
            code::INVALID_REQUEST
        );
        // A request with a null id is refused (the host's answers to what it cannot read
        // carry a null id: the client would take one for this request's answer), and a
        // batch is said to be one. A response may still carry a null id.
        let (id, e) = parse(br#"{"jsonrpc":"2.0","id":null,"method":"tools/call"}"#).unwrap_err();
        assert_eq!((id, e.code), (Value::Null, code::INVALID_REQUEST));
        assert!(e.message.contains("must not be null"), "{}", e.message);
        let batch = br#"[{"jsonrpc":"2.0","id":1,"method":"ping"}]"#;
        assert!(parse(batch).unwrap_err().1.message.contains("batches"));
        assert!(matches!(
            parse(br#"{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"x"}}"#),
            Ok(Incoming::Response { .. })
        ));
    }

    #[test]
    fn negotiates_only_revisions_the_host_speaks() {
        assert_eq!(negotiate("2025-03-26"), Some("2025-03-26"));
        assert_eq!(negotiate("2024-11-05"), Some("2024-11-05"));
        assert_eq!(negotiate("2025-06-18"), Some(PROTOCOL_VERSION));
        assert_eq!(negotiate("2025-11-25"), None);
        assert_eq!(negotiate(""), None);
    }

    #[test]
    fn own_codes_avoid_those_the_sdks_reserve() {
        // -32000 connection closed, -32001 request timeout (both SDKs), -32002 resource
        // not found (the specification), -32042 URL elicitation required.
        for reserved in [-32000, -32001, -32002, -32042] {
            for own in [
                code::ACCESS_DENIED,
                code::FLOW_DENIED,
                code::NOT_INITIALIZED,
            ] {
                assert_ne!(own, reserved);
            }
        }
    }

    #[test]
    fn error_lines_carry_data() {
        let e =
            RpcError::new(code::FLOW_DENIED, "no").with_data(json!({"denial": "flow_violation"}));
        let line: Value = serde_json::from_str(&error_response(&json!(1), &e)).unwrap();
        assert_eq!(line["error"]["data"]["denial"], "flow_violation");
    }
}
