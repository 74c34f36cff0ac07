//! What a session serves besides tools: the lists of signed resources and prompts, content
//! requests through the pipeline (`pipeline::content`), subscriptions and the resource
//! updates they bring, and the client's logging level.

use std::sync::Arc;

use flowhost_broker::Escaped;
use serde_json::{Value, json};

use super::super::Generation;
use super::super::executor::{CallControl, ExecutorError, UpdateSink};
use super::super::pipeline::content::{ContentMethod, Forward, ForwardError};
use super::super::pipeline::{self, refusal};
use super::subscriptions::{Full, MAX_SUBSCRIPTIONS};
use super::{Bound, Executors, Identity, Session, env};
use crate::decision::{Denial, Failure, Verdict};
use crate::ident::PrincipalId;
use crate::mcp::{self, RpcError, code};
use crate::registry::ContentRoute;
use crate::state::SessionKey;

/// The eight `logging/setLevel` levels (RFC 5424 severities), least severe first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    /// `debug`.
    Debug,
    /// `info`.
    Info,
    /// `notice`.
    Notice,
    /// `warning`.
    Warning,
    /// `error`.
    Error,
    /// `critical`.
    Critical,
    /// `alert`.
    Alert,
    /// `emergency`.
    Emergency,
}

impl LogLevel {
    const ALL: [LogLevel; 8] = [
        LogLevel::Debug,
        LogLevel::Info,
        LogLevel::Notice,
        LogLevel::Warning,
        LogLevel::Error,
        LogLevel::Critical,
        LogLevel::Alert,
        LogLevel::Emergency,
    ];

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            LogLevel::Debug => "debug",
            LogLevel::Info => "info",
            LogLevel::Notice => "notice",
            LogLevel::Warning => "warning",
            LogLevel::Error => "error",
            LogLevel::Critical => "critical",
            LogLevel::Alert => "alert",
            LogLevel::Emergency => "emergency",
        }
    }

    /// The level named `name`, if it is one.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|l| l.as_str() == name)
    }
}

impl Session {
    /// `resources/list`, `resources/templates/list` or `prompts/list`: what registered
    /// servers signed and the principal's patterns name (`server/name`), never what an
    /// executor says it has.
    pub(super) fn list_content(&self, method: &str) -> Result<Value, RpcError> {
        let generation = self.host.current();
        let principal = self.principal(&generation)?;
        let registry = &generation.registry;
        let text = |v: Option<&str>| v.map(crate::manifest::sanitize_for_client);
        if method == "prompts/list" {
            let prompts: Vec<Value> = registry
                .prompts()
                .filter(|(server, p)| principal.may_call(server, p.name()))
                .map(|(server, p)| {
                    let arguments: Vec<Value> = p
                        .arguments()
                        .iter()
                        .map(|a| {
                            json!({"name": a.name, "description": text(a.description.as_deref()),
                                   "required": a.required})
                        })
                        .collect();
                    json!({
                        "name": generation.config.public_tool_name(server, p.name()),
                        "title": text(p.title()),
                        "description": text(p.description()),
                        "arguments": arguments,
                    })
                })
                .map(without_nulls)
                .collect();
            return Ok(json!({ "prompts": prompts }));
        }
        let templates = method == "resources/templates/list";
        let resources: Vec<Value> = registry
            .resources()
            .filter(|(server, r)| principal.may_call(server, r.name()))
            .filter(|(_, r)| {
                templates == matches!(r.locator(), crate::manifest::ResourceLocator::Template(_))
            })
            .map(|(_, r)| {
                let locator = if templates { "uriTemplate" } else { "uri" };
                without_nulls(json!({
                    locator: r.locator().as_str(),
                    "name": r.name(),
                    "title": text(r.title()),
                    "description": text(r.description()),
                    "mimeType": r.mime_type(),
                }))
            })
            .collect();
        Ok(if templates {
            json!({ "resourceTemplates": resources })
        } else {
            json!({ "resources": resources })
        })
    }

    /// `resources/read`, `prompts/get`, `completion/complete`, through the pipeline with
    /// this session's executors.
    pub(super) async fn content(&self, method: &str, params: &Value) -> Result<Value, RpcError> {
        let generation = self.host.current();
        let Some(method) = ContentMethod::from_method(method) else {
            return Err(RpcError::new(
                code::METHOD_NOT_FOUND,
                format!("method {method:?} is not served"),
            ));
        };
        let mut executors = Executors {
            session: self,
            generation: &generation,
            answered: None,
            control: CallControl::none(),
            outbox: self.out.clone(),
        };
        pipeline::content::content_request(
            &super::env(&self.host, &generation),
            self.caller(&generation),
            method,
            params,
            &mut executors,
        )
        .await
    }

    /// `resources/subscribe` and `resources/unsubscribe` of a signed resource the principal
    /// may read, forwarded to one of the session's executors of its server. What the URI
    /// carries joins the session's label and the request is recorded before the executor
    /// sees it; nothing is read, so nothing more is labelled. A refusal is recorded.
    pub(super) async fn subscription(
        &self,
        method: &str,
        params: &Value,
    ) -> Result<Value, RpcError> {
        let generation = self.host.current();
        let what = format!("({method})");
        let principal = match self.principal(&generation) {
            Ok(p) => p,
            Err(e) => return Err(self.refuse_session(&what, e).await),
        };
        let Some(uri) = params.get("uri").and_then(Value::as_str) else {
            let e = refusal(
                code::INVALID_PARAMS,
                format!("{method} needs a string \"uri\""),
                Denial::InvalidParams,
            );
            return Err(self.refuse_session(&what, e).await);
        };
        let route = match generation.registry.resource_route(uri) {
            Ok(r) => r,
            Err(unroutable) => {
                pipeline::content::warn_if_ambiguous(&unroutable, Some(&self.id));
                let e = refusal(
                    pipeline::content::RESOURCE_NOT_FOUND,
                    unroutable.client_words(),
                    Denial::UnknownResource,
                );
                return Err(self.refuse_session(&what, e).await);
            }
        };
        // From here on a refusal's record names the server and what it signed; the client is
        // told by what it asked, never by what the route found.
        let refuse =
            |e, verdict| self.refuse_subscription(&generation, method, params, &route, e, verdict);
        if !principal.may_call(&route.server_id, &route.name) {
            let e = refusal(
                code::ACCESS_DENIED,
                format!("principal {} may not use this resource", principal.id),
                Denial::AccessDenied,
            );
            return Err(refuse(e, Verdict::refused(Denial::AccessDenied)).await);
        }
        let server = &route.server_id;
        let subscribe = method == "resources/subscribe";
        // Counted in the session's set (and as in flight) before the executor is asked: it
        // may send the first update at once, and only URIs in the set reach the client. The
        // limit is checked first of all: a subscribe it refuses is neither recorded as
        // authorized nor has its URI's taint joined (a refusal below ends the count).
        let asking = if subscribe {
            match self.subscriptions.begin(server, uri, MAX_SUBSCRIPTIONS) {
                Ok(asking) => Some(asking),
                Err(Full) => {
                    let e = refusal(
                        code::INVALID_REQUEST,
                        format!(
                            "the session holds {MAX_SUBSCRIPTIONS} subscriptions, the most it may; unsubscribe one first"
                        ),
                        Denial::SubscriptionLimit,
                    );
                    return Err(refuse(e, Verdict::refused(Denial::SubscriptionLimit)).await);
                }
            }
        } else {
            None
        };
        let key = SessionKey {
            principal: principal.id.clone(),
            session: self.id.clone(),
        };
        // The executor is about to see the request (a template's variables can carry what
        // the client knows): its taint joins the state first, as a read's does, and the
        // request is recorded before it is sent.
        let (source, state, rec) = match self.host.resolver.before_content(&key, params).await {
            Ok((source, state)) => {
                let rec = pipeline::content::record_subscription(
                    &env(&self.host, &generation),
                    self.caller(&generation),
                    method,
                    params,
                    &route,
                    &source,
                    &state,
                )
                .await?;
                (source, state, rec)
            }
            Err(e) => {
                let e = refusal(
                    code::INTERNAL_ERROR,
                    format!("flow state unavailable: {e}"),
                    Denial::StateFailure,
                );
                return Err(refuse(e, Verdict::Failed(Failure::StateFailure)).await);
            }
        };
        if !subscribe {
            self.subscriptions.remove(server, uri);
            // The unsubscribe goes to the executor holding the subscription: binding takes
            // the last idle executor first. Another holder (rare: one taken while the first
            // served a call) keeps watching until idle reaping stops it; its updates no
            // longer reach the client, and a new subscribe counts it as the holder again.
            if let Ok(mut all) = self.executors.lock()
                && let Some(s) = all.get_mut(server.as_str())
                && let Some(at) = s.idle.iter().position(|b| b.subscribed.contains(uri))
            {
                let holder = s.idle.remove(at);
                s.idle.push(holder);
            }
        }
        let mut executors = Executors {
            session: self,
            generation: &generation,
            answered: None,
            control: CallControl::none(),
            outbox: self.out.clone(),
        };
        let forwarded = executors
            .subscription((server, &route.name), method, uri, &source)
            .await;
        let outcome = match forwarded {
            Ok(_) => Ok(json!({})),
            // The session stopped relaying the URI's updates above: for the client the
            // subscription has ended, as the allow recorded says, whatever the executor
            // answered. It may go on watching; what it sends no longer reaches the client.
            Err(e) if !subscribe => {
                tracing::warn!(session = %self.id, server = %server, uri = %Escaped(uri), error = %Escaped(&e), "the executor did not take the unsubscribe; the session no longer relays the resource's updates");
                Ok(json!({}))
            }
            Err(e) => {
                // Nothing is read here, so nothing is labelled: what the executor said (an
                // error's message, a broken line) goes to the host's log, never the client.
                tracing::warn!(session = %self.id, server = %server, method, uri, error = %Escaped(&e), "a subscription request failed");
                let failed = |why: &str| {
                    RpcError::new(
                        code::INTERNAL_ERROR,
                        format!(
                            "server {server:?}: {method} of {uri:?} failed: {why} (the host's log says more)"
                        ),
                    )
                };
                // Recorded as every forwarded request's failure is; told in words of its own
                // (a subscription reads nothing, so none of the executor's).
                let told = match &e {
                    ForwardError::AccessWithdrawn(why) => {
                        refusal(code::ACCESS_DENIED, why.clone(), Denial::AccessDenied)
                    }
                    ForwardError::Answered(_) => failed("its executor answered with an error"),
                    ForwardError::NotStarted(_) => failed("no executor of it could be started"),
                    ForwardError::NotTaken(_) => {
                        failed("no executor of it took the request within the host's bounds")
                    }
                    ForwardError::Failed(_) => failed("its executor failed"),
                    ForwardError::BoundReached(_) => {
                        failed("its executor ran into a bound or its deadline")
                    }
                };
                let failure = e.failure();
                // The allow recorded above did not take effect: recorded so, or the
                // records would show a subscription the client was told failed.
                match pipeline::content::record_subscription_failed(
                    &env(&self.host, &generation),
                    &rec,
                    failure,
                    &state,
                )
                .await
                {
                    Ok(()) => Err(told),
                    Err(record_failed) => Err(record_failed),
                }
            }
        };
        // A failed subscribe takes out only a URI it added, once no other subscribe of it is
        // asking and none succeeded.
        if let Some(asking) = asking {
            asking.answered(outcome.is_ok());
        }
        outcome
    }

    /// Records a subscription request routed to `route` that did not go ahead (`verdict`: a
    /// refusal, or a failure when the flow state could not be read, which is no refusal to
    /// fold) and returns `e`, what the client is told (or the record failure).
    async fn refuse_subscription(
        &self,
        generation: &Generation,
        method: &str,
        params: &Value,
        route: &ContentRoute,
        e: RpcError,
        verdict: Verdict,
    ) -> RpcError {
        match pipeline::content::refuse_subscription(
            &env(&self.host, generation),
            self.caller(generation),
            method,
            params,
            route,
            verdict,
        )
        .await
        {
            Ok(()) => e,
            Err(record_failure) => record_failure,
        }
    }

    /// `logging/setLevel`: remembered for the session and given to each executor as it is
    /// taken for the session's next request (an unknown level is refused and recorded).
    pub(super) async fn set_log_level(&self, params: &Value) -> Result<Value, RpcError> {
        let generation = self.host.current();
        if let Err(e) = self.principal(&generation) {
            return Err(self.refuse_session("(logging/setLevel)", e).await);
        }
        let Some(level) = params
            .get("level")
            .and_then(Value::as_str)
            .and_then(LogLevel::parse)
        else {
            let e = refusal(
                code::INVALID_PARAMS,
                "level must be one of debug, info, notice, warning, error, critical, alert, emergency",
                Denial::InvalidParams,
            );
            return Err(self.refuse_session("(logging/setLevel)", e).await);
        };
        if let Ok(mut l) = self.log_level.lock() {
            *l = Some(level);
        }
        // Each executor gets it when it is next taken for the session, after the check that
        // it is fit for that request's label. Sent to idle executors now, the client's choice
        // (made with whatever the session has read since) would reach executors approved for
        // an older, lower label, with connections still open, and unrecorded.
        Ok(json!({}))
    }

    /// Where resource updates of the session's executors of `server` go: to the client,
    /// for a URI that `server` signed and the session's principal may read (what an
    /// executor says of anything else is dropped).
    pub(super) fn updates_for(&self, server: &str) -> UpdateSink {
        let host = self.host.clone();
        // The principal the session acts for (pinned at `initialize`), as the current
        // configuration has it.
        let pinned = self.pinned().cloned();
        let identity = self.identity.clone();
        let out = self.out.clone();
        let subscriptions = self.subscriptions.clone();
        let server = server.to_string();
        Arc::new(move |params: &Value| {
            let Some(uri) = params.get("uri").and_then(Value::as_str) else {
                return;
            };
            if !may_watch(&host.current(), &identity, pinned.as_ref(), &server, uri) {
                tracing::debug!(server = %server, "dropped an update of a resource the session may not read");
                return;
            }
            if !subscriptions.contains(&server, uri) {
                tracing::debug!(server = %server, "dropped an update of a resource the client is not subscribed to");
                return;
            }
            // A client that does not read loses updates rather than holding the executor.
            let _ = out.try_send(mcp::notification(
                "notifications/resources/updated",
                json!({ "uri": uri }),
            ));
        })
    }
}

/// Whether a session of `identity` acting for `pinned` may watch `uri` of `server` under
/// `generation`: `server` signed the resource, the configuration still maps the identity
/// to the pinned principal (as every request of the session requires), and the principal
/// may read it. A reload can take any of this away; what it takes away, the session stops
/// watching.
pub(super) fn may_watch(
    generation: &Generation,
    identity: &Identity,
    pinned: Option<&PrincipalId>,
    server: &str,
    uri: &str,
) -> bool {
    let Some(principal) = identity
        .principal(&generation.config)
        .filter(|p| Some(&p.id) == pinned)
    else {
        return false;
    };
    generation
        .registry
        .resource_route(uri)
        .is_ok_and(|r| r.server_id == server && principal.may_call(&r.server_id, &r.name))
}

/// `value` without its `null` fields (optional fields MCP leaves out rather than nulls).
fn without_nulls(mut value: Value) -> Value {
    if let Some(map) = value.as_object_mut() {
        map.retain(|_, v| !v.is_null());
        for v in map.values_mut() {
            if let Some(items) = v.as_array_mut() {
                for item in items {
                    *item = without_nulls(std::mem::take(item));
                }
            }
        }
    }
    value
}

impl Executors<'_> {
    /// Forwards `method` to one of the session's executors of `server`; `served` sees the
    /// executor once it has answered with a result. An executor that answered is kept
    /// aside until the request is settled (see `release`).
    async fn forward_then(
        &mut self,
        (server, name): (&str, &str),
        method: &str,
        params: Value,
        source: &crate::label::InformationLabel,
        served: impl FnOnce(&mut Bound),
    ) -> Result<Value, ForwardError> {
        let deadline = super::RequestDeadline::from_now(self.generation.config.call_timeout);
        let permits = self.permits(server).map_err(ForwardError::NotStarted)?;
        let permit = deadline
            .permit(server, &permits)
            .await
            .map_err(super::NotReady::for_forward)?;
        let mut bound = self
            .ready(server, name, source, deadline)
            .await
            .map_err(super::NotReady::for_forward)?;
        let forwarded = bound.exec.forward(method, params, deadline.left()).await;
        match forwarded.map_err(|e| deadline.said(e)) {
            Ok(result) => {
                served(&mut bound);
                self.answered = Some((server.to_string(), bound, permit));
                Ok(result)
            }
            // The executor answered: it may serve again once this is settled.
            Err(ExecutorError::Rpc(why)) => {
                self.answered = Some((server.to_string(), bound, permit));
                Err(ForwardError::Answered(why))
            }
            Err(e) => {
                tracing::warn!(server = %server, method, error = %Escaped(&e), "the executor of server {server:?} failed; it is retired");
                bound.exec.stop().await;
                Err(if e.ran_into_a_bound() {
                    ForwardError::BoundReached(e.to_string())
                } else {
                    ForwardError::Failed(e.to_string())
                })
            }
        }
    }

    /// Forwards `resources/subscribe` or `resources/unsubscribe` of `uri` to one of the
    /// session's executors of `server`, which then holds (or no longer holds) the
    /// subscription.
    async fn subscription(
        &mut self,
        (server, name): (&str, &str),
        method: &str,
        uri: &str,
        source: &crate::label::InformationLabel,
    ) -> Result<Value, ForwardError> {
        let subscribe = method == "resources/subscribe";
        let answer = self
            .forward_then((server, name), method, json!({ "uri": uri }), source, |b| {
                if subscribe {
                    b.subscribed.insert(uri.to_string());
                } else {
                    b.subscribed.remove(uri);
                }
            })
            .await;
        // Nothing is read by a subscription, so nothing waits to be labelled.
        self.release(true).await;
        answer
    }
}

impl Forward for Executors<'_> {
    async fn forward(
        &mut self,
        server: &str,
        name: &str,
        method: &str,
        params: Value,
        source: &crate::label::InformationLabel,
    ) -> Result<Value, ForwardError> {
        self.forward_then((server, name), method, params, source, |_| {})
            .await
    }

    async fn settled(&mut self, durable: bool) {
        self.release(durable).await;
    }
}
