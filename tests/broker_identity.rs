//! The broker carries an allowed unix socket operation out with the executor's identity, not
//! its own: what a server learns of its peer, what the file permissions allow and who owns a
//! socket file made are what they would be had the executor made the call itself.
//!
//! Before, the broker (root, in the daemon and in a root `sandbox run`) connected, bound and
//! sent as itself: a server saw uid 0 (`SO_PEERCRED`, `SCM_CREDENTIALS`), an allow rule lent
//! the executor root's file permissions, and a socket it bound was root's.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixDatagram, UnixListener};
use std::path::Path;

use common::{broker, probe_argv, run_under, run_with};
use flowhost_broker::Verdict;
use nix::sys::socket::{ControlMessageOwned, MsgFlags, getsockopt, recvmsg, setsockopt, sockopt};

fn set_mode(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Only root's broker has an identity to lend: unprivileged, it already runs as the
/// executor's uid.
fn root_only() -> bool {
    if !common::is_root() {
        eprintln!("SKIP: an unprivileged broker runs as the executor's uid already");
        return false;
    }
    true
}

fn number(r: &serde_json::Value, field: &str) -> u32 {
    r[field]
        .as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .unwrap_or_else(|| panic!("no {field} in {r}"))
}

/// A unix listener in a directory executors see, whose socket any uid may connect to, and
/// the probe's arguments to connect to it (the directory lives as long as the first).
fn server_any_uid_may_reach() -> (tempfile::TempDir, UnixListener, Vec<String>) {
    let dir = common::executor_visible_dir();
    let path = dir.path().join("server.sock");
    let listener = UnixListener::bind(&path).unwrap();
    listener.set_nonblocking(true).unwrap();
    set_mode(&path, 0o777);
    let argv = probe_argv(&["unix-connect", path.to_str().unwrap()]);
    (dir, listener, argv)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_sees_the_executors_uid_and_gid_on_a_brokered_connect() {
    if !root_only() {
        return;
    }
    let Some(b) = broker() else { return };
    let (_dir, listener, argv) = server_any_uid_may_reach();
    let run = run_with(&b, "brokered", argv, |_| Verdict::Allow).await;
    let r = run.result();
    assert_eq!(r["result"], "ok", "{r}");
    let (conn, _) = listener
        .accept()
        .expect("the allowed connect did not arrive");
    let peer = getsockopt(&conn, sockopt::PeerCredentials).unwrap();
    assert_ne!(peer.uid(), 0, "the server saw the broker's uid");
    assert_eq!(peer.uid(), number(&r, "uid"));
    assert_eq!(peer.gid(), number(&r, "gid"));
}

/// A spawn that names the identity its executor runs as has its unix operations made as
/// that identity too. Before, no uid was leased for it, so they were made as the broker
/// itself: root, with its capabilities.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spawn_naming_its_identity_has_its_connects_made_as_that_identity() {
    if !root_only() {
        return;
    }
    let Some(b) = broker() else { return };
    let (_dir, listener, argv) = server_any_uid_may_reach();
    let named = (61_999, 61_998);
    let run = common::run_as(&b, "brokered", argv, named, |_| Verdict::Allow).await;
    let r = run.result();
    assert_eq!(r["result"], "ok", "{r}");
    assert_eq!((number(&r, "uid"), number(&r, "gid")), named, "{r}");
    let (conn, _) = listener
        .accept()
        .expect("the allowed connect did not arrive");
    let peer = getsockopt(&conn, sockopt::PeerCredentials).unwrap();
    assert_eq!(
        (peer.uid(), peer.gid()),
        named,
        "the server saw another identity"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_brokered_connect_needs_the_executors_own_file_permissions() {
    if !root_only() {
        return;
    }
    let Some(b) = broker() else { return };
    let dir = common::executor_visible_dir();
    let path = dir.path().join("root-only.sock");
    let listener = UnixListener::bind(&path).unwrap();
    listener.set_nonblocking(true).unwrap();
    // Connecting needs write permission on the socket file: root's alone here.
    set_mode(&path, 0o755);
    let argv = probe_argv(&["unix-connect", path.to_str().unwrap()]);
    let run = run_with(&b, "brokered", argv.clone(), |_| Verdict::Allow).await;
    assert_eq!(run.errno(), libc::EACCES as i64, "{}", run.stdout);
    assert!(listener.accept().is_err(), "the connect reached the server");
    // And search permission on every directory above it.
    set_mode(&path, 0o777);
    set_mode(dir.path(), 0o700);
    let run = run_with(&b, "brokered", argv.clone(), |_| Verdict::Allow).await;
    assert_eq!(run.errno(), libc::EACCES as i64, "{}", run.stdout);
    assert!(listener.accept().is_err(), "the connect reached the server");
    // Given both, it is carried out.
    set_mode(dir.path(), 0o755);
    let run = run_with(&b, "brokered", argv, |_| Verdict::Allow).await;
    assert_eq!(run.result()["result"], "ok", "{}", run.stdout);
    assert!(
        listener.accept().is_ok(),
        "the allowed connect did not arrive"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_brokered_bind_makes_a_socket_the_executor_owns_and_only_where_its_uid_may_write() {
    if !root_only() {
        return;
    }
    let Some(b) = broker() else { return };
    let (open, closed) = (
        common::executor_visible_dir(),
        common::executor_visible_dir(),
    );
    set_mode(open.path(), 0o1777);
    // Both are write paths (Landlock allows both); only one is writable by the executor.
    let mut profile = (*common::profile("brokered")).clone();
    profile.read_write.push(open.path().to_path_buf());
    profile.read_write.push(closed.path().to_path_buf());
    let profile = std::sync::Arc::new(profile);

    let made = open.path().join("mine.sock");
    let argv = probe_argv(&["unix-bind", made.to_str().unwrap()]);
    let run = run_under(&b, profile.clone(), argv, |_| Verdict::Allow).await;
    let r = run.result();
    assert_eq!(r["result"], "ok", "{r}");
    let meta = std::fs::symlink_metadata(&made).expect("the socket file was not made");
    assert_eq!(
        (meta.uid(), meta.gid()),
        (number(&r, "uid"), number(&r, "gid")),
        "the socket file is not the executor's"
    );

    let squat = closed.path().join("squat.sock");
    let argv = probe_argv(&["unix-bind", squat.to_str().unwrap()]);
    let run = run_under(&b, profile, argv, |_| Verdict::Allow).await;
    assert_eq!(run.errno(), libc::EACCES as i64, "{}", run.stdout);
    assert!(
        !squat.exists(),
        "a socket was made in a directory only root may write"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_brokered_datagram_carries_the_executors_credentials() {
    if !root_only() {
        return;
    }
    let Some(b) = broker() else { return };
    let dir = common::executor_visible_dir();
    let path = dir.path().join("log.sock");
    let receiver = UnixDatagram::bind(&path).unwrap();
    receiver.set_nonblocking(true).unwrap();
    // As a logging service does: every datagram says who sent it.
    setsockopt(&receiver, sockopt::PassCred, &true).unwrap();
    set_mode(&path, 0o777);
    let argv = probe_argv(&["unix-sendto", path.to_str().unwrap()]);
    let run = run_with(&b, "brokered", argv.clone(), |_| Verdict::Allow).await;
    let r = run.result();
    assert_eq!(r["result"], "ok", "{r}");
    let mut buf = [0u8; 64];
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    let mut space = nix::cmsg_space!(nix::sys::socket::UnixCredentials);
    let msg = recvmsg::<()>(
        std::os::fd::AsRawFd::as_raw_fd(&receiver),
        &mut iov,
        Some(&mut space),
        MsgFlags::empty(),
    )
    .expect("the allowed datagram did not arrive");
    let creds = msg
        .cmsgs()
        .unwrap()
        .find_map(|c| match c {
            ControlMessageOwned::ScmCredentials(c) => Some(c),
            _ => None,
        })
        .expect("no credentials with the datagram");
    assert_ne!(creds.uid(), 0, "the datagram carried the broker's uid");
    assert_eq!(creds.uid(), number(&r, "uid"));
    assert_eq!(creds.gid(), number(&r, "gid"));
    // Sending needs write permission on the receiver's socket file.
    set_mode(&path, 0o755);
    let run = run_with(&b, "brokered", argv, |_| Verdict::Allow).await;
    assert_eq!(run.errno(), libc::EACCES as i64, "{}", run.stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_sees_the_executors_uid_and_gid_on_a_brokered_listener() {
    if !root_only() {
        return;
    }
    let Some(b) = broker() else { return };
    // The probe listens in its private /tmp and connects to itself: the connecting side is
    // told who listens, as captured when `listen` was carried out.
    let argv = probe_argv(&["unix-listen-peer", "/tmp/server.sock"]);
    let run = run_with(&b, "brokered", argv, |_| Verdict::Allow).await;
    let r = run.result();
    assert_eq!(r["result"], "ok", "{r}");
    assert_ne!(
        number(&r, "peer_uid"),
        0,
        "the listener had the broker's uid"
    );
    assert_eq!(number(&r, "peer_uid"), number(&r, "uid"));
    assert_eq!(number(&r, "peer_gid"), number(&r, "gid"));
}

/// The broker's threads keep its identity after operations made as an executor: the runtime's
/// workers (which made them) get theirs back, and a helper thread never starts with an
/// executor's. A thread starts with its creator's credentials: the watchdog that bounds
/// connects, once started by the first bounded call (in this binary always a unix connect,
/// made as an executor), kept that executor's uid and lacked the broker's capabilities for
/// good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_brokers_threads_keep_its_identity_after_a_unix_connect() {
    if !root_only() {
        return;
    }
    let Some(b) = broker() else { return };
    let dir = common::executor_visible_dir();
    let path = dir.path().join("server.sock");
    let listener = common::listener_for_executors(&path);
    listener.set_nonblocking(true).unwrap();
    let argv = probe_argv(&["unix-connect", path.to_str().unwrap()]);
    let run = run_with(&b, "brokered", argv, |_| Verdict::Allow).await;
    assert_eq!(run.result()["result"], "ok", "{}", run.stdout);
    let own = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    let identity = |status: &str| -> Vec<String> {
        status
            .lines()
            .filter(|l| {
                ["Uid:", "Gid:", "Groups:", "CapEff:", "CapPrm:"]
                    .iter()
                    .any(|k| l.starts_with(k))
            })
            .map(str::to_owned)
            .collect()
    };
    let mut threads = 0;
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let task = task.unwrap().path();
        let Ok(status) = std::fs::read_to_string(task.join("status")) else {
            continue; // ended meanwhile
        };
        let name = std::fs::read_to_string(task.join("comm")).unwrap_or_default();
        if name.starts_with("flowhost-") || name.starts_with("tokio-runtime") {
            threads += 1;
            assert_eq!(identity(&status), identity(&own), "thread {}", name.trim());
        }
    }
    assert!(threads > 0, "no broker thread found");
}
