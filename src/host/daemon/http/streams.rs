//! A session's SSE streams: one per request in flight (it carries what the session sends
//! while serving the request, then the response, and ends), and the session's GET stream
//! (messages that belong to no request). Every event has an id `STREAM-SEQ`; the events of
//! a stream are kept (bounded) so a client that lost the connection can resume the stream
//! with `Last-Event-ID` and get what it missed, then the rest.
//!
//! A stream is read by one client at a time, and a session has at most [`MAX_GETS`] GETs
//! open: an event's bytes are shared by the log and every channel carrying it, so what a
//! session keeps stays near its bound however its client resumes.

use std::collections::{BTreeMap, VecDeque};
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};

use bytes::Bytes;
use serde_json::Value;
use tokio::sync::mpsc;

use super::super::session::NotDelivered;

/// Events kept per stream for replay.
const MAX_EVENTS: usize = 256;
/// Finished streams kept for replay.
const MAX_FINISHED: usize = 32;
/// Bytes of events kept for replay across a session's streams; past it the oldest go first.
const MAX_LOG_BYTES: usize = 8 << 20;
/// Bytes of events kept for replay across every session of the transport
/// ([`ReplayBudget`]): 32 sessions at their own limit. Past it, the session that keeps
/// another event lets go of its own oldest first, down to [`SESSION_LOG_FLOOR`].
pub(super) const MAX_TRANSPORT_LOG_BYTES: usize = 256 << 20;
/// Bytes of events every session may keep for replay whatever the others keep: sessions
/// that hold the transport's budget (a principal's idle ones, say) cannot take resumption
/// from the rest. 1,024 sessions at it add 256 MiB to [`MAX_TRANSPORT_LOG_BYTES`].
const SESSION_LOG_FLOOR: usize = 256 << 10;
/// Events buffered towards a client before it must resume instead.
const CHANNEL: usize = 64;
/// GET streams a session may have open at once (its own stream and resumed ones).
pub(super) const MAX_GETS: usize = 16;

/// One SSE event as sent. Its bytes are shared (not copied) by the replay log and every
/// channel that carries it.
pub(super) type Event = Bytes;

/// What a client reads from one stream. While it lives, another reader of the stream is
/// refused and, for a GET, it counts among the session's open GETs (which keep the session
/// in use).
pub(super) struct Events {
    rx: mpsc::Receiver<Event>,
    _reader: Arc<()>,
    _get: Option<Arc<()>>,
    /// When the stream has been silent this long, a comment goes out (see
    /// [`Events::keep_alive`]).
    keep_alive: Option<tokio::time::Interval>,
    /// Whether the stream may still be read, and how often that is asked while it is
    /// silent (see [`Events::while_true`]).
    valid: Option<(Validity, tokio::time::Interval)>,
}

/// How often a silent stream bound to a credential asks whether it still authenticates.
const VALIDITY_CHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether what a stream carries may still go to its reader (its credential still
/// authenticates).
pub(super) type Validity = std::sync::Arc<dyn Fn() -> bool + Send + Sync>;

/// An SSE comment: clients skip it, and it is not an event (no id, nothing kept).
const KEEP_ALIVE_COMMENT: &[u8] = b": keep-alive\n\n";

/// Ends the stream of a request the client cancelled that takes its answer as one JSON body
/// ([`is_cancellation`]): its POST is then answered as cancelled, not as one whose session
/// ended. Only such a stream carries it, and an SSE client would skip it as a comment.
const CANCELLED_COMMENT: &[u8] = b": cancelled\n\n";

/// Whether `event` says its stream's request was cancelled by the client.
pub(super) fn is_cancellation(event: &[u8]) -> bool {
    event == CANCELLED_COMMENT
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events")
            .field("keep_alive", &self.keep_alive.is_some())
            .field("bound", &self.valid.is_some())
            .finish_non_exhaustive()
    }
}

impl Events {
    /// The next event; `None` once the stream has ended and every event was read.
    pub(super) async fn recv(&mut self) -> Option<Event> {
        let event = self.rx.recv().await;
        if !self.still_valid() {
            return None;
        }
        event
    }

    /// Ends the stream, for its reader, once `valid` says no: an event is given only
    /// while it holds, and a silent stream read as a stream ends within a second of its
    /// ceasing to hold.
    pub(super) fn while_true(mut self, valid: Validity) -> Events {
        let mut every =
            tokio::time::interval_at(tokio::time::Instant::now() + VALIDITY_CHECK, VALIDITY_CHECK);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.valid = Some((valid, every));
        self
    }

    /// Whether the stream's credential (if it is bound to one) still authenticates.
    pub(super) fn still_valid(&self) -> bool {
        self.valid.as_ref().is_none_or(|(valid, _)| valid())
    }

    /// Read as a stream, the events come with a comment after every `silence` without one: a
    /// stream that carries nothing still writes to its connection now and then, so a client
    /// that vanished without closing it (its host gone, a network cut) is found out by TCP
    /// and its connection freed, instead of holding it for as long as the host runs.
    pub(super) fn keep_alive(mut self, silence: std::time::Duration) -> Events {
        let mut every = tokio::time::interval_at(tokio::time::Instant::now() + silence, silence);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.keep_alive = Some(every);
        self
    }
}

impl tokio_stream::Stream for Events {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        if let Poll::Ready(event) = self.rx.poll_recv(cx) {
            if !self.still_valid() {
                return Poll::Ready(None);
            }
            if let Some(every) = &mut self.keep_alive {
                every.reset();
            }
            return Poll::Ready(event);
        }
        // Polled until pending, so the next check wakes this stream.
        if let Some((valid, every)) = &mut self.valid {
            while every.poll_tick(cx).is_ready() {
                if !valid() {
                    return Poll::Ready(None);
                }
            }
        }
        if let Some(every) = &mut self.keep_alive
            && every.poll_tick(cx).is_ready()
        {
            return Poll::Ready(Some(Bytes::from_static(KEEP_ALIVE_COMMENT)));
        }
        Poll::Pending
    }
}

/// What a GET attaches to.
pub(super) enum Target {
    /// The session's stream for messages that belong to no request.
    Standalone,
    /// The stream of this event id, from after it.
    Resume(String),
}

/// Why a GET cannot attach.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum AttachError {
    /// A client already reads that stream.
    Busy,
    /// The event id names no stream kept here.
    Unknown,
    /// The session has [`MAX_GETS`] GET streams open.
    TooMany,
}

struct Stream {
    /// Where its events go while a client reads it.
    tx: Option<mpsc::Sender<Event>>,
    /// Alive while a client holds the stream's [`Events`], whether or not more events can
    /// reach it (a finished stream's replay has no sender).
    reader: Weak<()>,
    /// The stream answers a POST that accepts only JSON: its client reads one response and
    /// nothing else, so a request from the server cannot reach it here.
    json_only: bool,
    log: VecDeque<(u64, Event)>,
    next: u64,
    done: bool,
}

/// The bytes of events the transport's sessions keep for replay, together: bounded by
/// [`MAX_TRANSPORT_LOG_BYTES`], so many sessions each at its own limit cannot make the host
/// hold gigabytes for resumptions that may never come.
#[derive(Debug)]
pub(super) struct ReplayBudget {
    kept: std::sync::atomic::AtomicUsize,
    limit: usize,
    /// Events let go of early for the bound, for the log.
    let_go: std::sync::atomic::AtomicU64,
}

impl Default for ReplayBudget {
    fn default() -> Self {
        ReplayBudget::new(MAX_TRANSPORT_LOG_BYTES)
    }
}

impl ReplayBudget {
    /// Nothing kept yet; at most `limit` bytes together.
    pub(super) fn new(limit: usize) -> ReplayBudget {
        ReplayBudget {
            kept: Default::default(),
            limit,
            let_go: Default::default(),
        }
    }

    /// Whether the sessions keep more than the limit together.
    fn over(&self) -> bool {
        self.kept() > self.limit
    }

    fn kept(&self) -> usize {
        self.kept.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn add(&self, bytes: usize) {
        self.kept
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    fn sub(&self, bytes: usize) {
        self.kept
            .fetch_sub(bytes, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The streams of one session.
#[derive(Default)]
pub(super) struct Streams {
    streams: BTreeMap<u64, Stream>,
    /// Requests in flight (their id as JSON text) and their streams, oldest first.
    pending: Vec<(String, u64)>,
    /// Progress tokens of requests in flight (as JSON text) and their streams.
    progress: Vec<(String, u64)>,
    standalone: Option<u64>,
    next: u64,
    /// Bytes of the events kept for replay.
    log_bytes: usize,
    /// Held by every open GET's [`Events`]: the GETs open are its other holders.
    gets: Arc<()>,
    /// Server messages dropped for want of a stream to carry them.
    dropped: u64,
    /// What the transport's sessions keep for replay together (a session of its own by
    /// default).
    budget: Arc<ReplayBudget>,
}

impl Drop for Streams {
    fn drop(&mut self) {
        self.budget.sub(self.log_bytes);
    }
}

impl Stream {
    /// Whether a client holds it now (reading what was sent or replayed).
    fn attached(&self) -> bool {
        self.reader.strong_count() > 0
    }

    /// Whether what is sent now reaches a client.
    fn live(&self) -> bool {
        self.tx.as_ref().is_some_and(|tx| !tx.is_closed())
    }

    /// Gives the stream to a new reader: a channel of `capacity` (its sender kept unless the
    /// stream is done) and the reader's hold, counted as a GET when `get` is given.
    fn read(&mut self, capacity: usize, get: Option<Arc<()>>) -> (mpsc::Sender<Event>, Events) {
        let (tx, rx) = mpsc::channel(capacity);
        let reader = Arc::new(());
        self.reader = Arc::downgrade(&reader);
        self.tx = (!self.done).then(|| tx.clone());
        let events = Events {
            rx,
            _reader: reader,
            _get: get,
            keep_alive: None,
            valid: None,
        };
        (tx, events)
    }
}

impl Streams {
    /// No stream yet; what it keeps for replay counts against `budget`, shared by the
    /// transport's sessions.
    pub(super) fn sharing(budget: Arc<ReplayBudget>) -> Streams {
        let mut streams = Streams::default();
        streams.budget = budget;
        streams
    }

    /// Counts `bytes` fewer kept for replay.
    fn drop_bytes(&mut self, bytes: usize) {
        self.log_bytes -= bytes;
        self.budget.sub(bytes);
    }

    /// Opens a stream and gives it to its first reader (a GET when it holds `get`).
    fn new_stream(&mut self, json_only: bool, get: Option<Arc<()>>) -> (u64, Events) {
        let mut stream = Stream {
            tx: None,
            reader: Weak::new(),
            json_only,
            log: VecDeque::new(),
            next: 0,
            done: false,
        };
        let (_, events) = stream.read(CHANNEL, get);
        self.next += 1;
        self.streams.insert(self.next, stream);
        (self.next, events)
    }

    /// Whether anything is in flight, a GET is open (even one replaying a stream no longer
    /// kept), or what the session sends reaches a client.
    pub(super) fn in_use(&self) -> bool {
        !self.pending.is_empty() || self.open_gets() > 0 || self.streams.values().any(Stream::live)
    }

    /// GET streams open now.
    fn open_gets(&self) -> usize {
        Arc::strong_count(&self.gets) - 1
    }

    /// The client cancelled request `id` (as JSON text): the session will not answer it, so
    /// its stream ends here and it is in flight no more.
    pub(super) fn cancelled(&mut self, id: &str) {
        let Some(at) = self.pending.iter().position(|(p, _)| p == id) else {
            return;
        };
        let (_, n) = self.pending.remove(at);
        self.progress.retain(|(_, p)| *p != n);
        if let Some(s) = self.streams.get_mut(&n) {
            s.done = true;
            if s.json_only
                && let Some(tx) = &s.tx
            {
                // Not kept for replay: a JSON-only stream cannot be resumed.
                let _ = tx.try_send(Event::from_static(CANCELLED_COMMENT));
            }
            s.tx = None;
        }
        self.forget_finished();
    }

    /// Whether a request with `request`'s id is in flight.
    pub(super) fn in_flight(&self, request: &Value) -> bool {
        let id = request["id"].to_string();
        self.pending.iter().any(|(p, _)| *p == id)
    }

    /// Opens the stream that answers `request` (a JSON-RPC request with an id); `json_only`
    /// when its client takes the response alone, as one JSON body.
    pub(super) fn open_for_request(&mut self, request: &Value, json_only: bool) -> Events {
        let (n, events) = self.new_stream(json_only, None);
        self.pending.push((request["id"].to_string(), n));
        if let Some(token) = request["params"]["_meta"].get("progressToken") {
            self.progress.push((token.to_string(), n));
        }
        events
    }

    /// Routes one message the session sent: a response to its request's stream (which it
    /// ends); a message sent while serving `request` (an id as JSON text) to that
    /// request's stream while it is open; progress to the stream of the request that asked
    /// for it. A message of no request in flight goes to the GET stream while a client
    /// reads it, else to the newest request whose client reads SSE, else to the GET
    /// stream's log (for a client that resumes it); a response to no request in flight
    /// goes nowhere (the GET stream carries no responses).
    ///
    /// A request to the client bound for a stream whose client takes only JSON goes to the
    /// GET stream while one is read; a request with no stream to carry it cannot be
    /// delivered, and it is returned so that its sender can be answered at once rather than
    /// wait for its deadline. What else is dropped is logged.
    pub(super) fn route(&mut self, message: &str, request: Option<&str>) -> Option<NotDelivered> {
        let parsed: Option<Value> = serde_json::from_str(message).ok();
        let response_to = parsed
            .as_ref()
            .filter(|v| v.get("method").is_none())
            .and_then(|v| v.get("id"))
            .map(Value::to_string);
        if let Some(id) = response_to {
            let Some(at) = self.pending.iter().position(|(p, _)| *p == id) else {
                // Expected when a cancel crossed the answer: the client stopped waiting.
                tracing::debug!(request = %id, "a response to no request in flight was dropped");
                return None;
            };
            let (_, n) = self.pending.remove(at);
            self.progress.retain(|(_, p)| *p != n);
            self.push(n, message);
            if let Some(s) = self.streams.get_mut(&n) {
                s.done = true;
                s.tx = None;
            }
            self.forget_finished();
            return None;
        }
        let progress_of = parsed
            .as_ref()
            .filter(|v| v["method"] == "notifications/progress")
            .and_then(|v| v["params"].get("progressToken"))
            .map(Value::to_string)
            .and_then(|t| self.progress.iter().find(|(p, _)| *p == t).map(|(_, n)| *n));
        let serving = request
            .and_then(|r| self.pending.iter().find(|(p, _)| p == r))
            .map(|(_, n)| *n);
        let json_only = |n: &u64| self.streams.get(n).is_some_and(|s| s.json_only);
        let listening = self
            .standalone
            .filter(|g| self.streams.get(g).is_some_and(Stream::live));
        let target = serving.or(progress_of).or_else(|| {
            listening
                .or_else(|| {
                    let mut newest_first = self.pending.iter().rev().map(|(_, n)| *n);
                    newest_first.find(|n| !json_only(n))
                })
                .or(self.standalone)
        });
        // A request to the client (it has an id and a method): what it asks for.
        let asks = parsed
            .as_ref()
            .filter(|v| v.get("id").is_some())
            .and_then(|v| Some((v["id"].clone(), v.get("method")?.as_str()?.to_string())));
        let not_delivered = |(id, method): (Value, String), why: &str| NotDelivered {
            id,
            why: format!("{why}, so it cannot receive {method}"),
        };
        match (target, asks) {
            (Some(n), Some(asked)) if json_only(&n) => match listening {
                Some(g) => self.push(g, message),
                None => {
                    return Some(not_delivered(
                        asked,
                        "the client's HTTP request accepts only application/json and the session has no GET stream open",
                    ));
                }
            },
            // Its client reads one response and nothing else: what comes before it would
            // only fill the channel, and a full channel would lose the response. As the
            // client chose, this is no fault (and not logged above debug).
            (Some(n), None) if json_only(&n) => {
                tracing::debug!("a notification for a client that takes only JSON was dropped");
            }
            (Some(n), _) => self.push(n, message),
            (None, Some(asked)) => {
                return Some(not_delivered(
                    asked,
                    "the session has no GET stream and no request whose client reads SSE",
                ));
            }
            (None, None) => self.dropped(),
        }
        None
    }

    /// Logs a server message that no stream could carry: the first, then one line per
    /// 1,000, so a flood of them does not flood the log too.
    fn dropped(&mut self) {
        self.dropped += 1;
        if self.dropped % 1000 == 1 {
            tracing::warn!(
                dropped = self.dropped,
                "a server message of no request was dropped: the session has no GET stream and no request whose client reads SSE"
            );
        }
    }

    fn push(&mut self, n: u64, data: &str) {
        let Some(s) = self.streams.get_mut(&n) else {
            return;
        };
        let seq = s.next;
        s.next += 1;
        let event = Event::from(format!("id: {n}-{seq}\ndata: {data}\n\n"));
        // A JSON-only client never sees event ids, so it cannot resume: nothing is kept.
        if !s.json_only {
            let mut freed = 0;
            if s.log.len() == MAX_EVENTS
                && let Some((_, old)) = s.log.pop_front()
            {
                freed = old.len();
            }
            s.log.push_back((seq, event.clone()));
            // The fields, not the helpers: the stream is borrowed from the map.
            self.log_bytes = self.log_bytes - freed + event.len();
            self.budget.sub(freed);
            self.budget.add(event.len());
        }
        // A client that is gone or too slow resumes from the log instead.
        if let Some(tx) = &s.tx
            && tx.try_send(event).is_err()
        {
            s.tx = None;
        }
        self.trim_logs();
    }

    /// Drops the oldest kept events, oldest stream first, until the session keeps at most
    /// [`MAX_LOG_BYTES`] and the transport's sessions together at most
    /// [`MAX_TRANSPORT_LOG_BYTES`] (or this session keeps at most [`SESSION_LOG_FLOOR`]): a
    /// client that asks for large answers cannot make the host keep them all for
    /// resumption, nor can many.
    fn trim_logs(&mut self) {
        let over = |own: usize, budget: &ReplayBudget| {
            own > MAX_LOG_BYTES || (own > SESSION_LOG_FLOOR && budget.over())
        };
        let mut freed = 0;
        let mut early = 0;
        for s in self.streams.values_mut() {
            while over(self.log_bytes - freed, &self.budget) {
                let for_the_transport = self.log_bytes - freed <= MAX_LOG_BYTES;
                let Some((_, old)) = s.log.pop_front() else {
                    break;
                };
                freed += old.len();
                early += u64::from(for_the_transport);
                // Counted at once, so the transport's total is right while this loops.
                self.budget.sub(old.len());
            }
        }
        self.log_bytes -= freed;
        if early > 0 {
            let before = self
                .budget
                .let_go
                .fetch_add(early, std::sync::atomic::Ordering::Relaxed);
            let after = before + early;
            // Said at the first and then once per 1,000, over the transport.
            if before == 0 || before / 1000 != after / 1000 {
                tracing::warn!(
                    let_go = after,
                    limit = self.budget.limit,
                    "events kept for resumption let go early: the HTTP sessions keep at most this many bytes together"
                );
            }
        }
    }

    fn forget_finished(&mut self) {
        let finished: Vec<u64> = self
            .streams
            .iter()
            .filter(|(_, s)| s.done)
            .map(|(n, _)| *n)
            .collect();
        for n in finished
            .iter()
            .take(finished.len().saturating_sub(MAX_FINISHED))
        {
            if let Some(gone) = self.streams.remove(n) {
                self.drop_bytes(gone.log.iter().map(|(_, e)| e.len()).sum::<usize>());
            }
        }
    }

    /// Attaches a GET to `target`: refused while a client reads that stream, or while the
    /// session has [`MAX_GETS`] GETs open.
    pub(super) fn attach(&mut self, target: Target) -> Result<Events, AttachError> {
        if self.open_gets() >= MAX_GETS {
            return Err(AttachError::TooMany);
        }
        let get = Some(self.gets.clone());
        match target {
            Target::Standalone => match self.standalone.and_then(|n| self.streams.get_mut(&n)) {
                Some(s) if s.attached() => Err(AttachError::Busy),
                Some(s) => Ok(s.read(CHANNEL, get).1),
                None => {
                    let (n, events) = self.new_stream(false, get);
                    self.standalone = Some(n);
                    Ok(events)
                }
            },
            Target::Resume(last) => {
                let (n, seq) = last
                    .split_once('-')
                    .and_then(|(n, s)| Some((n.parse::<u64>().ok()?, s.parse::<u64>().ok()?)))
                    .ok_or(AttachError::Unknown)?;
                let s = self.streams.get_mut(&n).ok_or(AttachError::Unknown)?;
                if s.attached() {
                    return Err(AttachError::Busy);
                }
                // Shared bytes: the reader holds no copy of what the log keeps.
                let missed: Vec<Event> = s
                    .log
                    .iter()
                    .filter(|(q, _)| *q > seq)
                    .map(|(_, e)| e.clone())
                    .collect();
                // A finished stream gets nothing more; a channel cannot be empty.
                let room = if s.done { 1 } else { CHANNEL };
                let (tx, events) = s.read(missed.len() + room, get);
                for e in missed {
                    // Capacity was made for every missed event.
                    let _ = tx.try_send(e);
                }
                Ok(events)
            }
        }
    }

    /// Ends every stream (the session is over).
    pub(super) fn close_all(&mut self) {
        for s in self.streams.values_mut() {
            s.tx = None;
            s.done = true;
        }
        self.pending.clear();
        self.progress.clear();
    }
}

/// The `data` of one SSE event as written here.
pub(super) fn data_of(event: &[u8]) -> Option<String> {
    std::str::from_utf8(event)
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("data: "))
        .map(ToString::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn drain(rx: &mut Events) -> Vec<String> {
        let mut out = Vec::new();
        while let Ok(e) = rx.rx.try_recv() {
            out.push(data_of(&e).unwrap());
        }
        out
    }

    /// What a session keeps for resumption is bounded in bytes, whatever the answers' size
    /// and number, and a JSON-only stream (which cannot be resumed) keeps nothing.
    #[test]
    fn the_events_kept_for_resumption_are_bounded_in_bytes() {
        let mut s = Streams::default();
        let big = "x".repeat(1 << 20);
        for id in 0..40 {
            let _rx = s.open_for_request(&json!({"id": id}), false);
            s.route(
                &format!(r#"{{"jsonrpc":"2.0","id":{id},"result":"{big}"}}"#),
                None,
            );
        }
        let kept: usize = s
            .streams
            .values()
            .flat_map(|x| &x.log)
            .map(|(_, e)| e.len())
            .sum();
        assert_eq!(kept, s.log_bytes);
        assert!(kept <= MAX_LOG_BYTES, "{kept}");
        assert!(
            kept > MAX_LOG_BYTES - (2 << 20),
            "the newest are kept: {kept}"
        );
        let mut json_only = Streams::default();
        let _rx = json_only.open_for_request(&json!({"id": 1}), true);
        json_only.route(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#, None);
        assert_eq!(json_only.log_bytes, 0);
    }

    /// What the transport's sessions keep together is bounded too: past the bound, the session
    /// that keeps another event lets go of its own oldest first, and a session that ends gives
    /// back what it kept. Before, each session kept up to 8 MiB whatever the others kept, so
    /// 1,024 sessions could make the host hold 8 GiB.
    #[test]
    fn what_the_sessions_keep_together_is_bounded() {
        // Room for three of the answers below, and a half.
        let budget = Arc::new(ReplayBudget::new(7 << 19));
        let big = "x".repeat(1 << 20);
        let answer = |s: &mut Streams, id: u64| {
            let _rx = s.open_for_request(&json!({"id": id}), false);
            s.route(
                &format!(r#"{{"jsonrpc":"2.0","id":{id},"result":"{big}"}}"#),
                None,
            );
        };
        let mut first = Streams::sharing(budget.clone());
        for id in 0..2 {
            answer(&mut first, id);
        }
        let mut second = Streams::sharing(budget.clone());
        for id in 0..3 {
            answer(&mut second, id);
        }
        assert!(budget.kept() <= 7 << 19, "{}", budget.kept());
        assert_eq!(budget.kept(), first.log_bytes + second.log_bytes);
        assert!(
            first.log_bytes > 1 << 20,
            "the other session's events are not let go of: {}",
            first.log_bytes
        );
        assert!(
            (1 << 20..2 << 20).contains(&second.log_bytes),
            "the newest is kept, its older ones let go of: {}",
            second.log_bytes
        );
        drop(first);
        assert_eq!(budget.kept(), second.log_bytes);

        // Sessions holding the whole budget (each within its floor) do not take resumption
        // from another: it keeps what fits in its own floor.
        let full = Arc::new(ReplayBudget::new(512 << 10));
        let under_floor = "x".repeat(200 << 10);
        let hogs: Vec<Streams> = (0..3)
            .map(|_| {
                let mut hog = Streams::sharing(full.clone());
                let _rx = hog.open_for_request(&json!({"id": 1}), false);
                hog.route(
                    &format!(r#"{{"jsonrpc":"2.0","id":1,"result":"{under_floor}"}}"#),
                    None,
                );
                hog
            })
            .collect();
        assert!(hogs.iter().all(|h| h.log_bytes > 0));
        let mut small = Streams::sharing(full.clone());
        let _rx = small.open_for_request(&json!({"id": 1}), false);
        small.route(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#, None);
        assert!(full.over());
        assert!(small.log_bytes > 0, "kept within its floor");
    }

    /// A silent stream read as a stream carries a comment (no event: no id, no data) after
    /// each silence; events pass as they come, and the stream still ends when it ends.
    #[tokio::test]
    async fn a_silent_stream_carries_a_comment_now_and_then() {
        use tokio_stream::StreamExt;
        let mut s = Streams::default();
        let silence = std::time::Duration::from_millis(50);
        let mut rx = s
            .open_for_request(&json!({"id": 7}), false)
            .keep_alive(silence);
        let started = tokio::time::Instant::now();
        let first = rx.next().await.unwrap();
        assert_eq!(&first[..], KEEP_ALIVE_COMMENT);
        assert!(started.elapsed() >= silence);
        assert_eq!(data_of(&first), None);
        s.route(r#"{"jsonrpc":"2.0","id":7,"result":{}}"#, None);
        let answer = rx.next().await.unwrap();
        assert!(data_of(&answer).unwrap().contains("\"id\":7"));
        assert_eq!(rx.next().await, None, "the stream ended");
    }

    /// A cancelled request is answered by nobody: its stream ends, and it no longer counts
    /// as in flight (nor takes the messages of no request, nor keeps its session in use).
    #[test]
    fn a_cancelled_request_ends_its_stream_and_is_in_flight_no_more() {
        let mut s = Streams::default();
        let mut rx = s.open_for_request(&json!({"id": 7}), false);
        assert!(s.in_flight(&json!({"id": 7})));
        s.cancelled("7");
        assert!(!s.in_flight(&json!({"id": 7})));
        assert!(!s.in_use());
        assert!(rx.rx.try_recv().is_err(), "the stream ended");
    }

    #[test]
    fn a_request_stream_carries_its_notifications_then_its_response_and_ends() {
        let mut s = Streams::default();
        let mut rx = s.open_for_request(&json!({"id": 7}), false);
        s.route(
            r#"{"jsonrpc":"2.0","method":"notifications/progress","params":{}}"#,
            None,
        );
        s.route(r#"{"jsonrpc":"2.0","id":7,"result":{}}"#, None);
        let got = drain(&mut rx);
        assert_eq!(got.len(), 2);
        assert!(got[1].contains("\"id\":7"));
        assert!(rx.rx.try_recv().is_err(), "the stream ended");
    }

    #[test]
    fn a_json_only_stream_carries_only_its_response_however_much_comes_before() {
        let mut s = Streams::default();
        let mut rx = s.open_for_request(&json!({"id": 7}), true);
        for _ in 0..(2 * CHANNEL) {
            s.route(
                r#"{"jsonrpc":"2.0","method":"notifications/message","params":{}}"#,
                Some("7"),
            );
        }
        s.route(r#"{"jsonrpc":"2.0","id":7,"result":{}}"#, None);
        let got = drain(&mut rx);
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(got[0].contains("\"id\":7"));
    }

    #[test]
    fn a_lost_stream_resumes_after_the_last_event_seen() {
        let mut s = Streams::default();
        let rx = s.open_for_request(&json!({"id": "a"}), false);
        s.route(
            r#"{"jsonrpc":"2.0","method":"notifications/message","params":{"n":1}}"#,
            None,
        );
        drop(rx); // the connection is lost
        s.route(
            r#"{"jsonrpc":"2.0","method":"notifications/message","params":{"n":2}}"#,
            None,
        );
        let mut resumed = s.attach(Target::Resume("1-0".into())).unwrap();
        s.route(r#"{"jsonrpc":"2.0","id":"a","result":{}}"#, None);
        let got = drain(&mut resumed);
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got[0].contains("\"n\":2"));
        assert!(got[1].contains("\"result\""));
        assert_eq!(
            s.attach(Target::Resume("9-0".into())).unwrap_err(),
            AttachError::Unknown
        );
    }

    /// A finished stream has one replay reader at a time: every GET resuming it would
    /// otherwise hold a copy of all it kept, multiplying the session's bound on what is
    /// kept. A reader keeps the session in use; once it is gone the stream can be resumed
    /// again.
    #[test]
    fn a_stream_has_one_replay_reader_at_a_time() {
        let mut s = Streams::default();
        drop(s.open_for_request(&json!({"id": 1}), false)); // the connection is lost
        s.route(
            r#"{"jsonrpc":"2.0","method":"notifications/message","params":{}}"#,
            None,
        );
        s.route(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#, None);
        assert!(!s.in_use());
        let mut first = s.attach(Target::Resume("1-0".into())).unwrap();
        assert_eq!(
            s.attach(Target::Resume("1-0".into())).unwrap_err(),
            AttachError::Busy
        );
        assert!(s.in_use(), "a GET being read keeps the session in use");
        assert_eq!(drain(&mut first).len(), 1);
        drop(first);
        assert!(!s.in_use());
        let mut again = s.attach(Target::Resume("1-0".into())).unwrap();
        assert_eq!(drain(&mut again).len(), 1);
    }

    /// A session has at most [`MAX_GETS`] GETs open, and what a GET replays is the log's own
    /// bytes, not a copy.
    #[test]
    fn gets_are_bounded_and_a_replay_shares_the_kept_bytes() {
        let mut s = Streams::default();
        for id in 1..=MAX_GETS {
            drop(s.open_for_request(&json!({"id": id}), false));
            s.route(
                r#"{"jsonrpc":"2.0","method":"notifications/message","params":{}}"#,
                None,
            );
            s.route(
                &format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{{}}}}"#),
                None,
            );
        }
        let mut open: Vec<Events> = (1..=MAX_GETS)
            .map(|n| s.attach(Target::Resume(format!("{n}-0"))).unwrap())
            .collect();
        let replayed = open[0].rx.try_recv().unwrap();
        let kept = &s.streams[&1].log[1].1;
        assert_eq!(replayed.as_ptr(), kept.as_ptr(), "shared, not copied");
        assert_eq!(
            s.attach(Target::Standalone).unwrap_err(),
            AttachError::TooMany
        );
        open.pop();
        assert!(s.attach(Target::Standalone).is_ok());
    }

    #[test]
    fn progress_goes_to_the_request_that_asked_for_it() {
        let mut s = Streams::default();
        let mut first = s.open_for_request(
            &json!({"id": 1, "params": {"_meta": {"progressToken": "p1"}}}),
            false,
        );
        let mut second = s.open_for_request(&json!({"id": 2}), false);
        s.route(r#"{"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":"p1","progress":5}}"#, None);
        assert_eq!(drain(&mut first).len(), 1);
        assert!(drain(&mut second).is_empty());
    }

    #[test]
    fn what_a_request_sends_goes_on_its_own_stream() {
        let mut s = Streams::default();
        let mut call = s.open_for_request(&json!({"id": 1}), false);
        let mut ping = s.open_for_request(&json!({"id": "p"}), false);
        s.route(
            r#"{"jsonrpc":"2.0","id":"flowhost-relay-1","method":"sampling/createMessage","params":{}}"#,
            Some("1"),
        );
        s.route(
            r#"{"jsonrpc":"2.0","method":"notifications/message","params":{}}"#,
            Some("1"),
        );
        assert_eq!(drain(&mut call).len(), 2);
        assert!(
            drain(&mut ping).is_empty(),
            "not on the newest request's stream"
        );
    }

    #[test]
    fn a_request_for_a_json_only_client_goes_to_the_get_stream_or_back_to_its_sender() {
        let mut s = Streams::default();
        let mut call = s.open_for_request(&json!({"id": 1}), true);
        let asks = r#"{"jsonrpc":"2.0","id":"flowhost-relay-1","method":"sampling/createMessage","params":{}}"#;
        let back = s.route(asks, Some("1")).unwrap();
        assert_eq!(back.id, json!("flowhost-relay-1"));
        assert!(
            back.why.contains("accepts only application/json")
                && back.why.ends_with("cannot receive sampling/createMessage"),
            "{}",
            back.why
        );
        // A notification has no answer to wait for, and the client reads only its response:
        // nothing is returned, and nothing is carried.
        let note = r#"{"jsonrpc":"2.0","method":"notifications/message","params":{}}"#;
        assert!(s.route(note, Some("1")).is_none());
        assert!(drain(&mut call).is_empty());
        // With the GET stream open, the request goes there.
        let mut get = s.attach(Target::Standalone).unwrap();
        assert!(s.route(asks, Some("1")).is_none());
        assert_eq!(drain(&mut get).len(), 1);
        assert!(drain(&mut call).is_empty());
        // A closed GET stream carries nothing.
        drop(get);
        assert!(s.route(asks, Some("1")).is_some());
        // A client that takes SSE gets the request on its own stream.
        let mut sse = s.open_for_request(&json!({"id": 2}), false);
        assert!(s.route(asks, Some("2")).is_none());
        assert_eq!(drain(&mut sse).len(), 1);
    }

    /// A message of no request (a resource update) goes to the GET stream while a client
    /// reads it, not to the newest request in flight, whose client may read nothing but its
    /// response (JSON only).
    #[test]
    fn a_message_of_no_request_goes_to_the_get_stream_first() {
        let mut s = Streams::default();
        let mut call = s.open_for_request(&json!({"id": 1}), true);
        let mut get = s.attach(Target::Standalone).unwrap();
        assert!(s.route(UPDATED, None).is_none());
        assert_eq!(drain(&mut get).len(), 1);
        assert!(drain(&mut call).is_empty());
        // An SSE request in flight does not take it either.
        let mut sse = s.open_for_request(&json!({"id": 2}), false);
        assert!(s.route(UPDATED, None).is_none());
        assert_eq!(drain(&mut get).len(), 1);
        assert!(drain(&mut sse).is_empty());
    }

    /// Without a GET stream read, a message of no request goes to the newest request whose
    /// client reads SSE, past newer JSON-only ones.
    #[test]
    fn without_a_get_stream_a_message_of_no_request_goes_to_a_request_that_reads_sse() {
        let mut s = Streams::default();
        let mut sse = s.open_for_request(&json!({"id": 1}), false);
        let mut json_only = s.open_for_request(&json!({"id": 2}), true);
        assert!(s.route(UPDATED, None).is_none());
        assert_eq!(drain(&mut sse).len(), 1);
        assert!(drain(&mut json_only).is_empty());
        // A request to the client with no stream to carry it is returned to its sender.
        let mut only = Streams::default();
        let _json_only = only.open_for_request(&json!({"id": 2}), true);
        let asks = r#"{"jsonrpc":"2.0","id":"flowhost-relay-1","method":"roots/list"}"#;
        let back = only.route(asks, None).unwrap();
        assert!(
            back.why.ends_with("cannot receive roots/list"),
            "{}",
            back.why
        );
    }

    /// A response to no request in flight (one the client cancelled) is not carried: the
    /// GET stream carries no responses, and no other request's stream may take it.
    #[test]
    fn a_response_to_no_request_in_flight_is_not_carried() {
        let mut s = Streams::default();
        let mut get = s.attach(Target::Standalone).unwrap();
        let mut other = s.open_for_request(&json!({"id": 2}), false);
        assert!(
            s.route(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#, None)
                .is_none()
        );
        assert!(drain(&mut get).is_empty());
        assert!(drain(&mut other).is_empty());
    }

    const UPDATED: &str = r#"{"jsonrpc":"2.0","method":"notifications/resources/updated","params":{"uri":"file:///x"}}"#;

    #[test]
    fn one_get_stream_at_a_time() {
        let mut s = Streams::default();
        let mut rx = s.attach(Target::Standalone).unwrap();
        assert_eq!(s.attach(Target::Standalone).unwrap_err(), AttachError::Busy);
        s.route(
            r#"{"jsonrpc":"2.0","method":"notifications/resources/updated","params":{}}"#,
            None,
        );
        assert_eq!(drain(&mut rx).len(), 1);
        drop(rx);
        assert!(
            s.attach(Target::Standalone).is_ok(),
            "a closed GET stream can be reopened"
        );
    }
}
