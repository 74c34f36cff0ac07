//! `flowhost records verify|export` and `flowhost health` on real record directories, run
//! through the built binary.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use flowhost::records::{
    Correlation, DecisionRecord, FlowContext, RecordWriter, ServerInfo, ToolCallFacts, Verdict,
    WriterOptions, project_tool_call,
};

fn flowhost(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(args)
        .output()
        .expect("run flowhost")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn record(i: usize) -> DecisionRecord {
    record_of_call(i, &format!("call-{i}"))
}

fn record_of_call(i: usize, call_id: &str) -> DecisionRecord {
    DecisionRecord::tool_call(ToolCallFacts {
        server: ServerInfo::mcp("srv", None),
        tool_name: format!("tool_{i}"),
        projection: project_tool_call(None, &serde_json::json!({})),
        verdict: Verdict::Authorized { rule: None },
        credential_alias: None,
        correlation: Correlation::none(),
        context: FlowContext {
            call_id: Some(call_id.to_string()),
            ..FlowContext::default()
        },
    })
}

/// A closed record directory of `n` records in files of at most `rotate` bytes.
fn records(dir: &Path, n: usize, rotate: u64) -> Vec<PathBuf> {
    let w = RecordWriter::open(
        dir,
        WriterOptions {
            rotate_bytes: rotate,
            ..WriterOptions::default()
        },
    )
    .unwrap();
    for i in 0..n {
        w.commit_blocking(record(i)).unwrap();
    }
    w.close_blocking().unwrap();
    flowhost::records::store::list_record_files(dir)
        .unwrap()
        .into_iter()
        .map(|f| f.path)
        .collect()
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

fn write_lines(path: &Path, lines: &[String]) {
    std::fs::write(
        path,
        lines.iter().map(|l| format!("{l}\n")).collect::<String>(),
    )
    .unwrap();
}

fn files_first(path: &Path) -> u64 {
    flowhost::records::store::parse_record_file_name(path.file_name().unwrap().to_str().unwrap())
        .unwrap()
}

fn verify(dir: &Path) -> (i32, String) {
    let o = flowhost(&["records", "verify", dir.to_str().unwrap()]);
    (o.status.code().unwrap(), stdout(&o))
}

/// A directory with nothing in it to verify (a mistyped path, the state directory, one
/// emptied) is no intact stream: before, it printed "ok: 0 records" and exited 0.
#[test]
fn a_directory_holding_no_records_does_not_verify() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("state.db"), b"not records").unwrap();
    let o = flowhost(&["records", "verify", dir.path().to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("nothing to verify"),
        "{o:?}"
    );
    // Nor one holding an empty record file alone.
    std::fs::write(dir.path().join("records-00000000000000000001.jsonl"), b"").unwrap();
    let o = flowhost(&["records", "verify", dir.path().to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    // Nor is it exported as a surface of no decisions (before: "wrote 0 decisions", exit
    // 0), to standard output or a file.
    let out = dir.path().join("surface.json");
    for to_file in [false, true] {
        let mut args = vec![
            "records",
            "export",
            "--surface",
            dir.path().to_str().unwrap(),
        ];
        if to_file {
            args.extend(["--out", out.to_str().unwrap()]);
        }
        let o = flowhost(&args);
        assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
        assert!(stdout(&o).is_empty(), "{}", stdout(&o));
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("nothing exported"),
            "{o:?}"
        );
    }
    assert!(!out.exists());
    // A stream cut to nothing, its anchor removed, is missing its records (the ring's
    // checkpoint says how many), and says so: not "nothing to verify".
    let cut = tempfile::tempdir().unwrap();
    let files = records(cut.path(), 5, 1 << 20);
    std::fs::remove_file(cut.path().join("records.head")).unwrap();
    std::fs::write(&files[0], b"").unwrap();
    let o = flowhost(&["records", "verify", cut.path().to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(
        !String::from_utf8_lossy(&o.stderr).contains("nothing to verify"),
        "{o:?}"
    );
}

/// A directory whose head anchor and write-ahead ring were both removed, and then lines cut
/// from its end, is one whose end no writer or reader can vouch for: the host refuses to
/// open it, and `verify` and `export` refuse it too. Before, both exited 0 ("no head
/// anchor"), so a gate trusting their exit took a stream that lost records.
#[test]
fn a_directory_with_neither_anchor_nor_ring_does_not_verify() {
    let dir = tempfile::tempdir().unwrap();
    let files = records(dir.path(), 5, 1 << 20);
    std::fs::remove_file(dir.path().join("records.head")).unwrap();
    std::fs::remove_file(dir.path().join("records.wal")).unwrap();
    let kept = lines(&files[0]);
    write_lines(&files[0], &kept[..3]);
    let o = flowhost(&["records", "verify", dir.path().to_str().unwrap()]);
    let (code, out) = (o.status.code().unwrap(), stdout(&o));
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(code, 1, "{out}{stderr}");
    assert!(
        stderr.contains("neither records.head nor records.wal"),
        "{out}{stderr}"
    );
    let o = flowhost(&[
        "records",
        "export",
        "--surface",
        dir.path().to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(stdout(&o).is_empty(), "{}", stdout(&o));
    // Nor is its record file, named alone: it is judged as its directory is.
    let (code, out) = verify(&files[0]);
    assert_eq!(code, 1, "{out}");
    let o = flowhost(&["records", "export", "--surface", files[0].to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    // One file otherwise named, outside any directory a writer kept, is a copy: it
    // verifies as far as it goes, and says its end is not checked.
    let copy = tempfile::tempdir().unwrap();
    let alone = copy.path().join("copy.jsonl");
    write_lines(&alone, &kept[..3]);
    let (code, out) = verify(&alone);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("no head anchor"), "{out}");
}

#[test]
fn intact_rotated_stream_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let files = records(dir.path(), 40, 4096);
    assert!(files.len() > 3);
    let (code, out) = verify(dir.path());
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("ok: 40 records"), "{out}");
    assert!(out.contains("head anchor at seq 40 matches"), "{out}");
}

/// A record file whose line quotes a terminal escape where a decoder names it (an unknown
/// classification) is reported with the escape escaped, by `verify`, by `export` and in an
/// error: verifying a file from elsewhere must not let it drive the terminal. Before, the
/// decoder's words went out raw.
#[test]
fn a_hostile_line_cannot_drive_the_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let files = records(dir.path(), 3, 1 << 20);
    let mut l = lines(&files[0]);
    let mut second: serde_json::Value = serde_json::from_str(&l[1]).unwrap();
    second["classification"] = serde_json::json!("\u{1b}]0;owned\u{7}");
    l[1] = second.to_string();
    write_lines(&files[0], &l);
    let (code, out) = verify(dir.path());
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("\\u{1b}]0;owned"), "{out}");
    let export = flowhost(&[
        "records",
        "export",
        "--surface",
        dir.path().to_str().unwrap(),
    ]);
    let all = format!(
        "{out}{}{}",
        stdout(&export),
        String::from_utf8_lossy(&export.stderr)
    );
    assert!(
        !all.contains('\u{1b}') && !all.contains('\u{7}'),
        "a control character reached the terminal: {all:?}"
    );
    // An anchor naming an escape where its decoder quotes it (an unknown field): rejected
    // evidence, said escaped by verify, export and diff alike.
    let dir = tempfile::tempdir().unwrap();
    records(dir.path(), 2, 1 << 20);
    std::fs::write(
        dir.path().join("records.head"),
        r#"{"\u001b]0;owned\u0007":1}"#,
    )
    .unwrap();
    let d = dir.path().to_str().unwrap();
    let mut all = String::new();
    for args in [
        vec!["records", "verify", d],
        vec!["records", "export", "--surface", d],
    ] {
        let o = flowhost(&args);
        all += &stdout(&o);
        all += &String::from_utf8_lossy(&o.stderr);
    }
    assert!(all.contains("\\u{1b}]0;owned"), "{all}");
    assert!(
        !all.contains('\u{1b}'),
        "a control character reached the terminal: {all:?}"
    );
}

/// Exported to a terminal, a verified record's characters that reorder a line (here a
/// right-to-left override and a line separator in a call id an executor chose, which the
/// writer keeps and JSON leaves raw) go escaped; piped, the export keeps the bytes the chain
/// hashes. Before, the terminal got them raw.
#[test]
fn an_export_to_a_terminal_shows_no_character_a_terminal_acts_on() {
    use std::io::Read;
    let dir = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
    w.commit_blocking(record_of_call(0, "call-\u{202e}x\u{2028}y"))
        .unwrap();
    w.close_blocking().unwrap();
    let d = dir.path().to_str().unwrap();

    let piped = stdout(&flowhost(&["records", "export", "--surface", d]));
    assert!(piped.contains("call-\u{202e}x\u{2028}y"), "{piped}");

    let (master, slave) = common::open_pty();
    let mut child = Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(["records", "export", "--surface", d])
        .stdout(std::process::Stdio::from(slave))
        .spawn()
        .unwrap();
    let status = child.wait().unwrap();
    // Every slave is closed now, so the master reads what was shown, then EIO.
    drop(child);
    let mut shown = Vec::new();
    let mut master = std::fs::File::from(master);
    let mut buf = [0u8; 4096];
    while let Ok(n) = master.read(&mut buf) {
        if n == 0 {
            break;
        }
        shown.extend_from_slice(&buf[..n]);
    }
    let shown = String::from_utf8_lossy(&shown);
    assert!(status.success(), "{shown}");
    assert!(shown.contains("call-\\u202ex\\u2028y"), "{shown}");
    assert!(
        !shown.contains(['\u{202e}', '\u{2028}']),
        "a character a terminal acts on reached it: {shown:?}"
    );
}

#[test]
fn deleted_line_is_reported_as_a_gap_with_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let files = records(dir.path(), 10, 1 << 20);
    let mut l = lines(&files[0]);
    l.remove(4); // seq 5
    write_lines(&files[0], &l);
    let (code, out) = verify(dir.path());
    assert_eq!(code, 1, "{out}");
    let name = files[0].display().to_string();
    assert!(
        out.contains(&format!("{name}:5: gap: record 5 is missing")),
        "{out}"
    );
}

#[test]
fn deleted_file_in_the_middle_is_a_gap() {
    let dir = tempfile::tempdir().unwrap();
    let files = records(dir.path(), 30, 4096);
    std::fs::remove_file(&files[1]).unwrap();
    let (code, out) = verify(dir.path());
    assert_eq!(code, 1, "{out}");
    let first_of_next = flowhost::records::store::parse_record_file_name(
        files[2].file_name().unwrap().to_str().unwrap(),
    )
    .unwrap();
    assert!(
        out.contains(&format!(
            "{}:1: gap: records {}..={} are missing (deleted lines or a deleted file)",
            files[2].display(),
            files_first(&files[1]),
            first_of_next - 1
        )),
        "{out}"
    );
}

#[test]
fn edited_line_is_reported_at_the_edited_line() {
    let dir = tempfile::tempdir().unwrap();
    let files = records(dir.path(), 10, 1 << 20);
    let mut l = lines(&files[0]);
    l[2] = l[2].replace("\"tool_2\"", "\"tool_X\"");
    write_lines(&files[0], &l);
    let (code, out) = verify(dir.path());
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "{}:3: edited: record 3 does not hash to what the next record vouches for",
            files[0].display()
        )),
        "{out}"
    );
}

#[test]
fn edited_last_line_is_caught_by_the_head_anchor() {
    let dir = tempfile::tempdir().unwrap();
    let files = records(dir.path(), 5, 1 << 20);
    let mut l = lines(&files[0]);
    l[4] = l[4].replace("\"tool_4\"", "\"tool_Y\"");
    write_lines(&files[0], &l);
    let (code, out) = verify(dir.path());
    assert_eq!(code, 1, "{out}");
    assert!(out.contains(":5: edited: record 5"), "{out}");
    assert!(out.contains("head anchor"), "{out}");
}

#[test]
fn truncated_file_is_reported_torn_and_versus_the_head() {
    let dir = tempfile::tempdir().unwrap();
    let files = records(dir.path(), 6, 1 << 20);
    let bytes = std::fs::read(&files[0]).unwrap();
    // Cut in the middle of line 5: lines 5 and 6 are gone, line 5 is torn.
    let l = lines(&files[0]);
    let keep = l[..4].iter().map(|s| s.len() + 1).sum::<usize>() + 20;
    std::fs::write(&files[0], &bytes[..keep]).unwrap();
    let (code, out) = verify(dir.path());
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "{}:5: truncated: the last line (20 bytes) has no newline",
            files[0].display()
        )),
        "{out}"
    );
    assert!(
        out.contains("truncated: the head anchor names record 6 but the stream ends at 4 (2 whole lines missing)"),
        "{out}"
    );
    // Cutting whole lines only is caught by the anchor alone.
    write_lines(&files[0], &l[..3]);
    let (code, out) = verify(dir.path());
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("3 whole lines missing"), "{out}");
}

#[test]
fn single_file_with_explicit_head() {
    let dir = tempfile::tempdir().unwrap();
    let files = records(dir.path(), 4, 1 << 20);
    let head = dir.path().join("records.head");
    let o = flowhost(&[
        "records",
        "verify",
        files[0].to_str().unwrap(),
        "--head",
        head.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    let l = lines(&files[0]);
    write_lines(&files[0], &l[..3]);
    let o = flowhost(&[
        "records",
        "verify",
        files[0].to_str().unwrap(),
        "--head",
        head.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
}

/// A record file named on its own is checked as its directory is: when the later files of
/// a rotated directory are deleted, it is the last one left, and the directory's anchor
/// (and ring checkpoint), which name a record past its end, show the records missing. Before,
/// the anchor was dropped for naming another file and the checkpoint was never read, so
/// `verify` said ok and `export` exported the cut stream.
#[test]
fn a_record_file_left_last_by_deleting_later_ones_is_reported_cut() {
    let dir = tempfile::tempdir().unwrap();
    let files = records(dir.path(), 12, 2048);
    assert!(files.len() >= 2, "{files:?}");
    let first = files[0].to_str().unwrap().to_string();
    let o = flowhost(&["records", "verify", &first]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    for later in &files[1..] {
        std::fs::remove_file(later).unwrap();
    }
    let o = flowhost(&["records", "verify", &first]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(stdout(&o).contains("truncated"), "{}", stdout(&o));
    // An empty record file named after the deleted ones, so that the first no longer looks
    // like the directory's last, does not excuse them. Before, it dropped the witnesses.
    let decoy = dir.path().join("records-00000000000000099999.jsonl");
    std::fs::write(&decoy, "").unwrap();
    let o = flowhost(&["records", "verify", &first]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(stdout(&o).contains("truncated"), "{}", stdout(&o));
    std::fs::remove_file(&decoy).unwrap();
    let out = dir.path().join("surface.json");
    let o = flowhost(&[
        "records",
        "export",
        "--surface",
        &first,
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_ne!(
        o.status.code(),
        Some(0),
        "exported a cut stream: {}",
        stdout(&o)
    );
    assert!(!out.exists());
}

/// A record file read alone that is not its directory's last is held to the file after it:
/// that one's first record says where this one ends (its seq) and what its last line hashes
/// to (its `prev_hash`). Before, the anchor and checkpoint (which name the later file)
/// vouched for nothing here, and lines cut from its end verified as "ok" and exported.
#[test]
fn a_rotated_file_read_alone_is_held_to_the_file_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let files = records(dir.path(), 12, 2048);
    assert!(files.len() >= 2, "{files:?}");
    let first = files[0].to_str().unwrap().to_string();
    let o = flowhost(&["records", "verify", &first]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    let l = lines(&files[0]);
    assert!(l.len() >= 2, "{l:?}");
    // Its last line edited (the chain within the file still links: the last line is
    // nothing's predecessor here).
    let mut edited = l.clone();
    let last = edited.len() - 1;
    edited[last] = edited[last].replacen("\"seq\"", "\"seq\" ", 1);
    assert_ne!(edited[last], l[last]);
    write_lines(&files[0], &edited);
    let o = flowhost(&["records", "verify", &first]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(
        stdout(&o).contains("next record file's first record"),
        "{}",
        stdout(&o)
    );
    // Its last line cut.
    write_lines(&files[0], &l[..l.len() - 1]);
    let o = flowhost(&["records", "verify", &first]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(
        stdout(&o).contains("truncated: the next record file starts at record")
            && stdout(&o).contains("(1 whole lines missing)"),
        "{}",
        stdout(&o)
    );
    let out = dir.path().join("surface.json");
    let o = flowhost(&[
        "records",
        "export",
        "--surface",
        &first,
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(!out.exists());
    // Lines appended past where the next file starts (the second file's own first lines,
    // chained as they were) verify on their own but not as this file's end.
    let mut longer = l.clone();
    longer.extend(lines(&files[1]).into_iter().take(2));
    write_lines(&files[0], &longer);
    let o = flowhost(&["records", "verify", &first]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(
        stdout(&o).contains("records were added past its end"),
        "{}",
        stdout(&o)
    );
    // With the next file emptied, its name still says where this one ends.
    std::fs::write(&files[1], "").unwrap();
    let o = flowhost(&["records", "verify", &first]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(
        stdout(&o).contains("records were added past its end"),
        "{}",
        stdout(&o)
    );
}

/// A record file read alone is held to what its directory's anchor says of it, even when a
/// later-named record file (here an empty decoy) makes it look rotated. Before, the anchor
/// and ring checkpoint were dropped for a file that was not its directory's last, so lines
/// cut from its end verified as ok.
#[test]
fn a_later_record_file_does_not_excuse_a_cut_from_the_anchored_one() {
    let dir = tempfile::tempdir().unwrap();
    let files = records(dir.path(), 6, 1 << 20);
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_str().unwrap();
    let digits = name.trim_start_matches(|c: char| !c.is_ascii_digit());
    let width = digits.find(|c: char| !c.is_ascii_digit()).unwrap();
    let decoy = dir
        .path()
        .join(name.replace(&digits[..width], &format!("{:0width$}", 500, width = width)));
    assert_ne!(decoy, files[0]);
    let l = lines(&files[0]);
    write_lines(&files[0], &l[..4]);
    std::fs::write(&decoy, "").unwrap();
    let o = flowhost(&["records", "verify", files[0].to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(
        stdout(&o).contains("2 whole lines missing"),
        "{}",
        stdout(&o)
    );
}

/// A record file that ends in a line longer than any record (17 MiB, no newline) is
/// reported as not a record, and its rest is not read into memory. Before, the line was
/// carried whole, however large the file.
#[test]
fn an_endless_line_is_not_a_record_and_is_not_read_whole() {
    let dir = tempfile::tempdir().unwrap();
    let files = records(dir.path(), 2, 1 << 20);
    let mut tail = std::fs::OpenOptions::new()
        .append(true)
        .open(&files[0])
        .unwrap();
    std::io::Write::write_all(&mut tail, &vec![b'x'; 17 * 1024 * 1024]).unwrap();
    drop(tail);
    let o = flowhost(&["records", "verify", files[0].to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(
        stdout(&o).contains(":3: ") && stdout(&o).contains("longer than any record"),
        "{}",
        stdout(&o)
    );
}

/// An anchor named with `--head` that does not exist is an input error (exit 2), not a
/// check without an anchor.
#[test]
fn a_head_anchor_named_but_missing_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let files = records(dir.path(), 3, 1 << 20);
    let missing = dir.path().join("no-such.head");
    let o = flowhost(&[
        "records",
        "verify",
        files[0].to_str().unwrap(),
        "--head",
        missing.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{}{stderr}", stdout(&o));
    assert!(stderr.contains("no-such.head"), "{stderr}");
    // One the operator reaches by a symbolic link (a copy kept elsewhere) is read through
    // it: the directory's own anchor is never followed, a named one is the operator's.
    let kept = dir.path().join("kept.head");
    std::fs::copy(dir.path().join("records.head"), &kept).unwrap();
    let link = dir.path().join("latest.head");
    std::os::unix::fs::symlink(&kept, &link).unwrap();
    let o = flowhost(&[
        "records",
        "verify",
        files[0].to_str().unwrap(),
        "--head",
        link.to_str().unwrap(),
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}{}",
        stdout(&o),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn export(dir: &Path, out: &Path) -> Output {
    flowhost(&[
        "records",
        "export",
        "--surface",
        dir.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ])
}

#[test]
fn export_writes_the_envelope_and_refuses_broken_records() {
    let dir = tempfile::tempdir().unwrap();
    let files = records(dir.path(), 7, 2048);
    let out = dir.path().join("surface.json");
    let o = export(dir.path(), &out);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(v["schema"], "assay.tool_decision_surface.v0");
    let decisions = v["observed_tool_decisions"].as_array().unwrap();
    assert_eq!(decisions.len(), 7);
    let seqs: Vec<u64> = decisions
        .iter()
        .map(|d| d["flowhost"]["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, (1..=7).collect::<Vec<_>>());
    assert_eq!(v["non_claims"].as_array().unwrap().len(), 3);
    // Break the chain: export refuses and leaves the old output untouched.
    let mut l = lines(&files[0]);
    l.remove(0);
    write_lines(&files[0], &l);
    let before = std::fs::read(&out).unwrap();
    let o = export(dir.path(), &out);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("does not verify"));
    assert_eq!(std::fs::read(&out).unwrap(), before);
    // Exported to stdout: nothing reaches it, not even the problems (stderr has them), so
    // `> surface.json` never holds problem lines taken for an export.
    let o = flowhost(&[
        "records",
        "export",
        "--surface",
        dir.path().to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(stdout(&o), "");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("does not verify"), "{stderr}");
    assert!(stderr.lines().count() > 1, "no problem named: {stderr}");
}

#[test]
fn export_requires_the_surface_flag() {
    let dir = tempfile::tempdir().unwrap();
    records(dir.path(), 1, 1 << 20);
    let o = flowhost(&["records", "export", dir.path().to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
}

/// `flowhost health --records DIR --out DIR/health.json`, asserted to exit 0: the carrier.
fn offline_health(dir: &Path) -> serde_json::Value {
    let out = dir.join("health.json");
    let o = flowhost(&[
        "health",
        "--records",
        dir.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap()
}

/// An offline health of records `records verify` refuses (nothing there; a directory whose
/// anchor and ring were removed) says its record side is not complete, and why. Before, it
/// said `records_complete: true` for both.
#[test]
fn offline_health_of_records_verify_refuses_is_not_records_complete() {
    let empty = tempfile::tempdir().unwrap();
    let stripped = tempfile::tempdir().unwrap();
    records(stripped.path(), 3, 1 << 20);
    std::fs::remove_file(stripped.path().join("records.head")).unwrap();
    std::fs::remove_file(stripped.path().join("records.wal")).unwrap();
    for (dir, why) in [
        (empty.path(), "holds no record"),
        (stripped.path(), "neither records.head nor records.wal"),
    ] {
        let v = offline_health(dir);
        assert_eq!(v["records"]["records_complete"], false, "{v}");
        assert!(v["records"]["problems"].to_string().contains(why), "{v}");
    }
}

#[test]
fn offline_health_reports_the_range_and_is_incomplete() {
    let dir = tempfile::tempdir().unwrap();
    records(dir.path(), 9, 4096);
    let v = offline_health(dir.path());
    assert_eq!(v["schema"], "flowhost.tool_observation_health.v0");
    assert_eq!(v["producer"], "offline");
    assert_eq!(v["records"]["first_seq"], 1);
    assert_eq!(v["records"]["last_seq"], 9);
    assert_eq!(v["records"]["records_complete"], true);
    assert_eq!(v["complete"], false);
    assert!(
        v["incomplete_reasons"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r == "proxy_seen is unknown")
    );
}

/// The same crashed copy without its ring (left out of the copy, or removed): what was
/// durable only in the ring is gone, and every reader and `records replay` say so instead of
/// taking the record files for the whole stream ("nothing to replay", before).
#[test]
fn a_crashed_copy_without_its_ring_is_refused_by_readers_and_replay() {
    let dir = tempfile::tempdir().unwrap();
    crashed_copy(dir.path());
    std::fs::remove_file(dir.path().join(flowhost::records::RING_FILE)).unwrap();
    let path = dir.path().to_str().unwrap();
    // Rejected evidence for verify (exit 1, as any cut it finds); an input the others
    // cannot use (2).
    for (args, code) in [
        (&["records", "verify", path][..], 1),
        (&["records", "replay", path][..], 2),
        (&["health", "--records", path][..], 2),
    ] {
        let o = flowhost(args);
        assert_eq!(o.status.code(), Some(code), "{args:?}: {o:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("records.wal is missing, but records.head says"),
            "{args:?}: {err}"
        );
    }
}

/// A copy of a live writer's directory as a machine crash leaves it: the record file cut back
/// to what the ring's checkpoint made durable; the records after it are durable in the ring
/// only. Returns the copy and how many records the writer had committed.
fn crashed_copy(to: &Path) -> usize {
    let live = tempfile::tempdir().unwrap();
    let w = RecordWriter::open(
        live.path(),
        WriterOptions {
            // No anchor refresh (and so no checkpoint) after the first durable group.
            head_interval: std::time::Duration::from_secs(3600),
            ..WriterOptions::default()
        },
    )
    .unwrap();
    for i in 0..10 {
        w.commit_blocking(record(i)).unwrap();
    }
    // The ring first: its checkpoint only covers bytes already in the files copied after it.
    let ring = flowhost::records::RING_FILE;
    std::fs::copy(live.path().join(ring), to.join(ring)).unwrap();
    for entry in std::fs::read_dir(live.path()).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != ring {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
    let (checkpoint, _) = flowhost::records::ring::read_back(to).unwrap().unwrap();
    let file = to.join(&checkpoint.file);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes.truncate(checkpoint.bytes as usize);
    std::fs::write(&file, bytes).unwrap();
    w.close_blocking().unwrap();
    10
}

/// Records cut below the ring's checkpoint in a crashed copy (the ring still holding what
/// followed) are tampered evidence, not an input the reader could not use: `verify` exits 1
/// (problems) and `diff` 4 (evidence rejected), as for the same cut found by the anchor.
/// Before, both exited 2, which a gate takes for "try again".
#[test]
fn records_cut_below_the_rings_checkpoint_are_rejected_evidence() {
    let dir = tempfile::tempdir().unwrap();
    crashed_copy(dir.path());
    let (checkpoint, _) = flowhost::records::ring::read_back(dir.path())
        .unwrap()
        .unwrap();
    assert!(checkpoint.bytes > 0, "{checkpoint:?}");
    let file = dir.path().join(&checkpoint.file);
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..checkpoint.bytes as usize - 1]).unwrap();
    let path = dir.path().to_str().unwrap();
    let o = flowhost(&["records", "verify", path]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "{}{err}", stdout(&o));
    assert!(err.contains("durable bytes"), "{err}");
    let declared =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/declared/declared_empty.json");
    let o = flowhost(&[
        "diff",
        "--declared",
        declared.to_str().unwrap(),
        "--observed",
        path,
    ]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(4), "{}{err}", stdout(&o));
    assert!(err.contains("durable bytes"), "{err}");
}

/// A ring or head anchor put in place as a FIFO, a symbolic link (to `/dev/zero`, say) or a
/// directory is rejected evidence (verify exits 1), never waited on or read without end.
/// Before, a FIFO blocked verify, diff and export for good, and a link to `/dev/zero` made
/// them read until memory ran out; a link or directory gave exit 2.
#[test]
fn a_ring_or_anchor_that_is_no_regular_file_is_rejected_at_once() {
    let within = |args: &[&str]| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_flowhost"))
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                child.kill().unwrap();
                panic!("{args:?} did not end");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        child.wait_with_output().unwrap()
    };
    for (name, replace) in [
        (
            "ring a FIFO",
            (|d: &Path| {
                let ring = d.join(flowhost::records::RING_FILE);
                std::fs::remove_file(&ring).unwrap();
                let c = std::ffi::CString::new(ring.to_str().unwrap()).unwrap();
                // SAFETY: a NUL-terminated path.
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
            }) as fn(&Path),
        ),
        ("ring a link", |d: &Path| {
            let ring = d.join(flowhost::records::RING_FILE);
            std::fs::rename(&ring, d.join("elsewhere")).unwrap();
            std::os::unix::fs::symlink(d.join("elsewhere"), &ring).unwrap();
        }),
        ("anchor a link to /dev/zero", |d: &Path| {
            let head = d.join("records.head");
            std::fs::remove_file(&head).unwrap();
            std::os::unix::fs::symlink("/dev/zero", &head).unwrap();
        }),
        ("anchor a FIFO", |d: &Path| {
            let head = d.join("records.head");
            std::fs::remove_file(&head).unwrap();
            let c = std::ffi::CString::new(head.to_str().unwrap()).unwrap();
            // SAFETY: a NUL-terminated path.
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        }),
        ("anchor a directory", |d: &Path| {
            let head = d.join("records.head");
            std::fs::remove_file(&head).unwrap();
            std::fs::create_dir(&head).unwrap();
        }),
    ] {
        let dir = tempfile::tempdir().unwrap();
        records(dir.path(), 3, 1 << 20);
        replace(dir.path());
        let o = within(&["records", "verify", dir.path().to_str().unwrap()]);
        assert_eq!(
            o.status.code(),
            Some(1),
            "{name}: {}{}",
            stdout(&o),
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

#[test]
fn records_left_only_in_the_ring_are_refused_until_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let committed = crashed_copy(dir.path());
    let path = dir.path().to_str().unwrap();
    // Before the fix, verify said "ok: 1 records": the nine durable in the ring were not seen.
    let o = flowhost(&["records", "verify", path]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{}{err}", stdout(&o));
    assert!(
        // How far the ring's checkpoint got before the copy depends on the sync thread's
        // timing; the ring holds the rest, up to the last.
        err.contains(" to 10 are durable only in its write-ahead ring")
            && err.contains(&format!("flowhost records replay {path}")),
        "{err}"
    );
    let o = flowhost(&["health", "--records", path]);
    assert_eq!(o.status.code(), Some(2), "{}", stdout(&o));

    let o = flowhost(&["records", "replay", path]);
    assert_eq!(o.status.code(), Some(0), "{:?}", o);
    assert!(
        stdout(&o).contains(" to 10 copied from the write-ahead ring"),
        "{}",
        stdout(&o)
    );
    let (code, out) = verify(dir.path());
    assert_eq!(code, 0, "{out}");
    assert!(out.contains(&format!("ok: {committed} records")), "{out}");
    // A second replay finds nothing to copy.
    let o = flowhost(&["records", "replay", path]);
    assert_eq!(o.status.code(), Some(0), "{:?}", o);
    assert!(
        stdout(&o).contains("already held every durable record"),
        "{}",
        stdout(&o)
    );
}
