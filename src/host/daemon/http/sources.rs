//! The HTTP connections open per source, so that one remote host cannot take every
//! connection the listener allows (`max_connections_per_source` in `[http]`).
//!
//! A source is the peer's IPv4 address, or the /64 prefix of its IPv6 address: one host
//! commonly holds a whole /64 and can connect from any address in it. An IPv4 address
//! mapped into IPv6 (a dual-stack listener's view of an IPv4 peer) counts as that IPv4
//! address.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex};

/// The connections open per source, each source holding at most its limit: past it a new
/// connection from there is closed as soon as it is accepted, so no single host holds the
/// listener's whole limit. Only sources with a connection open are kept, so it holds at most
/// as many entries as connections are open.
#[derive(Debug)]
pub struct Sources {
    open: Mutex<HashMap<IpAddr, usize>>,
    limit: usize,
}

/// One open connection, counted against its source until it is dropped.
#[derive(Debug)]
pub struct SourceSlot {
    sources: Arc<Sources>,
    source: IpAddr,
}

impl Sources {
    /// No connection open yet; each source may hold `limit`.
    pub fn new(limit: usize) -> Sources {
        Sources {
            open: Mutex::default(),
            limit,
        }
    }

    /// How many connections one source may hold.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Counts a connection of `peer` against its source, or `None` when the source holds its
    /// limit already (or the count cannot be read: refused, as any doubt is).
    pub fn take(self: &Arc<Self>, peer: IpAddr) -> Option<SourceSlot> {
        let source = source_of(peer);
        let mut open = self.open.lock().ok()?;
        let held = open.entry(source).or_default();
        if *held >= self.limit {
            return None;
        }
        *held += 1;
        Some(SourceSlot {
            sources: self.clone(),
            source,
        })
    }

    /// How many connections `peer`'s source holds.
    #[cfg(test)]
    fn held(&self, peer: IpAddr) -> usize {
        self.open
            .lock()
            .map(|o| o.get(&source_of(peer)).copied().unwrap_or(0))
            .unwrap_or(0)
    }
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        if let Ok(mut open) = self.sources.open.lock()
            && let Some(held) = open.get_mut(&self.source)
        {
            *held = held.saturating_sub(1);
            if *held == 0 {
                open.remove(&self.source);
            }
        }
    }
}

/// What connections of `peer` are counted by (see the module docs).
pub(super) fn source_of(peer: IpAddr) -> IpAddr {
    match peer.to_canonical() {
        IpAddr::V6(v6) => {
            let s = v6.segments();
            IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX_CONNECTIONS_PER_SOURCE: usize = 32;

    fn sources() -> Arc<Sources> {
        Arc::new(Sources::new(MAX_CONNECTIONS_PER_SOURCE))
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn one_source_holds_at_most_its_share_and_others_are_unaffected() {
        let sources = sources();
        let mut held: Vec<SourceSlot> = (0..MAX_CONNECTIONS_PER_SOURCE)
            .map(|_| sources.take(ip("192.0.2.7")).unwrap())
            .collect();
        assert!(sources.take(ip("192.0.2.7")).is_none());
        // The same host seen through a dual-stack listener is the same source.
        assert!(sources.take(ip("::ffff:192.0.2.7")).is_none());
        assert!(sources.take(ip("192.0.2.8")).is_some());
        // A connection that closes makes room for one more.
        held.pop();
        let again = sources.take(ip("192.0.2.7"));
        assert!(again.is_some());
        drop(again);
        drop(held);
        assert_eq!(sources.held(ip("192.0.2.7")), 0);
        assert!(sources.open.lock().unwrap().is_empty());
    }

    #[test]
    fn an_ipv6_host_is_counted_by_its_64_prefix() {
        let sources = sources();
        let _held: Vec<SourceSlot> = (0..MAX_CONNECTIONS_PER_SOURCE)
            .map(|i| {
                sources
                    .take(ip(&format!("2001:db8:1:2::{:x}", i + 1)))
                    .unwrap()
            })
            .collect();
        assert!(sources.take(ip("2001:db8:1:2:ffff::1")).is_none());
        assert!(sources.take(ip("2001:db8:1:3::1")).is_some());
        assert_eq!(
            sources.held(ip("2001:db8:1:2::99")),
            MAX_CONNECTIONS_PER_SOURCE
        );
    }
}
