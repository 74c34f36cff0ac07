//! One content request (`resources/read`, `prompts/get`, `completion/complete`) through the
//! same stages as a call: **admit** (the caller is the session's principal; the URI, prompt
//! or completion reference is one a registered server signed, and the principal's patterns
//! name it as `server/name`; a prompt's arguments are declared strings) -> **pre-dispatch**
//! (what the request carries joins the session's label durably) -> **authorize** (the allow
//! recorded durably) -> **forward** (to one of the session's executors of that server, with
//! no call in flight: any egress it attempts meanwhile is refused) -> **settle** (`content
//! floor ⊔ signed output label ⊔ classifier(content)` joined durably, the outcome recorded,
//! then the content returned).
//!
//! Content whose label cannot be determined is never served: a request naming nothing a
//! server signed is refused (`unknown_resource`, `unknown_prompt`), and a label that cannot
//! be stored withholds the content (`state_failure`).

use serde_json::{Value, json};

use super::{CallEnv, Caller, bounded, labels_after, refusal};
use crate::config::{HostConfig, PrincipalConfig};
use crate::decision::{Denial, Failure, Verdict};
use crate::label::InformationLabel;
use crate::mcp::{RpcError, code};
use crate::records::{
    Correlation, EventKind, FlowContext, Projection, ServerInfo, ToolCallFacts,
    correlation_from_params,
};
use crate::registry::{ContentRoute, VerifiedRegistry};
use crate::state::{FlowState, SessionKey};

/// Most bytes of what an unrouted request names kept in its record (the client's text,
/// which names nothing signed).
const MAX_UNKNOWN_NAME_BYTES: usize = 128;

/// The JSON-RPC code MCP gives a resource that does not exist.
pub const RESOURCE_NOT_FOUND: i64 = -32002;

/// Which content request, with what it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentMethod {
    /// `resources/read`.
    ReadResource,
    /// `prompts/get`.
    GetPrompt,
    /// `completion/complete`.
    Complete,
}

impl ContentMethod {
    /// The MCP method.
    pub fn as_str(self) -> &'static str {
        match self {
            ContentMethod::ReadResource => "resources/read",
            ContentMethod::GetPrompt => "prompts/get",
            ContentMethod::Complete => "completion/complete",
        }
    }

    /// The method named `method`, if it is a content request.
    pub fn from_method(method: &str) -> Option<Self> {
        [
            ContentMethod::ReadResource,
            ContentMethod::GetPrompt,
            ContentMethod::Complete,
        ]
        .into_iter()
        .find(|m| m.as_str() == method)
    }
}

/// Why forwarding a content request failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ForwardError {
    /// No executor could be started or made ready (the request never reached one). The
    /// text is the host's words only: it reaches the client unlabelled, so it must hold
    /// nothing an executor said (the forwarder logs that instead).
    #[error("the executor could not be started: {0}")]
    NotStarted(String),
    /// No executor took the request within a bound of the host: its deadline ran out while
    /// it waited, or the principal holds its share of the host's executors (the host's
    /// words). The request never reached one.
    #[error("no executor took the request: {0}")]
    NotTaken(String),
    /// A reload withdrew the principal's access to the request while it waited, before an
    /// executor took it (the host's words).
    #[error("{0}")]
    AccessWithdrawn(String),
    /// The executor failed (it is retired).
    #[error("the executor failed: {0}")]
    Failed(String),
    /// The executor ran into a bound (its memory, CPU or process limit, or the request's
    /// deadline) and was ended (it is retired).
    #[error("the executor was ended: {0}")]
    BoundReached(String),
    /// The executor answered with a JSON-RPC error (its message and data are content: they
    /// are labelled like a result, then the error reaches the client as it was given).
    #[error("{0}")]
    Answered(RpcError),
}

impl ForwardError {
    /// The failure its outcome records: one mapping for every request forwarded (a read, a
    /// prompt, a subscription).
    pub fn failure(&self) -> Failure {
        match self {
            ForwardError::NotStarted(_) | ForwardError::Failed(_) => Failure::ExecutorFailed,
            ForwardError::NotTaken(_) | ForwardError::BoundReached(_) => Failure::BoundReached,
            ForwardError::AccessWithdrawn(_) => Failure::AccessWithdrawn,
            ForwardError::Answered(_) => Failure::ToolError,
        }
    }
}

/// Forwards an authorized content request to one of the session's executors.
pub trait Forward {
    /// Sends `method` with `params` to an executor of `server` fit for `source`. `name` is
    /// the signed resource or prompt the request routes to: a principal that may no longer
    /// use it by the time an executor takes the request is refused then.
    fn forward(
        &mut self,
        server: &str,
        name: &str,
        method: &str,
        params: Value,
        source: &InformationLabel,
    ) -> impl std::future::Future<Output = Result<Value, ForwardError>> + Send;

    /// Called once the request is settled: as [`super::Dispatch::settled`].
    fn settled(&mut self, durable: bool) -> impl std::future::Future<Output = ()> + Send {
        let _ = durable;
        async {}
    }
}

/// What a request names: the route to its server and the parameters the executor gets
/// (public prompt names become the server's own).
struct Routed {
    route: ContentRoute,
    params: Value,
}

/// Where `params` of `method` go, or the refusal (and its denial) when nothing signed
/// matches or the request is malformed.
/// `access` refuses a route the principal may not use: it is asked as soon as the route is
/// known, before anything else is checked against what the route signed (a prompt's
/// arguments), so a refusal names nothing the principal may not list.
fn route(
    config: &HostConfig,
    registry: &VerifiedRegistry,
    method: ContentMethod,
    params: &Value,
    access: impl FnOnce(&ContentRoute) -> Result<(), (RpcError, Denial)>,
) -> Result<Routed, (RpcError, Denial)> {
    let invalid = |why: String| {
        (
            refusal(code::INVALID_PARAMS, why, Denial::InvalidParams),
            Denial::InvalidParams,
        )
    };
    let unroutable = |why: crate::manifest::UnroutableUri| {
        warn_if_ambiguous(&why, None);
        (
            refusal(
                RESOURCE_NOT_FOUND,
                why.client_words(),
                Denial::UnknownResource,
            ),
            Denial::UnknownResource,
        )
    };
    let prompt = |public: &str| {
        let (server, name) = config.tool_name(public);
        let route = registry.prompt_route(server, name);
        let definition = registry.prompt(server, name);
        route.zip(definition).ok_or_else(|| {
            (
                refusal(
                    code::INVALID_PARAMS,
                    format!("unknown prompt {public:?} (prompts are named server/prompt)"),
                    Denial::UnknownPrompt,
                ),
                Denial::UnknownPrompt,
            )
        })
    };
    match method {
        ContentMethod::ReadResource => {
            let uri = params
                .get("uri")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid("resources/read needs a string \"uri\"".into()))?;
            let route = registry.resource_route(uri).map_err(unroutable)?;
            access(&route)?;
            Ok(Routed {
                route,
                params: json!({"uri": uri}),
            })
        }
        ContentMethod::GetPrompt => {
            let public = params
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid("prompts/get needs a string \"name\"".into()))?;
            let (route, definition) = prompt(public)?;
            access(&route)?;
            let arguments = params.get("arguments").filter(|a| !a.is_null());
            definition
                .check_arguments(arguments)
                .map_err(|why| invalid(format!("prompt {public:?}: {why}")))?;
            let mut forwarded = json!({"name": route.name});
            if let Some(a) = arguments {
                forwarded["arguments"] = a.clone();
            }
            Ok(Routed {
                route,
                params: forwarded,
            })
        }
        ContentMethod::Complete => {
            let reference = params
                .get("ref")
                .filter(|r| r.is_object())
                .ok_or_else(|| invalid("completion/complete needs a \"ref\" object".into()))?;
            let argument = params.get("argument");
            let (Some(name), Some(value)) = (
                argument.and_then(|a| a.get("name")).and_then(Value::as_str),
                argument
                    .and_then(|a| a.get("value"))
                    .and_then(Value::as_str),
            ) else {
                return Err(invalid(
                    "completion/complete needs an \"argument\" with a string name and value".into(),
                ));
            };
            // Rebuilt from what was routed and checked, never passed on as the client wrote
            // it: an executor reading a field the host did not route by (a prompt's name in
            // a resource reference) would answer for what was never checked.
            let mut forwarded = json!({"argument": {"name": name, "value": value}});
            // `context` and its `arguments` are optional (absent or null: none).
            if let Some(arguments) = params
                .get("context")
                .filter(|c| !c.is_null())
                .and_then(|c| c.get("arguments"))
                .filter(|a| !a.is_null())
            {
                if !arguments
                    .as_object()
                    .is_some_and(|m| m.values().all(Value::is_string))
                {
                    return Err(invalid(
                        "completion/complete's \"context.arguments\" is an object of strings"
                            .into(),
                    ));
                }
                forwarded["context"] = json!({"arguments": arguments});
            }
            let route = match reference.get("type").and_then(Value::as_str) {
                Some("ref/prompt") => {
                    let public = reference
                        .get("name")
                        .and_then(Value::as_str)
                        .ok_or_else(|| invalid("a ref/prompt needs a string \"name\"".into()))?;
                    let (route, _) = prompt(public)?;
                    forwarded["ref"] = json!({"type": "ref/prompt", "name": route.name});
                    route
                }
                Some("ref/resource") => {
                    let uri = reference
                        .get("uri")
                        .and_then(Value::as_str)
                        .ok_or_else(|| invalid("a ref/resource needs a string \"uri\"".into()))?;
                    forwarded["ref"] = json!({"type": "ref/resource", "uri": uri});
                    registry.resource_ref_route(uri).ok_or_else(|| {
                        unroutable(crate::manifest::UnroutableUri::NotSigned {
                            uri: uri.to_owned(),
                        })
                    })?
                }
                _ => {
                    return Err(invalid(
                        "ref.type must be \"ref/prompt\" or \"ref/resource\"".into(),
                    ));
                }
            };
            access(&route)?;
            Ok(Routed {
                route,
                params: forwarded,
            })
        }
    }
}

/// What one content request's records share.
pub struct ContentRecord {
    server: ServerInfo,
    name: String,
    correlation: Correlation,
    principal: Option<String>,
    session: String,
    call_id: String,
}

impl ContentRecord {
    fn facts(&self, verdict: Verdict, context: FlowContext) -> ToolCallFacts {
        ToolCallFacts {
            server: self.server.clone(),
            tool_name: self.name.clone(),
            projection: Projection::unknown_tool(),
            verdict,
            credential_alias: None,
            correlation: self.correlation.clone(),
            context: FlowContext {
                principal: self.principal.clone(),
                session: Some(self.session.clone()),
                call_id: Some(self.call_id.clone()),
                ..context
            },
        }
    }
}

/// Warns the operator of a URI two signed templates of one server match (the manifest's
/// fault: neither serves it), naming the server and the templates, and the client's URI
/// only by its fingerprint (see [`describe`]).
pub(crate) fn warn_if_ambiguous(why: &crate::manifest::UnroutableUri, session: Option<&str>) {
    if let crate::manifest::UnroutableUri::Ambiguous {
        uri,
        server_id,
        first,
        second,
    } = why
    {
        tracing::warn!(
            session = session.unwrap_or("(none)"),
            "a resource URI (fingerprint {}) matches two templates server {} signed, {:?} and {:?}: a read must reach exactly one, so neither serves it",
            crate::host::fingerprint::of(uri.as_bytes()),
            flowhost_broker::Escaped(server_id),
            flowhost_broker::Escaped(first),
            flowhost_broker::Escaped(second)
        );
    }
}

/// What a request names, for its records, before it is routed: a prompt's name (the
/// client's text, kept short, as an unknown tool's), or a URI's scheme and fingerprint,
/// `resources/read test://(unrouted, fingerprint …)`: a URI is the client's data, which can
/// hold anything (an address, a token), and a record must not, nor a digest a guess could
/// be tested against.
fn describe(method: ContentMethod, params: &Value) -> String {
    let reference = params.get("ref");
    let (what, is_uri) = match method {
        ContentMethod::ReadResource => (params.get("uri"), true),
        ContentMethod::GetPrompt => (params.get("name"), false),
        ContentMethod::Complete => match reference.and_then(|r| r.get("name")) {
            Some(name) => (Some(name), false),
            None => (reference.and_then(|r| r.get("uri")), true),
        },
    };
    let Some(what) = what.and_then(Value::as_str) else {
        return format!("{} (none)", method.as_str());
    };
    if !is_uri {
        return format!(
            "{} {}",
            method.as_str(),
            bounded(what, MAX_UNKNOWN_NAME_BYTES)
        );
    }
    let scheme = what
        .split_once("://")
        .map(|(s, _)| s)
        .filter(|s| {
            s.len() <= 32
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b))
        })
        .unwrap_or("?");
    format!(
        "{} {scheme}://(unrouted, fingerprint {})",
        method.as_str(),
        crate::host::fingerprint::of(what.as_bytes())
    )
}

/// Runs one content request through every stage (see the module docs), and logs one line
/// for it at info.
pub async fn content_request<F: Forward>(
    env: &CallEnv<'_>,
    caller: Caller<'_>,
    method: ContentMethod,
    params: &Value,
    forward: &mut F,
) -> Result<Value, RpcError> {
    let started = std::time::Instant::now();
    let mut rec = ContentRecord {
        server: ServerInfo::mcp("(none)", None),
        name: describe(method, params),
        correlation: correlation_from_params(params),
        principal: caller.pinned.map(ToString::to_string),
        session: caller.session.to_string(),
        call_id: super::super::random_id(),
    };
    let outcome = run(env, caller, method, params, forward, &mut rec).await;
    tracing::info!(
        principal = %rec.principal.as_deref().unwrap_or("(none)"),
        session = %rec.session,
        request = %rec.name,
        verdict = if outcome.is_ok() { "answered" } else { "refused" },
        reason = outcome.as_ref().err().and_then(RpcError::data_denial).unwrap_or(""),
        duration_ms = started.elapsed().as_millis() as u64,
        "content request"
    );
    outcome
}

async fn run<F: Forward>(
    env: &CallEnv<'_>,
    caller: Caller<'_>,
    method: ContentMethod,
    params: &Value,
    forward: &mut F,
    rec: &mut ContentRecord,
) -> Result<Value, RpcError> {
    // Admit.
    let (principal, routed) = match admit(env, caller, method, params, rec) {
        Ok(a) => a,
        Err((e, denial)) => {
            env.recorder
                .record(
                    EventKind::ContentRequest,
                    rec.facts(Verdict::refused(denial), FlowContext::default()),
                )
                .await?;
            return Err(e);
        }
    };
    let key = SessionKey {
        principal: principal.id.clone(),
        session: rec.session.clone(),
    };

    // Pre-dispatch: the executor is about to see the request.
    let (source, state) = match env.resolver.before_content(&key, &routed.params).await {
        Ok(s) => s,
        Err(e) => {
            env.recorder
                .record(
                    EventKind::ContentRequest,
                    rec.facts(
                        Verdict::Failed(Failure::StateFailure),
                        FlowContext::default(),
                    ),
                )
                .await?;
            return Err(refusal(
                code::INTERNAL_ERROR,
                format!("flow state unavailable: {e}"),
                Denial::StateFailure,
            ));
        }
    };

    // Authorize.
    record_authorized(env, rec, &source, &state).await?;

    // Forward.
    let server = routed.route.server_id.clone();
    let outcome = forward
        .forward(
            &server,
            &routed.route.name,
            method.as_str(),
            routed.params.clone(),
            &source,
        )
        .await;

    // Settle.
    let mut label = routed.route.label.clone();
    // Whether all the executor produced is labelled (its answer was not withheld).
    let mut labelled_whole = true;
    let (answer, verdict, text) = match outcome {
        Ok(result) => match carried_resources(
            env.registry,
            &principal,
            &routed.route.server_id,
            routed.params.get("uri").and_then(Value::as_str),
            &result,
        ) {
            Ok(carried) => {
                label = label.join_or_top(&carried);
                let text = crate::resolver::classifiable_text(&result);
                (Ok(result), Verdict::Succeeded { rule: None }, text)
            }
            // What the executor answered is withheld; the request's own label joins, as
            // for any answer it gave (it read what the route labels), and the host's words
            // the client reads are classified as any answer is. What it carried was never
            // labelled, so the executor serves nothing more.
            Err((why, denial)) => {
                labelled_whole = false;
                let e = refusal(
                    code::INTERNAL_ERROR,
                    format!("the answer of server {server:?} is withheld: {why}"),
                    denial,
                );
                let text = super::answered_text(&e);
                (Err(e), Verdict::Failed(Failure::AnswerWithheld), text)
            }
        },
        // The request never reached an executor: nothing ran, so nothing is labelled. A
        // bound of the host (its deadline, the principal's share) is no failed executor.
        Err(e) => {
            let failure = e.failure();
            let failed = Verdict::Failed(failure);
            match e {
                // The request never reached an executor: nothing ran, so nothing is
                // labelled. A bound of the host (its deadline, the principal's share) is no
                // failed executor.
                e @ (ForwardError::NotStarted(_) | ForwardError::NotTaken(_)) => {
                    record_outcome(env, rec, failed, &state, &state).await?;
                    return Err(RpcError::new(code::INTERNAL_ERROR, e.to_string()));
                }
                ForwardError::AccessWithdrawn(why) => {
                    record_outcome(env, rec, failed, &state, &state).await?;
                    return Err(refusal(code::ACCESS_DENIED, why, Denial::AccessDenied));
                }
                ForwardError::Failed(why) | ForwardError::BoundReached(why) => {
                    executor_ended(&server, why, failure)
                }
                ForwardError::Answered(e) => {
                    let text = super::answered_text(&e);
                    (Err(e), failed, text)
                }
            }
        }
    };
    let raised = env.resolver.after_content(&key, &label, &text).await;
    // As for a tool call: the executor serves again (and the resource updates it held go to
    // the client) only once what it produced is labelled and the outcome recorded.
    let (answered, durable) = match raised {
        Ok(after) => match record_outcome(env, rec, verdict, &after, &state).await {
            Ok(()) => (answer, labelled_whole),
            Err(e) => (Err(e), false),
        },
        Err(e) => {
            let failed = Verdict::Failed(Failure::StateFailure);
            let withheld = refusal(
                code::INTERNAL_ERROR,
                format!("the content's label could not be stored, so it is withheld: {e}"),
                Denial::StateFailure,
            );
            match record_outcome(env, rec, failed, &state, &state).await {
                Ok(()) => (Err(withheld), false),
                Err(e) => (Err(e), false),
            }
        }
    };
    forward.settled(durable).await;
    answered
}

/// Records an authorized `resources/subscribe` or `resources/unsubscribe` of a resource of
/// `route` before its executor sees it, with the label it is sent under (`source`, the
/// request's taint joined) and the labels that join left (`state`). The record names what
/// the server signed (as a read's does), not the client's URI. A subscription reads
/// nothing: it has an outcome record only when it did not take effect
/// ([`record_subscription_failed`]).
pub async fn record_subscription(
    env: &CallEnv<'_>,
    caller: Caller<'_>,
    method: &str,
    params: &Value,
    route: &ContentRoute,
    source: &InformationLabel,
    state: &FlowState,
) -> Result<ContentRecord, RpcError> {
    let rec = subscription_record(env, caller, method, params, route);
    record_authorized(env, &rec, source, state).await?;
    Ok(rec)
}

/// Records that the subscription request `rec` authorized did not take effect (`failure`:
/// access withdrawn, no executor, the executor's error), with the labels it leaves
/// (`state`, as authorized: nothing was read). Without it the records would hold only an
/// allow for a request the client was told failed.
pub async fn record_subscription_failed(
    env: &CallEnv<'_>,
    rec: &ContentRecord,
    failure: Failure,
    state: &FlowState,
) -> Result<(), RpcError> {
    record_outcome(env, rec, Verdict::Failed(failure), state, state).await
}

/// Records a `resources/subscribe` or `resources/unsubscribe` routed to `route` that did not
/// go ahead (`verdict`: refused, or failed when the flow state could not be read, as a
/// read's is), naming what the server signed as an authorized one's record does: the
/// operator reads which resource a principal was refused, whatever the client was told.
pub async fn refuse_subscription(
    env: &CallEnv<'_>,
    caller: Caller<'_>,
    method: &str,
    params: &Value,
    route: &ContentRoute,
    verdict: Verdict,
) -> Result<(), RpcError> {
    let rec = subscription_record(env, caller, method, params, route);
    env.recorder
        .record(
            EventKind::ContentRequest,
            rec.facts(verdict, FlowContext::default()),
        )
        .await
}

/// What a subscription request's records name: its server and what the server signed.
fn subscription_record(
    env: &CallEnv<'_>,
    caller: Caller<'_>,
    method: &str,
    params: &Value,
    route: &ContentRoute,
) -> ContentRecord {
    let digest = env.servers.get(&route.server_id).map(|s| s.digest.clone());
    ContentRecord {
        server: ServerInfo::mcp(&route.server_id, digest.as_deref()),
        name: format!("{method} {}", route.declared),
        correlation: correlation_from_params(params),
        principal: caller.pinned.map(ToString::to_string),
        session: caller.session.to_string(),
        call_id: super::super::random_id(),
    }
}

/// A content request's outcome when its executor failed or was ended (`why`, the host's
/// words): the error the client gets, the verdict recorded, and the text classified.
fn executor_ended(
    server: &str,
    why: String,
    failure: Failure,
) -> (Result<Value, RpcError>, Verdict, String) {
    let e = RpcError::new(code::INTERNAL_ERROR, format!("server {server:?}: {why}"));
    // Read whole, as the client reads it.
    let text = super::answered_text(&e);
    (Err(e), Verdict::Failed(failure), text)
}

/// Records, durably, that the content request `rec` names is sent to its executor under
/// `source`, leaving `state`.
async fn record_authorized(
    env: &CallEnv<'_>,
    rec: &ContentRecord,
    source: &InformationLabel,
    state: &FlowState,
) -> Result<(), RpcError> {
    env.recorder
        .record(
            EventKind::ContentRequest,
            rec.facts(
                Verdict::Authorized { rule: None },
                FlowContext {
                    source_label: Some(source.clone()),
                    labels_after: Some(labels_after(state)),
                    ..FlowContext::default()
                },
            ),
        )
        .await
}

/// Records a content request's outcome with the labels it leaves (already durable): see
/// `Recorder::record_outcome`; `authorized` is what its authorization record carried.
async fn record_outcome(
    env: &CallEnv<'_>,
    rec: &ContentRecord,
    verdict: Verdict,
    state: &FlowState,
    authorized: &FlowState,
) -> Result<(), RpcError> {
    env.recorder
        .record_outcome(
            EventKind::ContentOutcome,
            rec.facts(
                verdict,
                FlowContext {
                    labels_after: Some(labels_after(state)),
                    ..FlowContext::default()
                },
            ),
            state != authorized,
        )
        .await
}

/// The join of the labels of the signed resources other than the one asked for (`asked`)
/// that an executor's answer carries (a read's `contents[].uri`; an embedded resource's or
/// a resource link's `uri` in a prompt's messages or a tool result's content), or why the
/// answer is withheld: a URI another server signed, one the principal may not read, or one
/// matching two templates. A URI spelt otherwise than its one spelling (a standard
/// expansion of a signed template, `docs://q3%3Aplan`) is judged by its one spelling, and
/// one that has none is withheld under a scheme some manifest signs resources of. MCP lets
/// an answer carry several resources (a directory's children); each one a manifest signed
/// is judged as a read of it would be, and its label joined, so one answer cannot carry a
/// resource's content under a lower label or past the principal's access. A URI nothing
/// signed is content of the answer itself (an embedded resource), under the answer's
/// label. The reason names where in the answer, never the executor's URI.
pub(super) fn carried_resources(
    registry: &VerifiedRegistry,
    principal: &crate::config::PrincipalConfig,
    server_id: &str,
    asked: Option<&str>,
    result: &Value,
) -> Result<InformationLabel, (String, Denial)> {
    // Borrowed, never copied: a result can be large.
    fn items(v: Option<&Value>) -> &[Value] {
        v.and_then(Value::as_array).map_or(&[], Vec::as_slice)
    }
    // A block's embedded resource's URI and, for a link, its own: both are judged.
    fn block_uris(c: &Value) -> [Option<&Value>; 2] {
        let embedded = c.get("resource").and_then(|r| r.get("uri"));
        let linked = (c.get("type").and_then(Value::as_str) == Some("resource_link"))
            .then(|| c.get("uri"))
            .flatten();
        [embedded, linked]
    }
    let mut uris: Vec<(String, &Value)> = Vec::new();
    let contents = items(result.get("contents"));
    let messages = items(result.get("messages"));
    let content = items(result.get("content"));
    for (i, c) in contents.iter().enumerate() {
        if let Some(uri) = c.get("uri") {
            uris.push((format!("contents[{i}]"), uri));
        }
    }
    for (i, m) in messages.iter().enumerate() {
        // One block, as MCP has it, or several, as a server may send.
        let blocks: &[Value] = match m.get("content") {
            Some(Value::Array(blocks)) => blocks,
            Some(block) => std::slice::from_ref(block),
            None => &[],
        };
        for uri in blocks.iter().flat_map(block_uris).flatten() {
            uris.push((format!("messages[{i}].content"), uri));
        }
    }
    for (i, c) in content.iter().enumerate() {
        for uri in block_uris(c).into_iter().flatten() {
            uris.push((format!("content[{i}]"), uri));
        }
    }
    let mut carried = InformationLabel::bottom();
    for (at, uri) in &uris {
        let Some(uri) = uri.as_str() else {
            return Err((
                format!("its resource at {at} has a uri that is not a string"),
                Denial::UnknownResource,
            ));
        };
        if Some(uri) == asked {
            continue;
        }
        use crate::manifest::UnroutableUri;
        let ambiguous = || {
            (
                format!("its resource at {at} matches two templates"),
                Denial::UnknownResource,
            )
        };
        let route = match registry.resource_route(uri) {
            Ok(route) => route,
            // Nothing signed, as it is spelt: content of the answer.
            Err(UnroutableUri::NotSigned { .. }) => continue,
            Err(UnroutableUri::Ambiguous { .. }) => return Err(ambiguous()),
            // Spelt otherwise than its one spelling (an honest server's standard expansion
            // of a signed template escapes what the one spelling holds as it is): judged by
            // its one spelling. One that has none is withheld under a scheme some manifest
            // signs resources of (which resource it is cannot be told), and names nothing
            // signed under any other.
            Err(UnroutableUri::Spelling { .. }) => {
                let Some(spelt) = crate::manifest::one_spelling(uri) else {
                    if !signs_scheme(registry, uri) {
                        continue;
                    }
                    return Err((
                        format!(
                            "its resource at {at} has no spelling a URI can be routed by, \
                             under a scheme a manifest signs resources of"
                        ),
                        Denial::UnknownResource,
                    ));
                };
                match registry.resource_route(&spelt) {
                    Ok(route) => route,
                    Err(UnroutableUri::NotSigned { .. }) => continue,
                    Err(UnroutableUri::Ambiguous { .. }) => return Err(ambiguous()),
                    // Its one spelling is one (the rewrite leaves no fault but length).
                    Err(UnroutableUri::Spelling { .. }) => {
                        return Err((
                            format!("its resource at {at} is not a URI a route can read"),
                            Denial::UnknownResource,
                        ));
                    }
                }
            }
        };
        // Named by where it sits and why, never by what it is: the principal may not list
        // another server's or a forbidden resource's name.
        if route.server_id != server_id {
            return Err((
                format!("its resource at {at} is one another server signed"),
                Denial::UnknownResource,
            ));
        }
        if !principal.may_call(&route.server_id, &route.name) {
            return Err((
                format!("its resource at {at} is one the principal may not read"),
                Denial::AccessDenied,
            ));
        }
        carried = carried.join_or_top(&route.label);
    }
    Ok(carried)
}

/// Whether some manifest signs a resource (a URI or a template) of `uri`'s scheme, compared
/// without case.
fn signs_scheme(registry: &VerifiedRegistry, uri: &str) -> bool {
    let scheme_of = |u: &str| u.split_once(':').map(|(s, _)| s.to_ascii_lowercase());
    // A URI without a scheme names nothing a manifest signs (every signed one has one).
    let Some(scheme) = scheme_of(uri) else {
        return false;
    };
    registry
        .resources()
        .any(|(_, r)| scheme_of(r.locator().as_str()).as_deref() == Some(scheme.as_str()))
}

/// The admission stage: the principal, the route (named in `rec` once known), and the
/// principal's access to it.
fn admit(
    env: &CallEnv<'_>,
    caller: Caller<'_>,
    method: ContentMethod,
    params: &Value,
    rec: &mut ContentRecord,
) -> Result<(PrincipalConfig, Routed), (RpcError, Denial)> {
    let principal = caller.principal.map_err(|e| {
        let denial = e
            .data_denial()
            .and_then(|d| serde_json::from_value(json!(d)).ok())
            .unwrap_or(Denial::AccessDenied);
        (e, denial)
    })?;
    // Once routed, the record names what the server signed (a template rather than the
    // URI a client expanded from it: arguments are not recorded unmapped), whether or not
    // the principal may use it. The client is told by what it asked, never by what the
    // route found: the principal may not list the server or the signed name.
    let access = |route: &ContentRoute| {
        let digest = env.servers.get(&route.server_id).map(|s| s.digest.clone());
        rec.server = ServerInfo::mcp(&route.server_id, digest.as_deref());
        rec.name = format!("{} {}", method.as_str(), route.declared);
        if principal.may_call(&route.server_id, &route.name) {
            return Ok(());
        }
        let e = refusal(
            code::ACCESS_DENIED,
            format!(
                "principal {} may not use what this request names",
                principal.id
            ),
            Denial::AccessDenied,
        );
        Err((e, Denial::AccessDenied))
    };
    let routed = route(env.config, env.registry, method, params, access)?;
    Ok((principal, routed))
}
