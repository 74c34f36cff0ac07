//! The client's requests the host has not answered yet, read off the bytes the bridge relays
//! unchanged. MCP's stdio transport puts one JSON-RPC message on each line, so each
//! direction is split into lines and each line read as the host reads it
//! ([`crate::mcp::parse`]): a request of the client the host takes as one (an object, an
//! integer or string `id`) is owed an answer until the host sends one with its `id`, or the
//! client cancels it. What the host refuses as a whole (a batch, a line that is not a
//! request) it answers with a null `id`, so it owes nothing to track; a request longer than
//! the host's `max_message_bytes` (which the bridge does not know) is refused so too, naming
//! its length, which is how the bridge tells which one it was. A bridge that saw the client
//! end its input and the host close must still tell the user when answers are owed: the host
//! stopped or failed part way, and a script driving the client must not take that for a
//! finished session.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::mcp::Incoming;

/// The ids (as their JSON text) of the client's requests still owed an answer, each with
/// the lengths of the lines that sent it (a client may reuse an id; the host refuses the
/// second while the first is in flight, and each is owed its own answer), shared by both
/// directions of one bridge.
#[derive(Debug, Clone, Default)]
pub(crate) struct Unanswered(Arc<Mutex<BTreeMap<String, Vec<usize>>>>);

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
        self.lock().keys().cloned().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<usize>>> {
        // A panic while holding the lock leaves a set that is still a set: use it.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// One request of `id` answered: the one sent on a line of `length` bytes, or the
    /// earliest.
    fn answered(&self, id: &str, length: Option<usize>) {
        let mut owed = self.lock();
        let Some(lines) = owed.get_mut(id) else {
            return;
        };
        let at = length
            .and_then(|n| lines.iter().position(|&l| l == n))
            .unwrap_or(0);
        if at < lines.len() {
            lines.remove(at);
        }
        if lines.is_empty() {
            owed.remove(id);
        }
    }

    /// Takes in what one complete line says.
    fn line(&self, direction: Direction, line: &[u8]) {
        let Ok(message) = crate::mcp::parse(line) else {
            return;
        };
        match (direction, message) {
            (Direction::Up, Incoming::Request { id, .. }) if !id.is_null() => {
                self.lock()
                    .entry(id.to_string())
                    .or_default()
                    .push(line.len());
            }
            // A cancelled request may go unanswered (the host then sends nothing).
            (Direction::Up, Incoming::Notification { method, params })
                if method == "notifications/cancelled" =>
            {
                if let Some(cancelled) = params.get("requestId") {
                    self.answered(&cancelled.to_string(), None);
                }
            }
            // A request over the host's limit, refused with a null id: the one of that length.
            (
                Direction::Down,
                Incoming::Response {
                    id,
                    outcome: Err(e),
                },
            ) if id.is_null() => {
                if let Some(n) = crate::mcp::too_large_length(&e) {
                    let id = self
                        .lock()
                        .iter()
                        .find(|(_, lines)| lines.contains(&n))
                        .map(|(id, _)| id.clone());
                    if let Some(id) = id {
                        self.answered(&id, Some(n));
                    }
                }
            }
            // The host's own requests to the client (sampling, elicitation) are no answers.
            (Direction::Down, Incoming::Response { id, .. }) => {
                self.answered(&id.to_string(), None);
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

    /// Takes in the last line of a stream that ended without its newline: the host reads it
    /// as a line.
    pub(crate) fn finish(&mut self) {
        if !self.skipping && !self.partial.is_empty() {
            let partial = std::mem::take(&mut self.partial);
            self.unanswered.line(self.direction, &partial);
        }
    }

    /// Takes in the next bytes of the stream. Called before the bytes are passed on, so a
    /// request is known as owed before its answer can come back.
    pub(crate) fn feed(&mut self, mut bytes: &[u8]) {
        while let Some(end) = bytes.iter().position(|&b| b == b'\n') {
            let (head, rest) = bytes.split_at(end);
            // A line over the limit is not read, however it came in.
            if !self.skipping && self.partial.len() + head.len() <= self.limit {
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

    /// What the host refuses as a whole it answers with a null id: a batch, an id that is
    /// neither an integer nor a string, a line that is no message. None is owed (before, a
    /// batch's ids were, and a clean session ended as if the host had failed).
    #[test]
    fn what_the_host_refuses_as_a_whole_is_owed_nothing() {
        let (mut up, _, u) = pair();
        up.feed(b"[{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"a\"},{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"b\"}]\n");
        up.feed(b"{\"jsonrpc\":\"2.0\",\"id\":1.5,\"method\":\"a\"}\n");
        up.feed(b"{\"jsonrpc\":\"1.0\",\"id\":3,\"method\":\"a\"}\nnot json\n");
        assert!(u.ids().is_empty(), "{:?}", u.ids());
    }

    #[test]
    fn cancellations_and_the_clients_own_answers_are_read() {
        let (mut up, mut down, u) = pair();
        up.feed(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"a\"}\n{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"b\"}\n");
        assert_eq!(u.ids(), ["1", "2"]);
        up.feed(b"{\"jsonrpc\":\"2.0\",\"method\":\"notifications/cancelled\",\"params\":{\"requestId\":2}}\n");
        assert_eq!(u.ids(), ["1"]);
        // The client answering the host's request owes nothing and is owed nothing.
        up.feed(b"{\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{}}\n");
        down.feed(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n");
        assert!(u.ids().is_empty());
    }

    /// The host reads a last line without its newline as a line: so does the bridge (before,
    /// a request sent so was never owed).
    #[test]
    fn a_last_line_without_its_newline_is_read_at_the_end() {
        let (mut up, _, u) = pair();
        up.feed(b"{\"jsonrpc\":\"2.0\",\"id\":9,\"method\":\"tools/call\"}");
        assert!(u.ids().is_empty());
        up.finish();
        assert_eq!(u.ids(), ["9"]);
    }

    /// A request longer than the host's limit (which the bridge does not know) is owed
    /// until the host refuses it with a null id naming its length. Before, the bridge read
    /// requests only up to the default limit, and one a host with a higher limit served
    /// was never owed.
    #[test]
    fn a_request_the_host_refuses_as_too_long_is_owed_nothing_after_the_refusal() {
        let (mut up, mut down, u) = pair();
        let long = format!(
            "{{\"jsonrpc\":\"2.0\",\"id\":4,\"method\":\"a\",\"params\":{{\"p\":\"{}\"}}}}",
            "x".repeat(2000)
        );
        up.feed(format!("{long}\n").as_bytes());
        up.feed(b"{\"jsonrpc\":\"2.0\",\"id\":5,\"method\":\"b\"}\n");
        assert_eq!(u.ids(), ["4", "5"]);
        let refusal = crate::mcp::error_response(
            &serde_json::Value::Null,
            &crate::mcp::too_large(long.len(), 1024),
        );
        down.feed(format!("{refusal}\n").as_bytes());
        assert_eq!(u.ids(), ["5"]);
    }

    /// A reused id is owed once per request (the host refuses the second with that id while
    /// the first is in flight, and answers the first later); and only the host's own
    /// too-long refusal, code and data alone, ends what a request is owed.
    #[test]
    fn a_reused_id_is_owed_per_request_and_a_lookalike_refusal_ends_nothing() {
        let (mut up, mut down, u) = pair();
        up.feed(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"a\"}\n");
        up.feed(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"bb\"}\n");
        down.feed(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"error\":{\"code\":-32600,\"message\":\"in flight\"}}\n");
        assert_eq!(u.ids(), ["1"]);
        // A tool's error with a null id that looks like the refusal, but with more data.
        let n = b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"a\"}".len();
        down.feed(
            format!(
                "{{\"jsonrpc\":\"2.0\",\"id\":null,\"error\":{{\"code\":-32600,\"message\":\"x\",\"data\":{{\"message_bytes\":{n},\"more\":1}}}}}}\n"
            )
            .as_bytes(),
        );
        assert_eq!(u.ids(), ["1"]);
        down.feed(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n");
        assert!(u.ids().is_empty());
    }

    #[test]
    fn an_over_long_line_is_skipped_to_its_end_and_the_next_is_read() {
        let u = Unanswered::default();
        let mut up = Lines::new(Direction::Up, u.clone(), 40);
        up.feed(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"a-method-name-that-is-long\"");
        up.feed(b"}\n{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"b\"}\n");
        assert_eq!(u.ids(), ["2"]);
        up.feed(b"{\"jsonrpc\":\"2.0\",\"id\":3,\"method\":\"a-method-name-that-is-long\"");
        up.finish();
        assert_eq!(u.ids(), ["2"]);
        // Over the limit only once its end came: not read either.
        let u = Unanswered::default();
        let mut up = Lines::new(Direction::Up, u.clone(), 40);
        up.feed(b"{\"jsonrpc\":\"2.0\",\"id\":6,\"method\":\"b\"");
        up.feed(b",\"params\":{}}\n");
        assert!(u.ids().is_empty(), "{:?}", u.ids());
    }
}
