//! The client's requests the host has not answered yet, read off the bytes the bridge relays
//! unchanged. MCP's stdio transport puts one JSON-RPC message (or batch) on each line, so
//! each direction is split into lines and each line read as JSON: a request of the client
//! (a `method` and an `id`) is owed an answer until the host sends one with its `id`, or the
//! client cancels it. A bridge that saw the client end its input and the host close must
//! still tell the user when answers are owed: the host stopped or failed part way, and a
//! script driving the client must not take that for a finished session.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use serde_json::Value;

/// The ids (as their JSON text) of the client's requests still owed an answer, shared by
/// both directions of one bridge.
#[derive(Debug, Clone, Default)]
pub(crate) struct Unanswered(Arc<Mutex<BTreeSet<String>>>);

/// Which way a line travelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// From the client (stdin) to the host.
    Up,
    /// From the host to the client (stdout).
    Down,
}

impl Unanswered {
    /// The ids still owed an answer, in order.
    pub(crate) fn ids(&self) -> Vec<String> {
        self.lock().iter().cloned().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        // A panic while holding the lock leaves a set that is still a set: use it.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Takes in what one complete line says. A line that is not JSON owes nothing: the host
    /// answers it with a parse error whose `id` is null.
    fn line(&self, direction: Direction, line: &[u8]) {
        let Ok(message) = serde_json::from_slice::<Value>(line) else {
            return;
        };
        match message {
            Value::Array(batch) => batch.iter().for_each(|m| self.message(direction, m)),
            m => self.message(direction, &m),
        }
    }

    fn message(&self, direction: Direction, m: &Value) {
        let id = m.get("id").filter(|id| !id.is_null());
        let method = m.get("method").and_then(Value::as_str);
        match (direction, method, id) {
            (Direction::Up, Some("notifications/cancelled"), None) => {
                // A cancelled request may go unanswered (the host then sends nothing).
                if let Some(cancelled) = m.pointer("/params/requestId") {
                    self.lock().remove(&cancelled.to_string());
                }
            }
            (Direction::Up, Some(_), Some(id)) => {
                self.lock().insert(id.to_string());
            }
            // An answer: no method, an id, and a result or an error. The host's own requests
            // to the client (sampling, elicitation) carry a method and are not answers.
            (Direction::Down, None, Some(id))
                if m.get("result").is_some() || m.get("error").is_some() =>
            {
                self.lock().remove(&id.to_string());
            }
            _ => {}
        }
    }
}

/// Splits one direction's bytes into lines for [`Unanswered`].
#[derive(Debug)]
pub(crate) struct Lines {
    direction: Direction,
    unanswered: Unanswered,
    partial: Vec<u8>,
    /// A line longer than `limit` is not kept: the host refuses a message that long (its
    /// `max_message_bytes`), answering with no id, so it owes nothing to track either.
    limit: usize,
    /// Bytes of an over-long line are being skipped until its end.
    skipping: bool,
}

impl Lines {
    /// Lines travelling `direction`, read into `unanswered`.
    pub(crate) fn new(direction: Direction, unanswered: Unanswered, limit: usize) -> Lines {
        Lines {
            direction,
            unanswered,
            partial: Vec::new(),
            limit,
            skipping: false,
        }
    }

    /// Takes in the next bytes of the stream. Called before the bytes are passed on, so a
    /// request is known as owed before its answer can come back.
    pub(crate) fn feed(&mut self, mut bytes: &[u8]) {
        while let Some(end) = bytes.iter().position(|&b| b == b'\n') {
            let (head, rest) = bytes.split_at(end);
            if !self.skipping {
                if self.partial.is_empty() {
                    self.unanswered.line(self.direction, head);
                } else {
                    self.partial.extend_from_slice(head);
                    self.unanswered.line(self.direction, &self.partial);
                }
            }
            self.partial.clear();
            self.skipping = false;
            // `rest` starts with the newline itself.
            bytes = &rest[1..];
        }
        if self.skipping {
            return;
        }
        if self.partial.len() + bytes.len() > self.limit {
            self.partial = Vec::new();
            self.skipping = true;
        } else {
            self.partial.extend_from_slice(bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Lines, Lines, Unanswered) {
        let u = Unanswered::default();
        (
            Lines::new(Direction::Up, u.clone(), 1 << 20),
            Lines::new(Direction::Down, u.clone(), 1 << 20),
            u,
        )
    }

    #[test]
    fn a_request_is_owed_until_its_answer_comes_back() {
        let (mut up, mut down, u) = pair();
        up.feed(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}\n{\"jsonrpc\":\"2.0\",\"id\":\"a\",");
        assert_eq!(u.ids(), ["1"]);
        up.feed(b"\"method\":\"tools/list\"}\n{\"jsonrpc\":\"2.0\",\"method\":\"notifications/initialized\"}\n");
        assert_eq!(u.ids(), ["\"a\"", "1"]);
        down.feed(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n");
        assert_eq!(u.ids(), ["\"a\""]);
        // The host's own request with the same id is no answer.
        down.feed(b"{\"jsonrpc\":\"2.0\",\"id\":\"a\",\"method\":\"sampling/createMessage\"}\n");
        assert_eq!(u.ids(), ["\"a\""]);
        down.feed(
            b"{\"jsonrpc\":\"2.0\",\"id\":\"a\",\"error\":{\"code\":-1,\"message\":\"x\"}}\n",
        );
        assert!(u.ids().is_empty());
    }

    #[test]
    fn batches_cancellations_and_the_clients_own_answers_are_read() {
        let (mut up, mut down, u) = pair();
        up.feed(b"[{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"a\"},{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"b\"}]\n");
        assert_eq!(u.ids(), ["1", "2"]);
        up.feed(b"{\"jsonrpc\":\"2.0\",\"method\":\"notifications/cancelled\",\"params\":{\"requestId\":2}}\n");
        assert_eq!(u.ids(), ["1"]);
        // The client answering the host's request owes nothing and is owed nothing.
        up.feed(b"{\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{}}\n");
        down.feed(b"[{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}]\n");
        assert!(u.ids().is_empty());
    }

    #[test]
    fn an_over_long_line_is_skipped_to_its_end_and_the_next_is_read() {
        let u = Unanswered::default();
        let mut up = Lines::new(Direction::Up, u.clone(), 16);
        up.feed(b"{\"id\":1,\"method\":\"a-method-name-that-is-long\"");
        up.feed(b"}\n{\"id\":2,\"method\":\"b\"}\n");
        assert_eq!(u.ids(), ["2"]);
        up.feed(b"not json\n");
        assert_eq!(u.ids(), ["2"]);
    }
}
