//! Reading the executor's memory: every copy is followed by a `SECCOMP_IOCTL_NOTIF_ID_VALID`
//! check, so what was copied is known to come from the thread still waiting on the
//! notification; and the bounds on what one notification may copy and hold.
//!
//! Why a check after the copy is enough, with none before it: a notification that is valid
//! after the copy was valid throughout it (an id never becomes valid again), so its thread
//! was alive and waiting, and its thread id could not name another task while the copy
//! read it. A copy from a thread that ended first may read whatever task reused the id, but
//! the check then fails and those bytes are dropped unread; reading has no effect on the
//! task read. The same check proves every pidfd and descriptor taken before the copy.

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use super::cmsg::{Held, translate_control};
use super::socket::{TakenSocket, peer};
use super::{Caller, Outcome, Step, errno_of};
use crate::attempt::{Destination, EgressSyscall};
use crate::sys::{self, OwnedMessage};

/// Largest address the kernel accepts (`sizeof(struct sockaddr_storage)`).
const MAX_ADDR: usize = 128;
/// Most iovecs per message (`UIO_MAXIOV`).
pub(super) const MAX_IOV: usize = 1024;
/// Most control bytes copied per message.
const MAX_CONTROL: usize = 64 * 1024;
/// Most payload bytes copied per notification (all messages of a `sendmmsg` together); a
/// larger stream send is sent partially (as the kernel may do), a larger datagram is refused
/// with EMSGSIZE, and a batch is cut short before the message that does not fit (as the
/// kernel reports a batch that failed part-way).
const MAX_PAYLOAD: usize = 4 * 1024 * 1024;
/// Most descriptors held per notification: passed ones (`SCM_MAX_FD`, the kernel's own
/// per-message limit) and pinned unix paths together.
pub(super) const MAX_PASSED_FDS: usize = 253;
/// `struct msghdr` and `struct mmsghdr` sizes on x86_64.
pub(super) const MSGHDR_SIZE: usize = 56;
pub(super) const MMSGHDR_SIZE: usize = 64;

/// One message of a send, copied out of the executor.
pub(super) struct CopiedMessage {
    pub(super) msg: OwnedMessage,
    /// Destination decoded from `msg.name`, or the connected peer.
    pub(super) destination: Option<Destination>,
    pub(super) connected: bool,
    /// Descriptors passed with SCM_RIGHTS (kept alive until the send is done).
    _passed: Vec<Held>,
    pub(super) passed_count: usize,
    /// Pinned unix socket inode when the destination is a pathname.
    _pin: Option<Held>,
    /// Why the destination cannot be reached (a unix path that does not resolve), returned
    /// only if the host allows the attempt.
    pub(super) unreachable: Option<i32>,
}

impl Caller<'_> {
    pub(super) fn still_waiting(&self) -> Step<()> {
        if sys::notif_id_valid(self.ctx.listener.as_fd(), self.n.id) {
            Ok(())
        } else {
            Err(Outcome::Abandon)
        }
    }

    /// Called between the verdict and the operation: nothing is performed for a caller that
    /// went away while the host decided, and the broker-wide permit is released, since what
    /// follows may wait on the network for as long as the caller does. A verdict the host's
    /// synchronous judge gave needs no second look: nothing waited since the copy's check.
    pub(super) fn performing(&self) -> Step<()> {
        if self.waited.load(std::sync::atomic::Ordering::Relaxed) {
            self.still_waiting()?;
        }
        if let Ok(mut shared) = self.shared.lock() {
            shared.take();
        }
        Ok(())
    }

    /// Runs `wait`, a wait on the network before the decision (a send waiting for its
    /// socket's handshake), without the broker-wide permit, and takes one again after it: a
    /// caller whose peer is silent must not hold one of the slots every executor's egress
    /// needs (its own executor's slot still bounds it).
    pub(super) async fn unshared<T>(&self, wait: impl std::future::Future<Output = T>) -> T {
        let had = self
            .shared
            .lock()
            .ok()
            .and_then(|mut shared| shared.take())
            .is_some();
        let out = wait.await;
        if had {
            let permit = self.ctx.broker_handlers.clone().acquire_owned().await.ok();
            if let Ok(mut shared) = self.shared.lock() {
                *shared = permit;
            }
        }
        out
    }

    /// What to answer when the broker's own work for the caller failed: the error, unless
    /// the caller is gone (then there is nobody to answer). Never silence: an unanswered
    /// notification would leave the calling thread blocked forever.
    pub(super) fn failure(&self, e: &io::Error) -> Outcome {
        match self.still_waiting() {
            Ok(()) => Outcome::Errno(errno_of(e)),
            Err(gone) => gone,
        }
    }

    /// Copies `len` bytes at `addr` from the caller, followed by an ID_VALID check so the
    /// bytes are known to come from the thread that is waiting on this notification (see
    /// the module documentation).
    pub(super) fn copy(&self, addr: u64, len: usize) -> Step<Vec<u8>> {
        let mut buf = vec![0u8; len];
        sys::read_remote(self.n.pid, addr, &mut buf).map_err(|_| Outcome::Errno(libc::EFAULT))?;
        self.still_waiting()?;
        Ok(buf)
    }

    /// Copies two ranges of the caller's memory (a payload and its address) in one read,
    /// checked as [`Caller::copy`] is.
    pub(super) fn copy_two(&self, a: (u64, usize), b: (u64, usize)) -> Step<(Vec<u8>, Vec<u8>)> {
        let (mut first, mut second) = (vec![0u8; a.1], vec![0u8; b.1]);
        sys::read_remote_many(self.n.pid, &mut [(a.0, &mut first), (b.0, &mut second)])
            .map_err(|_| Outcome::Errno(libc::EFAULT))?;
        self.still_waiting()?;
        Ok((first, second))
    }

    /// Copies each `(address, length)` part of the caller's memory, one after another into
    /// one buffer, in one read (`parts` at most [`MAX_IOV`]), checked as [`Caller::copy`]
    /// is: a message's iovecs cost two system calls however many there are, not two each.
    pub(super) fn copy_gathered(&self, parts: &[(u64, usize)]) -> Step<Vec<u8>> {
        let total = parts.iter().map(|(_, len)| *len).sum();
        let mut buf = vec![0u8; total];
        {
            let mut rest: &mut [u8] = &mut buf;
            let mut pieces = Vec::with_capacity(parts.len());
            for &(addr, len) in parts {
                let (piece, tail) = std::mem::take(&mut rest).split_at_mut(len);
                pieces.push((addr, piece));
                rest = tail;
            }
            sys::read_remote_many(self.n.pid, &mut pieces)
                .map_err(|_| Outcome::Errno(libc::EFAULT))?;
        }
        self.still_waiting()?;
        Ok(buf)
    }

    /// The caller's `/proc/<tid>/mem`, open for writing, to report results the kernel would
    /// have written into the caller's memory. Opened before the caller's memory is first
    /// copied, so the validity check after that copy proves it is the waiting thread's.
    pub(super) fn memory(&self) -> Step<std::fs::File> {
        std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/{}/mem", self.n.pid))
            .map_err(|e| self.failure(&e))
    }

    pub(super) fn payload_len(&self, sock: &TakenSocket, len: usize) -> Step<usize> {
        if len <= MAX_PAYLOAD {
            Ok(len)
        } else if sock.info.socket_type == libc::SOCK_STREAM {
            Ok(MAX_PAYLOAD)
        } else {
            Err(Outcome::Errno(libc::EMSGSIZE))
        }
    }

    /// Copies one `struct msghdr` worth of message: name, payload and control data, within
    /// what is left of the notification's `budget`. A stream message larger than the budget
    /// is copied partially (and sent partially) only when nothing else of the notification
    /// was copied yet; otherwise it fails, as does a datagram that does not fit. `flags` are
    /// the send's (they say whether the kernel reads the name at all).
    pub(super) fn message(
        &self,
        pidfd: &OwnedFd,
        sock: &TakenSocket,
        header: &[u8],
        send: (EgressSyscall, i32),
        budget: &mut Budget,
    ) -> Step<CopiedMessage> {
        let (syscall, flags) = send;
        let u64_at = |o: usize| u64::from_ne_bytes(header[o..o + 8].try_into().unwrap_or([0; 8]));
        let u32_at = |o: usize| u32::from_ne_bytes(header[o..o + 4].try_into().unwrap_or([0; 4]));
        let (name_ptr, name_len) = (u64_at(0), u32_at(8) as usize);
        let (iov_ptr, iov_len) = (u64_at(16), u64_at(24) as usize);
        let (control_ptr, control_len) = (u64_at(32), u64_at(40) as usize);
        if name_len > MAX_ADDR {
            return Err(Outcome::Errno(libc::EINVAL));
        }
        if iov_len > MAX_IOV {
            return Err(Outcome::Errno(libc::EMSGSIZE));
        }
        if control_len > budget.control {
            return Err(Outcome::Errno(libc::ENOBUFS));
        }
        let iovecs = if iov_len > 0 {
            self.copy(iov_ptr, iov_len * 16)?
        } else {
            Vec::new()
        };
        let field = |i: usize, o: usize| {
            u64::from_ne_bytes(
                iovecs[i * 16 + o..i * 16 + o + 8]
                    .try_into()
                    .unwrap_or([0; 8]),
            )
        };
        let total = (0..iov_len).fold(0usize, |t, i| t.saturating_add(field(i, 8) as usize));
        let partial = sock.info.socket_type == libc::SOCK_STREAM && budget.untouched();
        if total > budget.payload && !partial {
            return Err(Outcome::Errno(libc::EMSGSIZE));
        }
        let mut parts = Vec::with_capacity(iov_len);
        let mut room = budget.payload;
        for i in 0..iov_len {
            let take = (field(i, 8) as usize).min(room);
            if take > 0 {
                parts.push((field(i, 0), take));
                room -= take;
            }
        }
        let data = self.copy_gathered(&parts)?;
        budget.payload -= data.len();
        budget.control -= control_len;
        let mut msg = OwnedMessage {
            data,
            ..OwnedMessage::default()
        };
        let (destination, connected);
        let (mut pin, mut unreachable) = (None, None);
        if name_ptr != 0 && name_len > 0 && !super::perform::ignores_address(sock, flags) {
            let raw = self.copy(name_ptr, name_len)?;
            let (dest, target) = self.resolve(&raw, sock, syscall);
            self.keep_from_the_host(&dest, sock, &target)?;
            if super::perform::needs_network_privilege(&dest) {
                unreachable = Some(libc::EPERM);
            }
            destination = Some(dest);
            connected = false;
            match target {
                Ok(t) => {
                    msg.name = t.addr;
                    pin = t
                        .pin
                        .map(|fd| Held::for_send(fd, &self.ctx.held))
                        .transpose()?;
                    // A pinned path is a descriptor held until the send: it counts.
                    if pin.is_some() {
                        budget.fds = budget
                            .fds
                            .checked_sub(1)
                            .ok_or(Outcome::Errno(libc::ENOBUFS))?;
                    }
                }
                Err(Outcome::Errno(e)) => unreachable = unreachable.or(Some(e)),
                Err(other) => return Err(other),
            }
        } else {
            connected = true;
            destination = peer(sock);
        }
        let mut passed = Vec::new();
        if control_ptr != 0 && control_len > 0 {
            let raw = self.copy(control_ptr, control_len)?;
            msg.control =
                translate_control(&raw, (pidfd, &self.ctx.held), &mut passed, budget.fds)?;
            budget.fds -= passed.len();
        }
        let passed_count = passed.len();
        Ok(CopiedMessage {
            msg,
            destination,
            connected,
            _passed: passed,
            passed_count,
            _pin: pin,
            unreachable,
        })
    }
}

/// What one notification may still copy out of the executor and hold while it is handled.
pub(super) struct Budget {
    payload: usize,
    control: usize,
    fds: usize,
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            payload: MAX_PAYLOAD,
            control: MAX_CONTROL,
            fds: MAX_PASSED_FDS,
        }
    }
}

impl Budget {
    fn untouched(&self) -> bool {
        self.payload == MAX_PAYLOAD
    }
}

pub(super) fn addr_len(len: u64) -> Step<usize> {
    let len = len as u32 as usize;
    if len > MAX_ADDR {
        Err(Outcome::Errno(libc::EINVAL))
    } else {
        Ok(len)
    }
}
