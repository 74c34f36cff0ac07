//! The HTTP connections that have not yet carried an authenticated request (in the TLS
//! handshake, waiting for a request's head, or refused one), so that clients without
//! credentials cannot hold the listener's connections against those with them.
//!
//! At most [`UNPROVEN_LIMIT`] connections are unproven at once. Past it, and when the
//! listener holds its limit of connections in all, a connection is closed to make room for
//! the newcomer: the oldest unproven one of the source (an IPv4 address, an IPv6 /64) that
//! holds the most unproven ones. A flood from a few sources then makes room out of its own
//! connections, and a client from any other source keeps its connection long enough to
//! send its first request. A connection leaves the count once a request on it is
//! authenticated; from then on only the listener's own limits hold it.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// Most connections unproven at once: half of the listener's limit, so connections without
/// credentials always leave the other half to authenticated ones.
pub const UNPROVEN_LIMIT: usize = crate::config::MAX_CONNECTIONS / 2;

/// The unproven connections, oldest first, and how many each source holds.
#[derive(Debug)]
pub struct Unproven {
    open: Mutex<Open>,
    limit: usize,
}

#[derive(Debug, Default)]
struct Open {
    /// Each unproven connection by the order it was accepted in.
    by_age: BTreeMap<u64, Arc<Place>>,
    /// How many unproven connections each source holds (only sources that hold some).
    per_source: HashMap<IpAddr, usize>,
    next: u64,
}

/// One unproven connection: its source, whether it holds one of the listener's places,
/// and what tells it to close.
#[derive(Debug)]
struct Place {
    source: IpAddr,
    holds_place: AtomicBool,
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

impl Open {
    /// Takes connection `id` out of the count (if it is still in it).
    fn remove(&mut self, id: u64) {
        if let Some(place) = self.by_age.remove(&id)
            && let Some(held) = self.per_source.get_mut(&place.source)
        {
            *held -= 1;
            if *held == 0 {
                self.per_source.remove(&place.source);
            }
        }
    }

    /// Tells the oldest unproven connection of the source that holds the most to close,
    /// sparing `newcomer` (and, with `holding`, passing over those that hold no place of
    /// the listener's yet: closing one frees none); whether there was one.
    fn close_one(&mut self, newcomer: u64, holding: bool) -> bool {
        let closable = |(id, place): &(&u64, &Arc<Place>)| {
            **id != newcomer && (!holding || place.holds_place.load(Ordering::SeqCst))
        };
        let mut held: HashMap<IpAddr, usize> = HashMap::new();
        for (_, place) in self.by_age.iter().filter(closable) {
            *held.entry(place.source).or_default() += 1;
        }
        let Some((source, _)) = held.into_iter().max_by_key(|(_, n)| *n) else {
            return false;
        };
        let Some((&id, place)) = self
            .by_age
            .iter()
            .filter(closable)
            .find(|(_, place)| place.source == source)
        else {
            return false;
        };
        place.told.store(true, Ordering::SeqCst);
        // A stored permit: the connection closes even if it is not waiting yet.
        place.closing.notify_one();
        self.remove(id);
        true
    }
}

impl Unproven {
    /// No connection yet; at most `limit` unproven at once.
    pub fn new(limit: usize) -> Arc<Unproven> {
        Arc::new(Unproven {
            open: Mutex::default(),
            limit,
        })
    }

    /// Counts a newly accepted connection from `source` (as [`super::sources`] counts
    /// them) as unproven, telling one to close ([`Open::close_one`]) when `limit` are
    /// already; the slot, and whether one was told. `None` when the count cannot be read
    /// (the connection is refused, as any doubt is).
    pub fn enter(self: &Arc<Self>, source: IpAddr) -> Option<(UnprovenSlot, bool)> {
        let mut open = self.open.lock().ok()?;
        let id = open.next;
        open.next += 1;
        let mut told = false;
        while open.by_age.len() >= self.limit && open.close_one(id, false) {
            told = true;
        }
        let place = Arc::new(Place {
            source,
            holds_place: AtomicBool::new(false),
            closing: Notify::new(),
            told: AtomicBool::new(false),
        });
        open.by_age.insert(id, place.clone());
        *open.per_source.entry(source).or_default() += 1;
        Some((
            UnprovenSlot {
                unproven: self.clone(),
                id,
                place,
            },
            told,
        ))
    }

    /// Tells one unproven connection that holds a place of the listener's, other than
    /// `newcomer`'s, to close, to make room for it when the listener holds its limit of
    /// connections in all; whether one was told.
    pub fn make_room(&self, newcomer: &UnprovenSlot) -> bool {
        self.open
            .lock()
            .is_ok_and(|mut open| open.close_one(newcomer.id, true))
    }

    /// How many connections are unproven.
    #[cfg(test)]
    fn count(&self) -> usize {
        self.open.lock().map(|o| o.by_age.len()).unwrap_or(0)
    }
}

impl UnprovenSlot {
    /// Takes the connection out of the count: a request on it was authenticated. False when
    /// it had been told to close already (to make room for a newer one), and is closing.
    pub fn prove(&self) -> bool {
        if let Ok(mut open) = self.unproven.open.lock() {
            open.remove(self.id);
        }
        // Told under the same lock that took it out of the count: read after it, this is final.
        !self.place.told.load(Ordering::SeqCst)
    }

    /// Marks the connection as holding a place of the listener's: closing it frees one.
    pub fn holds_place(&self) {
        self.place.holds_place.store(true, Ordering::SeqCst);
    }

    /// Completes when the connection is told to close, to make room for a newer one while
    /// it was unproven. Never completes once it is proven.
    pub async fn closing(&self) {
        self.place.closing.notified().await
    }
}

impl Drop for UnprovenSlot {
    fn drop(&mut self) {
        if let Ok(mut open) = self.unproven.open.lock() {
            open.remove(self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLOOD: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(192, 0, 2, 1));
    const CLIENT: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(198, 51, 100, 1));

    async fn closes(slot: &UnprovenSlot) -> bool {
        tokio::time::timeout(std::time::Duration::from_millis(200), slot.closing())
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn the_source_holding_the_most_makes_room_out_of_its_oldest() {
        let unproven = Unproven::new(3);
        let (client, _) = unproven.enter(CLIENT).unwrap();
        let (first, _) = unproven.enter(FLOOD).unwrap();
        let (second, told) = unproven.enter(FLOOD).unwrap();
        assert!(!told);
        let (third, told) = unproven.enter(FLOOD).unwrap();
        assert!(told, "one was told to close");
        assert_eq!(unproven.count(), 3);
        assert!(closes(&first).await, "the flood's oldest closes");
        assert!(!closes(&client).await, "the client's older one is spared");
        assert!(!first.prove(), "a connection told to close stays closing");

        assert!(client.prove(), "a request on it was authenticated");
        assert_eq!(unproven.count(), 2);
        let (_another, told) = unproven.enter(CLIENT).unwrap();
        assert!(!told, "a proven connection holds no unproven place");
        assert!(
            !unproven.make_room(&third),
            "none holds a place yet: closing one would free none"
        );
        second.holds_place();
        assert!(unproven.make_room(&third));
        assert!(closes(&second).await, "room made out of the flood's oldest");
        assert!(!closes(&third).await, "never the newcomer's own");
        assert!(client.prove(), "proving twice is still proven");
    }

    #[test]
    fn a_dropped_connection_leaves_the_count() {
        let unproven = Unproven::new(4);
        let (slot, _) = unproven.enter(CLIENT).unwrap();
        assert_eq!(unproven.count(), 1);
        drop(slot);
        assert_eq!(unproven.count(), 0);
        assert!(unproven.open.lock().unwrap().per_source.is_empty());
    }
}
