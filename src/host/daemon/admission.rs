//! Which connections the daemon serves, decided at `accept` before any shared resource is
//! taken, and how refusals are logged.
//!
//! Peers are told apart by `SO_PEERCRED`. A peer that maps to a principal takes a slot of
//! that principal's share of the sessions (an equal part of [`MAX_SESSIONS`] for each
//! configured principal), so no principal's peers, however many uids they have, can take
//! another principal's sessions (sessions opened under an earlier, larger share count
//! against the total only up to the share each principal has now, so they cannot either); a peer that maps to none (it will be refused at
//! `initialize`) has a small pool of its own, with a limit per uid. The own limit is checked
//! before any shared slot is taken, and peers that are no principal cannot hold a single
//! principal slot.
//!
//! Refusals are logged per uid and reason: the first of each interval at once, the rest as
//! one summary line per interval, so a peer looping connect/close cannot flood the log.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Most sessions of principals keeping to their shares served at once; each can run up to
/// eight executors per server, within its principal's share of the host's `max_executors`
/// (see [`super::budget`]) (sessions opened under earlier, larger shares may add to it, up
/// to [`MOST_PRINCIPAL_SESSIONS`]).
pub const MAX_SESSIONS: usize = 256;

/// Most principals' sessions open at once, whatever the shares: [`MAX_SESSIONS`] is what
/// principals keeping to their shares hold, and this bounds what sessions opened under
/// earlier, larger shares (reloads that added principals) and shares of one (more
/// principals than sessions) add to it.
pub const MOST_PRINCIPAL_SESSIONS: usize = 4 * MAX_SESSIONS;

/// Most sessions the peers of one principal hold at once when `principals` are configured:
/// an equal share of [`MAX_SESSIONS`], and at least one.
pub fn session_share(principals: usize) -> usize {
    (MAX_SESSIONS / principals.max(1)).max(1)
}
/// Most connections open at once from peers that are no principal (they are answered at
/// `initialize` with a refusal, then closed).
pub const MAX_STRANGERS: usize = 16;
/// Most connections one uid that is no principal holds open at once.
pub const MAX_STRANGERS_PER_UID: usize = 2;
/// How often refusals are summarised in the log.
pub const SUMMARY_INTERVAL: Duration = Duration::from_secs(10);
/// Most uids tracked individually between two summaries; refusals of further uids are
/// summed into one line, so the tracking itself stays bounded.
const MAX_TRACKED_UIDS: usize = 1024;

/// Whether the peer maps to a principal of the running configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerClass {
    /// A configured principal's uid or gid.
    Principal,
    /// Any other local peer.
    Stranger,
}

/// Who a connection is charged to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Peer {
    /// A peer of this principal, one of `configured` principals.
    Principal {
        /// The principal's id.
        id: String,
        /// How many principals the running configuration has.
        configured: usize,
    },
    /// A peer that maps to no principal, by uid.
    Stranger(u32),
}

impl Peer {
    /// Its class, for the refusal log.
    pub fn class(&self) -> PeerClass {
        match self {
            Peer::Principal { .. } => PeerClass::Principal,
            Peer::Stranger(_) => PeerClass::Stranger,
        }
    }
}

/// What an own limit is counted by.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Holder {
    Principal(String),
    Stranger(u32),
}

/// Why a connection was closed at `accept`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// The principal (or, for a peer that is no principal, the uid) already holds its
    /// share.
    OwnLimit,
    /// Every session slot of its class is taken.
    ClassLimit,
}

impl Refusal {
    fn describe(self, class: PeerClass) -> &'static str {
        match (self, class) {
            (Refusal::OwnLimit, PeerClass::Principal) => {
                "the principal's share of sessions reached"
            }
            (Refusal::OwnLimit, PeerClass::Stranger) => {
                "per-uid limit for peers that are no principal reached"
            }
            (Refusal::ClassLimit, PeerClass::Principal) => "session limit reached",
            (Refusal::ClassLimit, PeerClass::Stranger) => {
                "limit for peers that are no principal reached"
            }
        }
    }
}

#[derive(Default)]
struct Counts {
    by_holder: HashMap<Holder, usize>,
    principals: usize,
    strangers: usize,
}

#[derive(Default)]
struct RefusalLog {
    /// Refusals since the last summary, per (uid, class, reason); the first one was logged.
    pending: HashMap<(u32, PeerClass, Refusal), u64>,
    /// Refusals of uids beyond [`MAX_TRACKED_UIDS`].
    untracked: u64,
    last_summary: Option<Instant>,
}

/// Connection admission for one daemon: counts open connections per uid and class.
#[derive(Default)]
pub struct Admission {
    counts: Mutex<Counts>,
    log: Mutex<RefusalLog>,
}

/// One admitted connection; its slot is released when this is dropped.
pub struct Slot {
    admission: Arc<Admission>,
    holder: Holder,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The counters stay consistent under a panic elsewhere: every update is one statement.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Admission {
    /// Admits a connection of `peer`, or says why not. Its own limit is checked first;
    /// nothing is counted for a refused connection.
    pub fn admit(self: &Arc<Self>, peer: &Peer) -> Result<Slot, Refusal> {
        let (holder, own, total) = match peer {
            Peer::Principal { id, configured } => (
                Holder::Principal(id.clone()),
                session_share(*configured),
                MAX_SESSIONS,
            ),
            Peer::Stranger(uid) => (Holder::Stranger(*uid), MAX_STRANGERS_PER_UID, MAX_STRANGERS),
        };
        let mut counts = lock(&self.counts);
        if counts.by_holder.get(&holder).copied().unwrap_or(0) >= own {
            return Err(Refusal::OwnLimit);
        }
        // Principals' sessions count against the total only up to the share each may hold
        // now: sessions opened under an earlier, larger share (before a reload added
        // principals) stay, but must not keep a principal below its own share out. With
        // more principals than sessions each still gets its one. Nothing passes
        // [`MOST_PRINCIPAL_SESSIONS`].
        let full = match peer {
            Peer::Principal { .. } => {
                let counted: usize = counts
                    .by_holder
                    .iter()
                    .filter(|(h, _)| matches!(h, Holder::Principal(_)))
                    .map(|(_, n)| (*n).min(own))
                    .sum();
                (counted >= total && own > 1) || counts.principals >= MOST_PRINCIPAL_SESSIONS
            }
            Peer::Stranger(_) => counts.strangers >= total,
        };
        let class_open = match peer.class() {
            PeerClass::Principal => &mut counts.principals,
            PeerClass::Stranger => &mut counts.strangers,
        };
        if full {
            return Err(Refusal::ClassLimit);
        }
        *class_open += 1;
        *counts.by_holder.entry(holder.clone()).or_insert(0) += 1;
        Ok(Slot {
            admission: self.clone(),
            holder,
        })
    }

    /// Connections open now as (principal sessions, stranger connections).
    #[cfg(test)]
    fn open(&self) -> (usize, usize) {
        let counts = lock(&self.counts);
        (counts.principals, counts.strangers)
    }

    /// Logs a refusal: at once if it is the first of its uid and reason since the last
    /// summary, else only counted for the next summary.
    pub fn log_refusal(&self, uid: u32, class: PeerClass, refusal: Refusal) {
        let mut log = lock(&self.log);
        let key = (uid, class, refusal);
        if let Some(n) = log.pending.get_mut(&key) {
            *n += 1;
            return;
        }
        if log.pending.len() >= MAX_TRACKED_UIDS {
            log.untracked += 1;
            return;
        }
        log.pending.insert(key, 0);
        tracing::warn!(
            uid,
            "{}; closing a new connection (further refusals of this uid are summarised every {} s)",
            refusal.describe(class),
            SUMMARY_INTERVAL.as_secs()
        );
    }

    /// Writes the summary of the refusals counted since the last one (one line per uid and
    /// reason that had more than its first refusal), and starts a new interval.
    pub fn summarize(&self) {
        let mut log = lock(&self.log);
        let since = log
            .last_summary
            .map(|t| t.elapsed().as_secs())
            .unwrap_or(SUMMARY_INTERVAL.as_secs());
        for ((uid, class, refusal), n) in log.pending.drain() {
            if n > 0 {
                tracing::warn!(
                    uid,
                    refused = n,
                    "{}: {n} more connections closed in the last {since} s",
                    refusal.describe(class)
                );
            }
        }
        if log.untracked > 0 {
            tracing::warn!(
                refused = log.untracked,
                "{} more connections of other uids closed at a limit in the last {since} s",
                log.untracked
            );
            log.untracked = 0;
        }
        log.last_summary = Some(Instant::now());
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut counts = lock(&self.admission.counts);
        if let Some(n) = counts.by_holder.get_mut(&self.holder) {
            *n -= 1;
            if *n == 0 {
                counts.by_holder.remove(&self.holder);
            }
        }
        match self.holder {
            Holder::Principal(_) => counts.principals -= 1,
            Holder::Stranger(_) => counts.strangers -= 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn principal(id: &str, configured: usize) -> Peer {
        Peer::Principal {
            id: id.into(),
            configured,
        }
    }

    #[test]
    fn a_peer_at_its_own_limit_takes_no_shared_slot() {
        let a = Arc::new(Admission::default());
        let strangers: Vec<Slot> = (0..MAX_STRANGERS_PER_UID)
            .map(|_| a.admit(&Peer::Stranger(7)).unwrap())
            .collect();
        for _ in 0..1000 {
            assert_eq!(a.admit(&Peer::Stranger(7)).err(), Some(Refusal::OwnLimit));
        }
        assert_eq!(a.open(), (0, MAX_STRANGERS_PER_UID));
        // Strangers never hold principal slots: a principal still gets all of its share.
        let mine: Vec<Slot> = (0..session_share(2))
            .map(|_| a.admit(&principal("a", 2)).unwrap())
            .collect();
        assert_eq!(a.admit(&principal("a", 2)).err(), Some(Refusal::OwnLimit));
        let other: Vec<Slot> = (0..session_share(2))
            .map(|_| a.admit(&principal("b", 2)).unwrap())
            .collect();
        drop((strangers, mine, other));
        assert_eq!(a.open(), (0, 0));
        assert!(lock(&a.counts).by_holder.is_empty());
    }

    #[test]
    fn two_principals_cannot_take_a_third_ones_sessions() {
        // Before, the limit was per uid (128 of 256): two uids took every session.
        let a = Arc::new(Admission::default());
        let held: Vec<Slot> = ["a", "b"]
            .iter()
            .flat_map(|p| (0..MAX_SESSIONS).map_while(|_| a.admit(&principal(p, 3)).ok()))
            .collect();
        assert_eq!(held.len(), 2 * session_share(3));
        assert!(a.admit(&principal("c", 3)).is_ok());
        assert_eq!(session_share(1), MAX_SESSIONS);
        assert_eq!(session_share(1000), 1);
    }

    /// A reload that adds a principal shrinks every share, but the sessions the others
    /// opened under their larger share stay: the new principal is still admitted up to its
    /// own. Before, the class total (reached by the first principal alone) kept it out for
    /// as long as those sessions lasted. [`MOST_PRINCIPAL_SESSIONS`] bounds everything.
    #[test]
    fn a_principal_added_by_a_reload_gets_its_share_past_sessions_of_an_earlier_one() {
        let a = Arc::new(Admission::default());
        let first: Vec<Slot> = (0..MAX_SESSIONS)
            .map(|_| a.admit(&principal("a", 1)).unwrap())
            .collect();
        // Now two principals: a holds twice its share, b none.
        assert_eq!(a.admit(&principal("a", 2)).err(), Some(Refusal::OwnLimit));
        let second: Vec<Slot> = (0..session_share(2))
            .map(|_| a.admit(&principal("b", 2)).unwrap())
            .collect();
        assert_eq!(a.admit(&principal("b", 2)).err(), Some(Refusal::OwnLimit));
        // Further reloads: each added principal still gets its whole share.
        let third: Vec<Slot> = (0..session_share(3))
            .map(|_| a.admit(&principal("c", 3)).unwrap())
            .collect();
        let fourth: Vec<Slot> = (0..session_share(4))
            .map(|_| a.admit(&principal("d", 4)).unwrap())
            .collect();
        // Principals keeping to their shares: the total still holds.
        drop((first, second, third, fourth));
        let shared: Vec<Slot> = ["a", "b", "c", "d"]
            .iter()
            .flat_map(|p| (0..MAX_SESSIONS).map_while(|_| a.admit(&principal(p, 5)).ok()))
            .collect();
        assert_eq!(shared.len(), 4 * session_share(5));
        let fifth: Vec<Slot> = (0..session_share(5))
            .map(|_| a.admit(&principal("e", 5)).unwrap())
            .collect();
        assert_eq!(a.open().0, 5 * session_share(5));
        assert!(a.open().0 <= MAX_SESSIONS);
        drop((shared, fifth));
        // More principals than sessions: one each, up to the bound on everything.
        let many: Vec<Slot> = (0..2 * MOST_PRINCIPAL_SESSIONS)
            .map_while(|i| a.admit(&principal(&format!("p{i}"), 10_000)).ok())
            .collect();
        assert_eq!(many.len(), MOST_PRINCIPAL_SESSIONS);
        assert_eq!(
            a.admit(&principal("late", 10_000)).err(),
            Some(Refusal::ClassLimit)
        );
    }

    #[test]
    fn strangers_share_a_small_pool() {
        let a = Arc::new(Admission::default());
        let held: Vec<Slot> = (0..MAX_STRANGERS as u32)
            .map(|uid| a.admit(&Peer::Stranger(uid)).unwrap())
            .collect();
        assert_eq!(
            a.admit(&Peer::Stranger(9999)).err(),
            Some(Refusal::ClassLimit)
        );
        assert!(a.admit(&principal("a", 1)).is_ok());
        drop(held);
    }

    #[test]
    fn refusals_are_counted_once_logged() {
        let a = Admission::default();
        for _ in 0..5 {
            a.log_refusal(7, PeerClass::Stranger, Refusal::OwnLimit);
        }
        assert_eq!(
            lock(&a.log).pending[&(7, PeerClass::Stranger, Refusal::OwnLimit)],
            4
        );
        a.summarize();
        assert!(lock(&a.log).pending.is_empty());
        for uid in 0..(MAX_TRACKED_UIDS as u32 + 10) {
            a.log_refusal(uid, PeerClass::Stranger, Refusal::ClassLimit);
        }
        assert_eq!(lock(&a.log).pending.len(), MAX_TRACKED_UIDS);
        assert_eq!(lock(&a.log).untracked, 10);
    }
}
