//! The HTTP connections that have not yet carried an authenticated request (in the TLS
//! handshake, waiting for a request's head, or refused one), so that clients without
//! credentials cannot hold the listener's connections against those with them.
//!
//! At most [`UNPROVEN_LIMIT`] connections are unproven at once. Past it, and when the
//! listener holds its limit of connections in all, a connection is closed to make room for
//! the newcomer: the oldest unproven one of the source (an IPv4 address, an IPv6 /64) that
//! holds the most unproven ones. A flood from a few sources then makes room out of its own
//! connections. A connection whose source holds no more than the newcomer's keeps its
//! place for [`UNPROVEN_GRACE`] whatever comes after it: a flood from as many sources as
//! there are places then has its newcomers refused, rather than closing every connection
//! before its first request arrives. A newcomer that takes the place of its own source's
//! connection takes over that connection's grace as it stands, so a source that reconnects
//! cannot keep its places forever young. A connection leaves the count once a request on it
//! is authenticated; from then on only the listener's own limits hold it.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// Most connections unproven at once: half of the listener's limit, so connections without
/// credentials always leave the other half to authenticated ones.
pub const UNPROVEN_LIMIT: usize = crate::config::MAX_CONNECTIONS / 2;

/// How long an unproven connection keeps its place against a newcomer from a source that
/// holds as many unproven connections as its own, or more: time for a distant client's TLS
/// handshake and first request.
pub const UNPROVEN_GRACE: Duration = Duration::from_secs(2);

/// What a newcomer's entry closed to make room for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closed {
    /// Nothing: there was room.
    Nothing,
    /// A connection still waiting for a place of the listener's.
    Waiting,
    /// A connection holding a place of the listener's, which comes free once its task has
    /// let go of it.
    Placed,
}

/// Why a connection was not counted, and so is closed at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoEntry {
    /// The count cannot be read (a poisoned lock): refused, as any doubt is.
    Unreadable,
    /// [`UNPROVEN_LIMIT`] are unproven, and none may be closed for this newcomer: each is
    /// within its grace, of a source holding no more than the newcomer's.
    Full,
}

/// The unproven connections, oldest first, and how many each source holds.
#[derive(Debug)]
pub struct Unproven {
    open: Mutex<Open>,
    limit: usize,
}

#[derive(Debug, Default)]
struct Open {
    /// Each unproven connection by the order it was accepted in.
    by_age: BTreeMap<u64, Entry>,
    /// How many unproven connections each source holds (only sources that hold some).
    per_source: HashMap<IpAddr, usize>,
    next: u64,
}

/// One unproven connection as counted: what it shares with its task, and when its grace
/// started (its acceptance, or that of the connection of its source it replaced).
#[derive(Debug)]
struct Entry {
    place: Arc<Place>,
    since: Instant,
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
        if let Some(entry) = self.by_age.remove(&id)
            && let Some(held) = self.per_source.get_mut(&entry.place.source)
        {
            *held -= 1;
            if *held == 0 {
                self.per_source.remove(&entry.place.source);
            }
        }
    }

    /// Tells the oldest unproven connection of the source that holds the most to close, on
    /// behalf of `newcomer` from `source` (sparing it; with `holding`, passing over those
    /// that hold no place of the listener's yet: closing one frees none); the one closed,
    /// if any.
    ///
    /// Among sources holding equally many, the newcomer's own goes first, then the one
    /// whose oldest is oldest. A connection whose source holds no more than the newcomer's
    /// (the newcomer counted) is spared within its [`UNPROVEN_GRACE`], and the next source
    /// in that order is tried.
    fn close_one(
        &mut self,
        newcomer: u64,
        source: IpAddr,
        holding: bool,
        now: Instant,
    ) -> Option<Entry> {
        let closable = |(id, entry): &(&u64, &Entry)| {
            **id != newcomer && (!holding || entry.place.holds_place.load(Ordering::SeqCst))
        };
        let holds = |from: &IpAddr| self.per_source.get(from).copied().unwrap_or(0);
        let newcomers = holds(&source) + usize::from(!self.by_age.contains_key(&newcomer));
        // Each source's oldest closable connection (by_age is oldest first).
        let mut oldest: HashMap<IpAddr, (u64, Instant)> = HashMap::new();
        for (&id, entry) in self.by_age.iter().filter(closable) {
            oldest
                .entry(entry.place.source)
                .or_insert((id, entry.since));
        }
        let mut ranked: Vec<(IpAddr, (u64, Instant))> = oldest.into_iter().collect();
        ranked.sort_unstable_by_key(|(from, (id, _))| {
            Reverse((holds(from), *from == source, Reverse(*id)))
        });
        let (_, (id, _)) = ranked.into_iter().find(|(from, (_, since))| {
            holds(from) > newcomers || now.saturating_duration_since(*since) >= UNPROVEN_GRACE
        })?;
        let entry = self.by_age.get(&id)?;
        entry.place.told.store(true, Ordering::SeqCst);
        // A stored permit: the connection closes even if it is not waiting yet.
        entry.place.closing.notify_one();
        let since = entry.since;
        let place = entry.place.clone();
        self.remove(id);
        Some(Entry { place, since })
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

    /// Counts a connection from `source` (as [`super::sources`] counts them) accepted at
    /// `now` as unproven, telling one to close ([`Open::close_one`]) when `limit` are
    /// already; the slot, and what was closed.
    pub fn enter(
        self: &Arc<Self>,
        source: IpAddr,
        now: Instant,
    ) -> Result<(UnprovenSlot, Closed), NoEntry> {
        let mut open = self.open.lock().map_err(|_| NoEntry::Unreadable)?;
        let id = open.next;
        open.next += 1;
        let mut closed = Closed::Nothing;
        let mut since = now;
        while open.by_age.len() >= self.limit {
            let gone = open
                .close_one(id, source, false, now)
                .ok_or(NoEntry::Full)?;
            if gone.place.source == source {
                since = since.min(gone.since);
            }
            if gone.place.holds_place.load(Ordering::SeqCst) {
                closed = Closed::Placed;
            } else if closed == Closed::Nothing {
                closed = Closed::Waiting;
            }
        }
        let place = Arc::new(Place {
            source,
            holds_place: AtomicBool::new(false),
            closing: Notify::new(),
            told: AtomicBool::new(false),
        });
        open.by_age.insert(
            id,
            Entry {
                place: place.clone(),
                since,
            },
        );
        *open.per_source.entry(source).or_default() += 1;
        Ok((
            UnprovenSlot {
                unproven: self.clone(),
                id,
                place,
            },
            closed,
        ))
    }

    /// Tells one unproven connection that holds a place of the listener's, other than
    /// `newcomer`'s, to close, to make room for it when the listener holds its limit of
    /// connections in all; whether one was told.
    pub fn make_room(&self, newcomer: &UnprovenSlot, now: Instant) -> bool {
        let Ok(mut open) = self.open.lock() else {
            return false;
        };
        let source = newcomer.place.source;
        let Some(gone) = open.close_one(newcomer.id, source, true, now) else {
            return false;
        };
        if gone.place.source == source
            && let Some(entry) = open.by_age.get_mut(&newcomer.id)
        {
            entry.since = entry.since.min(gone.since);
        }
        true
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

    fn source(n: u8) -> IpAddr {
        IpAddr::V4(std::net::Ipv4Addr::new(203, 0, 113, n))
    }

    #[tokio::test]
    async fn the_source_holding_the_most_makes_room_out_of_its_oldest() {
        let unproven = Unproven::new(3);
        let t0 = Instant::now();
        let later = t0 + UNPROVEN_GRACE;
        let (client, _) = unproven.enter(CLIENT, t0).unwrap();
        let (first, _) = unproven.enter(FLOOD, t0).unwrap();
        let (second, closed) = unproven.enter(FLOOD, t0).unwrap();
        assert_eq!(closed, Closed::Nothing);
        let (third, closed) = unproven.enter(FLOOD, later).unwrap();
        assert_eq!(closed, Closed::Waiting, "one was told to close");
        assert_eq!(unproven.count(), 3);
        assert!(closes(&first).await, "the flood's oldest closes");
        assert!(!closes(&client).await, "the client's as old one is spared");
        assert!(!first.prove(), "a connection told to close stays closing");

        assert!(client.prove(), "a request on it was authenticated");
        assert_eq!(unproven.count(), 2);
        let (_another, closed) = unproven.enter(CLIENT, later).unwrap();
        assert_eq!(
            closed,
            Closed::Nothing,
            "a proven connection holds no unproven place"
        );
        assert!(
            !unproven.make_room(&third, later),
            "none holds a place yet: closing one would free none"
        );
        second.holds_place();
        assert!(unproven.make_room(&third, later));
        assert!(closes(&second).await, "room made out of the flood's oldest");
        assert!(!closes(&third).await, "never the newcomer's own");
        assert!(client.prove(), "proving twice is still proven");
    }

    /// With every source holding one, the oldest makes way, but only once its grace is
    /// over: until then the newcomer is refused. Before, the newcomer closed a connection
    /// of any age (at random among equals), so a flood from as many sources as there are
    /// places closed a client's connection before its first request arrived.
    #[tokio::test]
    async fn a_connection_keeps_its_place_for_its_grace_against_as_heavy_a_source() {
        let unproven = Unproven::new(3);
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let (first, _) = unproven.enter(source(1), at(0)).unwrap();
        let (second, _) = unproven.enter(source(2), at(0)).unwrap();
        let (client, _) = unproven.enter(CLIENT, at(1000)).unwrap();
        assert_eq!(
            unproven.enter(source(3), at(1500)).err(),
            Some(NoEntry::Full),
            "every connection is within its grace"
        );
        let (_third, closed) = unproven.enter(source(3), at(2100)).unwrap();
        assert_eq!(closed, Closed::Waiting);
        assert!(closes(&first).await, "the oldest, past its grace, made way");
        second.holds_place();
        let (_fourth, closed) = unproven.enter(source(4), at(2200)).unwrap();
        assert_eq!(closed, Closed::Placed, "its place comes free");
        assert!(closes(&second).await);
        assert_eq!(
            unproven.enter(source(5), at(2300)).err(),
            Some(NoEntry::Full),
            "the client's connection is the oldest, within its grace"
        );
        assert!(!closes(&client).await, "the client kept its place");
        assert!(client.prove(), "its first request came within its grace");
        assert_eq!(unproven.count(), 2);
    }

    /// A source holding more than the newcomer's makes room whatever the age of its
    /// connections, so a flood from few sources cannot refuse others by reconnecting fast.
    #[tokio::test]
    async fn a_heavier_source_makes_room_whatever_its_age() {
        let unproven = Unproven::new(3);
        let now = Instant::now();
        let (client, _) = unproven.enter(CLIENT, now).unwrap();
        let (first, _) = unproven.enter(FLOOD, now).unwrap();
        let (_second, _) = unproven.enter(FLOOD, now).unwrap();
        let (_other, closed) = unproven.enter(source(1), now).unwrap();
        assert_eq!(
            closed,
            Closed::Waiting,
            "the flood's connection made way at once"
        );
        assert!(closes(&first).await);
        assert!(!closes(&client).await);
        // Now every source holds one: each within its grace is spared, the newcomer's own
        // source's too.
        assert_eq!(unproven.enter(source(2), now).err(), Some(NoEntry::Full));
        assert_eq!(unproven.enter(source(1), now).err(), Some(NoEntry::Full));
        assert!(!closes(&client).await);
    }

    /// A source that reconnects to replace its own connection takes over that connection's
    /// grace as it stands. Before, 256 sources each reconnecting every 2 s or so kept every
    /// place young, and every other newcomer was refused.
    #[tokio::test]
    async fn a_source_that_reconnects_takes_over_its_connections_grace() {
        let unproven = Unproven::new(2);
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let (first, _) = unproven.enter(source(1), at(0)).unwrap();
        let (_other, _) = unproven.enter(source(2), at(0)).unwrap();
        assert_eq!(
            unproven.enter(source(1), at(1900)).err(),
            Some(NoEntry::Full),
            "its own connection is within its grace too"
        );
        let (again, closed) = unproven.enter(source(1), at(2100)).unwrap();
        assert_eq!(
            closed,
            Closed::Waiting,
            "it took its own connection's place"
        );
        assert!(closes(&first).await);
        let (_client, _) = unproven.enter(CLIENT, at(2200)).unwrap();
        let (_next, _) = unproven.enter(source(3), at(2300)).unwrap();
        assert!(
            closes(&again).await,
            "the reconnected one was past its grace: it started at 0, not at 2,100 ms"
        );
    }

    #[test]
    fn a_dropped_connection_leaves_the_count() {
        let unproven = Unproven::new(4);
        let (slot, _) = unproven.enter(CLIENT, Instant::now()).unwrap();
        assert_eq!(unproven.count(), 1);
        drop(slot);
        assert_eq!(unproven.count(), 0);
        assert!(unproven.open.lock().unwrap().per_source.is_empty());
    }
}
