//! Hostile local peers against the real daemon: a uid that is no principal flooding the
//! socket, peers refused at `initialize`, and connections left idle.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::lab::Lab;
use serde_json::{Value, json};

/// A uid that no lab principal maps to.
const STRANGER_UID: u32 = 4243;

/// Runs `f` on a thread whose effective uid alone is `euid` (SO_PEERCRED is captured at
/// connect from the connecting thread's credentials).
fn as_euid<T: Send + 'static>(euid: u32, f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        // SAFETY: raw setresuid changes only this thread's credentials; -1 keeps the real
        // and saved uid (0), so the thread can switch back.
        unsafe {
            assert_eq!(
                libc::syscall(libc::SYS_setresuid, -1i64, euid as i64, -1i64),
                0
            )
        };
        let out = f();
        // SAFETY: as above, back to euid 0.
        unsafe { assert_eq!(libc::syscall(libc::SYS_setresuid, -1i64, 0i64, -1i64), 0) };
        out
    })
    .join()
    .unwrap()
}

fn initialize_line() -> Vec<u8> {
    let mut line = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "test", "version": "0"}}})
    .to_string()
    .into_bytes();
    line.push(b'\n');
    line
}

/// Connects and sends `initialize`; returns the open stream and the response, or `None`
/// when the connection was refused or closed before answering.
fn session(socket: &Path) -> Option<(UnixStream, Value)> {
    let stream = UnixStream::connect(socket).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .ok()?;
    (&stream).write_all(&initialize_line()).ok()?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line).ok()?;
    let response = serde_json::from_str(&line).ok()?;
    Some((stream, response))
}

/// Whether the daemon closes `stream` within `within` (end of stream, not a timeout).
fn closed_within(stream: &mut UnixStream, within: Duration) -> bool {
    stream.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 256];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[test]
fn a_flooding_stranger_does_not_lock_a_principal_out() {
    let Some(lab) = Lab::start() else { return };
    let socket: PathBuf = lab.paths.socket.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let flooded = Arc::new(AtomicU64::new(0));
    // Two threads of one uid that is no principal loop connect/close at full speed.
    let flooders: Vec<_> = (0..2)
        .map(|_| {
            let (socket, stop, flooded) = (socket.clone(), stop.clone(), flooded.clone());
            std::thread::spawn(move || {
                as_euid(STRANGER_UID, move || {
                    while !stop.load(Ordering::Relaxed) {
                        if let Ok(s) = UnixStream::connect(&socket) {
                            drop(s);
                            flooded.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    // The principal (this process, uid 0: the lab's analyst) opens 100 sessions and keeps
    // them open.
    let mut held = Vec::new();
    let mut failures = Vec::new();
    let started = Instant::now();
    for i in 0..100 {
        match session(&socket) {
            Some((stream, r)) if r.get("result").is_some() => held.push(stream),
            other => failures.push((i, other.map(|(_, r)| r))),
        }
    }
    let took = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    for f in flooders {
        f.join().unwrap();
    }
    let flooded = flooded.load(Ordering::Relaxed);
    eprintln!(
        "100 principal sessions in {took:?} with {} failures, against {flooded} flooding connections",
        failures.len()
    );
    assert!(
        failures.len() <= 1,
        "{} of 100 principal sessions failed while a stranger flooded ({flooded} connections): {failures:?}",
        failures.len()
    );
    assert!(flooded > 1000, "the flood did not happen: {flooded}");
    // Refusals are logged once per uid and reason per interval, then summarised.
    let log = lab.log();
    let warnings = log
        .lines()
        .filter(|l| l.contains("closing a new connection"))
        .count();
    assert!(
        warnings <= 4,
        "{warnings} refusal warnings for one flooding uid"
    );
}

#[test]
fn refused_and_idle_connections_are_closed() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    let config = std::fs::read_to_string(&lab.config).unwrap().replacen(
        "[host]\n",
        "[host]\ninitialize_timeout_ms = 500\nsession_idle_timeout_ms = 1500\n",
        1,
    );
    lab.write_config(&config);
    lab.spawn();
    let socket = lab.paths.socket.clone();

    // A peer that is no principal gets its refusal, then the connection closes at once.
    let s = socket.clone();
    let (mut stranger, r) = as_euid(STRANGER_UID, move || session(&s)).unwrap();
    assert_eq!(
        r["error"]["code"],
        flowhost::mcp::code::ACCESS_DENIED,
        "{r}"
    );
    assert!(
        closed_within(&mut stranger, Duration::from_millis(500)),
        "a peer refused at initialize kept its connection"
    );

    // No initialize within the window: closed.
    let mut silent = UnixStream::connect(&socket).unwrap();
    let t = Instant::now();
    assert!(closed_within(&mut silent, Duration::from_secs(5)));
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());

    // An initialized session that goes quiet is closed after the idle window; one that
    // keeps asking is not.
    let (mut idle, r) = session(&socket).unwrap();
    assert!(r.get("result").is_some(), "{r}");
    let (mut busy, r) = session(&socket).unwrap();
    assert!(r.get("result").is_some(), "{r}");
    let t = Instant::now();
    let ping = b"{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"ping\"}\n";
    let mut reader = BufReader::new(busy.try_clone().unwrap());
    while t.elapsed() < Duration::from_millis(2500) {
        busy.write_all(ping).unwrap();
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        assert!(line.contains("\"result\""), "{line:?}");
        std::thread::sleep(Duration::from_millis(300));
    }
    assert!(closed_within(&mut idle, Duration::from_secs(3)));
    assert!(!closed_within(&mut busy, Duration::from_millis(200)));
}
