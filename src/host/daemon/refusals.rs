//! Folding repeated refusals, so that a peer cannot fill the records' disk (and so lock every
//! other principal out when the writer then fails closed) by repeating a refused request.
//!
//! Within one interval, the first refusal of a kind (same principal or unmapped peer, same
//! event, reason, server and tool, target, session, labels and grant, and for a relay the
//! same request and direction) is recorded as usual; identical ones after it are only
//! counted, and one record with `flowhost.folded: {count, first_at, last_at}` stands for them
//! when the interval closes, naming no call or trace, which each had of its own.
//! Each principal (or unmapped peer) also has a budget of refusal records per interval; past
//! it, its refusals fold into one record per event, reason and relay request per interval,
//! which names no server, tool, call or session, since it stands for many. What a client is
//! told never changes: every refusal is still refused, with its reason.
//!
//! An executor's refused egress attempts and lookups fold the same way: identical ones (same
//! executor, call, syscall, destination, reason: everything recorded of the attempt but its
//! byte count and time) within an interval are counted into one record, and each executor
//! (server and pid) has a budget of refusal records per interval, past which its refusals
//! fold into one record per tool, syscall, reason and destination that names no call or
//! session (and, once the folder holds as many kinds as it may, one per tool, syscall and
//! reason that names no destination). Executors' refusals have room of their own, apart
//! from principals'. An executor looping on a refused send (a misconfigured statsd client,
//! or one trying to) so costs a few records an interval, not one durable write per attempt.
//!
//! A crash loses the counts of the interval in progress (never a decision: folded refusals
//! had no effect to record before).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sha2::Digest;

use crate::decision::Denial;
use crate::records::{
    Correlation, DecisionRecord, EgressFacts, EventKind, Folded, Projection, RelayFacts,
    ServerInfo, ToolCallFacts, now_rfc3339,
};

/// Who a refusal is charged to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Holder {
    Principal(String),
    Peer(u32),
}

/// What makes two refusals identical. `tool` (server id and tool name) and `what` (a
/// digest of everything else recorded of them but their call, trace and time: the target,
/// the session, the labels, the grant) are `None` for the over-budget fold.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct FoldKey {
    holder: Holder,
    event: EventKind,
    denial: Option<Denial>,
    relay: Option<RelayFacts>,
    tool: Option<(String, String)>,
    what: Option<[u8; 32]>,
}

/// Refusals counted but not yet recorded.
struct Fold {
    event: EventKind,
    facts: ToolCallFacts,
    count: u64,
    first_at: String,
    last_at: String,
}

/// What makes two refused egress attempts (or lookups) identical: the executor, the reason,
/// the tool, the syscall, what made it egress and how it contradicts the declaration, and
/// (`what`: a digest of) everything else recorded of them but the byte count and time
/// (`None` for the executor's over-budget fold, which keeps the rest).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct EgressKey {
    server: String,
    pid: u32,
    denial: Option<Denial>,
    tool: String,
    syscall: String,
    basis: Option<crate::records::EgressBasis>,
    mismatch: Option<crate::records::DeclarationMismatch>,
    what: Option<[u8; 32]>,
    /// The destination of an over-budget fold (`None` past the folder's room).
    to: Option<[u8; 32]>,
}

/// Refused egress attempts counted but not yet recorded.
struct EgressFold {
    facts: EgressFacts,
    count: u64,
    first_at: String,
    last_at: String,
}

impl Window {
    /// The client refusal kinds remembered this interval, folds included: the bound on
    /// their memory (executors' refusals have a bound of their own, so that an executor
    /// cannot use up the room principals' refusals are judged in).
    fn kinds(&self) -> usize {
        self.seen.len() + self.folds.len()
    }

    /// The executor refusal kinds remembered this interval, folds included.
    fn egress_kinds(&self) -> usize {
        self.egress_seen.len() + self.egress_folds.len()
    }
}

struct Window {
    started: Instant,
    /// Refusal kinds recorded this interval.
    seen: HashMap<FoldKey, ()>,
    /// Refusal records charged to each holder this interval.
    charged: HashMap<Holder, usize>,
    folds: HashMap<FoldKey, Fold>,
    /// Egress refusal kinds recorded this interval.
    egress_seen: HashMap<EgressKey, ()>,
    /// Egress refusal records charged to each executor (server, pid) this interval.
    egress_charged: HashMap<(String, u32), usize>,
    /// Over-budget folds by destination each executor holds this interval: as many as its
    /// budget, then its refusals fold by reason alone (each fold is a record at the end of
    /// the interval, so one executor trying every port would otherwise write them all).
    egress_destination_folds: HashMap<(String, u32), usize>,
    egress_folds: HashMap<EgressKey, EgressFold>,
}

/// Whether a refusal is to be recorded now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Record it as usual.
    Record,
    /// Counted into a fold; recorded when the interval closes.
    Folded,
}

/// The folding state of one host.
pub struct RefusalFolder {
    interval: Duration,
    budget: usize,
    window: Mutex<Window>,
}

/// Most refusal kinds remembered in one interval across all holders; past it, every holder
/// is treated as over budget (memory stays bounded whatever peers send).
const MAX_KINDS: usize = 65_536;

impl RefusalFolder {
    /// Folds identical refusals within `interval`, allowing `budget` refusal records per
    /// holder per interval.
    pub fn new(interval: Duration, budget: usize) -> Self {
        RefusalFolder {
            interval,
            budget,
            window: Mutex::new(Window {
                started: Instant::now(),
                seen: HashMap::new(),
                charged: HashMap::new(),
                folds: HashMap::new(),
                egress_seen: HashMap::new(),
                egress_charged: HashMap::new(),
                egress_destination_folds: HashMap::new(),
                egress_folds: HashMap::new(),
            }),
        }
    }

    /// Decides whether the egress attempt (or lookup) `facts` is recorded now or folded
    /// (see the module docs). Only refusals fold: an allow is recorded before its effect,
    /// and a failure to decide (the flow state unreadable) is recorded each time.
    /// `executor` is the pid of the executor that made it: its budget, whichever of its
    /// threads (or processes) made the attempt.
    pub fn admit_egress(&self, facts: &EgressFacts, executor: u32) -> Admit {
        if !matches!(facts.verdict, crate::records::Verdict::Refused { .. }) {
            return Admit::Record;
        }
        let pid = executor;
        let denial = facts.verdict.denial();
        let mut same = facts.broker.clone();
        same.bytes = None;
        // The calling thread: an executor that starts a thread (or a process) per attempt
        // must not make each one a kind of its own.
        same.pid = 0;
        let c = &facts.context;
        let Ok(what) = serde_json::to_vec(&(&c.principal, &c.session, &c.call_id, &same)) else {
            return Admit::Record;
        };
        let key = EgressKey {
            server: facts.server.id.clone(),
            pid,
            denial,
            tool: facts.tool_name.clone(),
            syscall: facts.broker.syscall.clone(),
            basis: c.egress_basis,
            mismatch: c.declaration_mismatch,
            what: Some(sha2::Sha256::digest(&what).into()),
            to: None,
        };
        // A poisoned lock: record (the safe side is more evidence, not less).
        let Ok(mut w) = self.window.lock() else {
            return Admit::Record;
        };
        let key = if w.egress_seen.contains_key(&key) {
            key
        } else {
            let executor = (key.server.clone(), pid);
            let charged = w.egress_charged.get(&executor).copied().unwrap_or(0);
            if charged < self.budget && w.egress_kinds() < MAX_KINDS {
                w.egress_seen.insert(key, ());
                *w.egress_charged.entry(executor).or_insert(0) += 1;
                return Admit::Record;
            }
            // Over budget: one fold per destination (calls and sessions aside), for as many
            // destinations as the executor's budget while the folder has room; past that,
            // one per reason that names no destination.
            let to = serde_json::to_vec(&facts.broker.destination).ok();
            let over = EgressKey {
                what: None,
                to: to.map(|t| sha2::Sha256::digest(&t).into()),
                ..key
            };
            let held = w
                .egress_destination_folds
                .get(&executor)
                .copied()
                .unwrap_or(0);
            if w.egress_folds.contains_key(&over)
                || (held < self.budget && w.egress_kinds() < MAX_KINDS)
            {
                if !w.egress_folds.contains_key(&over) {
                    *w.egress_destination_folds.entry(executor).or_insert(0) += 1;
                }
                over
            } else {
                EgressKey { to: None, ..over }
            }
        };
        let now = now_rfc3339();
        match w.egress_folds.get_mut(&key) {
            Some(f) => {
                f.count += 1;
                f.last_at = now;
            }
            None => {
                let facts = if key.what.is_none() {
                    egress_over_budget(facts, key.to.is_some())
                } else {
                    facts.clone()
                };
                w.egress_folds.insert(
                    key,
                    EgressFold {
                        facts,
                        count: 1,
                        first_at: now.clone(),
                        last_at: now,
                    },
                );
            }
        }
        Admit::Folded
    }

    /// How long an interval lasts.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Decides whether the refusal recorded as `event` from `facts` is recorded now or
    /// folded. A refusal whose holder cannot be told (no principal, no peer) is always
    /// recorded.
    pub fn admit(&self, event: EventKind, facts: &ToolCallFacts) -> Admit {
        let holder = match (&facts.context.principal, &facts.context.peer) {
            (Some(p), _) => Holder::Principal(p.clone()),
            (None, Some(peer)) => Holder::Peer(peer.uid),
            (None, None) => return Admit::Record,
        };
        let denial = facts.verdict.denial();
        let relay = facts.context.relay;
        let (p, c) = (&facts.projection, &facts.context);
        let Ok(what) = serde_json::to_vec(&(
            (
                p.classification,
                &p.reason_code,
                &p.detail,
                &p.category,
                &p.action,
            ),
            &facts.server.declared_manifest_digest,
            &facts.credential_alias,
            (&c.session, &c.source_label, &c.clearance_used, &c.grant),
        )) else {
            return Admit::Record;
        };
        let key = FoldKey {
            holder: holder.clone(),
            event,
            denial,
            relay,
            tool: Some((facts.server.id.clone(), facts.tool_name.clone())),
            what: Some(sha2::Sha256::digest(&what).into()),
        };
        // A poisoned lock: record (the safe side is more evidence, not less).
        let Ok(mut w) = self.window.lock() else {
            return Admit::Record;
        };
        let key = if w.seen.contains_key(&key) {
            key
        } else {
            let charged = w.charged.get(&holder).copied().unwrap_or(0);
            if charged < self.budget && w.kinds() < MAX_KINDS {
                w.seen.insert(key, ());
                *w.charged.entry(holder).or_insert(0) += 1;
                return Admit::Record;
            }
            FoldKey {
                holder,
                event,
                denial,
                relay,
                tool: None,
                what: None,
            }
        };
        let now = now_rfc3339();
        match w.folds.get_mut(&key) {
            Some(f) => {
                f.count += 1;
                f.last_at = now;
            }
            None => {
                let facts = if key.tool.is_none() {
                    over_budget(facts)
                } else {
                    // What the refusals share: not the first one's call or trace.
                    let mut shared = facts.clone();
                    shared.correlation = Correlation::none();
                    shared.context.call_id = None;
                    shared
                };
                w.folds.insert(
                    key,
                    Fold {
                        event,
                        facts,
                        count: 1,
                        first_at: now.clone(),
                        last_at: now,
                    },
                );
            }
        }
        Admit::Folded
    }

    /// Closes the interval if it has run out (or `force`), returning one record per fold.
    pub fn take_due(&self, force: bool) -> Vec<DecisionRecord> {
        let Ok(mut w) = self.window.lock() else {
            return Vec::new();
        };
        if !force && w.started.elapsed() < self.interval {
            return Vec::new();
        }
        w.started = Instant::now();
        w.seen.clear();
        w.charged.clear();
        w.egress_seen.clear();
        w.egress_charged.clear();
        w.egress_destination_folds.clear();
        let calls: Vec<DecisionRecord> = w
            .folds
            .drain()
            .map(|(_, f)| {
                let mut facts = f.facts;
                facts.context.folded = Some(Folded {
                    count: f.count,
                    first_at: f.first_at,
                    last_at: f.last_at,
                });
                DecisionRecord::from_call_facts(facts, f.event)
            })
            .collect();
        let egress = w.egress_folds.drain().map(|(_, f)| {
            let mut facts = f.facts;
            facts.context.folded = Some(Folded {
                count: f.count,
                first_at: f.first_at,
                last_at: f.last_at,
            });
            DecisionRecord::egress_attempt(facts)
        });
        calls.into_iter().chain(egress).collect()
    }
}

/// The facts of an over-budget fold: what all its refusals share (holder, verdict, event,
/// relay request), and nothing of the first one's call, which the others did not share.
fn over_budget(first: &ToolCallFacts) -> ToolCallFacts {
    let c = &first.context;
    ToolCallFacts {
        server: ServerInfo::mcp("(various)", None),
        tool_name: "(refusals over the per-interval budget)".to_string(),
        projection: Projection::unknown_tool(),
        verdict: first.verdict.clone(),
        credential_alias: None,
        correlation: Correlation::none(),
        context: crate::records::FlowContext {
            principal: c.principal.clone(),
            peer: c.peer,
            relay: c.relay,
            ..Default::default()
        },
    }
}

/// The facts of an executor's over-budget egress fold: what all its refusals share (the
/// executor, the reason, the tool, the syscall, what made them egress and how they
/// contradict the declaration; the socket of the first; their destination when
/// `same_destination`), and no byte count, call or session, which the others did not share.
fn egress_over_budget(first: &EgressFacts, same_destination: bool) -> EgressFacts {
    let mut broker = first.broker.clone();
    if !same_destination {
        broker.destination = None;
    }
    broker.bytes = None;
    broker.dns_query_type = None;
    EgressFacts {
        server: first.server.clone(),
        tool_name: first.tool_name.clone(),
        broker,
        verdict: first.verdict.clone(),
        credential_alias: None,
        correlation: Correlation::none(),
        context: crate::records::FlowContext {
            egress_basis: first.context.egress_basis,
            declaration_mismatch: first.context.declaration_mismatch,
            ..Default::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::{FlowContext, PeerIdentity, RelayDirection, RelayMethod, Verdict};

    fn refusal(principal: Option<&str>, tool: &str) -> ToolCallFacts {
        ToolCallFacts {
            server: ServerInfo::mcp("(none)", None),
            tool_name: tool.to_string(),
            projection: Projection::unknown_tool(),
            verdict: Verdict::refused(Denial::UnknownTool),
            credential_alias: None,
            correlation: Correlation::none(),
            context: FlowContext {
                principal: principal.map(str::to_string),
                peer: principal
                    .is_none()
                    .then_some(PeerIdentity { uid: 7, gid: 7 }),
                ..FlowContext::default()
            },
        }
    }

    #[test]
    fn identical_refusals_fold_and_a_budget_caps_distinct_ones() {
        let f = RefusalFolder::new(Duration::from_secs(3600), 3);
        let call = EventKind::ToolCall;
        assert_eq!(f.admit(call, &refusal(Some("a"), "x")), Admit::Record);
        for _ in 0..10 {
            assert_eq!(f.admit(call, &refusal(Some("a"), "x")), Admit::Folded);
        }
        assert_eq!(f.admit(call, &refusal(Some("a"), "y")), Admit::Record);
        assert_eq!(f.admit(call, &refusal(Some("a"), "z")), Admit::Record);
        // Over budget: a fourth distinct kind folds into the budget fold.
        for i in 0..50 {
            assert_eq!(
                f.admit(call, &refusal(Some("a"), &format!("n{i}"))),
                Admit::Folded
            );
        }
        // Another principal and an unmapped peer have budgets of their own.
        assert_eq!(f.admit(call, &refusal(Some("b"), "x")), Admit::Record);
        assert_eq!(
            f.admit(EventKind::Session, &refusal(None, "x")),
            Admit::Record
        );
        assert!(f.take_due(false).is_empty(), "the interval has not run out");
        let mut folded: Vec<(String, u64)> = f
            .take_due(true)
            .into_iter()
            .map(|mut r| {
                let n = r.flowhost.folded.as_ref().unwrap().count;
                r.flowhost.seq = 1;
                r.validate().unwrap();
                (r.tool.name, n)
            })
            .collect();
        folded.sort();
        assert_eq!(
            folded,
            vec![
                ("(refusals over the per-interval budget)".to_string(), 50),
                ("x".to_string(), 10)
            ]
        );
        // A new interval starts afresh.
        assert_eq!(f.admit(call, &refusal(Some("a"), "x")), Admit::Record);
    }

    /// Refusals of one tool on different targets are not identical: each kind of target is
    /// recorded (or folded) on its own, and a fold names no call or trace of one of them.
    /// Before, they folded into one record bearing the first's target, call and session,
    /// counted as many times as there were calls, so a diff read every refusal as one on
    /// that target (and a declared denial of it covered them all).
    #[test]
    fn refusals_on_other_targets_are_not_identical() {
        let f = RefusalFolder::new(Duration::from_secs(3600), 4);
        let on = |repo: &str, call: &str| {
            let mut facts = refusal(Some("a"), "create_deploy_key");
            facts.verdict = Verdict::refused(Denial::AccessDenied);
            let mut target = crate::records::Target::for_provider("github");
            target.insert_text("repo", repo);
            facts.projection.action.target = Some(target);
            facts.context.call_id = Some(call.to_string());
            facts
        };
        let call = EventKind::ToolCall;
        assert_eq!(f.admit(call, &on("a", "c1")), Admit::Record);
        assert_eq!(f.admit(call, &on("b", "c2")), Admit::Record);
        assert_eq!(f.admit(call, &on("b", "c3")), Admit::Folded);
        assert_eq!(f.admit(call, &on("b", "c4")), Admit::Folded);
        let folds = f.take_due(true);
        assert_eq!(folds.len(), 1, "{folds:#?}");
        let fold = &folds[0];
        assert_eq!(fold.flowhost.folded.as_ref().unwrap().count, 2);
        let target = fold.action.target.as_ref().unwrap();
        assert_eq!(
            target.0.get("repo").map(|v| format!("{v:?}")),
            Some(format!(
                "{:?}",
                crate::records::TargetValue::Text("b".into())
            ))
        );
        assert_eq!(fold.flowhost.call_id, None, "{fold:#?}");
    }

    /// `facts` admitted as its executor's, the executor being the thread that made it.
    fn admit(f: &RefusalFolder, facts: &EgressFacts) -> Admit {
        f.admit_egress(facts, facts.broker.pid)
    }

    /// An executor that makes each refused attempt from a thread (or process) of its own is
    /// still one executor: its refusals fold once past its budget. Before, each thread id
    /// was a budget and a kind of its own, and one record was written per attempt.
    #[test]
    fn the_threads_of_one_executor_share_its_budget() {
        let f = RefusalFolder::new(Duration::from_secs(3600), 2);
        let mut recorded = 0;
        for thread in 1000..1100 {
            let mut e = egress(thread, 53, 1);
            e.broker.pid = thread;
            if f.admit_egress(&e, 7) == Admit::Record {
                recorded += 1;
            }
        }
        assert_eq!(recorded, 1, "one kind of refusal, from one executor");
        for (thread, port) in (2000..2100).zip(1000..) {
            let e = egress(thread, port, 1);
            let _ = f.admit_egress(&e, 7);
        }
        let w = f.window.lock().unwrap();
        assert_eq!(w.egress_charged.len(), 1, "one budget: the executor's");
        // Past its budget, an executor trying port after port holds as many destination
        // folds as its budget, then one by reason: each fold is a record when the interval
        // closes. Before, one per port.
        assert!(
            w.egress_folds.len() <= 1 + 2 + 1,
            "{}",
            w.egress_folds.len()
        );
    }

    fn egress(pid: u32, port: u16, bytes: u64) -> EgressFacts {
        EgressFacts {
            server: ServerInfo::mcp("inbox", None),
            tool_name: "publish".into(),
            broker: crate::records::BrokerDetails {
                pid,
                executable: None,
                syscall: "sendto".into(),
                family: "inet".into(),
                socket_type: Some("dgram".into()),
                protocol: Some("udp".into()),
                destination: Some(crate::records::Destination::Inet(
                    crate::records::InetDestination {
                        address: "192.0.2.1".parse().unwrap(),
                        port,
                        host_name: None,
                        other_host_names: Vec::new(),
                    },
                )),
                bytes: Some(bytes),
                dns_query_type: None,
            },
            verdict: Verdict::refused(Denial::DestinationBlocked),
            credential_alias: None,
            correlation: Correlation::none(),
            context: FlowContext {
                principal: Some("a".into()),
                call_id: Some("c1".into()),
                ..FlowContext::default()
            },
        }
    }

    /// An executor's identical refused attempts (whatever their byte counts) fold into one
    /// record with their count; distinct ones past its budget fold into one that names no
    /// destination; another executor has a budget of its own.
    #[test]
    fn an_executors_repeated_egress_refusals_fold() {
        let f = RefusalFolder::new(Duration::from_secs(3600), 2);
        assert_eq!(admit(&f, &egress(10, 53, 1)), Admit::Record);
        for n in 0..20 {
            assert_eq!(admit(&f, &egress(10, 53, n)), Admit::Folded);
        }
        assert_eq!(admit(&f, &egress(10, 54, 1)), Admit::Record);
        for port in 55..60 {
            assert_eq!(admit(&f, &egress(10, port, 1)), Admit::Folded);
        }
        assert_eq!(admit(&f, &egress(11, 53, 1)), Admit::Record);
        let mut folds: Vec<(Option<u16>, u64)> = f
            .take_due(true)
            .into_iter()
            .map(|mut r| {
                r.flowhost.seq = 1;
                r.validate().unwrap();
                assert_eq!(r.tool.name, "publish");
                let port = match r
                    .flowhost
                    .broker
                    .as_ref()
                    .and_then(|b| b.destination.clone())
                {
                    Some(crate::records::Destination::Inet(i)) => Some(i.port),
                    _ => None,
                };
                (port, r.flowhost.folded.unwrap().count)
            })
            .collect();
        folds.sort();
        // Over budget, an executor's first destinations (as many as its budget) each have
        // their fold (calls aside); the rest fold into one that names no destination.
        assert_eq!(
            folds,
            [(None, 3), (Some(53), 20), (Some(55), 1), (Some(56), 1)]
        );
        // A new interval starts afresh.
        assert_eq!(admit(&f, &egress(10, 53, 1)), Admit::Record);
        // A failure to decide (the state unreadable) and an allow are recorded each time:
        // a fold stands for refusals only.
        for verdict in [
            Verdict::Failed(crate::records::Failure::StateFailure),
            Verdict::Authorized { rule: None },
        ] {
            for _ in 0..3 {
                let mut e = egress(10, 53, 1);
                e.verdict = verdict.clone();
                assert_eq!(admit(&f, &e), Admit::Record, "{verdict:?}");
            }
        }
        // Refusals of another tool, or with another basis, are not the same over budget.
        let g = RefusalFolder::new(Duration::from_secs(3600), 1);
        assert_eq!(admit(&g, &egress(10, 53, 1)), Admit::Record);
        let mut other = egress(10, 54, 1);
        other.tool_name = "fetch".into();
        for _ in 0..2 {
            assert_eq!(admit(&g, &egress(10, 55, 1)), Admit::Folded);
            assert_eq!(admit(&g, &other), Admit::Folded);
        }
        let tools: Vec<String> = g.take_due(true).into_iter().map(|r| r.tool.name).collect();
        assert_eq!(tools.len(), 2, "{tools:?}");
    }

    /// Past its budget of destination folds, an executor's refusals to yet more
    /// destinations fold into one record per reason that names no destination, counting
    /// every one of them: memory and records stay bounded, and nothing is dropped
    /// uncounted. Before, one executor trying every port held a fold (and so wrote a
    /// record) per port, up to the folder's room of 65,536.
    #[test]
    fn past_its_budget_an_executor_folds_without_destinations() {
        let f = RefusalFolder::new(Duration::from_secs(3600), 1);
        let total = MAX_KINDS + 10;
        for i in 0..total {
            let mut e = egress(10, (i % 65_536) as u16, 1);
            if let Some(crate::records::Destination::Inet(d)) = e.broker.destination.as_mut() {
                d.address = std::net::Ipv4Addr::new(192, 0, 2, (i / 65_536) as u8).into();
            }
            admit(&f, &e);
        }
        let records = f.take_due(true);
        // One executor: one destination fold (its budget), then one by reason.
        assert_eq!(records.len(), 2);
        let counted: u64 = records
            .iter()
            .map(|r| r.flowhost.folded.as_ref().unwrap().count)
            .sum();
        assert_eq!(
            counted as usize,
            total - 1,
            "all but the first, which was recorded"
        );
        let without: Vec<_> = records
            .iter()
            .filter(|r| {
                r.flowhost
                    .broker
                    .as_ref()
                    .is_some_and(|b| b.destination.is_none())
            })
            .collect();
        assert_eq!(without.len(), 1);
        assert_eq!(
            without[0].flowhost.folded.as_ref().unwrap().count as usize,
            total - 2
        );
    }

    #[test]
    fn refusals_of_other_relay_requests_or_servers_are_not_identical() {
        let f = RefusalFolder::new(Duration::from_secs(3600), 4);
        let relay = |method| {
            let mut r = refusal(Some("a"), "x");
            r.context.relay = Some(RelayFacts {
                method,
                direction: RelayDirection::ToClient,
            });
            r
        };
        let relay_event = EventKind::Relay;
        assert_eq!(
            f.admit(relay_event, &relay(RelayMethod::Sampling)),
            Admit::Record
        );
        assert_eq!(
            f.admit(relay_event, &relay(RelayMethod::Elicitation)),
            Admit::Record
        );
        assert_eq!(
            f.admit(relay_event, &relay(RelayMethod::Sampling)),
            Admit::Folded
        );
        let mut elsewhere = refusal(Some("a"), "x");
        elsewhere.server = ServerInfo::mcp("other-server", None);
        assert_eq!(
            f.admit(EventKind::ToolCall, &refusal(Some("a"), "x")),
            Admit::Record
        );
        assert_eq!(f.admit(EventKind::ToolCall, &elsewhere), Admit::Record);
        // Over budget: one fold per relay request, naming no call of any of them.
        for i in 0..3 {
            let mut r = relay(RelayMethod::Elicitation);
            r.context.call_id = Some(format!("call-{i}"));
            r.context.session = Some("s".into());
            r.tool_name = format!("t{i}");
            assert_eq!(f.admit(relay_event, &r), Admit::Folded);
        }
        let mut folds = f.take_due(true);
        folds.sort_by_key(|r| r.flowhost.folded.as_ref().unwrap().count);
        let budget = folds.last().unwrap();
        assert_eq!(budget.flowhost.folded.as_ref().unwrap().count, 3);
        assert_eq!(budget.tool.name, "(refusals over the per-interval budget)");
        assert_eq!(budget.server.id, "(various)");
        assert_eq!(budget.flowhost.call_id, None);
        assert_eq!(budget.flowhost.session, None);
        assert_eq!(
            budget.flowhost.relay.map(|r| r.method),
            Some(RelayMethod::Elicitation)
        );
    }
}
