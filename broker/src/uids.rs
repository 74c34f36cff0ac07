//! A uid (and the gid of the same number) per live executor, from a configured range, the
//! way systemd's DynamicUser picks one: per-uid limits (`RLIMIT_NPROC`), signals and ptrace
//! scope then never cross executors.
//!
//! A uid is leased only when no process on the host runs with it and no other broker (a
//! `flowhost sandbox run` beside the daemon) holds it. The cross-process claim is an abstract
//! unix socket named after the uid, bound for as long as the lease lives: the kernel releases
//! it when the broker exits, however it exits. The lease is returned after the executor's
//! cgroup is gone.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// An inclusive range of uids executors run as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UidRange {
    /// The first uid.
    pub first: u32,
    /// How many uids (at least 1).
    pub count: u32,
}

impl UidRange {
    /// The default range: 65536 uids from 0x70000000, above the ranges systemd assigns
    /// to users, DynamicUser services and containers.
    pub const DEFAULT: UidRange = UidRange {
        first: 0x7000_0000,
        count: 65536,
    };

    /// The last uid of the range.
    pub fn last(&self) -> u32 {
        self.first + (self.count - 1)
    }

    /// Whether `id` is one of the range's.
    pub fn contains(&self, id: u32) -> bool {
        (self.first..=self.last()).contains(&id)
    }

    /// Refuses a range holding a user's uid or primary gid or a group's gid of this host
    /// (`/etc/passwd`, `/etc/group`), or overlapping ids delegated to a user's namespaces
    /// (`/etc/subuid`, `/etc/subgid`): an executor runs as uid and gid N of the range, so it
    /// would own that user's (or that user's containers') files and be in that group. A
    /// host without a file has nothing there to collide with; one that cannot be read
    /// refuses. (A user known only through NSS, such as LDAP's, is not looked up.)
    pub fn held_by_nobody(&self) -> Result<(), RangeHeld> {
        for (file, what) in [
            ("/etc/passwd", "user"),
            ("/etc/group", "group"),
            ("/etc/subuid", "subordinate uids of user"),
            ("/etc/subgid", "subordinate gids of user"),
        ] {
            let text = match std::fs::read_to_string(file) {
                Ok(text) => text,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(source) => {
                    return Err(RangeHeld::Unreadable {
                        range: *self,
                        file,
                        source,
                    });
                }
            };
            let found = if file.starts_with("/etc/sub") {
                delegated_in_range(&text, *self)
            } else {
                id_in_range(&text, *self)
            };
            if let Some((name, id)) = found {
                return Err(RangeHeld::Held {
                    range: *self,
                    id,
                    what,
                    name,
                    file,
                });
            }
        }
        Ok(())
    }
}

/// Why a range of executor uids may not be used.
#[derive(Debug, thiserror::Error)]
pub enum RangeHeld {
    /// A user or group of the host has an id in it.
    #[error(
        "the executor uid range {range} holds id {id}, {what} {name:?} of {file}: an executor \
         run as it would own that {what}'s files; choose a range no user or group has (the \
         default, 1879048192-1879113727, is above them all)"
    )]
    Held {
        /// The range.
        range: UidRange,
        /// The id found in it.
        id: u32,
        /// `user` or `group`.
        what: &'static str,
        /// Its name.
        name: String,
        /// The file naming it.
        file: &'static str,
    },
    /// The file could not be read, so the range cannot be shown to be free.
    #[error("cannot read {file} to check the executor uid range {range} against it: {source}")]
    Unreadable {
        /// The range.
        range: UidRange,
        /// The file.
        file: &'static str,
        /// Why.
        source: std::io::Error,
    },
}

/// The first entry of `text` (in the form of `/etc/passwd` or `/etc/group`: name, then
/// password, then the id; a passwd entry's primary gid after it) whose id is in `range`.
fn id_in_range(text: &str, range: UidRange) -> Option<(String, u32)> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let mut fields = l.split(':');
        let name = fields.next()?;
        let mut ids = fields.skip(1).take(2);
        let id = ids.next()?.trim().parse::<u32>().ok()?;
        let primary_gid = ids.next().and_then(|g| g.trim().parse::<u32>().ok());
        [Some(id), primary_gid]
            .into_iter()
            .flatten()
            .find(|id| range.contains(*id))
            .map(|id| (name.to_string(), id))
    })
}

/// The first entry of `text` (in the form of `/etc/subuid`: name, first id, count) whose
/// ids overlap `range`, with the first id of the overlap.
fn delegated_in_range(text: &str, range: UidRange) -> Option<(String, u32)> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let mut fields = l.split(':');
        let name = fields.next()?;
        let first = fields.next()?.trim().parse::<u64>().ok()?;
        let count = fields.next()?.trim().parse::<u64>().ok()?;
        let end = first.checked_add(count)?;
        let (lo, hi) = (u64::from(range.first), u64::from(range.last()) + 1);
        let start = first.max(lo);
        if count == 0 || start >= end.min(hi) {
            return None;
        }
        Some((name.to_string(), u32::try_from(start).ok()?))
    })
}

impl std::fmt::Display for UidRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.first, self.last())
    }
}

/// Hands out the uids of a range, one per live executor.
#[derive(Debug)]
pub(crate) struct UidPool {
    range: UidRange,
    proc: std::path::PathBuf,
    next: AtomicU32,
    leased: Mutex<std::collections::BTreeSet<u32>>,
}

/// The host's processes could not be listed, so no uid can be shown to be unused.
#[derive(Debug, thiserror::Error)]
#[error("cannot list the host's processes in {} to find an unused executor uid: {source}", proc.display())]
pub struct UidScanError {
    /// The directory listed.
    pub proc: std::path::PathBuf,
    /// Why the listing failed.
    #[source]
    pub source: std::io::Error,
}

/// One leased uid; dropping it returns the uid.
#[derive(Debug)]
pub(crate) struct UidLease {
    pool: Arc<UidPool>,
    uid: u32,
    _claim: OwnedFd,
}

fn claim(uid: u32) -> Option<OwnedFd> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, bind, socket};
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .ok()?;
    let name = format!("flowhost-executor-uid-{uid}");
    let addr = UnixAddr::new_abstract(name.as_bytes()).ok()?;
    use std::os::fd::AsRawFd;
    bind(fd.as_raw_fd(), &addr).ok()?;
    Some(fd)
}

/// Where the host's processes are listed; a test points a pool elsewhere to make the listing
/// fail.
const PROC: &str = "/proc";

/// uids of every process on the host now: the owner of each `<proc>/<pid>` directory (what
/// `procfs`'s `Process::uid` reads too), with one `statx` per process instead of opening
/// each directory, since every spawn pays for this scan.
///
/// A listing that cannot be read is an error, never an empty set: an empty set would lease a
/// uid some host process may run with. A process that exits between the listing and its
/// `statx` runs with no uid, so its `ENOENT` is skipped.
fn running_uids(proc: &std::path::Path) -> std::io::Result<std::collections::BTreeSet<u32>> {
    use std::os::unix::fs::MetadataExt;
    let mut uids = std::collections::BTreeSet::new();
    for entry in std::fs::read_dir(proc)? {
        let entry = entry?;
        if !entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        {
            continue;
        }
        match std::fs::metadata(entry.path()) {
            Ok(m) => {
                uids.insert(m.uid());
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(uids)
}

impl UidPool {
    pub(crate) fn new(range: UidRange) -> Self {
        UidPool {
            range,
            proc: PROC.into(),
            next: AtomicU32::new(0),
            leased: Mutex::new(Default::default()),
        }
    }

    pub(crate) fn range(&self) -> UidRange {
        self.range
    }

    /// Leases a uid no process runs with and nobody else holds; `Ok(None)` when the range is
    /// exhausted, an error naming the listing when the host's processes cannot be listed.
    pub(crate) fn lease(self: &Arc<Self>) -> Result<Option<UidLease>, UidScanError> {
        let running = running_uids(&self.proc).map_err(|source| UidScanError {
            proc: self.proc.clone(),
            source,
        })?;
        let mut leased = self.leased.lock().unwrap_or_else(|p| p.into_inner());
        let start = self.next.fetch_add(1, Ordering::Relaxed) % self.range.count;
        for i in 0..self.range.count {
            let uid = self.range.first + (start + i) % self.range.count;
            if leased.contains(&uid) || running.contains(&uid) {
                continue;
            }
            if let Some(claim) = claim(uid) {
                leased.insert(uid);
                self.next
                    .store((start + i + 1) % self.range.count, Ordering::Relaxed);
                return Ok(Some(UidLease {
                    pool: self.clone(),
                    uid,
                    _claim: claim,
                }));
            }
        }
        Ok(None)
    }

    /// uids leased now.
    #[cfg(test)]
    pub(crate) fn leased(&self) -> usize {
        self.leased.lock().map(|l| l.len()).unwrap_or(0)
    }
}

impl UidLease {
    /// The leased uid (also the gid).
    pub(crate) fn uid(&self) -> u32 {
        self.uid
    }
}

impl Drop for UidLease {
    fn drop(&mut self) {
        let mut leased = self.pool.leased.lock().unwrap_or_else(|p| p.into_inner());
        leased.remove(&self.uid);
    }
}

#[cfg(test)]
mod tests {
    /// Entries of `/etc/passwd` and `/etc/group` are read by their third field; a comment or
    /// a broken line names no id. A privileged broker refuses a range holding root's id,
    /// however it was started. Before, only the daemon checked: `sandbox run` and the demo
    /// as root could run an executor as a local user.
    #[test]
    fn a_range_holding_a_users_id_is_refused() {
        let range = |first, count| UidRange { first, count };
        let passwd = "root:x:0:0:root:/root:/bin/bash\n# a comment\nalice:x:1000:1000::/home/alice:/bin/sh\nbroken line\n";
        assert_eq!(
            super::id_in_range(passwd, range(900, 201)),
            Some(("alice".into(), 1000))
        );
        assert_eq!(super::id_in_range(passwd, range(1001, 10)), None);
        assert_eq!(
            super::id_in_range("staff:x:1050:\n", range(1050, 1))
                .unwrap()
                .1,
            1050
        );
        // A user's primary gid, though no group of that id is listed.
        assert_eq!(
            super::id_in_range("bob:x:900:4000::/home/bob:/bin/sh\n", range(4000, 10)),
            Some(("bob".into(), 4000))
        );
        // Ids delegated to a user's containers overlap the range at either end or inside.
        let sub = "alice:100000:65536\n# c\nbob:300000:0\n";
        assert_eq!(
            super::delegated_in_range(sub, range(165000, 1000)),
            Some(("alice".into(), 165000))
        );
        assert_eq!(
            super::delegated_in_range(sub, range(90000, 10001)),
            Some(("alice".into(), 100000))
        );
        assert_eq!(super::delegated_in_range(sub, range(165536, 100)), None);
        assert_eq!(super::delegated_in_range(sub, range(300000, 5)), None);
        UidRange::DEFAULT.held_by_nobody().unwrap();
        let root = range(0, 1).held_by_nobody().unwrap_err().to_string();
        assert!(root.contains("\"root\""), "{root}");
        if nix::unistd::geteuid().is_root() {
            let refused = crate::Broker::new(crate::BrokerOptions {
                executor_identity: None,
                executor_uids: Some(range(0, 1)),
            });
            let Err(e) = refused else {
                panic!("a broker over root's uid started")
            };
            assert!(e.to_string().contains("/etc/passwd"), "{e}");
        } else {
            eprintln!("SKIP: needs root for a privileged broker");
        }
    }

    use super::*;

    #[test]
    fn live_leases_never_share_a_uid_and_come_back() {
        let pool = Arc::new(UidPool::new(UidRange {
            first: 0x7100_0000,
            count: 4,
        }));
        let a = pool.lease().unwrap().unwrap();
        let b = pool.lease().unwrap().unwrap();
        let c = pool.lease().unwrap().unwrap();
        let d = pool.lease().unwrap().unwrap();
        let mut uids = vec![a.uid(), b.uid(), c.uid(), d.uid()];
        uids.sort();
        uids.dedup();
        assert_eq!(uids.len(), 4);
        assert!(pool.lease().unwrap().is_none(), "the range is exhausted");
        // Another broker (another pool over the same range) gets none of them either.
        let other = Arc::new(UidPool::new(pool.range()));
        assert!(other.lease().unwrap().is_none());
        let freed = b.uid();
        drop(b);
        assert_eq!(pool.leased(), 3);
        assert_eq!(other.lease().unwrap().map(|l| l.uid()), Some(freed));
    }

    #[test]
    fn a_uid_a_process_runs_with_is_skipped() {
        // This test process runs as its own uid: a range made of only that uid is empty.
        let me = nix::unistd::getuid().as_raw();
        let pool = Arc::new(UidPool::new(UidRange {
            first: me,
            count: 1,
        }));
        assert!(pool.lease().unwrap().is_none());
    }

    #[test]
    fn a_host_whose_processes_cannot_be_listed_leases_no_uid() {
        // Before, an unreadable listing was read as "no process runs with any uid".
        let gone = tempfile::tempdir().unwrap();
        let proc = gone.path().join("proc");
        let pool = Arc::new(UidPool {
            proc: proc.clone(),
            ..UidPool::new(UidRange {
                first: 0x7200_0000,
                count: 4,
            })
        });
        let err = pool.lease().unwrap_err();
        assert_eq!(err.proc, proc);
        assert!(
            err.to_string().contains("cannot list the host's processes"),
            "{err}"
        );
        assert_eq!(pool.leased(), 0);
    }
}
