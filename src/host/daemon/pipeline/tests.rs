//! The call pipeline's decisions, without sockets, root or real executors: the pricing lab's
//! signed manifests and configuration, a real flow-state database and a real record writer in
//! a temporary directory, and a scripted executor.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use super::*;
use crate::config::HostConfig;
use crate::lab::{LabPaths, host_config};
use crate::records::WriterOptions;
use crate::resolver::{Classifier, FlowResolver};
use crate::state::FlowStateStore;

const ANALYST: u32 = 4001;
const REVIEWER: u32 = 4002;

/// The SQLite store whose raises can be made to fail from the test (as a PostgreSQL store's
/// do while its server is unreachable): every other operation goes on working.
#[derive(Debug)]
struct Breakable {
    inner: crate::state::SqliteStore,
    broken: Arc<std::sync::atomic::AtomicBool>,
}

impl crate::state::StateBackend for Breakable {
    fn get<'a>(
        &'a self,
        key: &'a crate::state::SessionKey,
    ) -> crate::state::StateFuture<'a, crate::state::FlowState> {
        crate::state::StateBackend::get(&self.inner, key)
    }
    fn raise<'a>(
        &'a self,
        key: &'a crate::state::SessionKey,
        principal: &'a crate::label::InformationLabel,
        session: &'a crate::label::InformationLabel,
    ) -> crate::state::StateFuture<'a, crate::state::FlowState> {
        if self.broken.load(std::sync::atomic::Ordering::SeqCst) {
            return Box::pin(std::future::ready(Err(crate::state::StateError::Failed(
                "broken by the test".into(),
            ))));
        }
        crate::state::StateBackend::raise(&self.inner, key, principal, session)
    }
    fn forget_session<'a>(
        &'a self,
        key: &'a crate::state::SessionKey,
    ) -> crate::state::StateFuture<'a, ()> {
        crate::state::StateBackend::forget_session(&self.inner, key)
    }
    fn consume_grant<'a>(&'a self, id: &'a str, now: u64) -> crate::state::StateFuture<'a, bool> {
        crate::state::StateBackend::consume_grant(&self.inner, id, now)
    }
    fn snapshot(&self) -> crate::state::StateFuture<'_, crate::state::StateSnapshot> {
        crate::state::StateBackend::snapshot(&self.inner)
    }
    fn checkpoint(&self) -> crate::state::StateFuture<'_, Option<(u64, String)>> {
        crate::state::StateBackend::checkpoint(&self.inner)
    }
    fn set_checkpoint<'a>(&'a self, seq: u64, hash: &'a str) -> crate::state::StateFuture<'a, ()> {
        crate::state::StateBackend::set_checkpoint(&self.inner, seq, hash)
    }
    fn failure(&self) -> Option<String> {
        crate::state::StateBackend::failure(&self.inner)
    }
    fn describe(&self) -> String {
        crate::state::StateBackend::describe(&self.inner)
    }
}

/// The host side of one test: configuration, registry, state and records on disk.
struct Host {
    /// Set: every raise of the flow state fails.
    broken: Arc<std::sync::atomic::AtomicBool>,
    dir: tempfile::TempDir,
    config: HostConfig,
    registry: VerifiedRegistry,
    servers: BTreeMap<String, ServerFacts>,
    resolver: FlowResolver,
    records: RecordWriter,
    counters: HostCounters,
    refusals: RefusalFolder,
}

fn lab() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/pricing-lab")
}

impl Host {
    fn new() -> Host {
        Host::with_config(|text| text)
    }

    /// The lab with the conformance server (its resources and prompts under the content
    /// floor `conformance-data`), which the analyst may use.
    fn with_content() -> Host {
        Host::with_config(|text| {
            let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
            format!(
                "{}{}",
                text.replacen(
                    "tools = [\"workspace/*\", ",
                    "tools = [\"conformance/*\", \"workspace/*\", ",
                    1
                ),
                crate::lab::conformance_server(repo, "/bin/true")
            )
        })
    }

    fn with_config(edit: impl FnOnce(String) -> String) -> Host {
        let dir = tempfile::tempdir().unwrap();
        let paths = LabPaths {
            workspace_command: vec!["/bin/true".into()],
            publisher_command: vec!["/bin/true".into()],
            documents: lab().join("documents"),
            manifests_dir: lab(),
            keys_dir: lab().join("keys"),
            state_dir: dir.path().join("state"),
            records_dir: dir.path().join("records"),
            socket: dir.path().join("s.sock"),
            team_sink: "127.0.0.1:1001".parse().unwrap(),
            public_sink: "127.0.0.1:1002".parse().unwrap(),
            exfil_sink: "127.0.0.1:1003".parse().unwrap(),
            analyst_uid: ANALYST,
            reviewer_uid: REVIEWER,
            socket_mode: "600".into(),
        };
        let file = dir.path().join("host.toml");
        std::fs::write(&file, edit(host_config(&paths))).unwrap();
        let config = HostConfig::load(&file).unwrap();
        let (registry, _) = crate::daemon::verify_registry(&config).unwrap();
        let servers = config
            .servers
            .iter()
            .map(|s| {
                let digest = registry
                    .servers()
                    .find(|a| a.server_id() == s.id)
                    .unwrap()
                    .manifest_digest()
                    .to_string();
                (
                    s.id.clone(),
                    ServerFacts {
                        digest,
                        mappings: s.record_mappings.clone(),
                    },
                )
            })
            .collect();
        std::fs::create_dir_all(dir.path().join("state")).unwrap();
        let broken = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let state = FlowStateStore::with_backend(Box::new(Breakable {
            inner: crate::state::SqliteStore::open(&dir.path().join("state/state.db")).unwrap(),
            broken: broken.clone(),
        }));
        let resolver = FlowResolver::new(
            Classifier::new(config.classifiers.clone()),
            config.operator_input_floor.clone(),
            Arc::new(state),
            &config.authorities,
        );
        let records =
            RecordWriter::open(&dir.path().join("records"), WriterOptions::default()).unwrap();
        Host {
            broken,
            dir,
            config,
            registry,
            servers,
            resolver,
            records,
            counters: HostCounters::default(),
            refusals: RefusalFolder::new(std::time::Duration::from_secs(3600), 100),
        }
    }

    fn env(&self) -> CallEnv<'_> {
        CallEnv {
            config: &self.config,
            registry: &self.registry,
            servers: &self.servers,
            resolver: &self.resolver,
            recorder: Recorder {
                records: &self.records,
                counters: &self.counters,
                refusals: &self.refusals,
            },
        }
    }

    fn principal(&self, uid: u32) -> PrincipalConfig {
        self.config.principal_for(uid, 0).unwrap().clone()
    }

    /// `uid`'s principal in session `session-1`.
    fn caller<'p>(&self, uid: u32, pinned: &'p crate::ident::PrincipalId) -> Caller<'p> {
        Caller {
            session: "session-1",
            peer: Some(PeerIdentity { uid, gid: 0 }),
            principal: Ok(self.principal(uid)),
            pinned: Some(pinned),
        }
    }

    async fn call<D: Dispatch>(
        &self,
        uid: u32,
        params: Value,
        exec: &mut D,
    ) -> Result<Value, RpcError> {
        let pinned = self.principal(uid).id;
        tools_call(&self.env(), self.caller(uid, &pinned), &params, exec).await
    }

    /// Every record so far (the writer is closed first).
    async fn records(&self) -> Vec<Value> {
        self.records.close().await.unwrap();
        let mut out = Vec::new();
        for f in crate::records::store::record_sources(&self.dir.path().join("records")).unwrap() {
            for line in std::fs::read_to_string(f).unwrap().lines() {
                out.push(serde_json::from_str(line).unwrap());
            }
        }
        out
    }
}

/// An executor that answers from a script and remembers what it was asked.
#[derive(Default)]
struct Scripted {
    answers: VecDeque<Result<Value, DispatchError>>,
    asked: Vec<(String, String, Value)>,
}

impl Scripted {
    fn answering(answers: Vec<Result<Value, DispatchError>>) -> Scripted {
        Scripted {
            answers: answers.into(),
            asked: Vec::new(),
        }
    }
}

impl Dispatch for Scripted {
    async fn dispatch(
        &mut self,
        server: &str,
        tool: &str,
        arguments: Value,
        _call: CallInFlight,
        _gate: &RelayGate<'_>,
    ) -> Result<Value, DispatchError> {
        self.asked
            .push((server.to_string(), tool.to_string(), arguments));
        self.answers
            .pop_front()
            .unwrap_or(Err(DispatchError::Failed("no scripted answer".into())))
    }
}

/// An executor that, as it answers, makes the records' next sync 1.5 s slower (long enough
/// that a test reads the writer's status before it ends, on a busy machine too).
struct HoldingTheNextSync<'w> {
    records: &'w RecordWriter,
    inner: Scripted,
}

impl Dispatch for HoldingTheNextSync<'_> {
    async fn dispatch(
        &mut self,
        server: &str,
        tool: &str,
        arguments: Value,
        call: CallInFlight,
        gate: &RelayGate<'_>,
    ) -> Result<Value, DispatchError> {
        self.records.slow_next_sync(Duration::from_millis(1500));
        self.inner
            .dispatch(server, tool, arguments, call, gate)
            .await
    }
}

/// An executor that answers once and keeps what the pipeline said when the call was
/// settled; it may break the flow state while it answers.
struct Settling {
    answer: Option<Result<Value, DispatchError>>,
    break_state: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// Closed while the call runs: its outcome record then fails.
    close_records: Option<RecordWriter>,
    settled: Vec<bool>,
}

impl Settling {
    /// One that answers `answer`, breaking nothing.
    fn answering(answer: Result<Value, DispatchError>) -> Self {
        Settling {
            answer: Some(answer),
            break_state: None,
            close_records: None,
            settled: Vec::new(),
        }
    }

    /// The analyst's call of `tool` with `arguments` through it, and what the pipeline said
    /// as the call settled.
    async fn call(
        mut self,
        host: &Host,
        tool: &str,
        arguments: Value,
    ) -> (Result<Value, RpcError>, Vec<bool>) {
        let r = host.call(ANALYST, call(tool, arguments), &mut self).await;
        (r, self.settled)
    }
}

impl Dispatch for Settling {
    async fn dispatch(
        &mut self,
        _server: &str,
        _tool: &str,
        _arguments: Value,
        _call: CallInFlight,
        _gate: &RelayGate<'_>,
    ) -> Result<Value, DispatchError> {
        if let Some(broken) = &self.break_state {
            broken.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        if let Some(records) = &self.close_records {
            records.close().await.unwrap();
        }
        self.answer
            .take()
            .unwrap_or(Err(DispatchError::Failed("answered once".into())))
    }

    async fn settled(&mut self, durable: bool) {
        self.settled.push(durable);
    }
}

fn text(t: &str) -> Result<Value, DispatchError> {
    Ok(json!({"content": [{"type": "text", "text": t}]}))
}

/// What `workspace/read_terms` answers with `t` as the document `t.md`: text, and the
/// structured content its signed output schema declares.
fn terms(t: &str) -> Result<Value, DispatchError> {
    Ok(json!({
        "content": [{"type": "text", "text": t}],
        "structuredContent": {"document": "t.md", "text": t}
    }))
}

fn call(tool: &str, arguments: Value) -> Value {
    json!({"name": tool, "arguments": arguments})
}

/// The analyst's call of the public inbox (it egresses, cleared for public data only).
async fn publish_publicly<D: Dispatch>(host: &Host, exec: &mut D) -> Result<Value, RpcError> {
    host.call(
        ANALYST,
        call(
            "public-inbox/publish",
            json!({"message": "m", "sink": "127.0.0.1:1002"}),
        ),
        exec,
    )
    .await
}

fn denial_of(e: &RpcError) -> &str {
    e.data_denial().unwrap_or("")
}

const TERMS: &str = "Harbor Goods: floor 4.10 EUR";

#[tokio::test]
async fn access_is_checked_before_anything_runs() {
    let host = Host::new();
    let mut exec = Scripted::default();
    let e = host
        .call(
            REVIEWER,
            call("workspace/read_terms", json!({"document": "t.md"})),
            &mut exec,
        )
        .await
        .unwrap_err();
    assert_eq!(e.code, code::ACCESS_DENIED);
    assert_eq!(denial_of(&e), "access_denied");
    assert!(exec.asked.is_empty(), "nothing was dispatched");
    let records = host.records().await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0]["flowhost"]["denial_kind"], "access_denied");
}

#[tokio::test]
async fn arguments_failing_the_signed_schema_are_refused_and_recorded() {
    let host = Host::new();
    let mut exec = Scripted::default();
    // A tool execution error the model can act on, not a protocol error.
    let r = host
        .call(ANALYST, call("workspace/read_terms", json!({})), &mut exec)
        .await
        .unwrap();
    assert_eq!(r["isError"], true, "{r}");
    assert!(
        r["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("document"),
        "{r}"
    );
    assert!(exec.asked.is_empty());
    assert_eq!(
        host.records().await[0]["flowhost"]["denial_kind"],
        "schema_invalid"
    );
}

#[tokio::test]
async fn a_read_taints_the_session_and_the_public_sink_is_refused_before_dispatch() {
    let host = Host::new();
    let mut exec = Scripted::answering(vec![
        terms(TERMS),
        Ok(json!({
            "content": [{"type": "text", "text": "delivered 1 bytes"}],
            "structuredContent": {"accepted": true}
        })),
    ]);
    let r = host
        .call(
            ANALYST,
            call("workspace/read_terms", json!({"document": "t.md"})),
            &mut exec,
        )
        .await
        .unwrap();
    assert_eq!(r["content"][0]["text"], TERMS);
    let e = publish_publicly(&host, &mut exec).await.unwrap_err();
    assert_eq!(
        (e.code, denial_of(&e)),
        (code::FLOW_DENIED, "flow_violation")
    );
    // The team channel is cleared for the contract label.
    host.call(
        ANALYST,
        call(
            "team-inbox/publish",
            json!({"message": "m", "sink": "127.0.0.1:1001"}),
        ),
        &mut exec,
    )
    .await
    .unwrap();
    let asked: Vec<String> = exec
        .asked
        .iter()
        .map(|(s, t, _)| format!("{s}/{t}"))
        .collect();
    assert_eq!(asked, ["workspace/read_terms", "team-inbox/publish"]);
    let records = host.records().await;
    let events: Vec<(String, String)> = records
        .iter()
        .map(|r| {
            (
                r["flowhost"]["event"].as_str().unwrap().to_string(),
                r["decision"]["effect"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let e = |a: &str, b: &str| (a.to_string(), b.to_string());
    assert_eq!(
        events,
        [
            e("tool_call", "allow"),
            e("tool_outcome", "allow"),
            e("tool_call", "deny"),
            e("tool_call", "allow"),
            e("tool_outcome", "allow"),
        ]
    );
    // The outcome carries the label the read left behind.
    assert!(
        records[1]["flowhost"]["labels_after"]["principal"]
            .to_string()
            .contains("harbor-goods-terms")
    );
}

/// The `response.status` of each `tool_outcome` record so far, in order.
async fn outcome_statuses(host: &Host) -> Vec<String> {
    host.records()
        .await
        .iter()
        .filter(|r| r["flowhost"]["event"] == "tool_outcome")
        .map(|r| r["response"]["status"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn outcomes_say_what_became_of_an_allowed_call() {
    let host = Host::new();
    let mut exec = Scripted::answering(vec![
        Ok(json!({"content": [{"type": "text", "text": "no such document"}], "isError": true})),
        Err(DispatchError::Failed(
            "the executor exited during the call".into(),
        )),
        Err(DispatchError::NotStarted("spawn refused".into())),
    ]);
    let args = || call("workspace/read_terms", json!({"document": "t.md"}));
    let r = host.call(ANALYST, args(), &mut exec).await.unwrap();
    assert_eq!(r["isError"], true);
    let r = host.call(ANALYST, args(), &mut exec).await.unwrap();
    assert!(r["content"][0]["text"].as_str().unwrap().contains("exited"));
    let r = host.call(ANALYST, args(), &mut exec).await.unwrap();
    assert!(
        r["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("could not be started")
    );
    let statuses = outcome_statuses(&host).await;
    assert_eq!(
        statuses,
        ["tool_error", "executor_failed", "executor_failed"]
    );
}

/// A result that breaks the tool's signed output schema (none of the `structuredContent`
/// MCP requires of a tool declaring one, or content that does not match it) is withheld:
/// the client reads why, naming the schema's keyword and never the value, and the outcome
/// is recorded as `answer_withheld`. A tool error need not carry structured content.
/// Before, such a result went to the client as the executor gave it, under a schema the
/// host advertised as signed.
#[tokio::test]
async fn a_result_breaking_the_signed_output_schema_is_withheld() {
    let host = Host::new();
    let secret = "Harbor Goods pays 4.10";
    let said = |t: &str| vec![json!({"type": "text", "text": t})];
    let mut exec = Scripted::answering(vec![
        text(secret),
        Ok(json!({"content": said(secret), "structuredContent": {"accepted": secret}})),
        Ok(json!({"content": said("delivered 1 bytes"), "structuredContent": {"accepted": true}})),
        Ok(json!({"content": said("no sink address given"), "isError": true})),
    ]);
    let publish = || {
        call(
            "team-inbox/publish",
            json!({"message": "m", "sink": "127.0.0.1:1001"}),
        )
    };
    for fault in ["no structuredContent", "fails /properties/accepted/type"] {
        let r = host.call(ANALYST, publish(), &mut exec).await.unwrap();
        let text = r["content"][0]["text"].as_str().unwrap();
        assert!(
            r["isError"] == true
                && r.get("structuredContent").is_none()
                && text.contains("withheld")
                && text.contains("\"team-inbox\"")
                && text.contains(fault)
                && !text.contains("Harbor"),
            "{r}"
        );
    }
    let r = host.call(ANALYST, publish(), &mut exec).await.unwrap();
    assert_eq!(r["structuredContent"], json!({"accepted": true}), "{r}");
    let r = host.call(ANALYST, publish(), &mut exec).await.unwrap();
    assert_eq!(r["content"][0]["text"], "no sink address given", "{r}");
    assert_eq!(
        outcome_statuses(&host).await,
        [
            "answer_withheld",
            "answer_withheld",
            "success",
            "tool_error"
        ]
    );
}

/// A call or a content request whose executor a bound or its deadline ended is recorded as
/// `bound_reached`, which a test run's health counts as cut short. Before, a content
/// request's was a `tool_error`, and a test gate passed the run.
#[tokio::test]
async fn what_a_bound_ended_is_recorded_as_bound_reached() {
    let host = Host::with_content();
    let mut exec = Scripted::answering(vec![Err(DispatchError::BoundReached(
        "the call's deadline".into(),
    ))]);
    let args = call("workspace/read_terms", json!({"document": "t.md"}));
    host.call(ANALYST, args, &mut exec).await.unwrap();
    let mut feeding = Feeding::default();
    feeding
        .answers
        .push_back(Err(content::ForwardError::BoundReached(
            "the memory bound".into(),
        )));
    host.read(ANALYST, "test://static-text", &mut feeding)
        .await
        .unwrap_err();
    let statuses: Vec<(String, String)> = host
        .records()
        .await
        .iter()
        .filter(|r| r["decision"]["effect"] == "error")
        .map(|r| {
            (
                r["flowhost"]["event"].as_str().unwrap().to_string(),
                r["response"]["status"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        statuses,
        [
            ("tool_outcome".to_string(), "bound_reached".to_string()),
            ("content_outcome".to_string(), "bound_reached".to_string())
        ]
    );
}

/// An output whose classified text raises a label beyond what the call's authorization
/// record carried is answered only once the outcome record claiming the raise is durable:
/// the records alone must hold every label a client was answered under, since a state
/// rebuilt from them (`state.db` lost after a crash) must not come back lower. Before, the
/// outcome's sync was left to the next group, after the answer. A content read's floor and
/// finding are settled the same way.
#[tokio::test]
async fn an_outcome_that_raised_a_label_is_durable_before_the_answer() {
    let host = Host::with_content();
    let last_durable = || host.records.status().last_seq;
    // Read without closing the writer: a record written is in its file for any reader.
    let last_written = || async {
        let dir = host.dir.path().join("records");
        let mut last = None;
        for f in crate::records::store::record_sources(&dir).unwrap() {
            for line in std::fs::read_to_string(f).unwrap().lines() {
                let r: Value = serde_json::from_str(line).unwrap();
                last = r["flowhost"]["seq"].as_u64();
            }
        }
        last
    };
    // What an error answer carries is classified as a result would be. The sync after the
    // executor answers is held back: an outcome not waited for is then still not durable
    // when the call returns, whatever the machine's speed.
    let answer = || {
        Err(DispatchError::Answered(
            RpcError::new(-32602, "bad folder").with_data(json!({"read": TERMS})),
        ))
    };
    let mut exec = HoldingTheNextSync {
        records: &host.records,
        inner: Scripted::answering(vec![answer(), answer()]),
    };
    let list = || call("workspace/list_documents", json!({}));
    host.call(ANALYST, list(), &mut exec).await.unwrap_err();
    let durable = last_durable();
    let written = last_written().await;
    assert!(
        written.is_some() && durable == written,
        "{durable:?} {written:?}"
    );
    // The same again raises nothing: its outcome is not waited for (a steady call pays one
    // sync, its authorization's).
    host.call(ANALYST, list(), &mut exec).await.unwrap_err();
    let durable = last_durable();
    let written = last_written().await;
    assert!(durable < written, "{durable:?} {written:?}");
    let mut exec = Feeding::default();
    exec.answers.push_back(Ok(json!({"contents": [
        {"uri": "test://template/7/data", "text": "plain"}]})));
    host.read(ANALYST, "test://template/7/data", &mut exec)
        .await
        .unwrap();
    let durable = last_durable();
    let written = last_written().await;
    assert!(
        written.is_some() && durable == written,
        "{durable:?} {written:?}"
    );
}

#[tokio::test]
async fn a_tool_answering_with_an_error_passes_it_on_labelled_like_its_output() {
    let host = Host::new();
    let mut exec = Scripted::answering(vec![Err(DispatchError::Answered(
        RpcError::new(-32602, "bad folder").with_data(json!({"read": TERMS})),
    ))]);
    let e = host
        .call(
            ANALYST,
            call("workspace/list_documents", json!({})),
            &mut exec,
        )
        .await
        .unwrap_err();
    assert_eq!(e.code, -32602, "{e:?}");
    assert_eq!(e.message, "bad folder");
    assert_eq!(e.data, Some(json!({"read": TERMS})));
    // What the error carries raised the session's label as a result would have (the
    // classifier's label for the terms: this tool declares none of its own).
    assert!(
        serde_json::to_value(host.session_label(ANALYST).await)
            .unwrap()
            .to_string()
            .contains("harbor-goods-terms")
    );
    let statuses = outcome_statuses(&host).await;
    assert_eq!(statuses, ["tool_error"]);
}

#[tokio::test]
async fn unknown_and_malformed_calls_are_refused_and_recorded() {
    let host = Host::new();
    let mut exec = Scripted::default();
    let e = host
        .call(ANALYST, call("nowhere/nothing", json!({})), &mut exec)
        .await
        .unwrap_err();
    assert_eq!(denial_of(&e), "unknown_tool");
    let e = host
        .call(
            ANALYST,
            json!({"name": "workspace/read_terms", "arguments": 7}),
            &mut exec,
        )
        .await
        .unwrap_err();
    assert_eq!(denial_of(&e), "invalid_params");
    let e = host
        .call(ANALYST, json!({"arguments": {}}), &mut exec)
        .await
        .unwrap_err();
    assert_eq!(denial_of(&e), "invalid_params");
    assert!(exec.asked.is_empty());
    let kinds: Vec<(String, String)> = host
        .records()
        .await
        .iter()
        .map(|r| {
            (
                r["flowhost"]["event"].as_str().unwrap().to_string(),
                r["flowhost"]["denial_kind"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let k = |a: &str, b: &str| (a.to_string(), b.to_string());
    assert_eq!(
        kinds,
        [
            k("tool_call", "unknown_tool"),
            k("tool_call", "invalid_params"),
            k("session", "invalid_params"),
        ]
    );
}

#[tokio::test]
async fn a_record_that_cannot_be_written_refuses_before_any_effect() {
    let host = Host::new();
    host.records.close().await.unwrap();
    let mut exec = Scripted::answering(vec![terms(TERMS)]);
    let e = host
        .call(
            ANALYST,
            call("workspace/read_terms", json!({"document": "t.md"})),
            &mut exec,
        )
        .await
        .unwrap_err();
    assert_eq!(
        (e.code, denial_of(&e)),
        (code::INTERNAL_ERROR, "record_failure")
    );
    assert!(exec.asked.is_empty(), "the executor never saw the call");
}

#[tokio::test]
async fn a_session_whose_principal_check_fails_is_refused_and_recorded_under_its_principal() {
    let host = Host::new();
    let mut exec = Scripted::default();
    let pinned = crate::ident::PrincipalId::new("oss-reviewer").unwrap();
    let caller = Caller {
        session: "session-2",
        peer: Some(PeerIdentity {
            uid: ANALYST,
            gid: 0,
        }),
        principal: Err(refusal(
            code::ACCESS_DENIED,
            "remapped",
            Denial::AccessDenied,
        )),
        pinned: Some(&pinned),
    };
    let e = tools_call(
        &host.env(),
        caller,
        &call("workspace/list_documents", json!({})),
        &mut exec,
    )
    .await
    .unwrap_err();
    assert_eq!(denial_of(&e), "access_denied");
    let records = host.records().await;
    assert_eq!(records[0]["flowhost"]["principal"], "oss-reviewer");
    assert!(exec.asked.is_empty());
}

/// A scripted executor for content requests.
#[derive(Default)]
struct Feeding {
    answers: VecDeque<Result<Value, content::ForwardError>>,
    asked: Vec<(String, String, Value)>,
    /// Where the records are written: when set, how many lines they held as each request
    /// was settled (the executor then serves again, and what it held for the client goes
    /// out) is kept in `lines_when_settled`.
    records: Option<std::path::PathBuf>,
    lines_when_settled: Vec<usize>,
}

/// How many record lines the files of `dir` hold.
fn record_lines(dir: &Path) -> usize {
    crate::records::store::record_sources(dir)
        .unwrap()
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap().lines().count())
        .sum()
}

impl content::Forward for Feeding {
    async fn forward(
        &mut self,
        server: &str,
        _name: &str,
        method: &str,
        params: Value,
        _source: &crate::label::InformationLabel,
    ) -> Result<Value, content::ForwardError> {
        self.asked
            .push((server.to_string(), method.to_string(), params));
        self.answers
            .pop_front()
            .unwrap_or(Err(content::ForwardError::Failed(
                "no scripted answer".into(),
            )))
    }

    async fn settled(&mut self, _durable: bool) {
        if let Some(dir) = &self.records {
            self.lines_when_settled.push(record_lines(dir));
        }
    }
}

impl Host {
    async fn content(
        &self,
        uid: u32,
        method: &str,
        params: Value,
        exec: &mut Feeding,
    ) -> Result<Value, RpcError> {
        let pinned = self.principal(uid).id;
        let method = content::ContentMethod::from_method(method).unwrap();
        content::content_request(
            &self.env(),
            self.caller(uid, &pinned),
            method,
            &params,
            exec,
        )
        .await
    }

    async fn read(&self, uid: u32, uri: &str, exec: &mut Feeding) -> Result<Value, RpcError> {
        self.content(uid, "resources/read", json!({ "uri": uri }), exec)
            .await
    }

    async fn session_label(&self, uid: u32) -> crate::label::InformationLabel {
        let key = crate::state::SessionKey {
            principal: self.principal(uid).id,
            session: "session-1".into(),
        };
        self.resolver.state().get(&key).await.unwrap().combined()
    }
}

/// The executor that served a read serves again, and the resource updates it held go to the
/// client, only once the read's outcome (with the label it raised) is recorded: were the
/// record to fail, the client would have had messages under a label no record holds.
#[tokio::test]
async fn a_read_is_recorded_before_its_executor_is_released() {
    let host = Host::with_content();
    let records = host.dir.path().join("records");
    let mut exec = Feeding {
        records: Some(records.clone()),
        ..Feeding::default()
    };
    exec.answers.push_back(Ok(json!({"contents": [
        {"uri": "test://template/7/data", "text": TERMS}]})));
    host.read(ANALYST, "test://template/7/data", &mut exec)
        .await
        .unwrap();
    let all = host.records().await;
    assert_eq!(all.last().unwrap()["flowhost"]["event"], "content_outcome");
    assert_eq!(exec.lines_when_settled, [all.len()], "{all:#?}");
}

#[tokio::test]
async fn content_carries_floor_and_classified_label_into_the_session_before_it_is_returned() {
    let host = Host::with_content();
    let mut exec = Feeding::default();
    exec.answers.push_back(Ok(json!({"contents": [
        {"uri": "test://template/7/data", "text": TERMS}]})));
    let r = host
        .read(ANALYST, "test://template/7/data", &mut exec)
        .await
        .unwrap();
    assert_eq!(r["contents"][0]["text"], TERMS);
    assert_eq!(exec.asked[0].0, "conformance");
    let label = serde_json::to_value(host.session_label(ANALYST).await).unwrap();
    // The content floor, and the classifier's contract label for what the text says.
    assert_eq!(
        label["compartments"],
        json!(["conformance-data", "harbor-goods-terms"]),
        "{label}"
    );

    // Prompts and completions go by the server's own prompt name.
    exec.answers.push_back(Ok(json!({"messages": []})));
    exec.answers
        .push_back(Ok(json!({"completion": {"values": []}})));
    host.content(
        ANALYST,
        "prompts/get",
        json!({"name": "test_prompt_with_arguments",
        "arguments": {"arg1": "a", "arg2": "b"}}),
        &mut exec,
    )
    .await
    .unwrap();
    host.content(
        ANALYST,
        "completion/complete",
        json!({
        "ref": {"type": "ref/prompt", "name": "test_prompt_with_arguments", "uri": "test://x"},
        "argument": {"name": "arg1", "value": "p", "extra": 1},
        "context": {"arguments": {"arg2": "b"}, "more": true}}),
        &mut exec,
    )
    .await
    .unwrap();
    assert_eq!(
        exec.asked[1].2,
        json!({"name": "test_prompt_with_arguments", "arguments": {"arg1": "a", "arg2": "b"}})
    );
    assert_eq!(exec.asked[2].1, "completion/complete");
    // A completion is forwarded rebuilt from what was routed and checked: nothing the
    // client added beside it (a URI in a prompt reference, which an executor reading it
    // first would answer for unchecked) reaches the executor. Before, the client's `ref`,
    // `argument` and `context` went on as written.
    assert_eq!(
        exec.asked[2].2,
        json!({
            "ref": {"type": "ref/prompt", "name": "test_prompt_with_arguments"},
            "argument": {"name": "arg1", "value": "p"},
            "context": {"arguments": {"arg2": "b"}}
        })
    );

    let records = host.records().await;
    assert_eq!(records[0]["flowhost"]["event"], "content_request");
    // The record names the signed template, not the URI the client expanded from it.
    assert_eq!(
        records[0]["tool"]["name"],
        "resources/read test://template/{id}/data"
    );
    assert_eq!(records[1]["flowhost"]["event"], "content_outcome");
    assert!(records.iter().all(|r| r["decision"]["effect"] == "allow"));
    assert_eq!(
        records[1]["flowhost"]["labels_after"]["session"]["compartments"],
        json!(["conformance-data", "harbor-goods-terms"])
    );
}

/// A read's answer may carry several resources: one a manifest signed is judged as a read
/// of it would be (here, another spelling of a signed URI is refused), and one nothing
/// signed is content of the answer itself. Before, nothing the executor answered was
/// looked at, so a read of one signed resource could carry another's content under the
/// first's label.
#[tokio::test]
async fn the_resources_an_answer_carries_are_judged_as_reads_of_them() {
    // The analyst may read the static text, and no other resource of the server.
    let host = Host::with_config(|text| {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
        format!(
            "{}{}",
            text.replacen(
                "tools = [\"workspace/*\", ",
                "tools = [\"conformance/static-text\", \"conformance/test_prompt_with_arguments\", \"workspace/*\", ",
                1
            ),
            crate::lab::conformance_server(repo, "/bin/true")
        )
    });
    let mut exec = Feeding::default();
    let carrying = |uri: &str| {
        Ok(json!({"contents": [
            {"uri": "test://static-text", "text": "asked"},
            {"uri": uri, "text": "also"}
        ]}))
    };
    // Nothing signed as it is spelt, or spelt otherwise under a scheme nothing signs:
    // content of the answer.
    for fine in ["test://embedded-resource", "note://a%3Ab"] {
        exec.answers.push_back(carrying(fine));
        let r = host.read(ANALYST, "test://static-text", &mut exec).await;
        assert!(r.is_ok(), "{fine}: {r:?}");
    }
    exec.answers.push_back(carrying("test://template/7/data"));
    let e = host
        .read(ANALYST, "test://static-text", &mut exec)
        .await
        .unwrap_err();
    assert_eq!(denial_of(&e), "access_denied", "{e:?}");
    // Where the resource sits is named, never what it is.
    assert!(
        e.message.contains("withheld")
            && e.message.contains("contents[1]")
            && e.message.contains("may not read"),
        "{e:?}"
    );
    assert!(!e.message.contains("template"), "{e:?}");
    // Spelt otherwise, it is judged by its one spelling (here the template the analyst may
    // not read, as a standard expansion escapes what the one spelling does not); one with
    // no spelling under a scheme the server signs cannot be told, and is withheld.
    for (spelt, denial) in [
        ("TEST://template/%37/data", "access_denied"),
        ("test://a/../template/7/data", "unknown_resource"),
    ] {
        exec.answers.push_back(carrying(spelt));
        let e = host
            .read(ANALYST, "test://static-text", &mut exec)
            .await
            .unwrap_err();
        assert_eq!(denial_of(&e), denial, "{spelt}: {e:?}");
    }
    // A completion's optional context may be empty.
    exec.answers
        .push_back(Ok(json!({"completion": {"values": []}})));
    host.content(
        ANALYST,
        "completion/complete",
        json!({"ref": {"type": "ref/prompt", "name": "test_prompt_with_arguments"},
               "argument": {"name": "arg1", "value": "p"}, "context": {}}),
        &mut exec,
    )
    .await
    .unwrap();

    // A tool's result is judged by the resources it carries too: here one another server
    // signed. Before, a tool result's embedded resources and links were not looked at.
    let mut tool = Scripted::answering(vec![Ok(json!({"content": [
        {"type": "text", "text": "see"},
        {"type": "resource_link", "uri": "test://static-text", "name": "x",
         "resource": {"uri": "urn:x"}}
    ], "structuredContent": {"documents": []}}))]);
    let r = host
        .call(
            ANALYST,
            call("workspace/list_documents", json!({})),
            &mut tool,
        )
        .await
        .unwrap();
    let said = r["content"][0]["text"].as_str().unwrap();
    assert!(
        r["isError"] == true
            && said.contains("content[1]")
            && said.contains("another server signed"),
        "{r}"
    );
    let statuses: Vec<String> = host
        .records()
        .await
        .iter()
        .filter(|r| r["flowhost"]["event"] == "content_outcome")
        .map(|r| r["response"]["status"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        statuses,
        [
            "success",
            "success",
            "answer_withheld",
            "answer_withheld",
            "answer_withheld",
            "success"
        ]
    );
}

/// A URI no signed resource routes is the client's text, which can hold anything (a
/// customer's address, a token): its refusal's record names its scheme and a digest, never
/// the URI. Before, the record kept the URI itself.
#[tokio::test]
async fn an_unrouted_uri_is_recorded_by_its_digest() {
    let host = Host::with_content();
    let mut exec = Feeding::default();
    let secret = "test://custmers/jane.doe@example.com?token=s3cr3t";
    let e = host.read(ANALYST, secret, &mut exec).await.unwrap_err();
    assert_eq!(denial_of(&e), "unknown_resource");
    let records = host.records().await;
    let text = serde_json::to_string(&records).unwrap();
    assert!(
        !text.contains("jane.doe") && !text.contains("s3cr3t"),
        "{text}"
    );
    let name = records[0]["tool"]["name"].as_str().unwrap();
    assert!(
        name.starts_with("resources/read test://(unrouted, fingerprint "),
        "{name}"
    );
}

#[tokio::test]
async fn content_nobody_signed_or_malformed_is_refused_before_any_executor_sees_it() {
    let host = Host::with_content();
    let mut exec = Feeding::default();
    let cases = [
        (
            "resources/read",
            json!({"uri": "test://nothing"}),
            "unknown_resource",
        ),
        ("resources/read", json!({}), "invalid_params"),
        ("prompts/get", json!({"name": "nothing"}), "unknown_prompt"),
        (
            "prompts/get",
            json!({"name": "test_prompt_with_arguments", "arguments": {"arg1": "a"}}),
            "invalid_params",
        ),
        (
            "prompts/get",
            json!({"name": "test_simple_prompt", "arguments": {"x": "a"}}),
            "invalid_params",
        ),
        (
            "completion/complete",
            json!({"ref": {"type": "ref/resource", "uri": "test://template/7/data"}, "argument": {"name": "id", "value": "1"}}),
            "unknown_resource",
        ),
        (
            "completion/complete",
            json!({"ref": {"type": "ref/other"}, "argument": {"name": "id"}}),
            "invalid_params",
        ),
    ];
    for (method, params, denial) in &cases {
        let e = host
            .content(ANALYST, method, params.clone(), &mut exec)
            .await
            .unwrap_err();
        assert_eq!(denial_of(&e), *denial, "{method} {params}: {e:?}");
    }
    // A principal whose patterns do not name the server's content, told so without the
    // server or the signed name it may not list (before, the refusal named both).
    let e = host
        .read(REVIEWER, "test://static-text", &mut exec)
        .await
        .unwrap_err();
    assert_eq!(denial_of(&e), "access_denied");
    let route = host.registry.resource_route("test://static-text").unwrap();
    assert!(
        !e.message.contains(&route.server_id) && !e.message.contains(&route.name),
        "{}",
        e.message
    );
    // Nor are a prompt's arguments checked first, which named them (that it exists, an
    // access refusal still tells, as it does of a tool).
    let e = host
        .content(
            REVIEWER,
            "prompts/get",
            json!({"name": "test_prompt_with_arguments", "arguments": {"x": "a"}}),
            &mut exec,
        )
        .await
        .unwrap_err();
    assert_eq!(denial_of(&e), "access_denied", "{e:?}");
    assert!(!e.message.contains("arg1"), "{}", e.message);
    assert!(exec.asked.is_empty(), "{:?}", exec.asked);
    assert!(host.session_label(ANALYST).await.is_bottom());
    let records = host.records().await;
    assert_eq!(records.len(), cases.len() + 2);
    assert!(
        records
            .iter()
            .all(|r| r["flowhost"]["event"] == "content_request"
                && r["decision"]["effect"] == "deny")
    );
}

#[tokio::test]
async fn what_an_executor_answers_as_an_error_is_labelled_like_content() {
    let host = Host::with_content();
    let mut exec = Feeding::default();
    exec.answers
        .push_back(Err(content::ForwardError::Answered(RpcError::new(
            -32002,
            format!("not found: {TERMS}"),
        ))));
    let e = host
        .read(ANALYST, "test://static-text", &mut exec)
        .await
        .unwrap_err();
    // The executor's own error, as it gave it.
    assert_eq!(e.code, -32002, "{e:?}");
    assert_eq!(e.message, format!("not found: {TERMS}"));
    let label = serde_json::to_value(host.session_label(ANALYST).await).unwrap();
    assert_eq!(
        label["compartments"],
        json!(["conformance-data", "harbor-goods-terms"]),
        "{label}"
    );
    let records = host.records().await;
    assert_eq!(records[1]["flowhost"]["event"], "content_outcome");
    assert_eq!(records[1]["decision"]["effect"], "error");
}

/// An executor that, during its call, sends its client what `relay` says through the
/// call's gate, and keeps what came of each.
struct Relaying {
    /// What the gate answered, in order.
    seen: Vec<Result<(), String>>,
    /// The session's combined label once the request was let through.
    label_when_forwarded: Option<crate::label::InformationLabel>,
}

impl Dispatch for Relaying {
    async fn dispatch(
        &mut self,
        _server: &str,
        _tool: &str,
        _arguments: Value,
        _call: CallInFlight,
        gate: &RelayGate<'_>,
    ) -> Result<Value, DispatchError> {
        use crate::records::RelayMethod::{Elicitation, Sampling};
        let asked =
            json!({"messages": [{"role": "user", "content": {"type": "text", "text": TERMS}}]});
        let denial = |r: Result<(), RpcError>| r.map_err(|e| denial_of(&e).to_string());
        self.seen
            .push(denial(gate.to_client(Sampling, &asked, false, 0).await));
        self.seen.push(denial(
            gate.to_client(Sampling, &asked, true, relay::MAX_PENDING_RELAYS)
                .await,
        ));
        self.seen
            .push(denial(gate.to_client(Elicitation, &asked, true, 0).await));
        let state = gate.env.resolver.state().get(&gate.plan.key).await.unwrap();
        self.label_when_forwarded = Some(state.combined());
        let answer = json!({"action": "accept", "content": {"name": "n"}});
        self.seen
            .push(denial(gate.to_tool(Elicitation, &answer, &|_| true).await));
        Ok(json!({"content": [{"type": "text", "text": "done"}]}))
    }
}

/// An executor whose egress was approved under another label (a connection it may still
/// hold open) is handed no client answer: before, an answer of a tool that declares no
/// egress was checked against no clearance, and reached the connection unjudged.
struct AnsweredUnfit {
    seen: Vec<Result<(), String>>,
}

impl Dispatch for AnsweredUnfit {
    async fn dispatch(
        &mut self,
        _server: &str,
        _tool: &str,
        _arguments: Value,
        _call: CallInFlight,
        gate: &RelayGate<'_>,
    ) -> Result<Value, DispatchError> {
        use crate::records::RelayMethod::Sampling;
        let answer = json!({"role": "assistant", "content": {"type": "text", "text": "fine"}});
        for fit in [true, false] {
            let answered = gate.to_tool(Sampling, &answer, &|_| fit).await;
            self.seen
                .push(answered.map_err(|e| denial_of(&e).to_string()));
        }
        Ok(json!({"content": [{"type": "text", "text": "done"}]}))
    }
}

/// An executor whose request to its client is refused (the client declared no sampling)
/// still had the request's content: it joins the call's label as any output would. Before,
/// it was read by no classifier, and the executor served later calls below it.
struct RefusedRelay {
    label_after: Option<crate::label::InformationLabel>,
}

impl Dispatch for RefusedRelay {
    async fn dispatch(
        &mut self,
        _server: &str,
        _tool: &str,
        _arguments: Value,
        _call: CallInFlight,
        gate: &RelayGate<'_>,
    ) -> Result<Value, DispatchError> {
        let asked =
            json!({"messages": [{"role": "user", "content": {"type": "text", "text": TERMS}}]});
        let refused = gate
            .to_client(crate::records::RelayMethod::Sampling, &asked, false, 0)
            .await;
        assert!(refused.is_err());
        let state = gate.env.resolver.state().get(&gate.plan.key).await.unwrap();
        self.label_after = Some(state.combined());
        Ok(json!({"content": [{"type": "text", "text": "done"}]}))
    }
}

#[tokio::test]
async fn a_refused_request_to_the_client_still_raises_the_calls_label() {
    let host = Host::new();
    let mut exec = RefusedRelay { label_after: None };
    publish_publicly(&host, &mut exec).await.unwrap();
    assert!(
        exec.label_after
            .unwrap()
            .to_string()
            .contains("harbor-goods-terms"),
        "the refused request's content was not labelled"
    );
}

#[tokio::test]
async fn an_answer_the_executor_is_not_fit_for_is_refused() {
    let host = Host::new();
    let mut exec = AnsweredUnfit { seen: Vec::new() };
    publish_publicly(&host, &mut exec).await.unwrap();
    assert_eq!(exec.seen, [Ok(()), Err("flow_violation".to_string())]);
}

#[tokio::test]
async fn what_an_executor_sends_its_client_is_governed_as_the_calls_output() {
    let host = Host::new();
    let mut exec = Relaying {
        seen: Vec::new(),
        label_when_forwarded: None,
    };
    // The public inbox egresses, cleared for public data only; the session starts public.
    publish_publicly(&host, &mut exec).await.unwrap();
    let refused = |d: &str| Err(d.to_string());
    assert_eq!(
        exec.seen,
        [
            refused("client_capability_missing"),
            refused("relay_limit"),
            Ok(()),
            // The request carried the terms: the classifier raised the session before it
            // went out, so the client's answer no longer flows to the tool's clearance.
            refused("flow_violation"),
        ]
    );
    assert!(
        exec.label_when_forwarded
            .unwrap()
            .to_string()
            .contains("harbor-goods-terms"),
        "the raise was durable before the request was let through"
    );
    let records = host.records().await;
    let relays: Vec<(Value, Value, Value)> = records
        .iter()
        .filter(|r| r["flowhost"]["event"] == "relay")
        .map(|r| {
            (
                r["flowhost"]["relay"].clone(),
                r["decision"]["effect"].clone(),
                r["flowhost"]["denial_kind"].clone(),
            )
        })
        .collect();
    let relay =
        |m: &str, d: &str, e: &str, k: Value| (json!({"method": m, "direction": d}), json!(e), k);
    assert_eq!(
        relays,
        [
            relay(
                "sampling",
                "to_client",
                "deny",
                json!("client_capability_missing")
            ),
            relay("sampling", "to_client", "deny", json!("relay_limit")),
            relay("elicitation", "to_client", "allow", Value::Null),
            relay("elicitation", "to_tool", "deny", json!("flow_violation")),
        ]
    );
    for r in &records {
        DecisionRecord::from_json_line(r.to_string().as_bytes()).unwrap();
    }
}

/// A registered, mapped tool refused at admission (its arguments not an object, a stale
/// bridge digest, a malformed grant) is recorded as a call of that tool, classified by its
/// mapping: before, every such refusal read as an unknown tool (no category), which the
/// diff reported as an unclassified action and health did not count.
#[tokio::test]
async fn a_mapped_tool_refused_at_admission_is_recorded_as_that_tool() {
    let host = Host::new();
    let mut exec = Scripted::answering(vec![]);
    let e = host
        .call(
            ANALYST,
            json!({"name": "workspace/read_terms", "arguments": 5}),
            &mut exec,
        )
        .await
        .unwrap_err();
    assert!(e.message.contains("must be an object"), "{e:?}");
    let records = host.records().await;
    let refused = records
        .iter()
        .find(|r| r["flowhost"]["denial_kind"] == "invalid_params")
        .expect("the refusal's record");
    assert_eq!(
        refused["classification"], "classified_incomplete",
        "{refused}"
    );
    assert_eq!(refused["tool"]["category"], "contract_read", "{refused}");
    assert!(
        refused["server"]["declared_manifest_digest"].is_string(),
        "{refused}"
    );
}

/// The executor may serve again only once the labels of what it produced are stored: the
/// dispatcher is told so after the raise, and told it is not when the raise failed.
#[tokio::test]
async fn the_dispatcher_learns_whether_the_output_was_labelled() {
    let host = Host::new();
    let listing = || {
        Ok(
            json!({"content": [{"type": "text", "text": "two documents"}],
            "structuredContent": {"documents": []}}),
        )
    };
    for (answer, breaks, labelled) in [
        (listing(), false, true),
        (listing(), true, false),
        (
            Err(DispatchError::Answered(RpcError::new(-32602, "bad folder"))),
            true,
            false,
        ),
        (Err(DispatchError::Cancelled("stop".into())), true, false),
        (
            Err(DispatchError::CancelledBeforeStart("stop".into())),
            true,
            true,
        ),
    ] {
        host.broken
            .store(false, std::sync::atomic::Ordering::SeqCst);
        let exec = Settling {
            break_state: breaks.then(|| host.broken.clone()),
            ..Settling::answering(answer.clone())
        };
        let (r, settled) = exec
            .call(&host, "workspace/list_documents", json!({}))
            .await;
        assert_eq!(settled, vec![labelled], "{answer:?}: {r:?}");
        if !labelled {
            let e = r.unwrap_err();
            assert!(e.message.contains("could not be stored"), "{e:?}");
        }
    }
    // Labelled, but its outcome not recorded: the executor does not serve again (what it
    // held for the client would go out under a label no record holds).
    let host = Host::new();
    let exec = Settling {
        close_records: Some(host.records.clone()),
        ..Settling::answering(listing())
    };
    let (r, settled) = exec
        .call(&host, "workspace/list_documents", json!({}))
        .await;
    assert!(r.is_err(), "{r:?}");
    assert_eq!(settled, vec![false]);
    // Its answer withheld (here: no structured content under a signed output schema), what
    // it produced was never labelled: it serves no later call, which could carry it out
    // under a lower label. Before, it was given back as any executor that answered.
    let host = Host::new();
    let (r, settled) = Settling::answering(text("two documents"))
        .call(&host, "workspace/read_terms", json!({"document": "t.md"}))
        .await;
    let r = r.unwrap();
    assert!(
        r["content"][0]["text"]
            .as_str()
            .is_some_and(|t| t.contains("withheld")),
        "{r}"
    );
    assert_eq!(settled, vec![false]);
}

/// The code of an executor's error answer goes to the client as it is, so the classifier
/// reads it with the message and data: before, a card number chosen as the code was never
/// read.
#[test]
fn an_error_answers_code_is_read_by_the_classifier() {
    let e = RpcError::new(4111111111111111, "x");
    assert!(super::answered_text(&e).contains("4111111111111111"));
    let e = e.with_data(json!({"detail": "y"}));
    let text = super::answered_text(&e);
    assert!(
        text.contains("4111111111111111") && text.contains('y'),
        "{text}"
    );
    // A code the protocol defines is the protocol's, not the tool's: not read.
    let e = RpcError::new(-32602, "x");
    assert_eq!(super::answered_text(&e), "x");
    // Another of the reserved range is the tool's choice, and may spell what it read.
    let e = RpcError::new(-32417, "x");
    assert!(super::answered_text(&e).contains("-32417"));
}
