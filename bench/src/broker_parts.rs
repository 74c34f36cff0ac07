//! Where a brokered connect or sendto spends its added time, part by part: each step the
//! broker takes per notification, timed alone on a real process (a child holding a UDP
//! socket), beside the whole added time measured by the loops (the host judging inline).
//! Parts paid once per thread or socket, or only when the host judges on its attempt
//! stream, are reported but not subtracted. What is left over is the kernel's notification
//! round trip (the trap, switching to the supervision thread, receiving and answering the
//! notification, switching back to the caller) and the validity checks.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::harness::{Row, Samples, fmt_duration, per_call};

/// A child process holding a UDP socket as its descriptor 0.
struct Target {
    child: Child,
    pid: libc::pid_t,
    /// An address in the child's memory (the start of its first mapping).
    addr: u64,
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn target() -> Target {
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp socket");
    let child = Command::new("/bin/sleep")
        .arg("600")
        .stdin(Stdio::from(OwnedFd::from(udp)))
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn sleep");
    let pid = child.id() as libc::pid_t;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let addr = maps
        .split('-')
        .next()
        .and_then(|a| u64::from_str_radix(a, 16).ok())
        .expect("a mapping");
    Target { child, pid, addr }
}

fn check(ret: libc::c_long, what: &str) -> libc::c_long {
    assert!(ret >= 0, "{what}: {}", std::io::Error::last_os_error());
    ret
}

fn pidfd_open(pid: libc::pid_t) -> OwnedFd {
    // SAFETY: plain integer syscall; the new descriptor is owned here alone.
    let fd = check(
        unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) },
        "pidfd_open",
    );
    // SAFETY: a descriptor the kernel just returned.
    unsafe { OwnedFd::from_raw_fd(fd as RawFd) }
}

fn pidfd_getfd(pidfd: &OwnedFd, fd: RawFd) -> OwnedFd {
    // SAFETY: plain integer syscall; the new descriptor is owned here alone.
    let fd = check(
        unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) },
        "pidfd_getfd",
    );
    // SAFETY: a descriptor the kernel just returned.
    unsafe { OwnedFd::from_raw_fd(fd as RawFd) }
}

fn sockopt(fd: &OwnedFd, name: libc::c_int) -> libc::c_int {
    let mut v: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: v and len describe an int the kernel may fill.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            name,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    check(r as libc::c_long, "getsockopt");
    v
}

fn cookie(fd: &OwnedFd) -> u64 {
    /// `SO_COOKIE` (asm-generic).
    const SO_COOKIE: libc::c_int = 57;
    let mut v: u64 = 0;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: v and len describe a u64 the kernel may fill.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_COOKIE,
            (&mut v as *mut u64).cast(),
            &mut len,
        )
    };
    check(r as libc::c_long, "getsockopt SO_COOKIE");
    v
}

fn vm_read(pid: libc::pid_t, addr: u64, buf: &mut [u8]) {
    let local = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: local describes `buf`; the kernel checks the remote range.
    let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    check(n as libc::c_long, "process_vm_readv");
}

/// The parts, timed alone (median per call), and what is left of each loop's `added` time
/// per operation (`(kind, added)`) once they are taken away.
pub fn run(
    runtime: &tokio::runtime::Runtime,
    samples: usize,
    added: &[(&str, Duration)],
) -> Vec<Row> {
    let t = target();
    let batch = 20;
    // Each part, and whether a notification pays it every time (connect or sendto of a
    // thread and socket met before, the host judging inline); the others are paid once per
    // thread or socket, or only when the host judges on its attempt stream.
    let mut parts: Vec<(&str, Samples, bool)> = Vec::new();
    let pidfd = pidfd_open(t.pid);
    parts.push((
        "pidfd_open of the calling thread + close (once per thread: kept while it lives)",
        per_call(samples, batch, || drop(pidfd_open(t.pid))),
        false,
    ));
    parts.push((
        "pidfd_getfd of its socket + close",
        per_call(samples, batch, || drop(pidfd_getfd(&pidfd, 0))),
        true,
    ));
    let sock = pidfd_getfd(&pidfd, 0);
    parts.push((
        "getsockopt SO_COOKIE (a socket met before: its facts are kept by cookie)",
        per_call(samples, batch, || {
            std::hint::black_box(cookie(&sock));
        }),
        true,
    ));
    parts.push((
        "getsockopt SO_DOMAIN, SO_TYPE, SO_PROTOCOL (once per socket)",
        per_call(samples, batch, || {
            for name in [libc::SO_DOMAIN, libc::SO_TYPE, libc::SO_PROTOCOL] {
                std::hint::black_box(sockopt(&sock, name));
            }
        }),
        false,
    ));
    let mut buf = [0u8; 16];
    let read = per_call(samples, batch, || vm_read(t.pid, t.addr, &mut buf));
    parts.push((
        "copy the 16-byte address: process_vm_readv",
        read.clone(),
        true,
    ));
    let mem = File::open(format!("/proc/{}/mem", t.pid)).expect("open /proc/pid/mem");
    let by_file = per_call(samples, batch, || {
        mem.read_exact_at(&mut buf, t.addr).expect("pread mem")
    });
    let by_open_file = per_call(samples, batch, || {
        let m = File::open(format!("/proc/{}/mem", t.pid)).expect("open /proc/pid/mem");
        m.read_exact_at(&mut buf, t.addr).expect("pread mem")
    });
    parts.push((
        "the executable: readlink /proc/<pid>/exe (only for attempts handed to the host's stream)",
        per_call(samples, batch, || {
            std::hint::black_box(std::fs::read_link(format!("/proc/{}/exe", t.pid)).ok());
        }),
        false,
    ));
    // The attempt's trip to the host and its verdict back: a bounded channel to another
    // task and a oneshot answer, on the same 2-worker runtime shape.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<tokio::sync::oneshot::Sender<bool>>(64);
    runtime.spawn(async move {
        while let Some(reply) = rx.recv().await {
            let _ = reply.send(true);
        }
    });
    // Timed inside a task of the runtime, as the supervisor runs.
    let decide = runtime
        .block_on(runtime.spawn(async move {
            let mut out = Vec::with_capacity(samples);
            for _ in 0..samples {
                let start = Instant::now();
                for _ in 0..batch {
                    let tx = tx.clone();
                    let handler = tokio::spawn(async move {
                        let (reply, verdict) = tokio::sync::oneshot::channel();
                        tx.send(reply).await.expect("decider");
                        verdict.await.expect("verdict")
                    });
                    std::hint::black_box(handler.await.expect("handler"));
                }
                out.push(start.elapsed() / batch as u32);
            }
            Samples(out)
        }))
        .expect("timing task");
    parts.push((
        "a handler task, the attempt to the host task and its verdict back (tokio; only when the host judges on its stream)",
        decide,
        false,
    ));
    drop(sock);

    let mut rows: Vec<Row> = parts
        .iter()
        .map(|(name, s, _)| Row {
            name: format!("per-notification part: {name} (median of {samples})"),
            flowhost: fmt_duration(s.median()),
            baseline: None,
            comparison: "—".into(),
            goal: "reported".into(),
            met: true,
        })
        .collect();
    rows.push(Row {
        name: format!(
            "per-notification part: copy the address via /proc/<pid>/mem instead (median of {samples})"
        ),
        flowhost: format!(
            "{} (pread on an open file), {} (open + pread + close)",
            fmt_duration(by_file.median()),
            fmt_duration(by_open_file.median())
        ),
        baseline: Some((
            "process_vm_readv, as the broker does".into(),
            fmt_duration(read.median()),
        )),
        comparison: format!(
            "{:.2}x / {:.2}x process_vm_readv",
            by_file.median().as_secs_f64() / read.median().as_secs_f64(),
            by_open_file.median().as_secs_f64() / read.median().as_secs_f64()
        ),
        goal: "reported".into(),
        met: true,
    });
    let measured: Duration = parts
        .iter()
        .filter(|(_, _, every)| *every)
        .map(|(_, s, _)| s.median())
        .sum();
    for (kind, total) in added {
        rows.push(Row {
            name: format!(
                "per-notification remainder ({kind}, the host judging inline): the kernel's \
                 notification round trip (trap, switching to the supervision thread and \
                 back), poll, receiving and answering the notification, the validity checks"
            ),
            flowhost: fmt_duration(total.saturating_sub(measured)),
            baseline: Some((
                format!("added per {kind} by the broker, this run"),
                fmt_duration(*total),
            )),
            comparison: format!(
                "the parts paid every time sum to {}",
                fmt_duration(measured)
            ),
            goal: "reported".into(),
            met: true,
        });
    }
    rows
}
