//! The resources a session's client subscribed to, by server. A subscription belongs to the
//! session, not to the executor that first took it: the first live executor holding one is
//! kept past its idle time (one of the current generation first; after a reload, one of the
//! previous generation keeps watching until the session binds that server again), and when
//! the session binds an executor of a server whose subscriptions no live idle executor of
//! the current generation holds (the holder was retired: a reload, a label it no longer
//! fits, an exit), the host subscribes that executor again. A reload that takes a resource
//! away from the session's principal ends the subscription to it. Updates reach the client
//! only for the URIs subscribed here, so an unsubscribed resource stays quiet whichever
//! executor still watches it.

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
    in_flight: HashMap<(String, String), InFlight>,
}

/// The subscribe requests of one URI in flight.
#[derive(Default)]
struct InFlight {
    count: usize,
    /// The first of them added the URI to the set, and none has succeeded yet: if none
    /// does, the URI leaves the set again.
    unconfirmed: bool,
}

/// Why a subscription was not added.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Full;

/// A subscribe request in flight, counted from [`Subscriptions::begin`] until it is
/// [`Asking::answered`] or dropped (a dropped one counts as failed).
pub(super) struct Asking {
    subscriptions: Subscriptions,
    key: (String, String),
    done: bool,
}

impl Asking {
    /// Ends the request: `ok` when the executor took the subscription. When the last request
    /// of a URI ends and none succeeded, the URI the first added leaves the set.
    pub(super) fn answered(mut self, ok: bool) {
        self.end(ok);
    }

    fn end(&mut self, ok: bool) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let Ok(mut s) = self.subscriptions.inner.lock() else {
            return;
        };
        let Some(f) = s.in_flight.get_mut(&self.key) else {
            return;
        };
        f.count = f.count.saturating_sub(1);
        if ok {
            f.unconfirmed = false;
        }
        if f.count > 0 {
            return;
        }
        let unconfirmed = f.unconfirmed;
        s.in_flight.remove(&self.key);
        if unconfirmed && let Some(uris) = s.by_server.get_mut(&self.key.0) {
            uris.remove(&self.key.1);
        }
    }
}

impl Drop for Asking {
    fn drop(&mut self) {
        self.end(false);
    }
}

impl Subscriptions {
    /// Adds `uri` of `server` unless it is new and the session holds `max` subscriptions, as
    /// one step, and counts a subscribe request in flight for it.
    pub(super) fn begin(&self, server: &str, uri: &str, max: usize) -> Result<Asking, Full> {
        let Ok(mut s) = self.inner.lock() else {
            return Err(Full);
        };
        let held = s.by_server.get(server).is_some_and(|u| u.contains(uri));
        if !held && s.by_server.values().map(BTreeSet::len).sum::<usize>() >= max {
            return Err(Full);
        }
        let key = (server.to_string(), uri.to_string());
        let f = s.in_flight.entry(key.clone()).or_default();
        f.count += 1;
        if !held {
            f.unconfirmed = true;
            s.by_server
                .entry(server.to_string())
                .or_default()
                .insert(uri.to_string());
        }
        Ok(Asking {
            subscriptions: self.clone(),
            key,
            done: false,
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

    /// Removes `uri` of `server` unless a subscribe request of it is in flight (which then
    /// decides).
    pub(super) fn remove_if_settled(&self, server: &str, uri: &str) {
        if let Ok(mut s) = self.inner.lock()
            && !s
                .in_flight
                .contains_key(&(server.to_string(), uri.to_string()))
            && let Some(uris) = s.by_server.get_mut(server)
        {
            uris.remove(uri);
        }
    }

    /// Ends every settled subscription `keep` refuses (a subscribe request in flight decides
    /// its own); returns what ended, as (server, URI).
    pub(super) fn end_unless(&self, keep: impl Fn(&str, &str) -> bool) -> Vec<(String, String)> {
        let mut ended = Vec::new();
        if let Ok(mut s) = self.inner.lock() {
            let Inner {
                by_server,
                in_flight,
            } = &mut *s;
            for (server, uris) in by_server.iter_mut() {
                uris.retain(|u| {
                    let asked = in_flight.contains_key(&(server.clone(), u.clone()));
                    let kept = asked || keep(server, u);
                    if !kept {
                        ended.push((server.clone(), u.clone()));
                    }
                    kept
                });
            }
        }
        ended
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
    /// Running and able to serve (its lookups reach its own resolver): the subscriptions it
    /// took are live.
    pub live: bool,
    /// Of the current generation (one of an earlier one serves no call any more).
    pub current: bool,
    /// The URIs it was subscribed to for the session.
    pub subscribed: &'a BTreeSet<String>,
}

/// Which of a server's idle executors (in their order) to stop: those idle past the limit,
/// every one that is not live (it exited, or can no longer serve), and every one of an
/// earlier generation (it serves no call any more), unless one is the
/// first live holder of a URI the client is still subscribed to (`wanted`), holders of the
/// current generation counted first. An executor that exited holds nothing; a second holder
/// of the same URI is redundant.
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
        stop[i] = (e.past_limit || !e.current || !e.live) && !needed;
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
        let (a, b, none, gone) = (
            set(&["r:a"]),
            set(&["r:a", "r:b"]),
            set(&[]),
            set(&["r:gone"]),
        );
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
        // One of an earlier generation holding nothing wanted goes before its idle time.
        assert_eq!(
            idle_to_stop(
                &[e(false, true, false, &none), e(false, true, false, &gone)],
                wanted
            ),
            [true, true]
        );
        // A holder that is not idle long enough stays and covers what it holds.
        assert_eq!(
            idle_to_stop(&[e(false, true, true, &a), e(true, true, true, &a)], wanted),
            [false, true]
        );
        // A URI the client unsubscribed keeps nobody.
        assert_eq!(idle_to_stop(&[e(true, true, true, &gone)], wanted), [true]);
        // Nothing live and not idle past the limit is stopped, holder or not; one that is not
        // live (it exited, or can no longer serve) goes before its idle time.
        assert_eq!(
            idle_to_stop(
                &[e(false, false, true, &none), e(false, true, true, &a)],
                wanted
            ),
            [true, false]
        );
    }

    #[test]
    fn adding_is_bounded_in_one_step_and_unconfirmed_additions_leave_again() {
        let s = Subscriptions::default();
        let x = s.begin("a", "file:///x", 2).unwrap();
        assert!(s.contains("a", "file:///x"), "in the set while asked");
        assert!(s.settled("a").is_empty(), "not renewed while asked");
        x.answered(true);
        assert_eq!(s.settled("a").len(), 1);
        assert!(
            !s.contains("b", "file:///x"),
            "another server's is another resource"
        );
        // Two asking at once for a new URI, both failing: it leaves with the last.
        let (y1, y2) = (
            s.begin("b", "file:///y", 2).unwrap(),
            s.begin("b", "file:///y", 2).unwrap(),
        );
        y1.answered(false);
        assert!(s.contains("b", "file:///y"), "the other is still asking");
        drop(y2); // dropped unanswered: failed
        assert!(!s.contains("b", "file:///y"));
        // One of them succeeding keeps it, in either order.
        let (z1, z2) = (
            s.begin("b", "file:///z", 2).unwrap(),
            s.begin("b", "file:///z", 2).unwrap(),
        );
        z1.answered(true);
        z2.answered(false);
        assert!(s.contains("b", "file:///z"));
        // A subscription the client had is never taken out by a failed subscribe.
        s.begin("a", "file:///x", 2).unwrap().answered(false);
        assert!(s.contains("a", "file:///x"));
        // The limit counts what the set holds; one held already passes it.
        assert_eq!(s.begin("c", "file:///w", 2).err(), Some(Full));
        assert!(s.begin("a", "file:///x", 2).is_ok());
        // A removal that waits for the requests in flight.
        let asking = s.begin("a", "file:///x", 2).unwrap();
        s.remove_if_settled("a", "file:///x");
        assert!(s.contains("a", "file:///x"));
        asking.answered(true);
        s.remove_if_settled("a", "file:///x");
        assert!(!s.contains("a", "file:///x"));
        let shared = s.clone();
        assert!(shared.remove("b", "file:///z"));
        assert!(!s.contains("b", "file:///z"), "clones share one set");
        assert!(!s.remove("b", "file:///z"));
    }
}
