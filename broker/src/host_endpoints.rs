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
/// not have (`net.ipv4.ip_nonlocal_bind`, common beside keepalived), a bind says nothing:
/// an IPv4 address is then looked up in the kernel's routing tables as `/proc/net/fib_trie`
/// shows them (its local routes, an interface's address among them), and an IPv6 one
/// counts as the host's. Where anything is in doubt, the address counts as the host's own
/// (fail closed).
pub fn is_host_address(ip: IpAddr) -> bool {
    host_address_by(ip, nonlocal_binds, || {
        std::fs::read_to_string("/proc/net/fib_trie")
    })
}

/// [`is_host_address`], given whether nonlocal binds are allowed for the address's family
/// (`None`: unknown) and how to read the text of `/proc/net/fib_trie`.
fn host_address_by(
    ip: IpAddr,
    nonlocal: impl Fn(&IpAddr) -> Option<bool>,
    fib_trie: impl Fn() -> io::Result<String>,
) -> bool {
    let ip = canonical_ip(ip);
    match std::net::UdpSocket::bind(SocketAddr::new(ip, 0)) {
        Err(e) => e.raw_os_error() != Some(libc::EADDRNOTAVAIL),
        Ok(_) if nonlocal(&ip) == Some(false) => true,
        Ok(_) => match ip {
            IpAddr::V4(v4) => fib_trie().map_or(true, |text| {
                local_routes(&text)
                    .iter()
                    .any(|&(net, len)| within(v4, net, len))
            }),
            IpAddr::V6(_) => true,
        },
    }
}

/// The local routes of `/proc/net/fib_trie`'s text, every table's: each leaf address
/// (`|-- A.B.C.D`) whose route line says `LOCAL` (`/LEN host LOCAL`), as (network, length).
fn local_routes(text: &str) -> Vec<(std::net::Ipv4Addr, u8)> {
    let mut leaf = None;
    let mut found = Vec::new();
    for line in text.lines().map(str::trim) {
        if let Some(addr) = line.strip_prefix("|-- ") {
            leaf = addr.trim().parse::<std::net::Ipv4Addr>().ok();
        } else if let (Some(addr), Some(rest)) = (leaf, line.strip_prefix('/')) {
            let mut words = rest.split_whitespace();
            let len = words.next().and_then(|l| l.parse::<u8>().ok());
            if let (Some(len), Some("LOCAL")) = (len.filter(|l| *l <= 32), words.last()) {
                found.push((addr, len));
            }
        }
    }
    found
}

/// Whether `ip` lies in `net`/`len`.
fn within(ip: std::net::Ipv4Addr, net: std::net::Ipv4Addr, len: u8) -> bool {
    let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
    u32::from(ip) & mask == u32::from(net) & mask
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
    /// any address, was refused. Where nonlocal binds make a bind say nothing, an IPv4
    /// address is looked up among the local routes of `/proc/net/fib_trie` (a local route's
    /// whole range counts), an IPv6 one is held, and so is anything when the table cannot be
    /// read.
    #[test]
    fn the_hosts_addresses_are_known_without_listing_interfaces() {
        let unread = || Err(io::Error::from_raw_os_error(libc::EACCES));
        let doc: IpAddr = "192.0.2.77".parse().unwrap();
        let loopback: IpAddr = "127.0.0.1".parse().unwrap();
        let off = |_: &IpAddr| Some(false);
        assert!(host_address_by(loopback, off, unread));
        // Where nonlocal binds are allowed here, the bind succeeds for any address and
        // this case is the one below.
        if nonlocal_binds(&doc) == Some(false) {
            assert!(!host_address_by(doc, off, unread));
        } else {
            eprintln!("SKIP: net.ipv4.ip_nonlocal_bind is set here: any address binds");
        }
        let probe = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        if probe.connect("192.0.2.1:9").is_ok() {
            let own = probe.local_addr().unwrap().ip();
            assert!(host_address_by(own, off, unread), "{own}");
        }
        // Where a bind says nothing (nonlocal binds allowed, or not known to be off).
        let trie = |routes: &'static str| {
            move || {
                Ok(format!(
                    "Local:\n  +-- 0.0.0.0/0 3 0 5\n{routes}     |-- 192.0.2.255\n        /32 link BROADCAST\n"
                ))
            }
        };
        let local_8 = "     |-- 127.0.0.0\n        /8 host LOCAL\n";
        let other = "     |-- 10.9.0.0\n        /16 host LOCAL\n";
        for nonlocal in [Some(true), None] {
            let said = |_: &IpAddr| nonlocal;
            assert!(host_address_by(loopback, said, unread));
            assert!(host_address_by(loopback, said, trie(local_8)));
            assert!(!host_address_by(loopback, said, trie(other)));
            assert!(host_address_by("::1".parse().unwrap(), said, trie(other)));
        }
        assert_eq!(
            local_routes(&trie(other)().unwrap()),
            [("10.9.0.0".parse().unwrap(), 16)]
        );
        assert!(within(
            "10.9.200.1".parse().unwrap(),
            "10.9.0.0".parse().unwrap(),
            16
        ));
        assert!(!within(
            "10.8.0.1".parse().unwrap(),
            "10.9.0.0".parse().unwrap(),
            16
        ));
        assert!(within(
            "1.2.3.4".parse().unwrap(),
            "0.0.0.0".parse().unwrap(),
            0
        ));
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
