//! The session's side of relaying what an executor sends its client during a call: the
//! client's declared capabilities, the request ids the host issues to the client (an
//! executor's own ids are never shown to it: two executors of a session may use the same
//! ids, and a client learns nothing of an executor by them), the answers awaited, and
//! [`CallRelay`], which moves one call's messages through its [`RelayGate`].
//!
//! A client's answer to an id no call awaits (a late answer, a made-up id) is ignored. A
//! call that ends (its result, its deadline, its cancellation) abandons what it still
//! awaits: the client is told the request is cancelled, and its answer is then ignored.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use serde_json::{Value, json};
use tokio::sync::oneshot;

use super::executor::{ClientRelay, ExecutorFit, RelayAnswer, RelayFuture};
use super::pipeline::RelayGate;
use super::session::Outbox;
use crate::mcp::{self, RpcError, code};
use crate::records::RelayMethod;

/// How every id of a request relayed to a client begins (`flowhost-relay-N`, per session).
pub(super) const RELAY_ID_PREFIX: &str = "flowhost-relay-";

/// The relay id `head`, the start of a client's message, gives as its `"id"` (a string
/// beginning with [`RELAY_ID_PREFIX`], without escapes), if it does: what is left of an
/// answer too large to read.
pub(super) fn relay_id_in(head: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(head);
    let mut rest = text.as_ref();
    while let Some(at) = rest.find("\"id\"") {
        rest = &rest[at + 4..];
        let Some(value) = rest.trim_start().strip_prefix(':') else {
            continue;
        };
        let Some(value) = value.trim_start().strip_prefix('"') else {
            continue;
        };
        let end = value.find('"')?;
        let id = &value[..end];
        if id.starts_with(RELAY_ID_PREFIX) && !id.contains('\\') {
            return Some(id.to_string());
        }
    }
    None
}

/// What the client declared it can do at `initialize` (of what the host relays).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientCapabilities {
    /// `capabilities.sampling`.
    pub sampling: bool,
    /// `capabilities.elicitation`.
    pub elicitation: bool,
}

impl ClientCapabilities {
    /// The capabilities `initialize`'s params declare (an object under the name; anything
    /// else declares nothing).
    pub fn declared(params: &Value) -> Self {
        let has = |name: &str| {
            params["capabilities"]
                .get(name)
                .is_some_and(Value::is_object)
        };
        ClientCapabilities {
            sampling: has("sampling"),
            elicitation: has("elicitation"),
        }
    }

    /// Whether the client can answer `method`.
    pub fn offers(self, method: RelayMethod) -> bool {
        match method {
            RelayMethod::Sampling => self.sampling,
            RelayMethod::Elicitation => self.elicitation,
            RelayMethod::Log | RelayMethod::Progress => true,
        }
    }
}

/// What came back for a request forwarded to the client.
#[derive(Debug, PartialEq)]
enum Answer {
    /// The client's answer: `Ok(result)` or `Err(error object)`.
    Client(Result<Value, Value>),
    /// The transport could not deliver the request, and says why.
    Undelivered(String),
}

/// The requests a session forwarded to its client, awaiting answers, by the host's id.
#[derive(Default)]
pub struct PendingRelays {
    next: AtomicU64,
    waiting: Mutex<HashMap<String, oneshot::Sender<Answer>>>,
    /// Set once no answer of the client is taken any more ([`PendingRelays::close`]).
    closed: std::sync::atomic::AtomicBool,
}

impl PendingRelays {
    /// Hands the client's answer (`Ok(result)` or `Err(error object)`) to the request `id`
    /// it answers; `false` (and nothing happens) when no request awaits that id.
    pub fn answered(&self, id: &Value, outcome: Result<Value, Value>) -> bool {
        self.settle(id, Answer::Client(outcome))
    }

    /// Tells the request `id` that the session's transport could not deliver it (`why`);
    /// `false` when no request awaits that id.
    pub fn undelivered(&self, id: &Value, why: String) -> bool {
        self.settle(id, Answer::Undelivered(why))
    }

    /// Takes no answer of the client from now on: every request awaiting one is told none
    /// will come (`why`), and none is forwarded any more; their calls go on without, rather
    /// than wait out their deadlines.
    pub fn close(&self, why: &str) {
        // Set under the lock `open` takes: no request is opened after it unseen.
        let waiting: Vec<_> = {
            // A poisoned lock still holds whole entries (each insert and removal is one).
            let mut w = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
            self.closed.store(true, Ordering::SeqCst);
            w.drain().map(|(_, tx)| tx).collect()
        };
        for tx in waiting {
            let _ = tx.send(Answer::Undelivered(why.to_string()));
        }
    }

    fn settle(&self, id: &Value, answer: Answer) -> bool {
        let waiting = self
            .waiting
            .lock()
            .ok()
            .and_then(|mut w| w.remove(&id.to_string()));
        match waiting {
            Some(tx) => tx.send(answer).is_ok(),
            None => false,
        }
    }

    /// A fresh id and its entry; the entry is removed when the returned guard drops.
    fn open<'a>(&'a self, out: &'a Outbox) -> Option<Awaiting<'a>> {
        let mut waiting = self.waiting.lock().ok()?;
        if self.closed.load(Ordering::SeqCst) {
            return None;
        }
        let id = json!(format!(
            "{RELAY_ID_PREFIX}{}",
            self.next.fetch_add(1, Ordering::Relaxed) + 1
        ));
        let (tx, rx) = oneshot::channel();
        waiting.insert(id.to_string(), tx);
        drop(waiting);
        Some(Awaiting {
            pending: self,
            out,
            id,
            rx: Some(rx),
        })
    }
}

/// One request awaiting the client's answer. Dropped before the answer came (its call
/// ended), it forgets the id and tells the client the request is cancelled.
struct Awaiting<'a> {
    pending: &'a PendingRelays,
    out: &'a Outbox,
    id: Value,
    rx: Option<oneshot::Receiver<Answer>>,
}

impl Awaiting<'_> {
    /// What came back (`None`: the session ended first).
    async fn answer(&mut self) -> Option<Answer> {
        let answer = self.rx.as_mut()?.await.ok();
        self.rx = None;
        answer
    }
}

impl Drop for Awaiting<'_> {
    fn drop(&mut self) {
        let forgotten = self
            .pending
            .waiting
            .lock()
            .ok()
            .and_then(|mut w| w.remove(&self.id.to_string()));
        if forgotten.is_some() && self.rx.is_some() {
            // Best effort: a client too slow to take it still has its answer ignored.
            self.out.try_send(mcp::notification(
                "notifications/cancelled",
                json!({"requestId": self.id, "reason": "the tool call that asked ended"}),
            ));
        }
    }
}

/// Relays one call's messages between its executor and the session's client.
pub struct CallRelay<'a> {
    /// The call's governance.
    pub gate: &'a RelayGate<'a>,
    /// The session's awaited answers.
    pub pending: &'a PendingRelays,
    /// What the client declared.
    pub capabilities: ClientCapabilities,
    /// The session's outgoing lines.
    pub out: &'a Outbox,
    /// Requests of this call relayed and not yet answered.
    pub in_flight: AtomicUsize,
}

impl CallRelay<'_> {
    /// Records that a request whose allow is recorded got no answer because the session's
    /// client went away; the error is the executor's answer.
    async fn client_gone(&self, kind: RelayMethod) -> RpcError {
        match self.gate.undelivered(kind).await {
            Ok(()) => RpcError::new(code::INTERNAL_ERROR, "the client is gone"),
            Err(e) => e,
        }
    }

    async fn relay(&self, method: String, params: Value, fit: ExecutorFit) -> RelayAnswer {
        // A ping needs no client: the host is the executor's peer.
        if method == "ping" {
            return Ok(json!({}));
        }
        let Some(kind) = RelayMethod::from_method(&method) else {
            // Not relayed, but output of the call all the same: its label joins (see
            // `RelayGate::to_client`).
            self.gate.raise(&params).await?;
            return Err(RpcError::new(
                code::METHOD_NOT_FOUND,
                format!(
                    "flowhost relays only sampling/createMessage and elicitation/create to the client, not {method:?}"
                ),
            ));
        };
        let _counted = Counted::new(&self.in_flight);
        let already = self.in_flight.load(Ordering::SeqCst) - 1;
        self.gate
            .to_client(kind, &params, self.capabilities.offers(kind), already)
            .await?;
        // From here on the allow is recorded: every way the request can fail to reach the
        // client, or its answer to come back, is recorded too.
        let Some(mut awaiting) = self.pending.open(self.out) else {
            return Err(self.client_gone(kind).await);
        };
        let line = json!({"jsonrpc": "2.0", "id": awaiting.id, "method": method, "params": params});
        // Closed since it was opened: nothing is forwarded to a client no answer of which
        // is taken.
        if self.pending.closed.load(Ordering::SeqCst) || !self.out.send(line.to_string()).await {
            return Err(self.client_gone(kind).await);
        }
        let answer = match awaiting.answer().await {
            None => return Err(self.client_gone(kind).await),
            Some(Answer::Client(answer)) => answer,
            Some(Answer::Undelivered(why)) => {
                self.gate.undelivered(kind).await?;
                return Err(RpcError::new(
                    code::METHOD_NOT_FOUND,
                    format!("{method} did not reach the client: {why}"),
                ));
            }
        };
        let shown = match &answer {
            Ok(result) => result,
            Err(error) => error,
        };
        {
            // Egress of the executor waits while its answer is judged: an approval landing
            // in between would not be seen by the check.
            let _judging = fit.judging().await;
            self.gate
                .to_tool(kind, shown, &|source| fit.fits(source))
                .await?;
        }
        answer.map_err(|error| {
            let mut e = RpcError::new(
                error["code"].as_i64().unwrap_or(code::INTERNAL_ERROR),
                error["message"].as_str().unwrap_or("the client refused"),
            );
            e.data = error.get("data").cloned();
            e
        })
    }
}

impl ClientRelay for CallRelay<'_> {
    fn log(&self, params: Value) -> RelayFuture<'_, ()> {
        Box::pin(async move {
            match self.gate.notify(RelayMethod::Log, &params).await {
                Ok(()) => {
                    // A client that went away loses the line; the call goes on.
                    self.out
                        .send(mcp::notification("notifications/message", params))
                        .await;
                }
                Err(e) => {
                    tracing::warn!(error = %e.message, "a log notification of a tool is withheld")
                }
            }
        })
    }

    fn request(
        &self,
        method: String,
        params: Value,
        fit: ExecutorFit,
    ) -> RelayFuture<'_, RelayAnswer> {
        Box::pin(self.relay(method, params, fit))
    }

    fn labelled<'a>(&'a self, numbers: &'a Value) -> RelayFuture<'a, bool> {
        // Each time: a number the classifier reads as output (an identifier sent one
        // notification at a time) raises the label as it would in the result. A raise that
        // changes nothing writes nothing.
        Box::pin(async move {
            match self.gate.notify(RelayMethod::Progress, numbers).await {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(error = %e.message, "a tool's progress is withheld");
                    false
                }
            }
        })
    }
}

/// Counts one request in flight for as long as it lives.
struct Counted<'a>(&'a AtomicUsize);

impl<'a> Counted<'a> {
    fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::SeqCst);
        Counted(n)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc;

    /// The id at the start of an oversized answer is found however it is spaced, and only
    /// a relay's own: another id, one with escapes, or none gives nothing.
    #[test]
    fn a_relay_id_is_read_from_the_start_of_an_answer() {
        let id = |head: &str| relay_id_in(head.as_bytes());
        assert_eq!(
            id(r#"{"jsonrpc":"2.0","id":"flowhost-relay-7","result":{"x":"#).as_deref(),
            Some("flowhost-relay-7")
        );
        assert_eq!(
            id(r#"{"result":{"id":3}, "id" : "flowhost-relay-12", "#).as_deref(),
            Some("flowhost-relay-12")
        );
        for none in [
            r#"{"jsonrpc":"2.0","id":7,"result":"#,
            r#"{"id":"other-7","result":"#,
            r#"{"id":"flowhost-relay-\u0037","#,
            r#"{"jsonrpc":"2.0","result":{"text":"xxxx"#,
            r#"{"id":"flowhost-relay-"#,
        ] {
            assert_eq!(id(none), None, "{none}");
        }
    }

    #[test]
    fn capabilities_are_what_initialize_declared() {
        let both = ClientCapabilities::declared(
            &json!({"capabilities": {"sampling": {}, "elicitation": {"form": {}}}}),
        );
        assert!(both.offers(RelayMethod::Sampling) && both.offers(RelayMethod::Elicitation));
        let none = ClientCapabilities::declared(&json!({"capabilities": {"sampling": true}}));
        assert_eq!(none, ClientCapabilities::default());
        assert_eq!(ClientCapabilities::declared(&json!(null)), none);
    }

    #[tokio::test]
    async fn an_answer_reaches_only_the_request_still_awaiting_it() {
        let pending = PendingRelays::default();
        let (tx, mut sent) = mpsc::channel(4);
        let out = Outbox::new(tx);
        let mut first = pending.open(&out).unwrap();
        let id = first.id.clone();
        assert!(!pending.answered(&json!("flowhost-relay-9"), Ok(json!({}))));
        assert!(pending.answered(&id, Ok(json!({"n": 1}))));
        assert_eq!(
            first.answer().await,
            Some(Answer::Client(Ok(json!({"n": 1}))))
        );
        assert!(!pending.answered(&id, Ok(json!({"n": 2}))), "answered once");
        drop(first);
        assert!(
            sent.try_recv().is_err(),
            "an answered request is not cancelled"
        );

        let second = pending.open(&out).unwrap();
        let id = second.id.clone();
        drop(second); // its call ended
        let cancelled: Value = serde_json::from_str(&sent.try_recv().unwrap().line).unwrap();
        assert_eq!(cancelled["method"], "notifications/cancelled");
        assert_eq!(cancelled["params"]["requestId"], id);
        assert!(
            !pending.answered(&id, Ok(json!({}))),
            "a late answer is ignored"
        );

        // The transport could not deliver the third: it is told why, once, and a client's
        // answer to it later is ignored.
        let mut third = pending.open(&out).unwrap();
        let id = third.id.clone();
        assert!(pending.undelivered(&id, "no stream".into()));
        assert_eq!(
            third.answer().await,
            Some(Answer::Undelivered("no stream".into()))
        );
        assert!(!pending.answered(&id, Ok(json!({}))));
        drop(third);
        assert!(sent.try_recv().is_err(), "nothing is cancelled");
    }
}
