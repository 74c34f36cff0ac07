//! `flowhost demo`: the pricing lab end to end, on real processes.
//!
//! This file is long on purpose: the demo is one story told in order (keys, manifests, host,
//! workflow, records, health, diff). The flowhost binary embeds the example executors
//! (fixtures/tools) behind a hidden `example-tool` subcommand so that this one-command main job
//! needs no other binary installed; production servers run their own executors.
//!
//! Generates keys, signs the three pricing-lab manifests, starts the host (real broker, real
//! sandboxed executors, loopback relays) and runs the workflow: read the terms, publish to the
//! team channel (allowed: the relay shows the bytes), publish to the public pull request
//! (refused: flow violation), and a tool that declares no egress but connects out (refused at
//! the syscall: missing clearance). Then it verifies the records, checks the health and runs
//! the diff against the declared surface. It succeeds only when every outcome was the expected
//! one.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};

use crate::daemon::{Host, run as run_host};
use crate::lab::{Client, LabPaths, Relay, declared_surface, host_config};

/// Why the demo could not run (as opposed to running and seeing a wrong outcome).
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// The host lacks what the broker needs.
    #[error(
        "the demo needs the native broker, which cannot run here: {0}\n\
         Run it as root (sudo), or as a user holding CAP_SYS_ADMIN, CAP_SYS_PTRACE, CAP_SETUID, CAP_SETGID, CAP_SETPCAP and CAP_KILL, or with unprivileged user namespaces enabled, on Linux 5.14 or later with seccomp user notification and Landlock."
    )]
    Broker(String),
    /// The demo directory holds something else.
    #[error("{0}: exists and is not a flowhost demo directory; choose another --dir")]
    NotADemoDir(PathBuf),
    /// A step failed to run.
    #[error("{step}: {reason}")]
    Step {
        /// Which step.
        step: &'static str,
        /// What failed.
        reason: String,
    },
}

impl From<std::io::Error> for DemoError {
    fn from(e: std::io::Error) -> Self {
        DemoError::Step {
            step: "talking to the host",
            reason: e.to_string(),
        }
    }
}

fn step<E: std::fmt::Display>(step: &'static str) -> impl Fn(E) -> DemoError {
    move |e| DemoError::Step {
        step,
        reason: e.to_string(),
    }
}

const MARKER: &str = ".flowhost-demo";
const SERVERS: [(&str, &str); 3] = [
    (
        "workspace",
        include_str!("../../fixtures/pricing-lab/workspace.manifest.json"),
    ),
    (
        "team-inbox",
        include_str!("../../fixtures/pricing-lab/team-inbox.manifest.json"),
    ),
    (
        "public-inbox",
        include_str!("../../fixtures/pricing-lab/public-inbox.manifest.json"),
    ),
];
const TERMS: (&str, &str) = (
    "harbor-goods-terms.md",
    include_str!("../../fixtures/pricing-lab/documents/harbor-goods-terms.md"),
);

/// The lab's relay, started for the demo.
fn relay() -> Result<Relay, DemoError> {
    Relay::start().map_err(step("starting a relay"))
}

/// The lab's client, connected for the demo.
fn connect(socket: &Path) -> Result<Client, DemoError> {
    Client::connect(socket).map_err(step("connecting to the host"))
}

fn text(r: &Value) -> Option<&str> {
    r.get("result")?
        .get("content")?
        .get(0)?
        .get("text")?
        .as_str()
}

/// A directory executors (another uid, with a private /tmp) can read and execute from:
/// made afresh under `/var/tmp` with a random name (as `mkdtemp` does), so nothing another
/// user prepared there (a directory of the expected name holding links to files the demo,
/// often run as root, would then overwrite) is ever used.
fn shared_dir() -> Result<PathBuf, DemoError> {
    shared_dir_in(Path::new("/var/tmp"))
}

fn shared_dir_in(parent: &Path) -> Result<PathBuf, DemoError> {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::Builder::new()
        .prefix("flowhost-demo-")
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir_in(parent)
        .map_err(step("preparing the executors' directory"))?
        .keep();
    // Opened up only once it is ours and empty: others may read it, never write it.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
        .map_err(step("preparing the executors' directory"))?;
    Ok(dir)
}

fn prepare_dir(dir: &Path) -> Result<(), DemoError> {
    if dir.exists() {
        let empty = std::fs::read_dir(dir)
            .map(|mut d| d.next().is_none())
            .unwrap_or(false);
        if !empty && !dir.join(MARKER).exists() {
            return Err(DemoError::NotADemoDir(dir.to_path_buf()));
        }
        std::fs::remove_dir_all(dir).map_err(step("clearing the previous demo"))?;
    }
    // Not writable by group or others whatever the umask: the host refuses a socket
    // directory others could change.
    std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o755)
        .create(dir)
        .map_err(step("creating the demo directory"))?;
    std::fs::write(
        dir.join(MARKER),
        "flowhost demo directory; `flowhost demo` may delete it\n",
    )
    .map_err(step("creating the demo directory"))
}

/// Prints one line of the demo's report. A stdout that refuses it (a closed pipe, a terminal
/// that hung up) ends the demo with an error, never a panic.
fn say(args: std::fmt::Arguments<'_>) -> Result<(), DemoError> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_fmt(args)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush())
        .map_err(step("cannot write the result to standard output"))
}

/// One expected outcome, printed with its verdict.
struct Outcomes {
    failed: Vec<String>,
}

impl Outcomes {
    fn check(
        &mut self,
        label: &str,
        ok: bool,
        line: String,
        detail: impl FnOnce() -> String,
    ) -> Result<(), DemoError> {
        if ok {
            say(format_args!("{label:<8} {line}"))
        } else {
            say(format_args!(
                "{label:<8} {line}\n         UNEXPECTED: {}",
                detail()
            ))?;
            self.failed.push(line);
            Ok(())
        }
    }
}

/// A grant for one reviewed summary: this session, the call's source label, these arguments, the
/// public inbox, purpose `reviewed-summary`, target bottom, valid ten minutes.
fn sign_reviewed_summary(
    key: &ed25519_dalek::SigningKey,
    session: &Value,
    arguments: &Value,
) -> Result<crate::grant::SignedGrant, DemoError> {
    let field = |name: &str| session[name].as_str().unwrap_or_default().to_string();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let body = crate::grant::GrantBody {
        schema: crate::grant::GRANT_SCHEMA.into(),
        grant_id: format!("demo-review-{now}"),
        authority: "review-board".into(),
        principal: crate::ident::PrincipalId::new(field("principal"))
            .map_err(step("reading the session"))?,
        session: field("session"),
        server: "public-inbox".into(),
        tool: "publish".into(),
        purpose: crate::ident::DeclassificationPurpose::new("reviewed-summary")
            .map_err(step("making a grant"))?,
        // The demo's own arguments: small integers and strings only.
        arguments_hash: crate::grant::arguments_hash(arguments)
            .ok_or("an integer beyond ±2^53")
            .map_err(step("binding the grant to its arguments"))?,
        source_label_hash: field("source_label_hash"),
        target_label: crate::label::InformationLabel::bottom(),
        issued_at: now,
        expires_at: now + 600,
    };
    crate::grant::SignedGrant::sign(body, key).map_err(step("signing a grant"))
}

/// Runs the demo in `dir`. `Ok(true)` when every outcome was the expected one.
pub fn run(dir: &Path) -> Result<bool, DemoError> {
    let broker = flowhost_broker::Broker::new(flowhost_broker::BrokerOptions::default())
        .map_err(|e| DemoError::Broker(e.to_string()))?;
    let support = broker.support();
    drop(broker);
    prepare_dir(dir)?;
    let dir = std::fs::canonicalize(dir).map_err(step("resolving the demo directory"))?;
    say(format_args!(
        "flowhost demo: the pricing lab, end to end, on real processes"
    ))?;
    say(format_args!(
        "         broker: {} mode, Landlock ABI {}; workspace: {}",
        if support.privileged {
            "privileged (namespaces, executor uid)"
        } else {
            "user-namespace"
        },
        support.landlock_abi,
        dir.display()
    ))?;

    // Keys and signed manifests.
    let keys = dir.join("keys");
    let manifests = dir.join("manifests");
    std::fs::create_dir_all(&manifests).map_err(step("creating the manifests directory"))?;
    for (server, body) in SERVERS {
        let generated = crate::keys::generate(&keys, server).map_err(step("generating keys"))?;
        let signing = crate::keys::load_signing_key(&generated.private_path)
            .map_err(step("loading a key"))?;
        let mut body: Value =
            serde_json::from_str(body).map_err(step("reading a manifest body"))?;
        body["public_key"] = json!(crate::keys::public_key_to_hex(&generated.verifying_key));
        let signed = crate::manifest::SignedManifest::sign(body, &signing)
            .map_err(step("signing a manifest"))?;
        crate::files::write_atomic(
            &manifests.join(format!("{server}.signed.json")),
            signed.to_pretty_json().as_bytes(),
            0o644,
        )
        .map_err(step("writing a signed manifest"))?;
        say(format_args!(
            "SIGNED   {server}: {} (key {})",
            signed.digest(),
            generated.public_path.display()
        ))?;
    }

    // Executors run as another uid with a private /tmp: give them a copy of this program
    // (which embeds the example tools) and the documents somewhere they can reach.
    let shared = shared_dir()?;
    let cleanup = SharedDir(shared.clone());
    let exe = std::env::current_exe().map_err(step("locating this program"))?;
    let program = shared.join("flowhost");
    copy_executable(&exe, &program)?;
    let documents = shared.join("documents");
    std::fs::create_dir_all(&documents).map_err(step("writing the documents"))?;
    std::fs::write(documents.join(TERMS.0), TERMS.1).map_err(step("writing the documents"))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&documents, std::fs::Permissions::from_mode(0o755))
        .map_err(step("writing the documents"))?;
    std::fs::set_permissions(
        documents.join(TERMS.0),
        std::fs::Permissions::from_mode(0o644),
    )
    .map_err(step("writing the documents"))?;

    let (team, public, elsewhere) = (relay()?, relay()?, relay()?);
    let prog = program.display().to_string();
    let paths = LabPaths {
        workspace_command: vec![prog.clone(), "example-tool".into(), "workspace".into()],
        publisher_command: vec![prog, "example-tool".into(), "publisher".into()],
        documents: documents.clone(),
        manifests_dir: manifests.clone(),
        keys_dir: keys.clone(),
        state_dir: dir.join("state"),
        records_dir: dir.join("records"),
        socket: dir.join("flowhost.sock"),
        team_sink: team.addr,
        public_sink: public.addr,
        exfil_sink: elsewhere.addr,
        analyst_uid: nix::unistd::geteuid().as_raw(),
        reviewer_uid: 65533,
        socket_mode: "600".into(),
    };
    // The review board: the declassification authority the operator trusts.
    let board = crate::keys::generate(&keys, "review-board").map_err(step("generating keys"))?;
    let board_key =
        crate::keys::load_signing_key(&board.private_path).map_err(step("loading a key"))?;
    let config = dir.join("host.toml");
    let config_text = format!(
        "{}\n[[declassification_authority]]\nid = \"review-board\"\nkey = \"{}\"\n",
        host_config(&paths),
        board.public_path.display()
    );
    crate::files::write_atomic(&config, config_text.as_bytes(), 0o600)
        .map_err(step("writing the host configuration"))?;
    let declared = dir.join("declared.json");
    crate::files::write_atomic(&declared, declared_surface(&paths).as_bytes(), 0o644)
        .map_err(step("writing the declared surface"))?;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(step("starting the runtime"))?;
    let (host, listener) = runtime
        .block_on(Host::start(&config, None))
        .map_err(step("starting the host"))?;
    let serving = runtime.spawn(run_host(host.clone(), listener));

    let mut outcomes = Outcomes { failed: Vec::new() };
    // Every step, its printing included, inside: the host is shut down in order whatever
    // ends it.
    let workflow = (|| -> Result<(), DemoError> {
        say(format_args!(
            "STARTED  host: 5 tools from 3 signed servers; relays: team {}, public {}, elsewhere {}",
            team.addr, public.addr, elsewhere.addr
        ))?;
        let mut c = connect(&paths.socket)?;
        let init = c.request("initialize", json!({"protocolVersion": crate::mcp::PROTOCOL_VERSION, "capabilities": {}, "clientInfo": {"name": "flowhost-demo", "version": env!("CARGO_PKG_VERSION")}}))?;
        if init.get("result").is_none() {
            return Err(DemoError::Step {
                step: "initialize",
                reason: init.to_string(),
            });
        }

        let r = c.call("workspace/read_terms", json!({"document": TERMS.0}))?;
        let terms = text(&r).unwrap_or_default().to_string();
        outcomes.check(
            "READ",
            terms.contains("Harbor Goods"),
            format!("workspace/read_terms: {} bytes of Harbor Goods terms; the session now carries larkfield-pricing / harbor-goods-terms", terms.len()),
            || r.to_string(),
        )?;

        let message = "Harbor Goods: floor 4.10 EUR, rebate 6.5% (for the pricing team)";
        let r = c.call(
            "team-inbox/publish",
            json!({"message": message, "sink": team.addr.to_string()}),
        )?;
        let got = team.await_bytes(message.len());
        outcomes.check(
            "ALLOW",
            text(&r).is_some_and(|t| t.starts_with("delivered")) && got == message.as_bytes(),
            format!("team-inbox/publish: cleared for the contract label; the team relay received {} bytes: {:?}", got.len(), String::from_utf8_lossy(&got)),
            || r.to_string(),
        )?;

        let r = c.call(
            "public-inbox/publish",
            json!({"message": "Pricing update", "sink": public.addr.to_string()}),
        )?;
        let denial = r["error"]["data"]["denial"].as_str().unwrap_or("");
        std::thread::sleep(Duration::from_millis(100));
        outcomes.check(
            "REFUSE",
            denial == "flow_violation" && public.connections() == 0,
            "public-inbox/publish: flow violation before dispatch (the session's contract label does not flow to a public clearance); the public relay received nothing".into(),
            || format!("{r} (public relay connections: {})", public.connections()),
        )?;

        // A step the workflow needs: the review board declassifies one reviewed summary for
        // the public inbox, bound to this session, the call's source label and these exact
        // arguments.
        let summary_args = json!({"message": "Reviewed summary: supply terms renegotiated this quarter.", "sink": public.addr.to_string()});
        let session = c.request(
            "flowhost/session",
            json!({"name": "public-inbox/publish", "arguments": summary_args}),
        )?;
        let grant = sign_reviewed_summary(&board_key, &session["result"], &summary_args)?;
        let id = grant.body().grant_id.clone();
        let with_grant = json!({"name": "public-inbox/publish", "arguments": summary_args,
                                "_meta": {"flowhost/grant": grant.to_value()}});
        let r = c.request("tools/call", with_grant.clone())?;
        let got = public.await_bytes(57);
        outcomes.check(
            "GRANT",
            text(&r).is_some_and(|t| t.starts_with("delivered")) && public.connections() == 1,
            format!("public-inbox/publish with grant {id} (purpose reviewed-summary, signed by review-board): declassified for this one call; the public relay received {} bytes: {:?}", got.len(), String::from_utf8_lossy(&got)),
            || r.to_string(),
        )?;
        let r = c.request("tools/call", with_grant)?;
        let denial = r["error"]["data"]["denial"].as_str().unwrap_or("");
        std::thread::sleep(Duration::from_millis(100));
        outcomes.check(
            "REFUSE",
            denial == "grant_replayed" && public.connections() == 1,
            "public-inbox/publish with the same grant again: a replay (single use, durable); the public relay received nothing more; the session still carries the contract label".into(),
            || r.to_string(),
        )?;

        let r = c.call(
            "workspace/summarize_terms",
            json!({"text": terms, "max_words": 12}),
        )?;
        std::thread::sleep(Duration::from_millis(100));
        let summary = text(&r).unwrap_or_default().to_string();
        outcomes.check(
            "OUTPUT",
            !summary.is_empty() && r["result"]["isError"] != json!(true),
            format!(
                "workspace/summarize_terms answered {:?} (it hides what it tried)",
                summary
            ),
            || r.to_string(),
        )?;
        Ok(())
    })();

    host.begin_shutdown();
    let stopped = runtime.block_on(async {
        matches!(
            tokio::time::timeout(Duration::from_secs(30), serving).await,
            Ok(Ok(crate::daemon::Served::Clean))
        )
    });
    drop(runtime);
    workflow?;
    // A stop that failed (the records not closed, the state not bound, the health not
    // written) leaves a run its evidence does not vouch for: as `flowhost serve` would
    // exit 1, the demo does not call it as expected.
    outcomes.check(
        "STOP",
        stopped,
        "the host stopped cleanly: records closed, flow state bound to them, health written".into(),
        || "the stop did not complete (the lines above say what failed)".into(),
    )?;

    // What the broker saw of the sneaky tool, from the records.
    let report = crate::records::chain::verify_records(&paths.records_dir, None)
        .map_err(step("verifying the records"))?;
    let records = read_records(&paths.records_dir)?;
    let sneaky = records
        .iter()
        .find(|r| r["flowhost"]["event"] == "egress_attempt" && r["server"]["id"] == "workspace");
    outcomes.check(
        "REFUSE",
        sneaky.is_some_and(|r| r["decision"]["effect"] == "deny" && r["flowhost"]["denial_kind"] == "missing_clearance")
            && elsewhere.connections() == 0,
        format!(
            "workspace/summarize_terms declared no egress but connected to {}: refused at the syscall (missing clearance); nothing left the sandbox",
            elsewhere.addr
        ),
        || format!("record: {sneaky:?}; relay connections: {}", elsewhere.connections()),
    )?;
    let head = report
        .head_hash
        .as_ref()
        .map(|h| h.as_str().to_string())
        .unwrap_or_default();
    outcomes.check(
        "RECORDS",
        report.is_ok() && report.records as usize == records.len(),
        format!(
            "{} decisions in {}, hash chain verified (seq {}..{}, head {})",
            report.records,
            paths.records_dir.display(),
            report.first_seq.unwrap_or(0),
            report.last_seq.unwrap_or(0),
            head.get(..23).unwrap_or(&head)
        ),
        || {
            report
                .problems
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join("; ")
        },
    )?;
    let health_file = paths.state_dir.join("health.json");
    let health = crate::records::ToolObservationHealth::read_from(&health_file)
        .map_err(step("reading the health file"))?;
    outcomes.check(
        "HEALTH",
        health.complete,
        format!(
            "{}: observation complete (broker supervised every executor it spawned)",
            health_file.display()
        ),
        || health.incomplete_reasons.join("; "),
    )?;

    let surface = crate::diff::surface::DeclaredSurface::parse(
        &std::fs::read_to_string(&declared).map_err(step("reading the declared surface"))?,
    )
    .map_err(step("reading the declared surface"))?;
    let diff = crate::diff::diff(&surface, &paths.records_dir, Some(&health))
        .map_err(step("running the diff"))?;
    let mut kinds: Vec<(String, String)> = diff
        .findings
        .iter()
        .map(|f| (f.kind.to_string(), f.tool.clone().unwrap_or_default()))
        .collect();
    kinds.sort();
    let expected = vec![
        (
            "attempted_privileged_tool_action_denied".to_string(),
            "public-inbox/publish".to_string(),
        ),
        (
            "attempted_privileged_tool_action_denied".to_string(),
            "workspace/summarize_terms".to_string(),
        ),
        (
            "unclassified_tool_action".to_string(),
            "workspace/summarize_terms".to_string(),
        ),
        (
            "undeclared_egress".to_string(),
            "workspace/summarize_terms".to_string(),
        ),
    ];
    outcomes.check(
        "DIFF",
        kinds == expected && diff.observation_complete,
        format!(
            "against {}: {} findings over {} decisions (the declared read, team publish, team egress and granted public publish give none):",
            declared.display(),
            diff.findings.len(),
            diff.observed_decisions
        ),
        || format!("{kinds:?}"),
    )?;
    for line in crate::diff::report::to_text(&diff).lines() {
        say(format_args!("           {line}"))?;
    }
    drop(cleanup);

    // The retained signed set, also where the README's inspection command looks for it
    // (`jq ... .research/signed-manifests.json`).
    let retained = std::fs::read(paths.state_dir.join("signed-manifests.json"))
        .map_err(step("reading the retained signed set"))?;
    let published = dir.join("signed-manifests.json");
    crate::files::write_atomic(&published, &retained, 0o644)
        .map_err(step("publishing the retained signed set"))?;

    if outcomes.failed.is_empty() {
        say(format_args!(
            "flowhost demo: every outcome was the expected one."
        ))?;
        say(format_args!(
            "         The host kept the envelopes it registered: jq '[.[] | .manifest | {{server_id, tools: [.tools[] | {{name, flow}}]}}]' {}",
            published.display()
        ))?;
        Ok(true)
    } else {
        say(format_args!(
            "flowhost demo: {} outcome(s) were not the expected ones.",
            outcomes.failed.len()
        ))?;
        Ok(false)
    }
}

fn copy_executable(src: &Path, dst: &Path) -> Result<(), DemoError> {
    // cp in a child process: this process never holds the file open for writing, so no
    // executor cloned meanwhile can inherit a write descriptor (which would make exec fail
    // with ETXTBSY).
    let status = std::process::Command::new("cp")
        .arg("--")
        .arg(src)
        .arg(dst)
        .status()
        .map_err(step("copying the executor program"))?;
    if !status.success() {
        return Err(DemoError::Step {
            step: "copying the executor program",
            reason: format!("cp exited with {status}"),
        });
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dst, std::fs::Permissions::from_mode(0o755))
        .map_err(step("copying the executor program"))
}

fn read_records(dir: &Path) -> Result<Vec<Value>, DemoError> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(step("reading the records"))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).map_err(step("reading the records"))?;
        for line in text.lines() {
            out.push(serde_json::from_str(line).map_err(step("reading the records"))?);
        }
    }
    Ok(out)
}

/// Removes the executors' directory when the demo ends.
struct SharedDir(PathBuf);

impl Drop for SharedDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    #[test]
    fn the_shared_directory_is_always_a_fresh_one() {
        let parent = tempfile::tempdir().unwrap();
        // What another user could prepare: a directory of a predictable name with a link
        // where the demo writes its documents.
        let victim = parent.path().join("victim");
        std::fs::write(&victim, "untouched").unwrap();
        let planted = parent
            .path()
            .join(format!("flowhost-demo-{}", std::process::id()));
        std::fs::create_dir_all(planted.join("documents")).unwrap();
        std::os::unix::fs::symlink(&victim, planted.join("documents").join(TERMS.0)).unwrap();
        let a = shared_dir_in(parent.path()).unwrap();
        let b = shared_dir_in(parent.path()).unwrap();
        assert_ne!(a, b);
        for dir in [&a, &b] {
            assert_ne!(dir, &planted);
            let meta = std::fs::symlink_metadata(dir).unwrap();
            assert!(meta.is_dir());
            assert_eq!(meta.permissions().mode() & 0o7777, 0o755);
            assert_eq!(meta.uid(), nix::unistd::geteuid().as_raw());
            assert_eq!(std::fs::read_dir(dir).unwrap().count(), 0);
        }
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "untouched");
    }
}
