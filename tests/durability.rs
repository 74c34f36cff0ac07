//! Durability and fail-closed behaviour of the record writer, in real processes.
//!
//! * A child process takes decisions through the writer and performs each allowed effect
//!   (bytes to a loopback TCP sink run by this test) only after `commit` says the record is
//!   durable. It is killed with SIGKILL mid-burst. Every effect the sink saw must have its
//!   record, and the records must verify (after the restart repair of a torn tail).
//! * A full disk: the child runs under RLIMIT_FSIZE with SIGXFSZ ignored, so writes fail with
//!   EFBIG; the writer must refuse from then on and the health must say so. As root, the same
//!   on a small tmpfs (ENOSPC).
//!
//! The children are this test binary re-executed on an `#[ignore]`d helper test selected by
//! name, with an environment variable carrying its parameters.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flowhost::records::chain::{ProblemKind, verify_records};
use flowhost::records::health::{HealthProducer, RecordsHealth, ToolObservationHealth};
use flowhost::records::store::StoreError;
use flowhost::records::{
    Correlation, DecisionRecord, FlowContext, MIN_RING_BYTES, RecordError, RecordWriter,
    ServerInfo, ToolCallFacts, Verdict, WriterOptions, project_tool_call,
};

const CHILD_ENV: &str = "FLOWHOST_DURABILITY_CHILD";

fn decision(call_id: &str) -> DecisionRecord {
    DecisionRecord::tool_call(ToolCallFacts {
        server: ServerInfo::mcp("sink-writer", None),
        tool_name: "sink.send".into(),
        projection: project_tool_call(None, &serde_json::json!({})),
        verdict: Verdict::Authorized {
            rule: Some("durability".into()),
        },
        credential_alias: None,
        correlation: Correlation::none(),
        context: FlowContext {
            call_id: Some(call_id.to_string()),
            ..FlowContext::default()
        },
    })
}

/// Runs this binary's helper test `name` as a child with `param` in [`CHILD_ENV`].
fn child(name: &str, param: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().expect("test binary"));
    c.args([
        "--ignored",
        "--exact",
        name,
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_ENV, param)
    .stdin(Stdio::null());
    c
}

fn child_param() -> Option<String> {
    std::env::var(CHILD_ENV).ok()
}

/// The call ids of the allow records in `dir`.
fn recorded_calls(dir: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for f in flowhost::records::store::list_record_files(dir).unwrap() {
        let bytes = std::fs::read(&f.path).unwrap();
        for line in flowhost::records::store::split_lines(&bytes).0 {
            let r = DecisionRecord::from_json_line(line).unwrap();
            if let Some(id) = r.flowhost.call_id {
                out.insert(id);
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// SIGKILL mid-burst

/// Child: 4 threads, each with its own connection to the sink, commit a decision and then
/// (only then) send its call id to the sink, until killed (bounded at 60 s).
#[test]
#[ignore = "helper: run as a child process by kill_mid_burst_loses_no_recorded_effect"]
fn child_commit_then_effect() {
    let Some(param) = child_param() else {
        return;
    };
    let (dir, addr) = param.split_once('|').expect("dir|addr");
    let w = RecordWriter::open(
        Path::new(dir),
        WriterOptions {
            rotate_bytes: 256 * 1024,
            ..WriterOptions::default()
        },
    )
    .expect("open writer");
    let deadline = Instant::now() + Duration::from_secs(60);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let w = w.clone();
            let mut sink = TcpStream::connect(addr).expect("connect sink");
            std::thread::spawn(move || {
                for i in 0.. {
                    if Instant::now() > deadline {
                        break;
                    }
                    let id = format!("t{t}-{i}");
                    w.commit_blocking(decision(&id)).expect("commit");
                    // The effect happens only after the record is durable.
                    sink.write_all(format!("{id}\n").as_bytes())
                        .expect("effect");
                }
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
}

#[test]
fn kill_mid_burst_loses_no_recorded_effect() {
    let dir = tempfile::tempdir().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink = {
        let seen = seen.clone();
        std::thread::spawn(move || {
            let mut readers = Vec::new();
            for _ in 0..4 {
                let (conn, _) = listener.accept().unwrap();
                let seen = seen.clone();
                readers.push(std::thread::spawn(move || {
                    // Only complete lines are effects; a cut line was never fully sent.
                    for line in BufReader::new(conn).lines() {
                        match line {
                            Ok(l) => seen.lock().unwrap().push(l),
                            Err(_) => break,
                        }
                    }
                }));
            }
            for r in readers {
                r.join().unwrap();
            }
        })
    };
    let mut proc = child(
        "child_commit_then_effect",
        &format!("{}|{addr}", dir.path().display()),
    )
    .stdout(Stdio::null())
    .spawn()
    .unwrap();
    // Let the burst run until a good number of effects happened, then kill -9 mid-burst.
    let start = Instant::now();
    while seen.lock().unwrap().len() < 2000 && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(5));
    }
    proc.kill().unwrap(); // SIGKILL
    let status = proc.wait().unwrap();
    assert!(!status.success(), "the child was killed");
    sink.join().unwrap();
    let effects: Vec<String> = seen.lock().unwrap().clone();
    assert!(
        effects.len() >= 100,
        "the burst was too short to test anything: {} effects",
        effects.len()
    );

    // Straight after the crash: at most a torn last line, nothing else; or, when the kill
    // fell between a record's durable write to the ring and its append to the file, a
    // refusal to verify until a restart replays the ring (what the file lacks is durable).
    match verify_records(dir.path(), None) {
        Ok(report) => {
            for p in &report.problems {
                assert!(
                    matches!(p.kind, ProblemKind::TornLine { .. }),
                    "unexpected problem after SIGKILL: {p}"
                );
            }
        }
        Err(StoreError::Unreplayed { first, last, .. }) => {
            println!(
                "the ring holds records {first}..={last} the file lacks; the restart replays them"
            );
        }
        Err(e) => panic!("cannot verify after SIGKILL: {e}"),
    }
    // The restart path repairs a torn tail; then the stream verifies cleanly.
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    w.close_blocking().unwrap();
    let report = verify_records(dir.path(), None).unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);

    let recorded = recorded_calls(dir.path());
    let missing: Vec<_> = effects.iter().filter(|e| !recorded.contains(*e)).collect();
    assert!(
        missing.is_empty(),
        "{} of {} effects have no record, e.g. {:?}",
        missing.len(),
        effects.len(),
        missing.first()
    );
    println!(
        "{} effects seen by the sink, {} records durable, all effects recorded",
        effects.len(),
        report.records
    );
}

// ---------------------------------------------------------------------------------------
// Full disk

/// Child: RLIMIT_FSIZE of `limit` bytes with SIGXFSZ ignored; commits until the writer
/// refuses, checks it keeps refusing, writes the health to `<dir>/health.json`, prints a
/// summary line.
#[test]
#[ignore = "helper: run as a child process by full_disk_under_rlimit_fsize_fails_closed"]
fn child_fill_disk() {
    let Some(param) = child_param() else {
        return;
    };
    let dir = PathBuf::from(param);
    // SAFETY: installing SIG_IGN runs no handler code; the process is single-purpose and
    // sets the disposition before starting any thread of its own.
    unsafe {
        nix::sys::signal::signal(
            nix::sys::signal::Signal::SIGXFSZ,
            nix::sys::signal::SigHandler::SigIgn,
        )
    }
    .expect("ignore SIGXFSZ");
    let limit = 64 * 1024;
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_FSIZE, limit, limit)
        .expect("set RLIMIT_FSIZE");
    let health_path = dir.join("health.json");
    let records = dir.join("records");
    // The smallest ring, so that the file limit bites on records, not on the ring.
    let options = WriterOptions {
        ring_bytes: MIN_RING_BYTES,
        ..WriterOptions::default()
    };
    let w = RecordWriter::open(&records, options).expect("open");
    let mut committed = 0u64;
    let first_error = loop {
        match w.commit_blocking(decision(&format!("c{committed}"))) {
            Ok(c) => {
                assert_eq!(c.seq, committed + 1);
                committed += 1;
            }
            Err(e) => break e,
        }
        assert!(committed < 10_000, "the limit never bit");
    };
    let second = w.commit_blocking(decision("after")).unwrap_err();
    let status = w.status();
    let mut health = ToolObservationHealth::unknown(HealthProducer::Daemon);
    health.records = RecordsHealth::from_writer(&status);
    health
        .write_to(&health_path)
        .expect("health is small enough to write");
    println!(
        "SUMMARY {}",
        serde_json::json!({
            "committed": committed,
            "first_error": first_error.to_string(),
            "first_is_writer_failed": matches!(first_error, RecordError::WriterFailed { .. }),
            "second_is_writer_failed": matches!(second, RecordError::WriterFailed { .. }),
            "status_failed": status.failed,
            "last_seq": status.last_seq,
        })
    );
}

#[test]
fn full_disk_under_rlimit_fsize_fails_closed() {
    let dir = tempfile::tempdir().unwrap();
    let out = child("child_fill_disk", dir.path().to_str().unwrap())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = stdout
        .lines()
        // libtest may print the test name on the same line first.
        .find_map(|l| l.split_once("SUMMARY ").map(|(_, s)| s))
        .map(|s| serde_json::from_str(s).unwrap())
        .expect("summary line");
    assert_eq!(summary["first_is_writer_failed"], true, "{summary}");
    assert_eq!(summary["second_is_writer_failed"], true, "{summary}");
    let reason = summary["first_error"].as_str().unwrap();
    assert!(reason.contains("File too large"), "{reason}");
    let committed = summary["committed"].as_u64().unwrap();
    assert!(committed > 10, "{summary}");
    assert_eq!(summary["last_seq"], committed);

    let health = ToolObservationHealth::read_from(&dir.path().join("health.json")).unwrap();
    assert!(health.records.writer_failed);
    assert!(!health.complete);
    assert!(
        health
            .incomplete_reasons
            .iter()
            .any(|r| r.contains("record writer failed") && r.contains("File too large")),
        "{:?}",
        health.incomplete_reasons
    );
    // The write that hit the limit went to the ring first, so the ring may hold a record the
    // files do not: readers refuse the directory until a writer's open (the restart) copies
    // it in, rather than reading the files as the whole stream.
    let records = dir.path().join("records");
    match verify_records(&records, None) {
        Ok(_) | Err(StoreError::Unreplayed { .. }) => {}
        Err(e) => panic!("{e}"),
    }
    RecordWriter::open(&records, WriterOptions::default())
        .unwrap()
        .close_blocking()
        .unwrap();
    // Everything acknowledged is on disk and chained; the failed write left at most a torn
    // line, which the restart set aside.
    let report = verify_records(&records, None).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert!(report.last_seq.unwrap_or(0) >= committed);
    let recorded = recorded_calls(&records);
    for i in 0..committed {
        assert!(
            recorded.contains(&format!("c{i}")),
            "c{i} acknowledged but missing"
        );
    }
}

/// Unmounts on drop, so a failing assertion does not leave a mount behind.
struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn full_tmpfs_fails_closed_when_root() {
    if !nix::unistd::Uid::effective().is_root() {
        println!(
            "skipping the tmpfs part: mounting a tmpfs needs root (RLIMIT_FSIZE covers the full-disk case)"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mount = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=96k,mode=0700", "flowhost-test"])
        .arg(dir.path())
        .output();
    match mount {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            println!(
                "skipping the tmpfs part: mount failed ({}); no CAP_SYS_ADMIN in this environment?",
                String::from_utf8_lossy(&o.stderr).trim()
            );
            return;
        }
        Err(e) => {
            println!("skipping the tmpfs part: cannot run mount: {e}");
            return;
        }
    }
    let _guard = Mounted(dir.path().to_path_buf());
    let options = WriterOptions {
        ring_bytes: MIN_RING_BYTES,
        ..WriterOptions::default()
    };
    let w = RecordWriter::open(dir.path(), options).unwrap();
    let mut committed = 0u64;
    let err = loop {
        match w.commit_blocking(decision(&format!("c{committed}"))) {
            Ok(_) => committed += 1,
            Err(e) => break e,
        }
        assert!(committed < 10_000, "the tmpfs never filled");
    };
    assert!(
        matches!(&err, RecordError::WriterFailed { reason } if reason.contains("No space left")),
        "{err}"
    );
    assert!(matches!(
        w.commit_blocking(decision("after")),
        Err(RecordError::WriterFailed { .. })
    ));
    let status = w.status();
    assert_eq!(status.last_seq, Some(committed));
    let mut health = ToolObservationHealth::unknown(HealthProducer::Daemon);
    health.records = RecordsHealth::from_writer(&status);
    let health = health.finalize();
    assert!(health.records.writer_failed && !health.complete);
    assert!(recorded_calls(dir.path()).contains(&format!("c{}", committed - 1)));
}
