//! Pidfds of an executor's threads, kept from one notification to the next so a thread
//! that makes many calls is not looked up anew for each.
//!
//! Only a pidfd that names one thread (`PIDFD_THREAD`) is kept: it names that task and no
//! other, so once the thread has exited every use of it fails with ESRCH, even after its
//! thread id has been given to another task. A use that fails so drops the pidfd and opens
//! one for whoever holds the id now, which the validity check after the copy proves to be
//! the calling thread, exactly as for a pidfd opened for this notification. (A pidfd for
//! the thread group, the fallback on kernels before 6.9, would stay valid while the process
//! lives even after the thread's id was reused elsewhere: it is never kept.)

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};

use crate::sys;

/// Most pidfds kept per executor; at the bound all are dropped (forgetting is safe). Each
/// is a descriptor of the host's, held until then even after its thread has exited, so the
/// bound keeps an executor with many threads from holding many (64 executors: 4,096).
const MAX_KEPT: usize = 64;

/// The pidfds kept for one executor's threads, by thread id.
#[derive(Default)]
pub(crate) struct Pidfds {
    kept: Mutex<HashMap<libc::pid_t, Arc<OwnedFd>>>,
}

/// Where a pidfd came from, for the caller's error handling.
pub(super) enum Opened {
    /// Opening one failed (the thread is gone, or another error).
    Failed(io::Error),
    /// Taking the descriptor with it failed.
    Taking(io::Error),
}

impl Pidfds {
    /// A pidfd for the thread `tid` and its descriptor `fd`, taken with it
    /// (`pidfd_getfd`). A kept pidfd whose thread has exited is replaced by a new one.
    pub(super) fn take(
        &self,
        tid: libc::pid_t,
        fd: i32,
    ) -> Result<(Arc<OwnedFd>, OwnedFd), Opened> {
        let kept = self.kept.lock().ok().and_then(|k| k.get(&tid).cloned());
        if let Some(pidfd) = kept {
            match sys::pidfd_getfd(pidfd.as_fd(), fd) {
                Ok(taken) => return Ok((pidfd, taken)),
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => self.forget(tid),
                Err(e) => return Err(Opened::Taking(e)),
            }
        }
        let pidfd = self.open(tid).map_err(Opened::Failed)?;
        let taken = sys::pidfd_getfd(pidfd.as_fd(), fd).map_err(Opened::Taking)?;
        Ok((pidfd, taken))
    }

    /// Opens a pidfd for `tid`, keeping it if it names the thread alone.
    fn open(&self, tid: libc::pid_t) -> io::Result<Arc<OwnedFd>> {
        match sys::pidfd_open_tid(tid) {
            Ok(fd) => {
                let fd = Arc::new(fd);
                if let Ok(mut kept) = self.kept.lock() {
                    if kept.len() >= MAX_KEPT {
                        kept.clear();
                    }
                    kept.insert(tid, fd.clone());
                }
                Ok(fd)
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                sys::pidfd_open_thread(tid).map(Arc::new)
            }
            Err(e) => Err(e),
        }
    }

    fn forget(&self, tid: libc::pid_t) {
        if let Ok(mut kept) = self.kept.lock() {
            kept.remove(&tid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::process::{Child, Command, Stdio};

    /// A process holding a UDP socket bound to a port of its own as its descriptor 0.
    fn holder() -> (Child, u16) {
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = udp.local_addr().unwrap().port();
        let child = Command::new("/bin/sleep")
            .arg("60")
            .stdin(Stdio::from(OwnedFd::from(udp)))
            .spawn()
            .unwrap();
        (child, port)
    }

    fn port_of(fd: &OwnedFd) -> u16 {
        let sock = std::net::UdpSocket::from(fd.try_clone().unwrap());
        sock.local_addr().unwrap().port()
    }

    /// Starts a holder whose pid is `pid` (the pid namespace's next pid set through
    /// `ns_last_pid`; other processes starting meanwhile can take it first, so it retries).
    fn holder_at(pid: u32) -> Option<(Child, u16)> {
        for _ in 0..200 {
            std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).ok()?;
            let (mut child, port) = holder();
            if child.id() == pid {
                return Some((child, port));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        None
    }

    #[test]
    fn a_kept_pidfd_never_reaches_the_task_that_reused_its_thread_id() {
        if sys::pidfd_open_tid(std::process::id() as i32).is_err() {
            eprintln!("SKIP: PIDFD_THREAD (Linux 6.9) is missing; no pidfd is kept");
            return;
        }
        let pidfds = Pidfds::default();
        let (mut first, first_port) = holder();
        let tid = first.id() as libc::pid_t;
        let (kept, taken) = pidfds.take(tid, 0).ok().unwrap();
        assert_eq!(port_of(&taken), first_port);
        let (again, _) = pidfds.take(tid, 0).ok().unwrap();
        assert_eq!(
            again.as_raw_fd(),
            kept.as_raw_fd(),
            "a live thread's pidfd is kept"
        );
        first.kill().unwrap();
        first.wait().unwrap();
        let Some((mut second, second_port)) = holder_at(tid as u32) else {
            eprintln!("SKIP: could not start a process at the reused pid {tid} (not root?)");
            return;
        };
        assert_ne!(first_port, second_port);
        let (fresh, taken) = pidfds.take(tid, 0).ok().unwrap();
        assert_eq!(
            port_of(&taken),
            second_port,
            "the descriptor comes from the task holding the id now"
        );
        assert_ne!(
            fresh.as_raw_fd(),
            kept.as_raw_fd(),
            "the stale pidfd was replaced"
        );
        let _ = second.kill();
        let _ = second.wait();
    }
}
