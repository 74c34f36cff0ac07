//! The resources a session's client subscribed to, by server. A subscription belongs to the
//! session, not to the executor that first took it: the first live executor holding one is
//! kept past its idle time (one of the current generation first; after a reload, one of the
//! previous generation keeps watching until the session binds that server again), and when
//! the session binds an executor of a server whose subscriptions no live idle executor of
//! the current generation holds (the holder was retired: a reload, a label it no longer
//! fits, an exit), the host subscribes that executor again. Updates reach the client only
//! for the URIs subscribed here, so an unsubscribed resource stays quiet whichever executor
//! still watches it.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

/// Most subscriptions one session holds: each is renewed on every executor that takes it
/// over, so the set is bounded.
pub(super) const MAX_SUBSCRIPTIONS: usize = 256;

/// The session's subscriptions, shared with the sinks that pass updates on.
#[derive(Clone, Default)]
pub(super) struct Subscriptions {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Default)]
struct Inner {
    by_server: HashMap<String, BTreeSet<String>>,
    /// Subscribe requests forwarded and not answered yet, by (server, URI).
    in_flight: HashMap<(String, String), usize>,
}

/// What adding a subscription did.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Added {
    /// It is new.
    New,
    /// The client had it already.
    Already,
    /// The session holds the most it may: not added.
    Full,
}

impl Subscriptions {
    /// Adds `uri` of `server` unless the session holds `max` subscriptions, as one step, and
    /// counts a subscribe request in flight for it (until [`Self::answered`]).
    pub(super) fn begin(&self, server: &str, uri: &str, max: usize) -> Added {
        let Ok(mut s) = self.inner.lock() else {
            return Added::Full;
        };
        let held = s.by_server.get(server).is_some_and(|u| u.contains(uri));
        if !held && s.by_server.values().map(BTreeSet::len).sum::<usize>() >= max {
            return Added::Full;
        }
        *s.in_flight
            .entry((server.to_string(), uri.to_string()))
            .or_default() += 1;
        if held {
            return Added::Already;
        }
        s.by_server
            .entry(server.to_string())
            .or_default()
            .insert(uri.to_string());
        Added::New
    }

    /// Ends a subscribe request counted by [`Self::begin`]; returns how many for `uri` are
    /// still in flight.
    pub(super) fn answered(&self, server: &str, uri: &str) -> usize {
        self.inner.lock().map_or(0, |mut s| {
            let key = (server.to_string(), uri.to_string());
            let left = s.in_flight.get(&key).map_or(0, |n| n.saturating_sub(1));
            if left == 0 {
                s.in_flight.remove(&key);
            } else {
                s.in_flight.insert(key, left);
            }
            left
        })
    }

    /// Removes `uri` of `server`; `false` if it was not there.
    pub(super) fn remove(&self, server: &str, uri: &str) -> bool {
        self.inner.lock().is_ok_and(|mut s| {
            s.by_server
                .get_mut(server)
                .is_some_and(|uris| uris.remove(uri))
        })
    }

    /// Whether the client is subscribed to `uri` of `server`.
    pub(super) fn contains(&self, server: &str, uri: &str) -> bool {
        self.inner.lock().is_ok_and(|s| {
            s.by_server
                .get(server)
                .is_some_and(|uris| uris.contains(uri))
        })
    }

    /// The URIs of `server` the client is subscribed to and no subscribe request of which
    /// is in flight (that request's executor will hold it).
    pub(super) fn settled(&self, server: &str) -> BTreeSet<String> {
        self.inner.lock().map_or_else(
            |_| BTreeSet::new(),
            |s| {
                let mut uris = s.by_server.get(server).cloned().unwrap_or_default();
                uris.retain(|u| !s.in_flight.contains_key(&(server.to_string(), u.clone())));
                uris
            },
        )
    }
}

/// What idle reaping knows of one idle executor of a server.
pub(super) struct IdleExecutor<'a> {
    /// Idle past the configured time.
    pub past_limit: bool,
    /// Running: the subscriptions it took are live.
    pub live: bool,
    /// Of the current generation (one of an earlier one serves no call any more).
    pub current: bool,
    /// The URIs it was subscribed to for the session.
    pub subscribed: &'a BTreeSet<String>,
}

/// Which of a server's idle executors (in their order) to stop: those idle past the limit,
/// unless one is the first live holder of a URI the client is still subscribed to
/// (`wanted`), holders of the current generation counted first. An executor that exited
/// holds nothing; a second holder of the same URI is redundant.
pub(super) fn idle_to_stop(idle: &[IdleExecutor<'_>], wanted: impl Fn(&str) -> bool) -> Vec<bool> {
    let mut covered: BTreeSet<&str> = BTreeSet::new();
    let mut stop = vec![false; idle.len()];
    let order = (0..idle.len())
        .filter(|&i| idle[i].current)
        .chain((0..idle.len()).filter(|&i| !idle[i].current));
    for i in order {
        let e = &idle[i];
        let needed = e.live
            && e.subscribed
                .iter()
                .any(|u| wanted(u) && !covered.contains(u.as_str()));
        stop[i] = e.past_limit && !needed;
        if !stop[i] && e.live {
            covered.extend(e.subscribed.iter().map(String::as_str));
        }
    }
    stop
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(uris: &[&str]) -> BTreeSet<String> {
        uris.iter().map(|u| u.to_string()).collect()
    }

    #[test]
    fn only_the_first_live_holder_of_a_wanted_uri_outlives_its_idle_time() {
        let (a, b, none) = (set(&["r:a"]), set(&["r:a", "r:b"]), set(&[]));
        let wanted = |u: &str| u != "r:gone";
        let e = |past_limit, live, current, subscribed| IdleExecutor {
            past_limit,
            live,
            current,
            subscribed,
        };
        // The first holder of r:a stays; a second holder of only r:a goes; one that also
        // holds r:b stays; one holding nothing goes.
        assert_eq!(
            idle_to_stop(
                &[
                    e(true, true, true, &a),
                    e(true, true, true, &a),
                    e(true, true, true, &b),
                    e(true, true, true, &none)
                ],
                wanted
            ),
            [false, true, false, true]
        );
        // An exited holder holds nothing, so it goes, and the live one after it stays.
        assert_eq!(
            idle_to_stop(&[e(true, false, true, &a), e(true, true, true, &a)], wanted),
            [true, false]
        );
        // A holder of the current generation is counted first: the earlier generation's
        // goes, wherever it stands; alone, it stays (it still watches for the client).
        assert_eq!(
            idle_to_stop(&[e(true, true, false, &a), e(true, true, true, &a)], wanted),
            [true, false]
        );
        assert_eq!(idle_to_stop(&[e(true, true, false, &a)], wanted), [false]);
        // A holder that is not idle long enough stays and covers what it holds.
        assert_eq!(
            idle_to_stop(&[e(false, true, true, &a), e(true, true, true, &a)], wanted),
            [false, true]
        );
        // A URI the client unsubscribed keeps nobody.
        let gone = set(&["r:gone"]);
        assert_eq!(idle_to_stop(&[e(true, true, true, &gone)], wanted), [true]);
        // Nothing idle past the limit is stopped, holder or not.
        assert_eq!(
            idle_to_stop(
                &[e(false, false, true, &none), e(false, true, true, &a)],
                wanted
            ),
            [false, false]
        );
    }

    #[test]
    fn adding_is_bounded_in_one_step_and_requests_in_flight_are_counted() {
        let s = Subscriptions::default();
        assert_eq!(s.begin("a", "file:///x", 2), Added::New);
        assert_eq!(s.begin("a", "file:///x", 2), Added::Already, "once");
        assert!(s.contains("a", "file:///x"));
        assert!(
            !s.contains("b", "file:///x"),
            "another server's is another resource"
        );
        assert_eq!(s.begin("b", "file:///x", 2), Added::New);
        assert_eq!(s.begin("b", "file:///y", 2), Added::Full);
        assert!(!s.contains("b", "file:///y"));
        assert_eq!(
            s.begin("b", "file:///x", 2),
            Added::Already,
            "held: no limit"
        );
        assert_eq!(s.answered("a", "file:///x"), 1);
        assert_eq!(s.answered("a", "file:///x"), 0);
        assert_eq!(s.answered("a", "file:///x"), 0, "never below zero");
        let shared = s.clone();
        assert!(shared.remove("a", "file:///x"));
        assert!(!s.contains("a", "file:///x"), "clones share one set");
        assert!(!s.remove("a", "file:///x"));
        assert!(s.settled("a").is_empty());
        assert!(s.settled("b").is_empty(), "a subscribe of it is in flight");
        assert_eq!(s.answered("b", "file:///x"), 1);
        assert_eq!(s.answered("b", "file:///x"), 0);
        assert_eq!(s.settled("b").len(), 1);
    }
}
