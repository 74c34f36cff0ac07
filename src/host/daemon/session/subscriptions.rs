//! The resources a session's client subscribed to, by server. A subscription belongs to the
//! session, not to the executor that first took it: the first live executor holding one is
//! kept past its idle time, and when the session binds an executor of a server whose
//! subscriptions no live idle executor holds any more (the holder was retired: a reload, a
//! label it no longer fits, an exit), the host subscribes that executor again. Updates reach the client only for
//! the URIs subscribed here, so an unsubscribed resource stays quiet whichever executor
//! still watches it.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

/// Most subscriptions one session holds: each is renewed on every executor that takes it
/// over, so the set is bounded.
pub(super) const MAX_SUBSCRIPTIONS: usize = 256;

/// The session's subscriptions, shared with the sinks that pass updates on.
#[derive(Clone, Default)]
pub(super) struct Subscriptions {
    by_server: Arc<Mutex<HashMap<String, BTreeSet<String>>>>,
}

impl Subscriptions {
    /// Adds `uri` of `server`; `false` if it was there already.
    pub(super) fn add(&self, server: &str, uri: &str) -> bool {
        self.by_server.lock().is_ok_and(|mut s| {
            s.entry(server.to_string())
                .or_default()
                .insert(uri.to_string())
        })
    }

    /// Removes `uri` of `server`; `false` if it was not there.
    pub(super) fn remove(&self, server: &str, uri: &str) -> bool {
        self.by_server
            .lock()
            .is_ok_and(|mut s| s.get_mut(server).is_some_and(|uris| uris.remove(uri)))
    }

    /// Whether the client is subscribed to `uri` of `server`.
    pub(super) fn contains(&self, server: &str, uri: &str) -> bool {
        self.by_server
            .lock()
            .is_ok_and(|s| s.get(server).is_some_and(|uris| uris.contains(uri)))
    }

    /// How many subscriptions the session holds, over all servers.
    pub(super) fn len(&self) -> usize {
        self.by_server
            .lock()
            .map_or(0, |s| s.values().map(BTreeSet::len).sum())
    }

    /// The URIs of `server` the client is subscribed to.
    pub(super) fn of(&self, server: &str) -> BTreeSet<String> {
        self.by_server
            .lock()
            .ok()
            .and_then(|s| s.get(server).cloned())
            .unwrap_or_default()
    }
}

/// What idle reaping knows of one idle executor of a server.
pub(super) struct IdleExecutor<'a> {
    /// Idle past the configured time.
    pub past_limit: bool,
    /// Of the current generation and running: the subscriptions it took are live.
    pub holds: bool,
    /// The URIs it was subscribed to for the session.
    pub subscribed: &'a BTreeSet<String>,
}

/// Which of a server's idle executors (in their order) to stop: those idle past the limit,
/// unless one is the first live holder of a URI the client is still subscribed to
/// (`wanted`). A holder that is not live holds nothing; a second holder of the same URI is
/// redundant.
pub(super) fn idle_to_stop(idle: &[IdleExecutor<'_>], wanted: impl Fn(&str) -> bool) -> Vec<bool> {
    let mut covered: BTreeSet<&str> = BTreeSet::new();
    idle.iter()
        .map(|e| {
            let needed = e.holds
                && e.subscribed
                    .iter()
                    .any(|u| wanted(u) && !covered.contains(u.as_str()));
            let stop = e.past_limit && !needed;
            if !stop && e.holds {
                covered.extend(e.subscribed.iter().map(String::as_str));
            }
            stop
        })
        .collect()
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
        let e = |past_limit, holds, subscribed| IdleExecutor {
            past_limit,
            holds,
            subscribed,
        };
        // The first holder of r:a stays; a second holder of only r:a goes; one that also
        // holds r:b stays; one holding nothing goes.
        assert_eq!(
            idle_to_stop(
                &[
                    e(true, true, &a),
                    e(true, true, &a),
                    e(true, true, &b),
                    e(true, true, &none)
                ],
                wanted
            ),
            [false, true, false, true]
        );
        // An old-generation or exited holder holds nothing, so it goes, and the live one
        // after it stays.
        assert_eq!(
            idle_to_stop(&[e(true, false, &a), e(true, true, &a)], wanted),
            [true, false]
        );
        // A holder that is not idle long enough stays and covers what it holds.
        assert_eq!(
            idle_to_stop(&[e(false, true, &a), e(true, true, &a)], wanted),
            [false, true]
        );
        // A URI the client unsubscribed keeps nobody.
        let gone = set(&["r:gone"]);
        assert_eq!(idle_to_stop(&[e(true, true, &gone)], wanted), [true]);
        // Nothing idle past the limit is stopped, holder or not.
        assert_eq!(
            idle_to_stop(&[e(false, false, &none), e(false, true, &a)], wanted),
            [false, false]
        );
    }

    #[test]
    fn a_subscription_is_per_server_and_ends_when_removed() {
        let s = Subscriptions::default();
        assert!(s.add("a", "file:///x"));
        assert!(!s.add("a", "file:///x"), "once");
        assert!(s.contains("a", "file:///x"));
        assert!(
            !s.contains("b", "file:///x"),
            "another server's is another resource"
        );
        let shared = s.clone();
        assert!(shared.remove("a", "file:///x"));
        assert!(!s.contains("a", "file:///x"), "clones share one set");
        assert!(!s.remove("a", "file:///x"));
        assert!(s.of("a").is_empty());
        s.add("a", "file:///y");
        s.add("b", "file:///y");
        assert_eq!(s.len(), 2);
    }
}
