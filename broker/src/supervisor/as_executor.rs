//! Unix socket operations carried out with the executor's identity.
//!
//! What the kernel does with a unix socket depends on who makes the call: the file
//! permissions of the path (search on each directory, write on a socket file, write on the
//! directory a socket is made in), the owner of a socket file made by `bind`, and the
//! credentials a peer is given (`SO_PEERCRED` from `connect` and `listen`, `SCM_CREDENTIALS`
//! with each message to a receiver that asks for them). A privileged broker making these
//! calls as itself would lend the executor its own identity (root's, or the service user's
//! with its capabilities). So on the thread that makes the call, the broker takes the
//! executor's uid and gid as its effective ids for the call's duration, with no supplementary
//! group and no capability, as the executor runs. Its real ids stay the broker's: a process
//! running as the executor's uid may then neither signal the thread nor change its priority
//! or CPUs meanwhile (an executor without a pid namespace of its own can name the broker's
//! threads). What the kernel would take from the real ids, the sender a unix receiver is told
//! of, is given with each send instead (an `SCM_CREDENTIALS` control message naming the
//! executor's uid and gid, which the kernel takes from a thread whose effective ids they
//! are). The process a peer is told of stays the broker's (its pid, and what is derived from
//! it: `SO_PEERPIDFD`, its cgroup, its `/proc` entry): the kernel takes it from the calling
//! process.
//!
//! A netlink socket is the same: the kernel checks a request to it against the capabilities
//! of the caller (a `SOCK_DESTROY` to `sock_diag` needs `CAP_NET_ADMIN`, and a broker that
//! has it would close any of the host's connections for the executor).
//!
//! An IP socket needs none of this: nothing the kernel does for its connect, bind or send
//! depends on the caller's identity beyond the privileged-port check the broker makes itself.

use std::io;

use super::socket::TakenSocket;
use crate::sys;

/// Runs `op` on this thread with `identity` (the executor's uid and gid) when `sock` is a
/// unix or netlink socket ([`as_the_executor`]) and the broker has an identity of its own
/// to set aside (`identity` is `Some`
/// only for a privileged broker); otherwise runs it as it is. The thread's own credentials
/// are back before this returns, even if `op` panics. If the executor's identity cannot be
/// taken, `op` is not run and the error is returned: the operation is refused, never carried
/// out as the broker. `op` must start no thread: a thread starts with its creator's
/// credentials.
pub(super) fn unix_op<T>(
    identity: Option<(u32, u32)>,
    sock: &TakenSocket,
    op: impl FnOnce() -> io::Result<T>,
) -> io::Result<T> {
    if as_the_executor(sock.info.family) {
        as_executor(identity, op)
    } else {
        op()
    }
}

/// Whether operations on a socket of `family` are made with the executor's identity: those
/// whose outcome depends on who calls (see the module docs).
pub(super) fn as_the_executor(family: i32) -> bool {
    matches!(family, libc::AF_UNIX | libc::AF_NETLINK)
}

/// Runs `op` on this thread as `identity` when there is one (see [`unix_op`]), else as it is.
pub(super) fn as_executor<T>(
    identity: Option<(u32, u32)>,
    op: impl FnOnce() -> io::Result<T>,
) -> io::Result<T> {
    let Some((uid, gid)) = identity else {
        return op();
    };
    let restore = Restore(sys::thread_credentials()?);
    if let Err(e) = sys::assume_identity(&restore.0, uid, gid) {
        // Logged as the broker: a log line is a message on a socket too.
        drop(restore);
        tracing::warn!(
            uid,
            gid,
            error = %e,
            "cannot act as the executor for a unix socket operation; refused"
        );
        return Err(e);
    }
    let result = op();
    drop(restore);
    result
}

/// Gives the thread its credentials back when dropped.
struct Restore(sys::ThreadCredentials);

impl Drop for Restore {
    fn drop(&mut self) {
        if let Err(e) = sys::restore_credentials(&self.0) {
            // The kernel allows every step (the saved ids and the permitted capabilities were
            // left as they were); only a failed allocation (ENOMEM) could stop it. Then this
            // thread of the broker would go on serving other executors as this one: nothing
            // may run on it any more.
            tracing::error!(error = %e, "cannot restore the broker thread's credentials");
            std::process::abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unix and netlink operations are made as the executor: a netlink request is checked
    /// against the caller's capabilities, which the broker's may exceed. IP ones are not.
    #[test]
    fn unix_and_netlink_operations_are_made_as_the_executor() {
        assert!(as_the_executor(libc::AF_UNIX));
        assert!(as_the_executor(libc::AF_NETLINK));
        assert!(!as_the_executor(libc::AF_INET));
        assert!(!as_the_executor(libc::AF_INET6));
    }

    /// The identity lines of a task's status: ids, groups and every capability set.
    fn status(path: &str) -> Vec<String> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .filter(|l| {
                [
                    "Uid:", "Gid:", "Groups:", "CapEff:", "CapPrm:", "CapInh:", "CapAmb:",
                ]
                .iter()
                .any(|k| l.starts_with(k))
            })
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn only_the_calling_thread_acts_as_the_executor_and_only_for_the_call() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIP: changing a thread's ids needs root");
            return;
        }
        let own = status("/proc/thread-self/status");
        let leader = status("/proc/self/status");
        let during = as_executor(Some((65534, 65533)), || {
            Ok((
                status("/proc/thread-self/status"),
                status("/proc/self/status"),
            ))
        })
        .unwrap();
        let (this, other) = during;
        // The real ids stay the broker's: no process of the executor's uid may signal it.
        assert!(
            this.contains(&"Uid:\t0\t65534\t0\t65534".to_owned()),
            "{this:?}"
        );
        assert!(
            this.contains(&"Gid:\t0\t65533\t0\t65533".to_owned()),
            "{this:?}"
        );
        assert!(
            this.iter()
                .any(|l| l.starts_with("Groups:") && l[7..].trim().is_empty()),
            "{this:?}"
        );
        assert!(
            this.contains(&"CapEff:\t0000000000000000".to_owned()),
            "{this:?}"
        );
        // The process's other threads kept theirs (glibc's wrappers would have changed all).
        assert_eq!(other, leader);
        assert_eq!(status("/proc/thread-self/status"), own);

        // A panic in the operation still gives the thread its credentials back.
        let panicked = std::panic::catch_unwind(|| {
            let _ = as_executor(Some((65534, 65534)), || -> io::Result<()> {
                panic!("in the call")
            });
        });
        assert!(panicked.is_err());
        assert_eq!(status("/proc/thread-self/status"), own);
    }

    /// As under systemd: the broker runs as a user of its own (not root) holding its
    /// capabilities, so leaving its uid drops none of them by itself.
    #[test]
    fn a_broker_that_is_not_root_but_holds_capabilities_gets_them_back() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIP: changing a thread's ids needs root");
            return;
        }
        std::thread::spawn(|| {
            // SAFETY: prctl and the raw setgroups/setresgid/setresuid change only this
            // thread, which ends here. Its group is its one supplementary group, as systemd
            // gives the unit's user.
            unsafe {
                assert_eq!(libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0), 0);
                let group: [libc::gid_t; 1] = [4243];
                assert_eq!(
                    libc::syscall(libc::SYS_setgroups, 1usize, group.as_ptr()),
                    0
                );
                assert_eq!(libc::syscall(libc::SYS_setresgid, 4243, 4243, 4243), 0);
                assert_eq!(libc::syscall(libc::SYS_setresuid, 4242, 4242, 4242), 0);
            }
            let permitted = caps::read(None, caps::CapSet::Permitted).unwrap();
            caps::set(None, caps::CapSet::Effective, &permitted).unwrap();
            let own = status("/proc/thread-self/status");
            assert!(
                own.contains(&"Uid:\t4242\t4242\t4242\t4242".to_owned()),
                "{own:?}"
            );
            assert!(own.contains(&"Groups:\t4243 ".to_owned()), "{own:?}");
            let this = as_executor(Some((65534, 65534)), || {
                Ok(status("/proc/thread-self/status"))
            })
            .unwrap();
            assert!(
                this.contains(&"Uid:\t4242\t65534\t4242\t65534".to_owned()),
                "{this:?}"
            );
            assert!(
                this.contains(&"CapEff:\t0000000000000000".to_owned()),
                "{this:?}"
            );
            assert!(
                this.iter()
                    .any(|l| l.starts_with("Groups:") && l[7..].trim().is_empty()),
                "{this:?}"
            );
            assert_eq!(status("/proc/thread-self/status"), own);
        })
        .join()
        .unwrap();
    }
}
