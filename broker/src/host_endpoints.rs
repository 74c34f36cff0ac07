//! The host's own listeners, which no executor may reach: the broker performs an executor's
//! connects and sends itself, so one that reached the host's socket would arrive as the
//! broker (its uid, its pid) and could be taken for whoever the host maps those to.

use std::collections::HashSet;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::RwLock;

use crate::attempt::canonical_ip;

/// The unix socket files (by device and inode, so any link or bind mount of them) and the
/// TCP listening addresses the host serves on.
#[derive(Debug, Default)]
pub(crate) struct HostEndpoints {
    unix: RwLock<HashSet<(u64, u64)>>,
    tcp: RwLock<Vec<SocketAddr>>,
}

impl HostEndpoints {
    /// Adds the unix socket file at `path` and the TCP listeners `tcp`.
    pub(crate) fn add(&self, unix: &[&Path], tcp: &[SocketAddr]) -> io::Result<()> {
        let mut inodes = Vec::with_capacity(unix.len());
        for path in unix {
            let m = std::fs::metadata(path)?;
            inodes.push((m.dev(), m.ino()));
        }
        if let Ok(mut known) = self.unix.write() {
            known.extend(inodes);
        }
        if let Ok(mut known) = self.tcp.write() {
            known.extend_from_slice(tcp);
        }
        Ok(())
    }

    /// Whether the socket file `pinned` (an `O_PATH` descriptor of what a connect or send
    /// names) is one of the host's. A file that cannot be looked at is taken to be one.
    pub(crate) fn holds_unix(&self, pinned: &OwnedFd) -> bool {
        let Ok(known) = self.unix.read() else {
            return true;
        };
        if known.is_empty() {
            return false;
        }
        match nix::sys::stat::fstat(pinned) {
            Ok(st) => known.contains(&(st.st_dev, st.st_ino)),
            Err(_) => true,
        }
    }

    /// Whether a TCP connect to `dest` reaches one of the host's listeners: its address,
    /// the unspecified address (which Linux connects to this host), or, for a listener on
    /// every address, a loopback one or any other address of this host; IPv4-mapped
    /// addresses as the IPv4 they carry.
    pub(crate) fn holds_tcp(&self, dest: SocketAddr) -> bool {
        let Ok(known) = self.tcp.read() else {
            return true;
        };
        let d = canonical_ip(dest.ip());
        known.iter().any(|listener| {
            let l = canonical_ip(listener.ip());
            listener.port() == dest.port()
                && (d == l
                    || d.is_unspecified()
                    || (l.is_unspecified() && (d.is_loopback() || is_host_address(d))))
        })
    }
}

/// Whether `ip` is one of this host's own addresses now, in the caller's network namespace
/// (where the broker connects): one a socket may bind to, so an interface's address and any
/// address of a local route (`ip route add local 10.0.0.0/8 dev lo`). Asked by a test bind,
/// through the socket families the daemon's unit allows (listing the interfaces takes a
/// netlink socket, which it may not open). Where sockets may bind addresses the host does
/// not have (`net.ipv4.ip_nonlocal_bind`, common beside keepalived), a bind says nothing,
/// and the interfaces are asked; where they cannot be listed, or anything else is in doubt,
/// the address counts as the host's own (fail closed).
pub fn is_host_address(ip: IpAddr) -> bool {
    host_address_by(ip, nonlocal_binds, listed_addresses)
}

/// [`is_host_address`], given whether nonlocal binds are allowed for the address's family
/// (`None`: unknown) and how to list the interfaces' addresses.
fn host_address_by(
    ip: IpAddr,
    nonlocal: impl Fn(&IpAddr) -> Option<bool>,
    interfaces: impl Fn() -> io::Result<Vec<IpAddr>>,
) -> bool {
    let ip = canonical_ip(ip);
    match std::net::UdpSocket::bind(SocketAddr::new(ip, 0)) {
        Err(e) => e.raw_os_error() != Some(libc::EADDRNOTAVAIL),
        Ok(_) if nonlocal(&ip) == Some(false) => true,
        Ok(_) => interfaces().map_or(true, |own| own.iter().any(|a| canonical_ip(*a) == ip)),
    }
}

/// Whether sockets of `ip`'s family may bind addresses the host does not have, per the
/// network namespace's sysctl (`None`: it cannot be read).
fn nonlocal_binds(ip: &IpAddr) -> Option<bool> {
    let file = match ip {
        IpAddr::V4(_) => "/proc/sys/net/ipv4/ip_nonlocal_bind",
        IpAddr::V6(_) => "/proc/sys/net/ipv6/ip_nonlocal_bind",
    };
    match std::fs::read_to_string(file).ok()?.trim() {
        "0" => Some(false),
        _ => Some(true),
    }
}

/// The addresses of this host's interfaces.
fn listed_addresses() -> io::Result<Vec<IpAddr>> {
    let interfaces = nix::ifaddrs::getifaddrs().map_err(io::Error::from)?;
    Ok(interfaces
        .filter_map(|i| i.address)
        .filter_map(|a| {
            a.as_sockaddr_in()
                .map(|v4| IpAddr::V4(v4.ip()))
                .or_else(|| a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tcp_connect_reaches_the_listener_by_any_address_that_leads_to_it() {
        let endpoints = HostEndpoints::default();
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        endpoints
            .add(&[], &[at("127.0.0.1:8931"), at("[::]:9000")])
            .unwrap();
        for reaches in [
            "127.0.0.1:8931",
            "[::ffff:127.0.0.1]:8931",
            "0.0.0.0:8931",
            "[::]:8931",
            "127.0.0.1:9000",
            "[::1]:9000",
            "0.0.0.0:9000",
        ] {
            assert!(endpoints.holds_tcp(at(reaches)), "{reaches}");
        }
        for elsewhere in ["127.0.0.2:8931", "127.0.0.1:8932", "192.0.2.1:8931"] {
            assert!(!endpoints.holds_tcp(at(elsewhere)), "{elsewhere}");
        }
        // The listener on every address is reached by any address of this host too (its
        // own on the network, where the rules may allow a whole network). Before, only
        // loopback ones were refused.
        let probe = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        match probe.connect("192.0.2.1:9") {
            Ok(()) => {
                let own = probe.local_addr().unwrap().ip();
                assert!(endpoints.holds_tcp(SocketAddr::new(own, 9000)), "{own}");
                assert!(!endpoints.holds_tcp(SocketAddr::new(own, 9001)), "{own}");
            }
            Err(e) => eprintln!("SKIP: no route to learn an address of this host by: {e}"),
        }
        assert!(!endpoints.holds_tcp(at("203.0.113.77:9000")));
    }

    /// The host's own addresses are asked by a test bind, so a host that may not open a
    /// netlink socket (the daemon's unit restricts it to unix and IP sockets) still tells its
    /// addresses from others. Before, they were listed through netlink, and under the unit
    /// every address counted as the host's: every connect to the HTTP listener's port, on
    /// any address, was refused. Where nonlocal binds make a bind say nothing, the interfaces
    /// are asked, and an address counts as the host's when they cannot be listed.
    #[test]
    fn the_hosts_addresses_are_known_without_listing_interfaces() {
        let unlisted = || Err(io::Error::from_raw_os_error(libc::EAFNOSUPPORT));
        let doc: IpAddr = "192.0.2.77".parse().unwrap();
        let loopback: IpAddr = "127.0.0.1".parse().unwrap();
        let off = |_: &IpAddr| Some(false);
        assert!(host_address_by(loopback, off, unlisted));
        // Where nonlocal binds are allowed here, the bind succeeds for any address and
        // this case is the one below.
        if nonlocal_binds(&doc) == Some(false) {
            assert!(!host_address_by(doc, off, unlisted));
        } else {
            eprintln!("SKIP: net.ipv4.ip_nonlocal_bind is set here: any address binds");
        }
        let probe = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        if probe.connect("192.0.2.1:9").is_ok() {
            let own = probe.local_addr().unwrap().ip();
            assert!(host_address_by(own, off, unlisted), "{own}");
        }
        // Where a bind says nothing (nonlocal binds allowed, or not known to be off), the
        // interfaces decide, and none listed means held.
        for nonlocal in [Some(true), None] {
            let said = |_: &IpAddr| nonlocal;
            assert!(host_address_by(loopback, said, unlisted));
            assert!(!host_address_by(loopback, said, || Ok(vec![doc])));
            assert!(host_address_by(loopback, said, || Ok(vec![loopback])));
        }
    }

    #[test]
    fn a_unix_socket_is_the_hosts_through_any_link_to_it() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("host.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let endpoints = HostEndpoints::default();
        let other = dir.path().join("other.sock");
        let _other = std::os::unix::net::UnixListener::bind(&other).unwrap();
        endpoints.add(&[&socket], &[]).unwrap();
        let linked = dir.path().join("linked.sock");
        std::fs::hard_link(&socket, &linked).unwrap();
        let opath = |p: &Path| -> OwnedFd {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_PATH)
                .open(p)
                .unwrap()
                .into()
        };
        assert!(endpoints.holds_unix(&opath(&socket)));
        assert!(endpoints.holds_unix(&opath(&linked)));
        assert!(!endpoints.holds_unix(&opath(&other)));
    }
}
