//! Record writing and the diff.
//!
//! * Durable records per second under 8 concurrent writers (threads, each committing one
//!   record at a time and waiting until it is durable), with group commit, side by side with
//!   plain appends by 8 writers each doing `write` + `fdatasync` per record on the same file
//!   system, and plain appends without any sync as an upper bound. The three are measured
//!   interleaved, on a directory under `target/` (the real disk, not a tmpfs).
//! * (Run by the daemon suite.) What one call's sync costs the disk: appending a call's two records (its
//!   authorization, about 1.3 KB, and the previous call's outcome, about 1.3 KB, written
//!   without a sync of its own) and one `fdatasync`, on a file whose blocks are reserved
//!   ahead of its end (as the record writer does) and on one whose are not, beside one
//!   1.1 KB append + `fdatasync` (the daemon suite's baseline); interleaved.
//! * The diff over 1,000,000 records (read, parse, match, aggregate), end to end.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use flowhost::diff::diff;
use flowhost::diff::surface::DeclaredSurface;
use flowhost::records::chain::verify_records;
use flowhost::records::health::{RecordsHealth, ToolObservationHealth};
use flowhost::records::{
    BrokerDetails, Chainer, Correlation, DecisionRecord, Destination, EgressFacts, FlowContext,
    InetDestination, RecordWriter, ServerInfo, ToolCallFacts, ToolMapping, Verdict, WriterOptions,
    project_tool_call,
};
use serde_json::json;

use crate::harness::{Row, Samples, fmt_duration, fmt_rate};

const WRITERS: usize = 8;

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures")
        .join(rel)
}

/// The deploy-key mapping of the fixtures.
fn deploy_key_mapping() -> ToolMapping {
    let text = std::fs::read_to_string(fixture("declared/mappings.toml")).expect("mappings");
    let mut maps: std::collections::BTreeMap<String, ToolMapping> =
        toml::from_str(&text).expect("valid mappings");
    maps.remove("github_add_deploy_key")
        .expect("deploy-key mapping")
}

fn tool_call(mapping: &ToolMapping, repo: &str, i: u64) -> DecisionRecord {
    DecisionRecord::tool_call(ToolCallFacts {
        server: ServerInfo::mcp("github", None),
        tool_name: "github.add_deploy_key".into(),
        projection: project_tool_call(
            Some(mapping),
            &json!({"owner": "org", "repo": repo, "title": "ci-key"}),
        ),
        verdict: Verdict::Authorized {
            rule: Some("policy.github".into()),
        },
        credential_alias: Some("github-prod-admin".into()),
        correlation: Correlation::none(),
        context: FlowContext {
            principal: Some("alice".into()),
            session: Some("session-1".into()),
            call_id: Some(format!("call-{i}")),
            ..FlowContext::default()
        },
    })
}

fn egress(port: u16) -> DecisionRecord {
    DecisionRecord::egress_attempt(EgressFacts {
        server: ServerInfo::mcp("fetcher", None),
        tool_name: "fetcher.fetch_url".into(),
        broker: BrokerDetails {
            pid: 4242,
            executable: Some("/usr/libexec/flowhost/fetcher".into()),
            syscall: "connect".into(),
            family: "inet".into(),
            socket_type: Some("stream".into()),
            protocol: Some("tcp".into()),
            destination: Some(Destination::Inet(InetDestination {
                address: "10.1.2.3".parse().expect("address"),
                port,
                host_name: None,
                other_host_names: Vec::new(),
            })),
            bytes: None,
            dns_query_type: None,
        },
        verdict: Verdict::Authorized {
            rule: Some("dest.internal".into()),
        },
        credential_alias: None,
        correlation: Correlation::none(),
        context: FlowContext::default(),
    })
}

/// A scratch directory on the real disk (under `target/`, not `/tmp`, which may be tmpfs).
fn scratch() -> tempfile::TempDir {
    let base = PathBuf::from("target/flowhost-bench");
    std::fs::create_dir_all(&base).expect("create target/flowhost-bench");
    tempfile::tempdir_in(&base).expect("scratch dir")
}

/// Runs `writers` threads calling `op` until `window` has passed; returns records/s.
fn throughput(writers: usize, window: Duration, op: impl Fn(usize) + Sync) -> f64 {
    let stop = AtomicBool::new(false);
    let done = AtomicU64::new(0);
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..writers {
            let (stop, done, op) = (&stop, &done, &op);
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    op(t);
                    done.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        std::thread::sleep(window);
        stop.store(true, Ordering::Relaxed);
    });
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// 8 tokio tasks (the daemon's shape) each awaiting one commit at a time, for `window`.
fn async_throughput(writer: &RecordWriter, template: &DecisionRecord, window: Duration) -> f64 {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .expect("runtime");
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    rt.block_on(async {
        let tasks: Vec<_> = (0..WRITERS)
            .map(|_| {
                let (w, r, done, stop) =
                    (writer.clone(), template.clone(), done.clone(), stop.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        w.commit(r.clone()).await.expect("durable commit");
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        tokio::time::sleep(window).await;
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await.expect("task");
        }
    });
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn plain_appends(dir: &Path, line: &[u8], window: Duration, sync: bool, writers: usize) -> f64 {
    let path = dir.join(if sync {
        "plain-sync.jsonl"
    } else {
        "plain.jsonl"
    });
    let files: Vec<_> = (0..writers)
        .map(|_| {
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .expect("open baseline file")
        })
        .collect();
    throughput(writers, window, |t| {
        let mut f = &files[t];
        f.write_all(line).expect("append");
        if sync {
            f.sync_data().expect("fdatasync");
        }
    })
}

/// Runs the record benchmarks.
pub fn run(quick: bool) -> Vec<Row> {
    let mut rows = Vec::new();
    let mapping = deploy_key_mapping();
    let (samples, window) = if quick {
        (3, Duration::from_millis(500))
    } else {
        (7, Duration::from_secs(2))
    };
    let line = {
        let mut r = tool_call(&mapping, "prod-repo", 0);
        Chainer::genesis().seal(&mut r).expect("valid record").line
    };
    let (mut group, mut plain_sync, mut plain, mut single, mut async_group) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..samples {
        let dir = scratch();
        let writer = Arc::new(
            RecordWriter::open(&dir.path().join("records"), WriterOptions::default())
                .expect("open writer"),
        );
        let template = tool_call(&mapping, "prod-repo", 0);
        group.push(throughput(WRITERS, window, |_| {
            writer
                .commit_blocking(template.clone())
                .expect("durable commit");
        }));
        async_group.push(async_throughput(&writer, &template, window));
        writer.close_blocking().expect("close");
        plain_sync.push(plain_appends(dir.path(), &line, window, true, WRITERS));
        plain.push(plain_appends(dir.path(), &line, window, false, WRITERS));
        single.push(plain_appends(dir.path(), &line, window, true, 1));
    }
    let (g, ps, p) = (median(group), median(plain_sync), median(plain));
    let sync_latency = Duration::from_secs_f64(1.0 / median(single).max(1.0));
    rows.push(Row {
        name: "durable records/s, group commit, 8 writers".into(),
        flowhost: fmt_rate(g),
        baseline: Some((
            "8 writers, write+fdatasync each".into(),
            format!("{} (no sync at all: {})", fmt_rate(ps), fmt_rate(p)),
        )),
        comparison: format!("{:.1}x the per-record-fsync baseline", g / ps.max(1.0)),
        goal: ">= 20,000/s".into(),
        met: g >= 20_000.0,
    });
    let ag = median(async_group);
    rows.push(Row {
        name: "durable records/s, group commit, 8 tokio tasks (2 workers)".into(),
        flowhost: fmt_rate(ag),
        baseline: Some(("8 writers, write+fdatasync each".into(), fmt_rate(ps))),
        comparison: format!("{:.1}x the per-record-fsync baseline", ag / ps.max(1.0)),
        goal: ">= 20,000/s".into(),
        met: ag >= 20_000.0,
    });
    // The disk's own cost of one durable append bounds every figure above: 8 writers with one
    // record in flight each cannot exceed 8 / (about 1.5 x this).
    rows.push(Row {
        name: "context: 1 writer, write+fdatasync latency".into(),
        flowhost: fmt_duration(sync_latency),
        baseline: None,
        comparison: format!(
            "ceiling for 8 writers ~ {}",
            fmt_rate(8.0 / (1.5 * sync_latency.as_secs_f64()))
        ),
        goal: "—".into(),
        met: true,
    });
    rows.extend(diff_million(&mapping, if quick { 1 } else { 5 }));
    rows
}

/// One call's sync with and without the blocks reserved ahead (see the module docs); run
/// by the daemon suite, beside the call it explains.
pub fn reserved_blocks(samples: usize) -> Vec<Row> {
    use std::os::fd::AsRawFd;
    let dir = scratch();
    let open = |name: &str, reserve: bool| {
        let f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.path().join(name))
            .expect("open scratch file");
        if reserve {
            // SAFETY: fallocate on a descriptor this function owns; no memory is passed.
            let r =
                unsafe { libc::fallocate(f.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, 0, 64 << 20) };
            assert_eq!(r, 0, "fallocate: {}", std::io::Error::last_os_error());
        }
        f
    };
    let (one, bare, reserved) = (
        open("one.jsonl", false),
        open("bare.jsonl", false),
        open("reserved.jsonl", true),
    );
    let (outcome, authorization, record) = (
        [b'o'; 1320]
            .iter()
            .chain(b"\n")
            .copied()
            .collect::<Vec<u8>>(),
        [b'a'; 1277]
            .iter()
            .chain(b"\n")
            .copied()
            .collect::<Vec<u8>>(),
        [b'r'; 1099]
            .iter()
            .chain(b"\n")
            .copied()
            .collect::<Vec<u8>>(),
    );
    let timed = |f: &std::fs::File, lines: &[&[u8]]| {
        let mut f = f;
        let start = Instant::now();
        for l in lines {
            f.write_all(l).expect("append");
        }
        f.sync_data().expect("fdatasync");
        start.elapsed()
    };
    let (mut t_one, mut t_bare, mut t_reserved) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..samples {
        t_one.push(timed(&one, &[&record]));
        t_bare.push(timed(&bare, &[&outcome, &authorization]));
        t_reserved.push(timed(&reserved, &[&outcome, &authorization]));
    }
    let (o, b, r) = (
        Samples(t_one).median(),
        Samples(t_bare).median(),
        Samples(t_reserved).median(),
    );
    vec![Row {
        name: format!(
            "one call's sync: two records (2.6 KB) + fdatasync, blocks reserved ahead (median of {samples})"
        ),
        flowhost: fmt_duration(r),
        baseline: Some((
            "the same without reserved blocks; one 1.1 KB record + fdatasync".into(),
            format!("{}; {}", fmt_duration(b), fmt_duration(o)),
        )),
        comparison: format!(
            "{:.2}x unreserved; {:.2}x one record",
            r.as_secs_f64() / b.as_secs_f64().max(1e-9),
            r.as_secs_f64() / o.as_secs_f64().max(1e-9)
        ),
        goal: "reported".into(),
        met: true,
    }]
}

/// The diff over 1,000,000 records: 97% declared allows, 2% declared network egress, 1%
/// undeclared (so findings are built and merged too).
fn diff_million(mapping: &ToolMapping, samples: usize) -> Vec<Row> {
    const N: u64 = 1_000_000;
    let dir = scratch();
    // A JSONL stream of its own, not a record file of a directory (whose end the diff
    // holds to the directory's anchor, which this stream has none of).
    let path = dir.path().join("observed.jsonl");
    {
        let mut out = std::io::BufWriter::new(std::fs::File::create(&path).expect("create"));
        let mut chain = Chainer::genesis();
        let allowed = tool_call(mapping, "prod-repo", 0);
        let undeclared = tool_call(mapping, "other-repo", 0);
        let net_ok = egress(443);
        for i in 0..N {
            let mut r = match i % 100 {
                0 => undeclared.clone(),
                1 | 2 => net_ok.clone(),
                _ => allowed.clone(),
            };
            out.write_all(&chain.seal(&mut r).expect("valid").line)
                .expect("write");
        }
        out.flush().expect("flush");
    }
    let bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    let declared = DeclaredSurface::parse(
        &json!({"schema": "assay.declared_tool_surface.v0", "declared_tool_actions": [
            {"id": "github.deploy_key.prod", "provider": "github", "action_class": "github_deploy_key",
             "allowed_targets": [{"owner": "org", "repo": "prod-repo"}],
             "allowed_effects": ["allow", "deny"], "required_decision": "explicit_policy"},
            {"id": "network.internal", "provider": "network", "action_class": "network_egress",
             "allowed_targets": [{"address": "10.0.0.0/8", "port": 443}],
             "allowed_effects": ["allow"], "required_decision": "explicit_policy"}
        ]})
        .to_string(),
    )
    .expect("declared");
    let report = verify_records(&path, None).expect("verify");
    // The complete health fixture, bound to this stream.
    let mut health =
        ToolObservationHealth::read_from(&fixture("health/health_complete.json")).expect("health");
    health.records = RecordsHealth::from_verify(&report);
    // Every record but the 2% egress attempts is a tool call.
    health.tool_calls_observed = Some(N - N / 50);
    let health = health.finalize();
    let mut times = Vec::new();
    for _ in 0..samples {
        let start = Instant::now();
        let r = diff(&declared, &path, Some(&health)).expect("diff");
        times.push(start.elapsed());
        assert_eq!(r.observed_decisions, N);
        assert_eq!(r.findings.len(), 1, "one merged finding: {:?}", r.findings);
        assert_eq!(r.findings[0].occurrences, N / 100);
    }
    let median = Samples(times).median();
    vec![Row {
        name: format!(
            "diff over 1,000,000 records ({:.0} MB JSONL, 2 cores)",
            bytes as f64 / 1e6
        ),
        flowhost: fmt_duration(median),
        baseline: None,
        comparison: format!("{:.2}x the goal", median.as_secs_f64() / 2.0),
        goal: "< 2 s".into(),
        met: median < Duration::from_secs(2),
    }]
}
