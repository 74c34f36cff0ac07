//! The HTTP connections that have not yet carried an authenticated request (in the TLS
//! handshake, waiting for a request's head, or refused one), so that clients without
//! credentials cannot hold the listener's connections against those with them.
//!
//! At most [`UNPROVEN_LIMIT`] connections are unproven at once. A newer one takes the place
//! of the oldest, which is closed: a client that means to authenticate sends its request as
//! soon as it has connected, so the oldest unproven connection is the one least likely to
//! be a client's. A connection leaves the count once a request on it is authenticated; from
//! then on only the listener's own limit ([`crate::config::MAX_CONNECTIONS`]) holds it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// Most connections unproven at once: half of the listener's limit, so a flood of
/// connections without credentials leaves the other half to authenticated ones, and every
/// new connection still gets a place to send its first request in.
pub const UNPROVEN_LIMIT: usize = crate::config::MAX_CONNECTIONS / 2;

/// The unproven connections, oldest first.
#[derive(Debug)]
pub struct Unproven {
    open: Mutex<Open>,
    limit: usize,
}

#[derive(Debug, Default)]
struct Open {
    /// Each unproven connection by the order it was accepted in.
    by_age: BTreeMap<u64, Arc<Place>>,
    next: u64,
}

/// What tells one connection to close.
#[derive(Debug, Default)]
struct Place {
    closing: Notify,
    told: AtomicBool,
}

/// One accepted connection while it is unproven; it leaves the count when proven or dropped.
#[derive(Debug)]
pub struct UnprovenSlot {
    unproven: Arc<Unproven>,
    id: u64,
    place: Arc<Place>,
}

impl Unproven {
    /// No connection yet; at most `limit` unproven at once.
    pub fn new(limit: usize) -> Arc<Unproven> {
        Arc::new(Unproven {
            open: Mutex::default(),
            limit,
        })
    }

    /// Counts a newly accepted connection as unproven, telling the oldest to close when
    /// `limit` are already; the slot, and whether one was told. `None` when the count
    /// cannot be read (the connection is refused, as any doubt is).
    pub fn enter(self: &Arc<Self>) -> Option<(UnprovenSlot, bool)> {
        let mut open = self.open.lock().ok()?;
        let mut told = false;
        while open.by_age.len() >= self.limit {
            let Some((_, oldest)) = open.by_age.pop_first() else {
                break;
            };
            oldest.told.store(true, Ordering::SeqCst);
            // A stored permit: the connection closes even if it is not waiting yet.
            oldest.closing.notify_one();
            told = true;
        }
        let id = open.next;
        open.next += 1;
        let place = Arc::new(Place::default());
        open.by_age.insert(id, place.clone());
        Some((
            UnprovenSlot {
                unproven: self.clone(),
                id,
                place,
            },
            told,
        ))
    }

    /// How many connections are unproven.
    #[cfg(test)]
    fn count(&self) -> usize {
        self.open.lock().map(|o| o.by_age.len()).unwrap_or(0)
    }
}

impl UnprovenSlot {
    /// Takes the connection out of the count: a request on it was authenticated. False when
    /// it had been told to close already (a newer connection took its place), and is closing.
    pub fn prove(&self) -> bool {
        if let Ok(mut open) = self.unproven.open.lock() {
            open.by_age.remove(&self.id);
        }
        // Told under the same lock that took it out of the count: read after it, this is final.
        !self.place.told.load(Ordering::SeqCst)
    }

    /// Completes when the connection is told to close: a newer one took its place while
    /// it was unproven. Never completes once it is proven.
    pub async fn closing(&self) {
        self.place.closing.notified().await
    }
}

impl Drop for UnprovenSlot {
    fn drop(&mut self) {
        if let Ok(mut open) = self.unproven.open.lock() {
            open.by_age.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_newer_connection_takes_the_place_of_the_oldest() {
        let unproven = Unproven::new(2);
        let (first, told) = unproven.enter().unwrap();
        assert!(!told);
        let (second, _) = unproven.enter().unwrap();
        let (third, told) = unproven.enter().unwrap();
        assert!(told, "the oldest was told to close");
        assert_eq!(unproven.count(), 2);
        tokio::time::timeout(std::time::Duration::from_secs(1), first.closing())
            .await
            .expect("the oldest closes");
        assert!(!first.prove(), "a connection told to close stays closing");

        assert!(second.prove(), "a request on it was authenticated");
        assert_eq!(unproven.count(), 1);
        let (_fourth, told) = unproven.enter().unwrap();
        assert!(!told, "a proven connection holds no unproven place");
        let (_fifth, told) = unproven.enter().unwrap();
        assert!(told);
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(50), second.closing())
                .await
                .is_err(),
            "a proven connection is never told to close"
        );
        tokio::time::timeout(std::time::Duration::from_secs(1), third.closing())
            .await
            .expect("the next oldest closes");
        assert!(second.prove(), "proving twice is still proven");
    }

    #[test]
    fn a_dropped_connection_leaves_the_count() {
        let unproven = Unproven::new(4);
        let (slot, _) = unproven.enter().unwrap();
        assert_eq!(unproven.count(), 1);
        drop(slot);
        assert_eq!(unproven.count(), 0);
    }
}
