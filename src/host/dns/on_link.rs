//! The networks the host is directly attached to: the destinations of its routes that have
//! no gateway (a connected subnet, a device route into a tunnel). An address there reaches a
//! neighbour of the host, which may trust the host for being one, however public the
//! address is; so an answer naming one must not bind it to an allowed name
//! ([`super::PrivateScope::OnLink`]).
//!
//! Read from `/proc/net/route` and `/proc/net/ipv6_route` (the daemon's unit allows no
//! netlink socket), renewed in the background once a reading is older than [`FRESH_FOR`],
//! so a connect in a steady stream pays a lock and a scan of the few connected networks
//! rather than a read of the routing table; the first after a quiet spell reads it. IPv4
//! routes are those of the main table only.

use std::net::{IpAddr, Ipv6Addr};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ipnet::IpNet;

/// How long a reading of the routing table is used before a new one is made: a network the
/// host attaches to counts within twice this long.
pub const FRESH_FOR: Duration = Duration::from_secs(1);

/// `RTF_UP`, `RTF_GATEWAY` and `RTF_REJECT` of `<linux/route.h>`, the flags of both files.
const RTF_UP: u32 = 0x0001;
const RTF_GATEWAY: u32 = 0x0002;
const RTF_REJECT: u32 = 0x0200;

/// Why the connected networks could not be read.
#[derive(Debug, thiserror::Error)]
pub enum OnLinkError {
    /// The IPv4 routing table could not be read or decoded.
    #[error("reading /proc/net/route: {0}")]
    Ipv4(String),
    /// The IPv6 routing table could not be read.
    #[error("reading {path}: {source}")]
    Ipv6 {
        /// The file read.
        path: String,
        /// Why it could not be.
        source: std::io::Error,
    },
    /// A line of the IPv6 routing table is not what the kernel writes.
    #[error("{path} line {line}: {why}")]
    Ipv6Line {
        /// The file read.
        path: String,
        /// Its line number, from 1.
        line: usize,
        /// What is wrong with it.
        why: &'static str,
    },
}

/// Whether a route with these properties leads to a connected network: up, no gateway, not
/// a reject route, not through the loopback device (the host's own addresses are asked
/// apart), and not a default route (a host whose every route is a device route, such as a
/// point-to-point uplink, would otherwise count the whole internet as its link).
fn connected(flags: u32, prefix: u8, device: &str) -> bool {
    flags & RTF_UP != 0 && flags & (RTF_GATEWAY | RTF_REJECT) == 0 && prefix > 0 && device != "lo"
}

/// The connected IPv4 networks of the routing table procfs reads.
fn ipv4() -> Result<Vec<IpNet>, OnLinkError> {
    let routes = procfs::net::route().map_err(|e| OnLinkError::Ipv4(e.to_string()))?;
    Ok(routes
        .into_iter()
        .filter_map(|r| {
            // A route's mask is contiguous; its length is its count of ones.
            let prefix = u32::from(r.mask).count_ones() as u8;
            connected(u32::from(r.flags), prefix, &r.iface)
                .then(|| IpNet::new(IpAddr::V4(r.destination), prefix).ok())
                .flatten()
        })
        .collect())
}

/// The connected IPv6 networks of `text`, the contents of `/proc/net/ipv6_route` (procfs
/// does not decode it): per line, the destination as 32 hex digits and its prefix length,
/// the source and its length, the next hop, the metric, two counters, the flags, the device.
fn ipv6_of(text: &str, path: &Path) -> Result<Vec<IpNet>, OnLinkError> {
    let mut networks = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let bad = |why| OnLinkError::Ipv6Line {
            path: path.display().to_string(),
            line: i + 1,
            why,
        };
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [dest, prefix, _, _, _, _, _, _, flags, device] = fields[..] else {
            return Err(bad("not ten fields"));
        };
        let dest = u128::from_str_radix(dest, 16).map_err(|_| bad("destination not hex"))?;
        let prefix = u8::from_str_radix(prefix, 16).map_err(|_| bad("prefix not hex"))?;
        let flags = u32::from_str_radix(flags, 16).map_err(|_| bad("flags not hex"))?;
        let net = IpNet::new(IpAddr::V6(Ipv6Addr::from(dest)), prefix)
            .map_err(|_| bad("prefix longer than 128"))?;
        if connected(flags, prefix, device) {
            networks.push(net);
        }
    }
    Ok(networks)
}

/// The connected IPv6 networks; none on a host without IPv6 (no such file).
fn ipv6() -> Result<Vec<IpNet>, OnLinkError> {
    let path = Path::new("/proc/net/ipv6_route");
    match std::fs::read_to_string(path) {
        Ok(text) => ipv6_of(&text, path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(source) => Err(OnLinkError::Ipv6 {
            path: path.display().to_string(),
            source,
        }),
    }
}

/// The networks the host is directly attached to now, read from its routing tables.
pub fn read() -> Result<Vec<IpNet>, OnLinkError> {
    let mut networks = ipv4()?;
    networks.extend(ipv6()?);
    Ok(networks)
}

/// The last reading of the routing tables, when it was made (`None` in it: they could not
/// be read), and whether a newer one is being made on a thread of its own.
struct Readings {
    last: Option<(Instant, Option<Arc<[IpNet]>>)>,
    refreshing: bool,
}

static READINGS: Mutex<Readings> = Mutex::new(Readings {
    last: None,
    refreshing: false,
});

/// Reads the routing tables (logging why when they cannot be read).
fn reading() -> Option<Arc<[IpNet]>> {
    match read() {
        Ok(networks) => Some(Arc::from(networks)),
        Err(e) => {
            tracing::warn!(
                error = %e,
                "the host's connected networks could not be read: every DNS answer address counts as on one"
            );
            None
        }
    }
}

/// Keeps `networks`, read from a start at `at`, as the last reading unless a newer one is.
fn keep(at: Instant, networks: Option<Arc<[IpNet]>>) {
    if let Ok(mut readings) = READINGS.lock()
        && readings.last.as_ref().is_none_or(|(last, _)| *last <= at)
    {
        readings.last = Some((at, networks));
    }
}

/// Lets a new background reading start once the thread making one is done, whichever way
/// it ends (a panic included).
struct Refreshed;

impl Drop for Refreshed {
    fn drop(&mut self) {
        if let Ok(mut readings) = READINGS.lock() {
            readings.refreshing = false;
        }
    }
}

/// The connected networks (`None`: they could not be read). A reading less than
/// [`FRESH_FOR`] old answers; one up to twice that old answers too, while a new one is made
/// on a thread of its own (so a steady stream of questions never waits for a large table
/// to be read); an older one, or none (the host was quiet), is replaced here before
/// answering, so no answer rests on a reading older than twice [`FRESH_FOR`].
fn networks() -> Option<Arc<[IpNet]>> {
    let now = Instant::now();
    let Ok(mut readings) = READINGS.lock() else {
        return None;
    };
    match readings.last.clone() {
        Some((at, networks)) if now.duration_since(at) < FRESH_FOR => networks,
        Some((at, networks)) if now.duration_since(at) < 2 * FRESH_FOR => {
            if !readings.refreshing {
                readings.refreshing = true;
                drop(readings);
                let spawned = std::thread::Builder::new()
                    .name("flowhost-routes".into())
                    .spawn(|| {
                        let _done = Refreshed;
                        let at = Instant::now();
                        keep(at, reading());
                    });
                if spawned.is_err() {
                    drop(Refreshed);
                }
            }
            networks
        }
        _ => {
            drop(readings);
            let networks = reading();
            keep(now, networks.clone());
            networks
        }
    }
}

/// Whether `ip` (an address as it reaches the host: IPv4 for an IPv4-mapped one) is on a
/// network the host is directly attached to, as its routing tables said at most twice
/// [`FRESH_FOR`] ago ([`networks`]). When they cannot be
/// read, every address counts as on one (fail closed: an answer then binds only where
/// `private_answers` opts in), and the log says why. IPv4 networks are those of the main
/// routing table (the only one `/proc/net/route` shows): a connected network in another
/// table (a VRF, a policy-routing table) is not seen.
pub fn on_host_network(ip: IpAddr) -> bool {
    networks().is_none_or(|n| n.iter().any(|net| net.contains(&ip)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const IPV6_ROUTE: &str = "\
fd000000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001     eth0
20010db8000000010000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001     eth0
fe800000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000002 00000000 00000001     eth0
00000000000000000000000000000000 00 00000000000000000000000000000000 00 fd000000000000000000000000000001 00000400 00000003 00000000 00000003     eth0
20010db8000000050000000000000000 40 00000000000000000000000000000000 00 fd000000000000000000000000000001 00000400 00000003 00000000 00000003     eth0
00000000000000000000000000000001 80 00000000000000000000000000000000 00 00000000000000000000000000000000 00000000 00000002 00000000 80200001       lo
20010db8000000090000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 ffffffff 00000001 00000000 00200200       lo
20010db80000000a0000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 ffffffff 00000001 00000000 00000201     eth1
";

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn only_routes_without_a_gateway_lead_to_connected_networks() {
        let nets = ipv6_of(IPV6_ROUTE, Path::new("ipv6_route")).unwrap();
        let shown: Vec<String> = nets.iter().map(IpNet::to_string).collect();
        // The default route and 2001:db8:0:5::/64 go through a gateway; ::1 and the
        // blackhole are on lo; 2001:db8:0:a::/64 is a reject route.
        assert_eq!(shown, ["fd00::/64", "2001:db8:0:1::/64", "fe80::/64"]);
        assert!(nets[1].contains(&ip("2001:db8:0:1::77")));
        assert!(!nets[1].contains(&ip("2001:db8:0:2::77")));
        assert!(!nets[1].contains(&ip("192.0.2.1")));
    }

    #[test]
    fn a_line_the_kernel_would_not_write_is_an_error_naming_it() {
        let text = "fd000000000000000000000000000000 40 0 00 0 0 0 0 zz eth0\n";
        let e = ipv6_of(text, Path::new("/proc/net/ipv6_route")).unwrap_err();
        assert_eq!(e.to_string(), "/proc/net/ipv6_route line 1: flags not hex");
        let e = ipv6_of("fd00 40\n", Path::new("/proc/net/ipv6_route")).unwrap_err();
        assert_eq!(e.to_string(), "/proc/net/ipv6_route line 1: not ten fields");
    }

    #[test]
    fn a_default_route_is_no_link() {
        assert!(!connected(RTF_UP, 0, "eth0"));
        assert!(connected(RTF_UP, 24, "eth0"));
        assert!(!connected(RTF_UP, 24, "lo"));
        assert!(!connected(0, 24, "eth0"), "a route that is down");
    }

    /// On this host: each IPv4 network its routing table shows without a gateway counts,
    /// and an address past them does not (unless the host has a route to it without one).
    #[test]
    fn the_hosts_own_connected_networks_count() {
        let nets = read().unwrap();
        let Some(IpNet::V4(net)) = nets.iter().find(|n| matches!(n, IpNet::V4(_))) else {
            eprintln!("SKIP: this host has no connected IPv4 network");
            return;
        };
        let inside = IpAddr::V4(net.network());
        assert!(on_host_network(inside), "{inside} on {net}");
    }
}
