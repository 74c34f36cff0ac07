//! Control messages: the executor's ancillary data rebuilt for the broker's own send.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Outcome, Step, errno_of};
use crate::sys;

/// Descriptors the broker holds for executors' sends across all of them (passed with
/// `SCM_RIGHTS`, pinned unix paths): a send may wait as long as its caller, holding them,
/// and each notification may hold up to 253, so without a bound across executors a few of
/// them could take the host's every descriptor (the record writer's, the sockets').
static HELD: AtomicUsize = AtomicUsize::new(0);

/// Most descriptors held for sends at once ([`HELD`]); past it a send is refused
/// (`ETOOMANYREFS`, as the kernel refuses a sender with too many descriptors in flight).
/// Half the unit's `LimitNOFILE` (65536).
const MAX_HELD: usize = 32 * 1024;

/// Most held by one executor's sends, so that a few executors cannot take [`MAX_HELD`]
/// from the others (four notifications' worth of 253).
pub(super) const MAX_HELD_PER_EXECUTOR: usize = 1024;

/// One executor's count of descriptors held for its sends.
pub(super) type ExecutorHeld = std::sync::Arc<AtomicUsize>;

/// A descriptor held for a send, counted in the broker's bound and its executor's until
/// dropped.
pub(super) struct Held {
    fd: OwnedFd,
    counts: [(CountRef, usize); 2],
}

/// A count a [`Held`] is in.
enum CountRef {
    Shared(&'static AtomicUsize),
    Executor(ExecutorHeld),
}

impl CountRef {
    fn get(&self) -> &AtomicUsize {
        match self {
            CountRef::Shared(c) => c,
            CountRef::Executor(c) => c,
        }
    }
}

impl Held {
    /// Counts `fd` in `shared` (at most `shared_limit`) and in `executor` (at most
    /// `executor_limit`), or refuses it (dropping it) past either.
    pub(super) fn adopt(
        fd: OwnedFd,
        (shared, shared_limit): (&'static AtomicUsize, usize),
        (executor, executor_limit): (&ExecutorHeld, usize),
    ) -> Step<Held> {
        let counts = [
            (CountRef::Shared(shared), shared_limit),
            (CountRef::Executor(executor.clone()), executor_limit),
        ];
        for (i, (count, limit)) in counts.iter().enumerate() {
            if count.get().fetch_add(1, Ordering::SeqCst) >= *limit {
                for (taken, _) in &counts[..=i] {
                    taken.get().fetch_sub(1, Ordering::SeqCst);
                }
                return Err(Outcome::Errno(libc::ETOOMANYREFS));
            }
        }
        Ok(Held { fd, counts })
    }

    /// [`Held::adopt`] in the broker's bound and `executor`'s.
    pub(super) fn for_send(fd: OwnedFd, executor: &ExecutorHeld) -> Step<Held> {
        Held::adopt(fd, (&HELD, MAX_HELD), (executor, MAX_HELD_PER_EXECUTOR))
    }
}

impl AsRawFd for Held {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        for (count, _) in &self.counts {
            count.get().fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Rebuilds a control buffer for the broker's own sendmsg: descriptors passed with
/// SCM_RIGHTS are replaced by the broker's duplicates of them (at most `max_fds` in all, as
/// the kernel refuses more than `SCM_MAX_FD` per message with EINVAL); any other SOL_SOCKET
/// control message is refused (SCM_CREDENTIALS would be checked against the broker's
/// credentials, not the executor's), and so are IP options and IPv6 extension headers, and
/// a PKTINFO naming an interface (the send would leave by it, which a decision by address
/// does not see) or a source address (the kernel then sends a multicast or broadcast
/// datagram by the interface holding that address, and for any datagram it is a `bind`
/// no one decided); other IP-level control messages (TOS, TTL, a PKTINFO naming neither)
/// pass unchanged. Lengths come from the executor, so every offset is checked
/// before use.
pub(super) fn translate_control(
    raw: &[u8],
    (pidfd, executor): (&OwnedFd, &ExecutorHeld),
    passed: &mut Vec<Held>,
    max_fds: usize,
) -> Step<Vec<u8>> {
    const HDR: usize = 16; // size_t cmsg_len; int cmsg_level; int cmsg_type
    let align = |n: usize| n.checked_add(7).map(|n| n & !7);
    let mut out = Vec::with_capacity(raw.len());
    let mut off = 0usize;
    while raw.len().saturating_sub(off) >= HDR {
        let field = |o: usize, n: usize| &raw[off + o..off + o + n];
        let len = u64::from_ne_bytes(field(0, 8).try_into().unwrap_or([0; 8]));
        let level = i32::from_ne_bytes(field(8, 4).try_into().unwrap_or([0; 4]));
        let kind = i32::from_ne_bytes(field(12, 4).try_into().unwrap_or([0; 4]));
        let len = usize::try_from(len)
            .ok()
            .filter(|len| *len >= HDR && *len <= raw.len() - off)
            .ok_or(Outcome::Errno(libc::EINVAL))?;
        let data = &raw[off + HDR..off + len];
        let start = out.len();
        out.extend_from_slice(&raw[off..off + HDR]);
        match (level, kind) {
            (libc::SOL_SOCKET, libc::SCM_RIGHTS) => {
                if passed.len() + data.len() / 4 > max_fds {
                    return Err(Outcome::Errno(libc::EINVAL));
                }
                for chunk in data.chunks_exact(4) {
                    let theirs = i32::from_ne_bytes(chunk.try_into().unwrap_or([0; 4]));
                    let ours = sys::pidfd_getfd(pidfd.as_fd(), theirs)
                        .map_err(|e| Outcome::Errno(errno_of(&e)))?;
                    let ours = Held::for_send(ours, executor)?;
                    out.extend_from_slice(&ours.as_raw_fd().to_ne_bytes());
                    passed.push(ours);
                }
            }
            (libc::SOL_SOCKET, _) => return Err(Outcome::Errno(libc::EPERM)),
            // IP options and IPv6 extension headers (source routes among them) are checked
            // against the broker's capabilities, not the executor's.
            (libc::IPPROTO_IP, libc::IP_OPTIONS | libc::IP_RETOPTS)
            | (
                libc::IPPROTO_IPV6,
                libc::IPV6_RTHDR
                | libc::IPV6_HOPOPTS
                | libc::IPV6_DSTOPTS
                | libc::IPV6_RTHDRDSTOPTS
                | libc::IPV6_2292RTHDR
                | libc::IPV6_2292HOPOPTS
                | libc::IPV6_2292DSTOPTS,
            ) => return Err(Outcome::Errno(libc::EPERM)),
            // `in_pktinfo` is its interface index, then the source address (`ipi_spec_dst`);
            // `in6_pktinfo` is the source address, then the interface index.
            (libc::IPPROTO_IP, libc::IP_PKTINFO)
            | (libc::IPPROTO_IPV6, libc::IPV6_PKTINFO | libc::IPV6_2292PKTINFO) => {
                let (index, source) = if level == libc::IPPROTO_IP {
                    (data.get(0..4), data.get(4..8))
                } else {
                    (data.get(16..20), data.get(0..16))
                };
                let (Some(index), Some(source)) = (index, source) else {
                    return Err(Outcome::Errno(libc::EINVAL));
                };
                if index.iter().chain(source).any(|b| *b != 0) {
                    return Err(Outcome::Errno(libc::EPERM));
                }
                out.extend_from_slice(data);
            }
            _ => out.extend_from_slice(data),
        }
        let step = align(len).ok_or(Outcome::Errno(libc::EINVAL))?;
        out.resize(start + step, 0);
        off += step;
    }
    Ok(out)
}

/// An `SCM_CREDENTIALS` control message giving `pid`, `uid` and `gid` as the sender's. The
/// kernel takes it from a thread whose effective ids are `uid` and `gid` and whose process is
/// `pid`, and tells a receiver that asks (`SO_PASSCRED`) exactly these.
pub(super) fn credentials(pid: u32, uid: u32, gid: u32) -> Vec<u8> {
    const HDR: usize = 16;
    let len = HDR + size_of::<libc::ucred>();
    let mut out = Vec::with_capacity(32);
    out.extend_from_slice(&(len as u64).to_ne_bytes());
    out.extend_from_slice(&libc::SOL_SOCKET.to_ne_bytes());
    out.extend_from_slice(&libc::SCM_CREDENTIALS.to_ne_bytes());
    out.extend_from_slice(&pid.to_ne_bytes());
    out.extend_from_slice(&uid.to_ne_bytes());
    out.extend_from_slice(&gid.to_ne_bytes());
    // Padded to the alignment the kernel steps by (CMSG_SPACE).
    out.resize(len.next_multiple_of(8), 0);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::memory::MAX_PASSED_FDS;

    fn cmsg(len: u64, level: i32, kind: i32, data: &[u8]) -> Vec<u8> {
        let mut raw = Vec::new();
        raw.extend_from_slice(&len.to_ne_bytes());
        raw.extend_from_slice(&level.to_ne_bytes());
        raw.extend_from_slice(&kind.to_ne_bytes());
        raw.extend_from_slice(data);
        raw.resize((raw.len() + 7) & !7, 0);
        raw
    }

    #[test]
    fn control_lengths_from_the_executor_are_checked() {
        let me = sys::pidfd_open(std::process::id() as i32).unwrap();
        for len in [u64::MAX, u64::MAX - 7, 1 << 40, 64, 8] {
            let raw = cmsg(len, libc::IPPROTO_IP, 1, &[0u8; 8]);
            let mut passed = Vec::new();
            assert!(
                matches!(
                    translate_control(
                        &raw,
                        (&me, &ExecutorHeld::default()),
                        &mut passed,
                        MAX_PASSED_FDS
                    ),
                    Err(Outcome::Errno(libc::EINVAL))
                ),
                "cmsg_len {len} accepted"
            );
        }
    }

    #[test]
    fn control_passes_at_most_the_descriptor_budget() {
        let file = std::fs::File::open("/dev/null").unwrap();
        let fds: Vec<u8> = std::iter::repeat_n(file.as_raw_fd().to_ne_bytes(), 3)
            .flatten()
            .collect();
        let raw = cmsg(16 + 12, libc::SOL_SOCKET, libc::SCM_RIGHTS, &fds);
        let me = sys::pidfd_open(std::process::id() as i32).unwrap();
        let mut passed = Vec::new();
        assert!(matches!(
            translate_control(&raw, (&me, &ExecutorHeld::default()), &mut passed, 2),
            Err(Outcome::Errno(libc::EINVAL))
        ));
        assert!(passed.is_empty(), "nothing taken before the refusal");
        translate_control(&raw, (&me, &ExecutorHeld::default()), &mut passed, 3).unwrap();
        assert_eq!(passed.len(), 3);
    }

    #[test]
    fn control_refuses_source_routes() {
        let me = sys::pidfd_open(std::process::id() as i32).unwrap();
        for (level, kind) in [
            (libc::IPPROTO_IP, libc::IP_RETOPTS),
            (libc::IPPROTO_IP, libc::IP_OPTIONS),
            (libc::IPPROTO_IPV6, libc::IPV6_RTHDR),
        ] {
            let raw = cmsg(16 + 8, level, kind, &[0u8; 8]);
            assert!(matches!(
                translate_control(
                    &raw,
                    (&me, &ExecutorHeld::default()),
                    &mut Vec::new(),
                    MAX_PASSED_FDS
                ),
                Err(Outcome::Errno(libc::EPERM))
            ));
        }
        let tos = cmsg(16 + 4, libc::IPPROTO_IP, libc::IP_TOS, &[0u8; 4]);
        assert!(
            translate_control(
                &tos,
                (&me, &ExecutorHeld::default()),
                &mut Vec::new(),
                MAX_PASSED_FDS
            )
            .is_ok()
        );
    }

    /// A PKTINFO naming an interface picks the one the send leaves by, which the decision
    /// by address does not see: refused. So is one naming a source address: for a multicast
    /// or broadcast datagram the kernel sends by the interface holding it (before, passed).
    /// One naming neither passes.
    #[test]
    fn control_refuses_an_outgoing_interface() {
        let me = sys::pidfd_open(std::process::id() as i32).unwrap();
        let translate = |raw: &[u8]| {
            translate_control(
                raw,
                (&me, &ExecutorHeld::default()),
                &mut Vec::new(),
                MAX_PASSED_FDS,
            )
        };
        let mut v4 = [0u8; 12];
        v4[0] = 2;
        let mut v6 = [0u8; 20];
        v6[16] = 2;
        let mut v4_source = [0u8; 12];
        v4_source[4..8].copy_from_slice(&[192, 0, 2, 1]);
        let mut v6_source = [0u8; 20];
        v6_source[15] = 1;
        for (level, kind, data) in [
            (libc::IPPROTO_IP, libc::IP_PKTINFO, &v4[..]),
            (libc::IPPROTO_IPV6, libc::IPV6_PKTINFO, &v6[..]),
            (libc::IPPROTO_IPV6, libc::IPV6_2292PKTINFO, &v6[..]),
            (libc::IPPROTO_IP, libc::IP_PKTINFO, &v4_source[..]),
            (libc::IPPROTO_IPV6, libc::IPV6_PKTINFO, &v6_source[..]),
        ] {
            let raw = cmsg(16 + data.len() as u64, level, kind, data);
            assert!(
                matches!(translate(&raw), Err(Outcome::Errno(libc::EPERM))),
                "{level}/{kind} {data:?}"
            );
            let unnamed = vec![0u8; data.len()];
            let raw = cmsg(16 + data.len() as u64, level, kind, &unnamed);
            assert!(
                translate(&raw).is_ok(),
                "{level}/{kind} without an interface"
            );
            let short = cmsg(16 + 2, level, kind, &[0u8; 2]);
            assert!(matches!(
                translate(&short),
                Err(Outcome::Errno(libc::EINVAL))
            ));
        }
    }

    /// Descriptors held for sends are counted across the broker and refused past the bound
    /// (`ETOOMANYREFS`), each counted until dropped: before, nothing bounded them across
    /// executors.
    #[test]
    fn held_descriptors_are_bounded_across_the_broker() {
        static SHARED: AtomicUsize = AtomicUsize::new(0);
        let null = || OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        let (one, other) = (ExecutorHeld::default(), ExecutorHeld::default());
        let adopt = |executor: &ExecutorHeld| Held::adopt(null(), (&SHARED, 3), (executor, 2));
        let first = adopt(&one).ok().unwrap();
        let second = adopt(&one).ok().unwrap();
        // One executor's share is spent; another's is not, up to the broker's bound.
        assert!(matches!(
            adopt(&one),
            Err(Outcome::Errno(libc::ETOOMANYREFS))
        ));
        let third = adopt(&other).ok().unwrap();
        assert!(matches!(
            adopt(&other),
            Err(Outcome::Errno(libc::ETOOMANYREFS))
        ));
        assert_eq!(SHARED.load(Ordering::SeqCst), 3);
        assert_eq!(
            (one.load(Ordering::SeqCst), other.load(Ordering::SeqCst)),
            (2, 1)
        );
        drop(first);
        let fourth = adopt(&other).ok().unwrap();
        drop((second, third, fourth));
        assert_eq!(SHARED.load(Ordering::SeqCst), 0);
        assert_eq!(
            (one.load(Ordering::SeqCst), other.load(Ordering::SeqCst)),
            (0, 0)
        );
    }

    #[test]
    fn control_refuses_credentials() {
        let mut raw = Vec::new();
        raw.extend_from_slice(&(16u64 + 12).to_ne_bytes());
        raw.extend_from_slice(&libc::SOL_SOCKET.to_ne_bytes());
        raw.extend_from_slice(&libc::SCM_CREDENTIALS.to_ne_bytes());
        raw.extend_from_slice(&[0u8; 12]);
        raw.resize(32, 0);
        let me = sys::pidfd_open(std::process::id() as i32).unwrap();
        let mut passed = Vec::new();
        assert!(matches!(
            translate_control(
                &raw,
                (&me, &ExecutorHeld::default()),
                &mut passed,
                MAX_PASSED_FDS
            ),
            Err(Outcome::Errno(libc::EPERM))
        ));
    }

    #[test]
    fn control_translates_passed_descriptors() {
        let file = std::fs::File::open("/dev/null").unwrap();
        let mut raw = Vec::new();
        raw.extend_from_slice(&(16u64 + 4).to_ne_bytes());
        raw.extend_from_slice(&libc::SOL_SOCKET.to_ne_bytes());
        raw.extend_from_slice(&libc::SCM_RIGHTS.to_ne_bytes());
        raw.extend_from_slice(&file.as_raw_fd().to_ne_bytes());
        raw.resize(24, 0);
        let me = sys::pidfd_open(std::process::id() as i32).unwrap();
        let mut passed = Vec::new();
        let out = translate_control(
            &raw,
            (&me, &ExecutorHeld::default()),
            &mut passed,
            MAX_PASSED_FDS,
        )
        .unwrap();
        assert_eq!(passed.len(), 1);
        let ours = i32::from_ne_bytes(out[16..20].try_into().unwrap());
        assert_eq!(ours, passed[0].as_raw_fd());
        assert_ne!(ours, file.as_raw_fd(), "the broker sends its own duplicate");
    }
}
