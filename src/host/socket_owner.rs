//! Who owns a socket on this host at the other end of a loopback exchange, from the kernel's
//! socket tables: what a local server or resolver asks before it trusts a peer, where
//! nothing in the exchange itself says who the peer is (plain TCP, UDP).

use std::net::SocketAddr;

use procfs::ProcResult;

use crate::destination::canonical_ip;

/// Two socket addresses name the same endpoint (an IPv4-mapped address as the IPv4 it
/// carries, as the IPv6 tables show sockets of dual-stack listeners).
fn same(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port() && canonical_ip(a.ip()) == canonical_ip(b.ip())
}

/// Reads one of the kernel's tables; one that is not there (IPv6 disabled) holds nothing.
fn table<T>(read: fn() -> ProcResult<Vec<T>>) -> Result<Vec<T>, String> {
    match read() {
        Ok(entries) => Ok(entries),
        Err(procfs::ProcError::NotFound(_)) => Ok(Vec::new()),
        Err(e) => Err(format!("cannot read the kernel's socket table: {e}")),
    }
}

/// The uid that owns the TCP socket whose local address is `local` and whose peer is
/// `remote` (the other end of a connection this host holds both ends of), if there is one.
pub fn tcp(local: SocketAddr, remote: SocketAddr) -> Result<Option<u32>, String> {
    Ok(table(procfs::net::tcp)?
        .into_iter()
        .chain(table(procfs::net::tcp6)?)
        .find(|e| same(e.local_address, local) && same(e.remote_address, remote))
        .map(|e| e.uid))
}

/// The uid that owns the UDP socket a datagram from `from` was sent from, when every
/// socket bound to that port (on any address) is one uid's; `None` when none is, or they
/// are several uids' (then who sent it cannot be told). The address is not looked at: a
/// sender chooses the source address it claims (`IP_PKTINFO` needs no privilege), while
/// the port it sends from is one its own socket holds.
pub fn udp(from: SocketAddr) -> Result<Option<u32>, String> {
    let mut owners = table(procfs::net::udp)?
        .into_iter()
        .chain(table(procfs::net::udp6)?)
        .filter(|e| e.local_address.port() == from.port())
        .map(|e| e.uid);
    let Some(first) = owners.next() else {
        return Ok(None);
    };
    Ok(owners.all(|uid| uid == first).then_some(first))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_owner_of_a_local_socket_is_found() {
        let me = nix::unistd::geteuid().as_raw();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (ours, theirs) = (client.local_addr().unwrap(), client.peer_addr().unwrap());
        assert_eq!(tcp(theirs, ours).unwrap(), Some(me));
        assert_eq!(tcp(ours, theirs).unwrap(), Some(me));
        let sender = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        assert_eq!(udp(sender.local_addr().unwrap()).unwrap(), Some(me));
        let unbound = "127.0.0.1:1".parse().unwrap();
        assert_eq!(udp(unbound).unwrap(), None);
        // Whatever address a datagram claims (IP_PKTINFO lets a sender choose it), the
        // port's sockets are what is asked.
        let port = sender.local_addr().unwrap().port();
        let claimed = SocketAddr::new("127.0.0.9".parse().unwrap(), port);
        assert_eq!(udp(claimed).unwrap(), Some(me));
    }
}
