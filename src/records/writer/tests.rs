//! Writer tests: group commit, rotation, resume, torn tails, the head anchor.

use super::*;
use crate::records::chain::verify_records;
use crate::records::tests::sample_tool_call;
use stages::RESERVE_AHEAD;
use std::io::Write;

fn small_rotation() -> WriterOptions {
    WriterOptions {
        rotate_bytes: 4096,
        head_interval: Duration::from_millis(10),
        ..WriterOptions::default()
    }
}

#[test]
fn commits_are_sequenced_durable_and_verify() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let w = w.clone();
            std::thread::spawn(move || {
                (0..25)
                    .map(|_| w.commit_blocking(sample_tool_call()).unwrap().seq)
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut seqs: Vec<u64> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    seqs.sort_unstable();
    assert_eq!(seqs, (1..=100).collect::<Vec<_>>());
    let status = w.close_blocking().unwrap();
    assert_eq!((status.first_seq, status.last_seq), (Some(1), Some(100)));
    let report = verify_records(dir.path(), None).unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    assert_eq!(report.records, 100);
    assert_eq!(report.head_anchor.as_ref().map(|a| a.seq), Some(100));
    assert_eq!(report.head_hash.as_ref(), Some(&status.chain_head));
    assert!(matches!(
        w.commit_blocking(sample_tool_call()),
        Err(RecordError::Closed)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_commit_from_many_tasks() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let w = w.clone();
            tokio::spawn(async move { w.commit(sample_tool_call()).await.unwrap() })
        })
        .collect();
    let mut seqs = Vec::new();
    for t in tasks {
        seqs.push(t.await.unwrap().seq);
    }
    seqs.sort_unstable();
    assert_eq!(seqs, (1..=50).collect::<Vec<_>>());
    w.close().await.unwrap();
    assert!(verify_records(dir.path(), None).unwrap().is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appended_records_are_readable_at_once_and_durable_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    let a = w.commit(sample_tool_call()).await.unwrap();
    let b = w.append(sample_tool_call()).await.unwrap();
    // Once `append` returns, the line is in the file for any reader.
    let text = std::fs::read_to_string(&w.status().current_file).unwrap();
    assert_eq!(text.lines().count(), 2, "{text}");
    // A flush makes the status cover every line in the file.
    w.flush().await.unwrap();
    assert_eq!(w.status().last_seq, Some(2));
    let c = w.commit(sample_tool_call()).await.unwrap();
    assert_eq!((a.seq, b.seq, c.seq), (1, 2, 3));
    // A commit after it is durable only once everything before it is.
    assert_eq!(w.status().last_seq, Some(3));
    w.close().await.unwrap();
    let report = verify_records(dir.path(), None).unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    assert_eq!(report.records, 3);
    assert!(matches!(
        w.append(sample_tool_call()).await,
        Err(RecordError::Closed)
    ));
}

#[test]
fn invalid_record_is_rejected_without_harming_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    let mut bad = sample_tool_call();
    bad.response.side_effect_verified = true;
    assert!(matches!(
        w.commit_blocking(bad),
        Err(RecordError::Invalid(_))
    ));
    assert_eq!(w.commit_blocking(sample_tool_call()).unwrap().seq, 1);
    assert!(w.failure().is_none());
}

#[test]
fn rotation_keeps_the_chain_and_resume_continues_it() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), small_rotation()).unwrap();
    let mut last = None;
    for _ in 0..30 {
        last = Some(w.commit_blocking(sample_tool_call()).unwrap());
    }
    w.close_blocking().unwrap();
    let files = crate::records::store::list_record_files(dir.path()).unwrap();
    assert!(
        files.len() >= 5,
        "expected several files, got {}",
        files.len()
    );
    assert_eq!(files[0].first_seq, 1);
    for f in &files {
        assert!(fs::metadata(&f.path).unwrap().len() <= 4096);
    }
    // Reopen: the sequence and chain continue.
    let w = RecordWriter::open(dir.path(), small_rotation()).unwrap();
    assert_eq!(w.status().last_seq, Some(30));
    assert_eq!(w.status().chain_head, last.unwrap().hash);
    assert_eq!(w.commit_blocking(sample_tool_call()).unwrap().seq, 31);
    w.close_blocking().unwrap();
    let report = verify_records(dir.path(), None).unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    assert_eq!((report.first_seq, report.last_seq), (Some(1), Some(31)));
}

#[test]
fn torn_tail_is_preserved_cut_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    for _ in 0..3 {
        w.commit_blocking(sample_tool_call()).unwrap();
    }
    drop(w);
    let file = dir.path().join(record_file_name(1));
    // Wait for the thread to finish its final anchor after the last handle dropped.
    std::thread::sleep(Duration::from_millis(100));
    let mut f = OpenOptions::new().append(true).open(&file).unwrap();
    f.write_all(b"{\"server\":{\"id\":\"half").unwrap();
    drop(f);
    let report = verify_records(dir.path(), None).unwrap();
    assert!(report.problems.iter().any(|p| matches!(
        p.kind,
        super::super::chain::ProblemKind::TornLine { bytes: 21 }
    )));

    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    let rec = w.recovered();
    assert_eq!(rec.len(), 1);
    assert_eq!(
        fs::read(&rec[0].sidecar).unwrap(),
        b"{\"server\":{\"id\":\"half"
    );
    assert_eq!(w.commit_blocking(sample_tool_call()).unwrap().seq, 4);
    w.close_blocking().unwrap();
    let report = verify_records(dir.path(), None).unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    assert_eq!(report.notes.len(), 1);
}

/// Commits three records to a writer on `dir` and closes it; returns their record file.
fn three_records_closed(dir: &Path) -> PathBuf {
    let w = RecordWriter::open(dir, WriterOptions::default()).unwrap();
    for _ in 0..3 {
        w.commit_blocking(sample_tool_call()).unwrap();
    }
    w.close_blocking().unwrap();
    dir.join(record_file_name(1))
}

/// Makes `dir` look as a directory from before the write-ahead ring does: no ring, and a head
/// anchor (if any) that does not say one was kept.
fn as_before_the_ring(dir: &Path) {
    let _ = fs::remove_file(dir.join(RING_FILE));
    let head = dir.join(HEAD_FILE);
    if let Some(mut anchor) = HeadAnchor::read(&head).unwrap() {
        anchor.ring = false;
        anchor.write(&head).unwrap();
    }
}

/// Opens a writer on `dir` and returns it with the head anchor as its open left it: the
/// syncer is held before its own first anchor while the anchor is read.
fn anchor_at_open(dir: &Path) -> (RecordWriter, HeadAnchor) {
    let (read, go, written) = pause_first_anchor(true);
    let w = RecordWriter::open(dir, WriterOptions::default()).unwrap();
    read.recv().unwrap();
    let anchor = HeadAnchor::read(&dir.join(HEAD_FILE)).unwrap().unwrap();
    go.send(()).unwrap();
    written.recv().unwrap();
    (w, anchor)
}

/// The ring removed (or renamed away) while the writer runs: what it makes durable from
/// then on lives only in a file the directory no longer names, which a power loss takes
/// with it. The writer fails at its next checkpoint (at the latest its close), naming the
/// ring; before, it went on acknowledging records until a crash lost them and the next
/// open refused the directory.
#[test]
fn a_ring_removed_while_the_writer_runs_fails_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    w.commit_blocking(sample_tool_call()).unwrap();
    fs::remove_file(dir.path().join(RING_FILE)).unwrap();
    let _ = w.commit_blocking(sample_tool_call());
    let e = w.close_blocking().unwrap_err().to_string();
    assert!(e.contains("records.wal") && e.contains("removed"), "{e}");
    // Renamed away, and with nothing new since the last checkpoint: the same.
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    w.commit_blocking(sample_tool_call()).unwrap();
    fs::rename(
        dir.path().join(RING_FILE),
        dir.path().join("records.wal.bak"),
    )
    .unwrap();
    let e = w.close_blocking().unwrap_err().to_string();
    assert!(e.contains("records.wal") && e.contains("replaced"), "{e}");
}

/// The record file the writer appends to, removed, moved away or replaced (`sed -i`) while it
/// runs: records acknowledged after that lived only in an inode no name reached, lost when
/// the process ended, while checkpoints went on vouching for them. The writer fails at its
/// next checkpoint and names the file.
#[test]
fn a_record_file_removed_or_replaced_while_the_writer_runs_fails_the_writer() {
    for how in ["removed", "renamed", "replaced"] {
        let dir = tempfile::tempdir().unwrap();
        let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
        w.commit_blocking(sample_tool_call()).unwrap();
        let file = dir.path().join(record_file_name(1));
        match how {
            "removed" => fs::remove_file(&file).unwrap(),
            "renamed" => fs::rename(&file, dir.path().join("archived.jsonl")).unwrap(),
            _ => {
                let copy = dir.path().join("copy");
                fs::copy(&file, &copy).unwrap();
                fs::rename(&copy, &file).unwrap();
            }
        }
        let _ = w.commit_blocking(sample_tool_call());
        let e = w.close_blocking().unwrap_err().to_string();
        assert!(
            e.contains(&file.display().to_string()) && e.contains("removed or replaced"),
            "{how}: {e}"
        );
    }
}

/// A directory whose head anchor says a writer kept a ring there, with the ring gone, is
/// refused by a writer and by a reader: the records durable only in the ring after a machine
/// crash would otherwise vanish without a trace. Before, the writer took the directory for
/// one from before the ring and made a new ring. A directory from before the ring still opens.
#[test]
fn a_directory_whose_ring_is_gone_is_refused_by_writers_and_readers() {
    let dir = tempfile::tempdir().unwrap();
    // The anchor says so from the writer's open, before any record is durable in the ring.
    let (w, anchor) = anchor_at_open(dir.path());
    assert!(anchor.ring && anchor.seq == 0, "{anchor:?}");
    w.close_blocking().unwrap();
    three_records_closed(dir.path());
    assert!(
        HeadAnchor::read(&dir.path().join(HEAD_FILE))
            .unwrap()
            .unwrap()
            .ring
    );
    fs::remove_file(dir.path().join(RING_FILE)).unwrap();
    let e = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap_err();
    assert!(
        e.to_string()
            .contains("records.wal is missing, but records.head says"),
        "{e}"
    );
    assert!(!dir.path().join(RING_FILE).exists(), "no new ring was made");
    let e = crate::records::store::list_record_files(dir.path()).unwrap_err();
    assert!(matches!(e, StoreError::RingMissing { .. }), "{e}");
    as_before_the_ring(dir.path());
    // Opened by a writer, it keeps a ring from now on, and its anchor says so at once.
    let (w, anchor) = anchor_at_open(dir.path());
    assert_eq!(w.status().last_seq, Some(3));
    assert!(anchor.ring && anchor.seq == 3, "{anchor:?}");
    w.close_blocking().unwrap();
    // A directory whose anchor alone was removed keeps its ring's checkpoint, which pins
    // the stream's end: a writer anchors the head again, not the start.
    fs::remove_file(dir.path().join(HEAD_FILE)).unwrap();
    let (w, anchor) = anchor_at_open(dir.path());
    assert!(anchor.ring && anchor.seq == 3, "{anchor:?}");
    assert_eq!(anchor.hash, w.status().chain_head.as_str());
    w.close_blocking().unwrap();
    // A directory with records and neither an anchor nor a ring lost both: every writer
    // keeps them, so whatever cut its last records removed them too. Before, the open
    // anchored what was left, and later readers took the cut stream for whole.
    fs::remove_file(dir.path().join(HEAD_FILE)).unwrap();
    fs::remove_file(dir.path().join(RING_FILE)).unwrap();
    let e = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap_err();
    assert!(matches!(e, RecordError::Unanchored { .. }), "{e:?}");
    assert!(
        e.to_string()
            .contains("neither records.head nor records.wal"),
        "{e}"
    );
    assert!(!dir.path().join(HEAD_FILE).exists(), "nothing was anchored");
    assert!(!dir.path().join(RING_FILE).exists(), "no ring was made");
}

/// The last record file of a directory read alone is held to the directory's head anchor:
/// its last lines cut, it does not verify. Before, only a directory read was checked
/// against the anchor, so the cut file alone verified as whole.
#[test]
fn the_last_record_file_read_alone_is_held_to_its_directorys_anchor() {
    let dir = tempfile::tempdir().unwrap();
    let file = three_records_closed(dir.path());
    assert!(verify_records(&file, None).unwrap().is_ok());
    let text = fs::read_to_string(&file).unwrap();
    let cut: String = text.lines().take(2).map(|l| format!("{l}\n")).collect();
    fs::write(&file, &cut).unwrap();
    let alone = verify_records(&file, None).unwrap();
    assert!(
        alone.problems.iter().any(|p| matches!(
            p.kind,
            crate::records::chain::ProblemKind::MissingVersusHead { .. }
        )),
        "{alone:?}"
    );
    // A file of the directory that is not its last is not held to the anchor (which names
    // a record past it): read alone, it verifies as it is.
    let rotated = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(
        rotated.path(),
        WriterOptions {
            rotate_bytes: 1,
            ..WriterOptions::default()
        },
    )
    .unwrap();
    for _ in 0..3 {
        w.commit_blocking(sample_tool_call()).unwrap();
    }
    w.close_blocking().unwrap();
    let first = rotated.path().join(record_file_name(1));
    assert!(rotated.path().join(record_file_name(2)).exists());
    let alone = verify_records(&first, None).unwrap();
    assert!(alone.is_ok(), "{alone:?}");
}

#[test]
fn open_refuses_a_stream_cut_or_edited_behind_the_anchor() {
    let dir = tempfile::tempdir().unwrap();
    let file = three_records_closed(dir.path());
    let original = fs::read(&file).unwrap();
    // Cut the last whole line.
    let text = String::from_utf8(original.clone()).unwrap();
    let cut: String = text.lines().take(2).map(|l| format!("{l}\n")).collect();
    fs::write(&file, &cut).unwrap();
    // The ring's checkpoint refuses first; without a ring (a directory from before it), the
    // head anchor does.
    let e = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap_err();
    assert!(e.to_string().contains("cut after they were synced"), "{e}");
    as_before_the_ring(dir.path());
    let e = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap_err();
    assert!(e.to_string().contains("1 whole lines are missing"), "{e}");
    // Edit the last line instead (still valid JSON; the lines before it as they were, so
    // that its prev_hash still links it to them).
    let at = text.rfind("\"session\":\"s-1\"").unwrap();
    let edited = format!("{}\"session\":\"s-2\"{}", &text[..at], &text[at + 15..]);
    fs::write(&file, edited).unwrap();
    let e = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap_err();
    assert!(e.to_string().contains("was edited"), "{e}");
}

#[test]
fn anchor_is_refreshed_while_idle() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(
        dir.path(),
        WriterOptions {
            head_interval: Duration::from_millis(20),
            ..WriterOptions::default()
        },
    )
    .unwrap();
    for _ in 0..2 {
        w.commit_blocking(sample_tool_call()).unwrap();
    }
    std::thread::sleep(Duration::from_millis(200));
    let anchor = HeadAnchor::read(&dir.path().join(HEAD_FILE))
        .unwrap()
        .unwrap();
    assert_eq!(anchor.seq, 2);
    assert_eq!(anchor.line, Some(2));
    assert_eq!(anchor.hash, w.status().chain_head.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_appended_record_nobody_waits_for_is_synced_on_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    let c = w.append(sample_tool_call()).await.unwrap();
    // No commit, flush or close follows: the syncer must make it durable by itself.
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while w.status().last_seq != Some(c.seq) {
        assert!(
            std::time::Instant::now() < deadline,
            "the appended record was never synced: {:?}",
            w.status()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(w.status().committed_since_open, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_close_every_request_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    w.commit(sample_tool_call()).await.unwrap();
    w.close().await.unwrap();
    let refused = tokio::time::timeout(Duration::from_secs(5), async {
        [
            w.flush().await.err(),
            w.append(sample_tool_call()).await.err(),
            w.commit(sample_tool_call()).await.err(),
            w.close().await.err(),
        ]
    })
    .await
    .expect("a request after close must be answered, not left waiting");
    for (request, error) in ["flush", "append", "commit", "close"].iter().zip(refused) {
        assert!(
            matches!(error, Some(RecordError::Closed)),
            "{request} after close: {error:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_is_booked_durable_when_it_returns_whoever_synced_it() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    // Alone, after an append, and among concurrent commits: each is in the status as
    // durable once it returns.
    for _ in 0..3 {
        let c = w.commit(sample_tool_call()).await.unwrap();
        assert!(w.status().last_seq >= Some(c.seq), "{:?}", w.status());
        w.append(sample_tool_call()).await.unwrap();
    }
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let w = w.clone();
            tokio::spawn(async move {
                let c = w.commit(sample_tool_call()).await.unwrap();
                assert!(w.status().last_seq >= Some(c.seq));
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let status = w.close().await.unwrap();
    assert_eq!(status.last_seq, Some(26));
    assert_eq!(status.committed_since_open, 26);
    assert!(verify_records(dir.path(), None).unwrap().is_ok());
}

/// A sync a caller leads that panics fails the writer and ends: a later commit is refused at
/// once instead of waiting for a sync nobody runs. Before, the queue stayed marked as
/// syncing, the syncer never synced again and every later commit hung.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_led_sync_that_panics_fails_the_writer_instead_of_hanging_it() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    w.stages.panic_next_sync();
    let leader = {
        let w = w.clone();
        tokio::spawn(async move { w.commit_alone(sample_tool_call()).await })
    };
    let joined = leader.await;
    assert!(joined.as_ref().is_err_and(|e| e.is_panic()), "{joined:?}");
    assert_eq!(
        w.stages.led_syncs(),
        1,
        "the caller led the sync that panicked"
    );
    let later = tokio::time::timeout(Duration::from_secs(5), w.commit(sample_tool_call()))
        .await
        .expect("a later commit waited for a sync that never ended");
    let e = later.unwrap_err();
    assert!(
        e.to_string().contains("a sync led by a caller panicked"),
        "{e}"
    );
}

/// A caller alone leads its sync on its own thread, and the record is durable when it
/// returns; among concurrent callers that ask to lead, with appends, flushes and a close
/// between them, syncs never overlap, nobody is left waiting, and the chain verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_caller_alone_leads_its_sync_and_concurrent_ones_stay_grouped_and_exact() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    // The first always leads; a later one leads if the sync before it was quick (a slow
    // disk keeps its waits on the sync thread), which this machine's load decides.
    let mut led = 0;
    for _ in 0..3 {
        led += u64::from(w.stages.last_sync_was_quick());
        let c = w.commit_alone(sample_tool_call()).await.unwrap();
        assert!(w.status().last_seq >= Some(c.seq), "{:?}", w.status());
        assert_eq!(
            w.stages.led_syncs(),
            led,
            "a caller alone syncs on its own thread"
        );
    }
    assert!(led >= 1);
    // A plain commit never leads.
    w.commit(sample_tool_call()).await.unwrap();
    assert_eq!(w.stages.led_syncs(), led);

    let threads: Vec<_> = (0..6)
        .map(|i| {
            let w = w.clone();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    for _ in 0..20 {
                        let c = w.commit_alone(sample_tool_call()).await.unwrap();
                        assert!(w.status().last_seq >= Some(c.seq));
                        if i % 2 == 0 {
                            w.append(sample_tool_call()).await.unwrap();
                        } else {
                            w.flush().await.unwrap();
                        }
                    }
                });
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let status = tokio::time::timeout(std::time::Duration::from_secs(10), w.close())
        .await
        .expect("close must be answered after led syncs")
        .unwrap();
    // 4 alone, 6 x 20 concurrent commits, 3 x 20 appends.
    assert_eq!(status.last_seq, Some(4 + 120 + 60));
    assert!(verify_records(dir.path(), None).unwrap().is_ok());
}

/// Blocks are reserved ahead of a record file's end (so a sync writes no allocation
/// metadata) without changing the file: it holds exactly its lines, and a reopened writer
/// continues the chain after them. Every commit is durable when it returns on both runtime
/// shapes the host uses (a current-thread runtime and a multi-threaded one with one worker).
#[test]
fn blocks_are_reserved_ahead_without_changing_the_file() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let shapes = [
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap(),
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap(),
    ];
    let mut expected = 0;
    for rt in shapes {
        let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
        rt.block_on(async {
            let tasks: Vec<_> = (0..8)
                .map(|_| {
                    let w = w.clone();
                    tokio::spawn(async move {
                        let c = w.commit(sample_tool_call()).await.unwrap();
                        assert!(w.status().last_seq >= Some(c.seq), "{:?}", w.status());
                        w.append(sample_tool_call()).await.unwrap();
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
            w.close().await.unwrap();
        });
        expected += 16;
        let path = w.status().current_file;
        let meta = std::fs::metadata(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), expected, "{}", path.display());
        assert_eq!(meta.len(), text.len() as u64, "{}", path.display());
        let allocated = meta.blocks() * 512;
        if allocated <= meta.len() {
            println!(
                "the file system of {} reserved nothing ahead (allocated {allocated} of {} bytes); \
                 only the file's contents are checked",
                path.display(),
                meta.len()
            );
        } else {
            assert!(allocated >= meta.len() + RESERVE_AHEAD / 2, "{allocated}");
        }
    }
    let report = verify_records(dir.path(), None).unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    assert_eq!(report.records, expected as u64);
}

/// Copies the record directory `from` as a machine crash would leave it: every record file
/// cut back to the ring's checkpoint (what was synced), with `junk` bytes after it (blocks
/// whose size reached the disk before their data).
fn crash_copy(from: &Path, to: &Path, junk: &[u8]) -> ring::Checkpoint {
    // The ring first: a live writer's checkpoint only covers bytes already in its file, so
    // the record files copied after it hold at least as much.
    std::fs::copy(from.join(RING_FILE), to.join(RING_FILE)).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != RING_FILE {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
    let (checkpoint, _) = ring::read_back(to).unwrap().unwrap();
    let file = to.join(&checkpoint.file);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes.truncate(checkpoint.bytes as usize);
    bytes.extend_from_slice(junk);
    std::fs::write(&file, bytes).unwrap();
    checkpoint
}

/// A machine crash after five records, where records 4 and 5 reached the record file's
/// pages on disk but the ring's pages holding them did not (records appended without
/// waiting are synced within milliseconds): `crashed` holds the ring as it was after three,
/// and the record file as it is after five. Returns the live writer (on `dir`) and the
/// crashed ring's checkpoint.
fn crashed_before_the_ring_synced_two(
    dir: &Path,
    crashed: &Path,
) -> (RecordWriter, ring::Checkpoint) {
    let w = RecordWriter::open(dir, no_anchor_refresh(1 << 20)).unwrap();
    for _ in 0..3 {
        w.commit_blocking(sample_tool_call()).unwrap();
    }
    let checkpoint = crash_copy(dir, crashed, b"");
    for _ in 0..2 {
        w.commit_blocking(sample_tool_call()).unwrap();
    }
    std::fs::copy(dir.join(&checkpoint.file), crashed.join(&checkpoint.file)).unwrap();
    (w, checkpoint)
}

/// Opens a writer on `dir` (options [`no_anchor_refresh`]) whose first anchor refresh
/// checkpoints record 1, its first record: the refresh is held until record 1 is durable.
/// Without the hold, a refresh that came before the first sync left the checkpoint at the
/// start, and no other came.
fn open_checkpointed_at_one(dir: &Path) -> RecordWriter {
    let (read, go, written) = pause_first_anchor(true);
    let w = RecordWriter::open(dir, no_anchor_refresh(1 << 20)).unwrap();
    read.recv_timeout(Duration::from_secs(10)).unwrap();
    // The sync thread is held in the refresh: the caller syncs its record itself.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    assert_eq!(
        rt.block_on(w.commit_alone(sample_tool_call())).unwrap().seq,
        1
    );
    go.send(()).unwrap();
    written.recv_timeout(Duration::from_secs(10)).unwrap();
    w
}

/// Makes the next writer opened on this thread hold its first anchor refresh (see
/// `stages::AnchorPause`); returns where the test hears it is held, lets it go on, and
/// hears it is written.
fn pause_first_anchor(before: bool) -> (mpsc::Receiver<()>, mpsc::Sender<()>, mpsc::Receiver<()>) {
    let ((read_tx, read), (go, go_rx), (written_tx, written)) =
        (mpsc::channel(), mpsc::channel(), mpsc::channel());
    stages::PAUSE_FIRST_ANCHOR.with(|p| {
        *p.borrow_mut() = Some(stages::AnchorPause {
            before,
            read: read_tx,
            go: go_rx,
            written: written_tx,
        })
    });
    (read, go, written)
}

fn no_anchor_refresh(ring_bytes: u64) -> WriterOptions {
    WriterOptions {
        head_interval: Duration::from_secs(3600),
        ring_bytes,
        ..WriterOptions::default()
    }
}

#[test]
fn records_a_machine_crash_took_from_their_file_are_written_back_from_the_ring() {
    let dir = tempfile::tempdir().unwrap();
    let w = open_checkpointed_at_one(dir.path());
    for _ in 1..10 {
        w.commit_blocking(sample_tool_call()).unwrap();
    }
    // The first sync's anchor refresh checkpointed record 1; 2..=10 are durable in the ring only.
    let crashed = tempfile::tempdir().unwrap();
    let checkpoint = crash_copy(dir.path(), crashed.path(), &[0u8; 700]);
    assert_eq!(checkpoint.seq, 1);
    let before = std::fs::read(dir.path().join(&checkpoint.file)).unwrap();

    let reopened = RecordWriter::open(crashed.path(), WriterOptions::default()).unwrap();
    assert_eq!(reopened.status().last_seq, Some(10));
    let recovered = reopened.recovered();
    assert_eq!(recovered.len(), 1, "{recovered:?}");
    assert_eq!(
        std::fs::read(&recovered[0].sidecar).unwrap(),
        vec![0u8; 700]
    );
    // The file is again exactly what the live writer had written.
    assert_eq!(
        std::fs::read(crashed.path().join(&checkpoint.file)).unwrap(),
        before
    );
    reopened.commit_blocking(sample_tool_call()).unwrap();
    reopened.close_blocking().unwrap();
    let report = verify_records(crashed.path(), None).unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    assert_eq!(report.records, 11);
    drop(w);
}

#[test]
fn a_small_ring_is_checkpointed_as_it_fills_and_replays_after_wrapping() {
    let dir = tempfile::tempdir().unwrap();
    // A ring of about twenty records, and no anchor refresh to checkpoint it: the ring must
    // be checkpointed as it fills (by the sync thread at half, or by the appender when full)
    // before it wraps over entries the record file has not synced.
    let w = RecordWriter::open(dir.path(), no_anchor_refresh(ring::MIN_RING_BYTES)).unwrap();
    for _ in 0..300 {
        w.commit_blocking(sample_tool_call()).unwrap();
    }
    let crashed = tempfile::tempdir().unwrap();
    let checkpoint = crash_copy(dir.path(), crashed.path(), b"");
    assert!(checkpoint.seq > 200, "{checkpoint:?}");
    let reopened = RecordWriter::open(crashed.path(), WriterOptions::default()).unwrap();
    assert_eq!(reopened.status().last_seq, Some(300));
    assert!(reopened.recovered().is_empty());
    reopened.close_blocking().unwrap();
    let report = verify_records(crashed.path(), None).unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    assert_eq!(report.records, 300);
    w.close_blocking().unwrap();
}

#[test]
fn lines_cut_after_a_checkpoint_are_not_restored_but_refused() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    for _ in 0..5 {
        w.commit_blocking(sample_tool_call()).unwrap();
    }
    w.close_blocking().unwrap();
    // Close checkpointed record 5; a file shorter than that lost synced lines: no crash
    // does that, so the ring does not paper over it but refuses.
    let file = dir.path().join(record_file_name(1));
    let bytes = std::fs::read(&file).unwrap();
    let cut = bytes[..bytes.len() - 1]
        .iter()
        .rposition(|&b| b == b'\n')
        .unwrap()
        + 1;
    std::fs::write(&file, &bytes[..cut]).unwrap();
    let err = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap_err();
    assert!(matches!(err, RecordError::Corrupt { .. }), "{err:?}");
    assert!(
        err.to_string().contains("cut after they were synced"),
        "{err}"
    );
}

#[test]
fn a_ring_that_cannot_be_made_refuses_the_open_and_names_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join(RING_FILE)).unwrap();
    let err = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap_err();
    assert!(matches!(err, RecordError::Ring(_)), "{err:?}");
    assert!(err.to_string().contains("records.wal"), "{err}");
}

/// Overwrites both header slots of the ring in `dir` (a block each), leaving no valid checkpoint.
fn spoil_both_ring_headers(dir: &Path) {
    let ring = dir.join(RING_FILE);
    let mut bytes = std::fs::read(&ring).unwrap();
    bytes[..8192].fill(0xAA);
    std::fs::write(&ring, bytes).unwrap();
}

#[test]
fn a_ring_without_a_valid_checkpoint_refuses_the_open() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    w.commit_blocking(sample_tool_call()).unwrap();
    w.close_blocking().unwrap();
    spoil_both_ring_headers(dir.path());
    let err = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap_err();
    assert!(err.to_string().contains("valid checkpoint"), "{err}");
}

#[test]
fn a_second_writer_on_a_directory_is_refused_until_the_first_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    w.commit_blocking(sample_tool_call()).unwrap();
    let err = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap_err();
    assert!(matches!(err, RecordError::InUse { .. }), "{err:?}");
    assert!(err.to_string().contains(LOCK_FILE), "{err}");
    w.close_blocking().unwrap();
    // Closed, even with the handle still alive, the directory is free again.
    let again = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    assert_eq!(again.status().last_seq, Some(1));
    drop(again);
    // Dropped: the next open waits for the sync thread's last checkpoint, then goes on.
    let third = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    assert_eq!(third.status().last_seq, Some(1));
    drop(w);
}

#[test]
fn a_rotation_cut_short_before_its_checkpoint_reopens() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), no_anchor_refresh(1 << 20)).unwrap();
    for _ in 0..3 {
        w.commit_blocking(sample_tool_call()).unwrap();
    }
    let crashed = tempfile::tempdir().unwrap();
    let checkpoint = crash_copy(dir.path(), crashed.path(), b"");
    assert!(checkpoint.seq < 3, "{checkpoint:?}");
    // The rotation synced the old file (so it is whole) and created the next one, then
    // stopped before its checkpoint: the ring still names the old file and holds records
    // that are all in it.
    std::fs::copy(
        dir.path().join(&checkpoint.file),
        crashed.path().join(&checkpoint.file),
    )
    .unwrap();
    reopens_after_a_cut_rotation(crashed.path(), 3);
    drop(w);
}

/// Creates the next record file, as a rotation after `records` records does before its
/// checkpoint, then checks that the directory reopens with all of them and goes on.
fn reopens_after_a_cut_rotation(crashed: &Path, records: u64) {
    std::fs::File::create(crashed.join(record_file_name(records + 1))).unwrap();
    let reopened = RecordWriter::open(crashed, WriterOptions::default()).unwrap();
    assert_eq!(reopened.status().last_seq, Some(records));
    reopened.commit_blocking(sample_tool_call()).unwrap();
    reopened.close_blocking().unwrap();
    let report = verify_records(crashed, None).unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    assert_eq!(report.records, records + 1);
}

#[test]
fn a_rotation_cut_short_after_records_the_ring_had_not_synced_reopens() {
    let (dir, crashed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // A rotation had synced the old file, so it holds records 4 and 5 whole, and created
    // the next one.
    let (w, _) = crashed_before_the_ring_synced_two(dir.path(), crashed.path());
    reopens_after_a_cut_rotation(crashed.path(), 5);
    drop(w);
}

#[test]
fn readers_refuse_lines_past_the_ring_that_the_next_writer_cuts() {
    let (dir, crashed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // A writer's open cuts records 4 and 5: they were never durable.
    let (w, checkpoint) = crashed_before_the_ring_synced_two(dir.path(), crashed.path());
    let file = crashed.path().join(&checkpoint.file);
    let err = verify_records(crashed.path(), None).unwrap_err();
    assert!(
        matches!(&err, StoreError::Uncommitted { file: f, .. } if *f == file),
        "{err:?}"
    );
    assert!(err.to_string().contains("flowhost records replay"), "{err}");
    // A record file read alone is refused as its directory is.
    let err = verify_records(&file, None).unwrap_err();
    assert!(matches!(err, StoreError::Uncommitted { .. }), "{err:?}");
    let reopened = RecordWriter::open(crashed.path(), WriterOptions::default()).unwrap();
    assert_eq!(reopened.status().last_seq, Some(3));
    assert_eq!(reopened.recovered().len(), 1);
    reopened.close_blocking().unwrap();
    let report = verify_records(crashed.path(), None).unwrap();
    assert!(report.is_ok() && report.records == 3, "{report:?}");
    drop(w);
}

#[test]
fn a_line_being_written_in_a_held_directory_is_not_reported_torn() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    for _ in 0..2 {
        w.commit_blocking(sample_tool_call()).unwrap();
    }
    // What a reader sees of a line the writer is appending in one write: its first part.
    let file = dir.path().join(record_file_name(1));
    let mut f = OpenOptions::new().append(true).open(&file).unwrap();
    f.write_all(b"{\"server\":{\"id\":\"half").unwrap();
    let live = verify_records(dir.path(), None).unwrap();
    assert!(live.is_ok(), "{:?}", live.problems);
    assert_eq!(live.records, 2);
    assert!(
        live.notes.iter().any(|n| n.contains("being written")),
        "{:?}",
        live.notes
    );
    // Read alone, the directory's last file is read as its directory is.
    let alone = verify_records(&file, None).unwrap();
    assert!(alone.is_ok() && alone.records == 2, "{alone:?}");
    // Once no writer holds it, the same bytes are a torn line. The lock goes when the
    // writer's last thread has ended, a moment after close returns.
    w.close_blocking().unwrap();
    drop(w);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while crate::records::store::writer_holds(dir.path()).unwrap() {
        assert!(
            std::time::Instant::now() < deadline,
            "the writer never let go"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let closed = verify_records(dir.path(), None).unwrap();
    assert!(
        closed
            .problems
            .iter()
            .any(|p| matches!(p.kind, super::super::chain::ProblemKind::TornLine { .. })),
        "{closed:?}"
    );
}

#[test]
fn a_file_changed_below_its_checkpoint_is_refused_not_rewritten() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    for _ in 0..3 {
        w.commit_blocking(sample_tool_call()).unwrap();
    }
    w.close_blocking().unwrap();
    drop(w);
    // A longer first line moves every later byte: the checkpoint's offset is now inside a
    // line, and a replay from there would splice two lines into one.
    let file = dir.path().join(record_file_name(1));
    let original = fs::read(&file).unwrap();
    let edited =
        String::from_utf8(original.clone())
            .unwrap()
            .replacen("prod-repo", "prod-repository", 1);
    fs::write(&file, &edited).unwrap();
    let err = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap_err();
    assert!(
        err.to_string().contains("no longer end at a line's end"),
        "{err}"
    );
    assert_eq!(fs::read_to_string(&file).unwrap(), edited, "left as it was");
}

#[test]
fn a_ring_cut_short_refuses_the_open() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    w.commit_blocking(sample_tool_call()).unwrap();
    w.close_blocking().unwrap();
    // The writer only renames whole rings into place: a shorter one lost what it held.
    let ring = dir.path().join(RING_FILE);
    let bytes = std::fs::read(&ring).unwrap();
    std::fs::write(&ring, &bytes[..20_000]).unwrap();
    let err = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap_err();
    assert!(matches!(err, RecordError::Ring(_)), "{err:?}");
    assert!(err.to_string().contains("fewer than any ring"), "{err}");
}

/// Readers held the whole ring in memory whatever its size: a sparse ring of a terabyte
/// whose checkpoint points at a wrap mark made every `records verify`, diff and health
/// read abort for want of memory.
#[test]
fn a_ring_larger_than_any_the_writer_makes_is_refused_not_read() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    w.commit_blocking(sample_tool_call()).unwrap();
    w.close_blocking().unwrap();
    let ring = dir.path().join(RING_FILE);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&ring)
        .unwrap()
        .set_len(1 << 40)
        .unwrap();
    let err = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap_err();
    assert!(err.to_string().contains("more than any ring"), "{err}");
    let read = format!("{:?}", verify_records(dir.path(), None));
    assert!(read.contains("more than any ring"), "{read}");
}

/// The writer's locks are its own: a lock file others may open lets them hold it and pass
/// for a live writer, whose partial last line and unreplayed ring a reader lets pass.
#[test]
fn only_the_writer_may_open_its_locks() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let lock = dir.path().join(crate::records::store::LOCK_FILE);
    // Left open to others by an older writer.
    fs::write(&lock, "").unwrap();
    fs::set_permissions(&lock, fs::Permissions::from_mode(0o644)).unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    for name in [
        crate::records::store::LOCK_FILE,
        crate::records::store::OPENING_LOCK_FILE,
    ] {
        let mode = fs::metadata(dir.path().join(name))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{name}");
    }
    w.close_blocking().unwrap();
}

/// A link put in place of a lock file or a record file is never followed: a root writer
/// (`records replay` in a directory its service user owns) would have made the file it
/// names 0600, or read and truncated it as records.
#[test]
fn links_in_a_record_directory_are_not_followed() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    three_records_closed(dir.path());
    let victim = dir.path().join("victim");
    fs::write(&victim, "keep me").unwrap();
    fs::set_permissions(&victim, fs::Permissions::from_mode(0o644)).unwrap();
    let opening = dir.path().join(crate::records::store::OPENING_LOCK_FILE);
    fs::remove_file(&opening).unwrap();
    std::os::unix::fs::symlink(&victim, &opening).unwrap();
    assert!(RecordWriter::open(dir.path(), WriterOptions::default()).is_err());
    let mode = fs::metadata(&victim).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o644, "the file the link named was changed");
    fs::remove_file(&opening).unwrap();
    // A ring that is a link (another stream's) is neither written nor read.
    let elsewhere = tempfile::tempdir().unwrap();
    three_records_closed(elsewhere.path());
    let ring = dir.path().join(RING_FILE);
    let kept = dir.path().join("ring-kept");
    fs::rename(&ring, &kept).unwrap();
    std::os::unix::fs::symlink(elsewhere.path().join(RING_FILE), &ring).unwrap();
    let before = fs::read(elsewhere.path().join(RING_FILE)).unwrap();
    assert!(RecordWriter::open(dir.path(), WriterOptions::default()).is_err());
    assert!(verify_records(dir.path(), None).is_err());
    assert_eq!(fs::read(elsewhere.path().join(RING_FILE)).unwrap(), before);
    fs::remove_file(&ring).unwrap();
    fs::rename(&kept, &ring).unwrap();
    // A record file that is a link is refused, by the writer and by readers.
    let other = tempfile::tempdir().unwrap();
    let real = three_records_closed(other.path());
    let linked = dir.path().join(record_file_name(4));
    std::os::unix::fs::symlink(&real, &linked).unwrap();
    assert!(RecordWriter::open(dir.path(), WriterOptions::default()).is_err());
    assert!(verify_records(dir.path(), None).is_err());
    assert_eq!(fs::read_to_string(&victim).unwrap(), "keep me");
}

/// The record file past the ring's checkpoint was read whole: a sparse terabyte appended
/// to it made the writer's open and every reader abort for want of memory. No crash leaves
/// more there than a full ring's records and a line: both refuse it, naming the file.
#[test]
fn a_record_file_grown_past_what_a_crash_leaves_is_refused_not_read() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    w.commit_blocking(sample_tool_call()).unwrap();
    w.close_blocking().unwrap();
    let file = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(1 << 40)
        .unwrap();
    let err = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap_err();
    assert!(err.to_string().contains("past the checkpoint"), "{err}");
    let read = format!("{:?}", verify_records(dir.path(), None));
    assert!(read.contains("past the checkpoint"), "{read}");
}

#[test]
fn readers_refuse_records_left_only_in_the_ring_until_a_writer_copies_them_in() {
    let dir = tempfile::tempdir().unwrap();
    let w = open_checkpointed_at_one(dir.path());
    for _ in 1..10 {
        w.commit_blocking(sample_tool_call()).unwrap();
    }
    // While the writer runs, its files hold every record: readers read them.
    let live = verify_records(dir.path(), None).unwrap();
    assert!(live.is_ok() && live.records == 10, "{live:?}");
    // After a machine crash, records 2..=10 are durable in the ring only. A reader that
    // took the files alone would judge a stream nine records short as whole.
    let crashed = tempfile::tempdir().unwrap();
    let checkpoint = crash_copy(dir.path(), crashed.path(), &[]);
    assert_eq!(checkpoint.seq, 1);
    let err = verify_records(crashed.path(), None).unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Unreplayed {
                first: 2,
                last: 10,
                ..
            }
        ),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains("records 2 to 10")
            && text.contains(&crashed.path().display().to_string())
            && text.contains("flowhost records replay"),
        "{text}"
    );
    let last_file = crate::records::store::record_files_on_disk(crashed.path())
        .unwrap()
        .pop()
        .unwrap()
        .path;
    for reader in [
        crate::records::store::record_sources(crashed.path()).map(|_| ()),
        crate::records::store::list_record_files(crashed.path()).map(|_| ()),
        // The file the records are missing from, named on its own.
        crate::records::store::record_sources(&last_file).map(|_| ()),
    ] {
        assert!(
            matches!(reader, Err(StoreError::Unreplayed { .. })),
            "{reader:?}"
        );
    }
    // A writer's open copies them in; then every reader sees all ten.
    RecordWriter::open(crashed.path(), WriterOptions::default())
        .unwrap()
        .close_blocking()
        .unwrap();
    let report = verify_records(crashed.path(), None).unwrap();
    assert!(report.is_ok() && report.records == 10, "{report:?}");
    w.close_blocking().unwrap();
}

#[test]
fn readers_refuse_a_directory_whose_ring_is_unreadable() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    w.commit_blocking(sample_tool_call()).unwrap();
    w.close_blocking().unwrap();
    spoil_both_ring_headers(dir.path());
    // The ring may hold durable records no file has: nothing can say the files are whole.
    let err = verify_records(dir.path(), None).unwrap_err();
    assert!(err.to_string().contains("valid checkpoint"), "{err}");
}

#[test]
fn a_reader_finding_the_directory_held_waits_until_its_writer_has_copied_the_ring_in() {
    use crate::records::store::{self, Locked, OPENING_LOCK_FILE};
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    w.commit_blocking(sample_tool_call()).unwrap();
    w.close_blocking().unwrap();
    // A writer between taking the directory and finishing its ring's replay holds both.
    // (The closed writer's sync thread lets go of its lock a moment after the close.)
    let hold = |name: &str| match store::lock_within(
        &dir.path().join(name),
        true,
        false,
        Duration::from_secs(5),
    )
    .unwrap()
    {
        Locked::Held(held) => held,
        _ => panic!("{name} not taken"),
    };
    let opening = hold(OPENING_LOCK_FILE);
    let writer = hold(LOCK_FILE);
    // Before, a reader that found the writer lock held read the files at once, even while
    // the ring was still being copied into them.
    let err = store::refuse_unreplayed_within(dir.path(), Duration::from_millis(50)).unwrap_err();
    assert!(matches!(err, StoreError::Opening { .. }), "{err:?}");
    assert!(err.to_string().contains("opening this directory"), "{err}");
    drop(opening);
    // Opened: its files are the stream.
    store::refuse_unreplayed_within(dir.path(), Duration::from_millis(50)).unwrap();
    drop(writer);
    // And a writer's open releases the opening lock once it has replayed.
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    assert!(matches!(
        store::lock_within(
            &dir.path().join(OPENING_LOCK_FILE),
            false,
            false,
            Duration::ZERO
        )
        .unwrap(),
        Locked::Held(_)
    ));
    w.close_blocking().unwrap();
}

/// A writer (closed at the end) commits ten records with no anchor refresh after the first
/// sync's, which checkpointed record 1; a crash copy of its directory then holds record 1 in
/// its file and 2..=10 in the ring only. Returns the writer's directory, the copy and its
/// checkpoint.
fn crashed_after_ten_checkpointed_at_one()
-> (tempfile::TempDir, tempfile::TempDir, ring::Checkpoint) {
    let dir = tempfile::tempdir().unwrap();
    let w = open_checkpointed_at_one(dir.path());
    for _ in 1..10 {
        w.commit_blocking(sample_tool_call()).unwrap();
    }
    let crashed = tempfile::tempdir().unwrap();
    let checkpoint = crash_copy(dir.path(), crashed.path(), &[]);
    w.close_blocking().unwrap();
    assert!(
        checkpoint.seq == 1 && checkpoint.bytes > 0,
        "{checkpoint:?}"
    );
    (dir, crashed, checkpoint)
}

#[test]
fn readers_refuse_a_file_cut_below_its_checkpoint_while_the_ring_holds_more() {
    let (_live, crashed, checkpoint) = crashed_after_ten_checkpointed_at_one();
    // Record 1, durable by the checkpoint, is cut away: before, readers offered a replay,
    // which the writer then refused, since copying records 2..=10 cannot bring 1 back.
    let file = crashed.path().join(&checkpoint.file);
    std::fs::write(&file, b"").unwrap();
    let err = verify_records(crashed.path(), None).unwrap_err();
    assert!(
        err.to_string().contains("durable bytes, but it holds 0"),
        "{err}"
    );
    std::fs::remove_file(&file).unwrap();
    let err = verify_records(crashed.path(), None).unwrap_err();
    assert!(err.to_string().contains("is missing"), "{err}");
}

/// Commits records to `w` (writing to `dir`, options [`no_anchor_refresh`] with the
/// smallest ring) until the sync thread has checkpointed the ring at the last one, past the
/// record the head anchor names (refreshed once, after the first sync), and past the fourth
/// record: a machine crash then leaves no ring entry after the checkpoint, and only the
/// checkpoint vouches for the last records. Returns how many were committed.
fn commit_until_checkpointed_past_the_anchor(w: &RecordWriter, dir: &Path) -> u64 {
    for n in 1..=1000 {
        w.commit_blocking(sample_tool_call()).unwrap();
        // The sync thread checkpoints a ring that is more than half used right after the
        // sync that completes the commit.
        let deadline = std::time::Instant::now() + Duration::from_millis(20);
        loop {
            let (checkpoint, entries) = ring::read_back(dir).unwrap().unwrap();
            // The anchor, once written, stays at the first records.
            let anchored = HeadAnchor::read(&dir.join(HEAD_FILE)).unwrap();
            // Past a few records, so the tests have whole lines below the checkpoint to cut
            // (with the smallest ring, a checkpoint can come at the second record).
            if n > 4
                && entries.is_empty()
                && checkpoint.seq == n
                && anchored.is_some_and(|a| a.seq < n)
            {
                return n;
            }
            if std::time::Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    panic!("the ring was never checkpointed at its last record");
}

/// A crash copy of a directory whose ring's checkpoint is at its last record and later than
/// its head anchor (see [`commit_until_checkpointed_past_the_anchor`]); returns the copy, the
/// checkpoint and the live writer's directory (kept until the end of the test).
fn checkpointed_past_the_anchor() -> (tempfile::TempDir, ring::Checkpoint, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), no_anchor_refresh(ring::MIN_RING_BYTES)).unwrap();
    let committed = commit_until_checkpointed_past_the_anchor(&w, dir.path());
    let crashed = tempfile::tempdir().unwrap();
    let checkpoint = crash_copy(dir.path(), crashed.path(), b"");
    assert_eq!(checkpoint.seq, committed);
    w.close_blocking().unwrap();
    (crashed, checkpoint, dir)
}

#[test]
fn whole_lines_cut_below_a_checkpoint_the_anchor_predates_are_refused_by_readers() {
    let (crashed, checkpoint, _live) = checkpointed_past_the_anchor();
    let file = crashed.path().join(&checkpoint.file);
    let bytes = fs::read(&file).unwrap();
    let text = String::from_utf8(bytes).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.len() > 3, "{}", lines.len());
    let kept: String = lines[..lines.len() - 3]
        .iter()
        .map(|l| format!("{l}\n"))
        .collect();
    fs::write(&file, kept).unwrap();
    // No ring entry follows the checkpoint, and the head anchor names an earlier record:
    // before, readers found nothing to object to and the stream verified three records short.
    let report = verify_records(crashed.path(), None);
    let problems: Vec<String> = match &report {
        Ok(r) => r.problems.iter().map(ToString::to_string).collect(),
        Err(e) => vec![e.to_string()],
    };
    assert!(
        problems
            .iter()
            .any(|p| p.contains("checkpoint") && p.contains("3 whole lines missing")),
        "{report:?}"
    );
    let err = RecordWriter::open(crashed.path(), WriterOptions::default()).unwrap_err();
    assert!(matches!(err, RecordError::Corrupt { .. }), "{err:?}");
}

#[test]
fn an_edit_of_the_last_durable_line_keeping_its_length_is_refused() {
    let (crashed, checkpoint, _live) = checkpointed_past_the_anchor();
    let file = crashed.path().join(&checkpoint.file);
    let text = fs::read_to_string(&file).unwrap();
    let code = "classified_github_deploy_key";
    let at = text.rfind(code).unwrap();
    let edited = format!(
        "{}classified_github_deploy_kez{}",
        &text[..at],
        &text[at + code.len()..]
    );
    assert_eq!(edited.len(), text.len());
    fs::write(&file, &edited).unwrap();
    // Before, the writer planned nothing (the file ends where the checkpoint says) and
    // continued the chain from the edited line.
    let err = RecordWriter::open(crashed.path(), WriterOptions::default()).unwrap_err();
    assert!(matches!(err, RecordError::Corrupt { .. }), "{err:?}");
    assert!(err.to_string().contains("checkpoint"), "{err}");
    assert_eq!(fs::read_to_string(&file).unwrap(), edited, "left as it was");
    let report = verify_records(crashed.path(), None).unwrap();
    let last = text.lines().count() as u64;
    assert!(
        report.problems.iter().any(|p| p.at.line == Some(last)
            && p.to_string().contains("edited")
            && p.to_string().contains("checkpoint")),
        "{report:?}"
    );
}

#[test]
fn a_durable_line_edited_while_the_ring_holds_more_is_refused_not_offered_for_replay() {
    let (_live, crashed, checkpoint) = crashed_after_ten_checkpointed_at_one();
    // Record 1, durable by the checkpoint, edited in place: copying 2..=10 in after it would
    // chain them to a line that is not the one they vouch for.
    let file = crashed.path().join(&checkpoint.file);
    let text = fs::read_to_string(&file).unwrap();
    fs::write(&file, text.replacen("prod-repo", "prod-repx", 1)).unwrap();
    let err = verify_records(crashed.path(), None).unwrap_err();
    assert!(matches!(err, StoreError::Ring(_)), "{err:?}");
    assert!(err.to_string().contains("cut or edited"), "{err}");
    let err = RecordWriter::open(crashed.path(), WriterOptions::default()).unwrap_err();
    assert!(matches!(err, RecordError::Corrupt { .. }), "{err:?}");
}

/// After a write-back error on a checkpoint's `fdatasync` the writer fails closed, but its
/// lines stay in the page cache: a restart (no reboot) finds the file holding every ring
/// entry, and its own `fdatasync` succeeds (the kernel reported the lost write-back once,
/// to the failed writer), so a checkpoint there would vouch for pages that never reached
/// the disk. The entries past the checkpoint are written again at their places, dirtying
/// those pages, and synced before the checkpoint moves. The write-back error itself cannot
/// be injected here: what is checked is that the open writes the file although it already
/// holds the entries (its modification time moves).
#[test]
fn entries_the_file_seems_to_hold_are_written_again_before_the_checkpoint_moves() {
    let (live, crashed, checkpoint) = crashed_after_ten_checkpointed_at_one();
    // The failed writer's file as the page cache holds it: every record, identical.
    let file = crashed.path().join(&checkpoint.file);
    std::fs::copy(live.path().join(&checkpoint.file), &file).unwrap();
    let before = std::fs::read(&file).unwrap();
    let (_, entries) = ring::read_back(crashed.path()).unwrap().unwrap();
    assert_eq!(entries.len(), 9);
    let long_ago = std::time::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
    OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_modified(long_ago)
        .unwrap();
    let reopened = RecordWriter::open(crashed.path(), WriterOptions::default()).unwrap();
    assert_eq!(reopened.status().last_seq, Some(10));
    assert!(reopened.recovered().is_empty());
    let modified = fs::metadata(&file).unwrap().modified().unwrap();
    assert!(
        modified > long_ago,
        "the entries past the checkpoint were not written again"
    );
    assert_eq!(fs::read(&file).unwrap(), before);
    reopened.close_blocking().unwrap();
    let report = verify_records(crashed.path(), None).unwrap();
    assert!(report.is_ok() && report.records == 10, "{report:?}");
}

#[test]
fn a_ring_stopped_right_after_it_was_made_reopens() {
    let dir = tempfile::tempdir().unwrap();
    ring::STOP_AFTER_MAKING.with(|stop| stop.set(true));
    let err = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap_err();
    assert!(err.to_string().contains("stopped by the test"), "{err}");
    // As a crash between renaming the new ring into place and its first checkpoint leaves
    // it: before, neither header slot was valid, and every later open and reader refused it.
    let report = verify_records(dir.path(), None).unwrap();
    assert!(report.is_ok() && report.records == 0, "{report:?}");
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    assert_eq!(w.commit_blocking(sample_tool_call()).unwrap().seq, 1);
    w.close_blocking().unwrap();
    let report = verify_records(dir.path(), None).unwrap();
    assert!(report.is_ok() && report.records == 1, "{report:?}");
}

#[test]
fn a_last_line_whose_seq_or_prev_hash_does_not_follow_the_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = three_records_closed(dir.path());
    let original = fs::read_to_string(&file).unwrap();
    let third = line_hash(original.lines().last().unwrap().as_bytes());
    let with_line = |seq: u64, prev_hash: &str| {
        let mut record = sample_tool_call();
        record.flowhost.seq = seq;
        record.flowhost.prev_hash = prev_hash.to_string();
        let line = String::from_utf8(serde_json::to_vec(&record).unwrap()).unwrap();
        fs::write(&file, format!("{original}{line}\n")).unwrap();
        // A directory from before the ring: the lines past the anchor vouch for themselves.
        as_before_the_ring(dir.path());
    };
    // Before, the chain resumed after seq u64::MAX and every new record got that seq again.
    for (seq, prev_hash) in [
        (u64::MAX, third.as_str()),
        (7, third.as_str()),
        (4, crate::records::GENESIS_HASH),
    ] {
        with_line(seq, prev_hash);
        let err = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap_err();
        assert!(
            matches!(err, RecordError::Corrupt { line: 4, .. }),
            "seq {seq}, prev_hash {prev_hash}: {err:?}"
        );
    }
    with_line(4, third.as_str());
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    assert_eq!(w.commit_blocking(sample_tool_call()).unwrap().seq, 5);
    w.close_blocking().unwrap();
}

/// The first anchor refresh after an open, with nothing synced since, names the head the
/// writer opened with. A sync a caller led while the refresh was being written made it name
/// that caller's record instead, with no file or line: a record its file did not yet hold
/// durably (only the ring did).
#[test]
fn the_first_anchor_never_names_a_record_synced_while_it_was_being_written() {
    let dir = tempfile::tempdir().unwrap();
    let (read, go, written) = pause_first_anchor(false);
    let w = RecordWriter::open(dir.path(), no_anchor_refresh(1 << 20)).unwrap();
    read.recv_timeout(Duration::from_secs(10)).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let c = rt.block_on(w.commit_alone(sample_tool_call())).unwrap();
    assert_eq!(c.seq, 1);
    assert_eq!(w.stages.led_syncs(), 1, "the caller led its own sync");
    go.send(()).unwrap();
    written.recv_timeout(Duration::from_secs(10)).unwrap();
    let anchor = HeadAnchor::read(&dir.path().join(HEAD_FILE))
        .unwrap()
        .unwrap();
    assert!(
        anchor.seq == 0 || anchor.file.is_some(),
        "the anchor names record {} without its file: {anchor:?}",
        anchor.seq
    );
    w.close_blocking().unwrap();
}

/// While a caller leads a sync that the disk holds up, records appended meanwhile come due
/// (5 ms) but cannot be synced until it ends. The sync thread used to look again at once,
/// over and over, for as long as the lead lasted (one core spinning on a stalled disk); it
/// now waits to be told the lead has ended, then syncs them.
#[tokio::test(flavor = "current_thread")]
async fn the_sync_thread_waits_for_a_led_sync_instead_of_spinning() {
    // On a tmpfs where there is one, so that the last sync is quick enough for a caller to
    // lead the next (what the disk's load would otherwise decide).
    let dir = match tempfile::tempdir_in("/dev/shm") {
        Ok(dir) => dir,
        Err(_) => tempfile::tempdir().unwrap(),
    };
    let w = RecordWriter::open(dir.path(), no_anchor_refresh(1 << 20)).unwrap();
    let mut last = w.commit_alone(sample_tool_call()).await.unwrap();
    for _ in 0..100 {
        if w.stages.last_sync_was_quick() {
            break;
        }
        last = w.commit_alone(sample_tool_call()).await.unwrap();
    }
    let led = w.stages.led_syncs();
    w.stages.slow_next_sync(Duration::from_secs(2));
    let leader = {
        let w = w.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            rt.block_on(w.commit_alone(sample_tool_call())).unwrap()
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while w.stages.led_syncs() == led {
        assert!(
            std::time::Instant::now() < deadline,
            "the caller did not lead"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let appended = w.append(sample_tool_call()).await.unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let looks = w.stages.syncer_looks();
    std::thread::sleep(Duration::from_millis(150));
    let looked = w.stages.syncer_looks() - looks;
    // The window is inside the held sync, whatever the scheduler did.
    assert!(
        !leader.is_finished(),
        "the held sync ended within the window"
    );
    assert!(
        looked < 40,
        "the sync thread looked {looked} times in 150 ms"
    );
    assert_eq!(leader.join().unwrap().seq, last.seq + 1);
    // Once the lead is over, the appended record is synced without anyone waiting for it.
    while w.status().last_seq < Some(appended.seq) {
        assert!(std::time::Instant::now() < deadline, "{:?}", w.status());
        std::thread::sleep(Duration::from_millis(1));
    }
    w.close_blocking().unwrap();
}

/// A record that broke the format was refused (and its decision with it) without a trace:
/// the writer went on, and the health built from its status called the records complete,
/// so the diff judged a run that lacked a decision. A client calling tool `""` was enough.
#[test]
fn a_record_refused_for_its_format_leaves_the_records_incomplete() {
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    w.commit_blocking(sample_tool_call()).unwrap();
    let mut bad = sample_tool_call();
    bad.tool.name = String::new();
    assert!(matches!(
        w.commit_blocking(bad),
        Err(RecordError::Invalid(_))
    ));
    // The writer goes on: the next decision is recorded.
    w.commit_blocking(sample_tool_call()).unwrap();
    let status = w.close_blocking().unwrap();
    assert_eq!(status.rejected, 1);
    assert!(status.failed.is_none());
    let health = crate::records::health::RecordsHealth::from_writer(&status);
    assert_eq!(health.records_complete, Some(false));
    assert!(
        health.problems.iter().any(|p| p.contains("tool.name")),
        "{:?}",
        health.problems
    );
    // A decision made after the stop closed the records (a call the stop stopped waiting
    // for) lacks its record too.
    assert!(matches!(
        w.commit_blocking(sample_tool_call()),
        Err(RecordError::Closed)
    ));
    let status = w.status();
    assert_eq!(status.rejected, 2);
    let health = crate::records::health::RecordsHealth::from_writer(&status);
    assert!(
        health
            .problems
            .iter()
            .any(|p| p.contains("after the records were closed")),
        "{:?}",
        health.problems
    );

    // Text the builder sanitizes is never empty, so such a decision has its record.
    assert_eq!(crate::records::sanitize(""), "\u{FFFD}");
}
