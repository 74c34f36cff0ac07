//! The resources a session's client subscribed to, by server. A subscription belongs to the
//! session, not to the executor that first took it: an executor that holds one is kept past
//! its idle time, and when the session binds an executor of a server whose subscriptions no
//! idle executor holds any more (the holder was retired: a reload, a label it no longer fits,
//! a failure), the host subscribes that executor again. Updates reach the client only for
//! the URIs subscribed here, so an unsubscribed resource stays quiet whichever executor
//! still watches it.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

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

    /// The URIs of `server` the client is subscribed to.
    pub(super) fn of(&self, server: &str) -> BTreeSet<String> {
        self.by_server
            .lock()
            .ok()
            .and_then(|s| s.get(server).cloned())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}
