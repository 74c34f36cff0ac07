//! Judging the egress attempts the broker reports: the resolver decides against the call in
//! flight, the decision is recorded durably, and only then is the verdict returned to the
//! broker (an allow's record is on disk before the connect or send happens). A record that
//! cannot be written refuses the attempt.

use std::pin::Pin;
use std::sync::Arc;

use flowhost_broker::{AttemptInfo, Destination, EgressAttempt, Verdict as BrokerVerdict};

use super::CallInFlight;
use super::executor::{AttemptSink, Judgment};
use crate::destination::{DestinationRules, HostName, NameBlocks, OriginRules};
use crate::dns::Lookup;
use crate::records::{
    BrokerDetails, Correlation, DecisionRecord, DeclarationMismatch, Denial, EgressBasis,
    EgressFacts, FlowContext, InetDestination, RecordWriter, ServerInfo, UnixDestination, Verdict,
};
use crate::resolver::FlowResolver;

/// The rules of each principal, by principal.
type OriginMap = std::collections::BTreeMap<crate::ident::PrincipalId, OriginRules>;

/// The per-origin destination rules a generation's judges decide by, by principal: set
/// when the generation is built, and narrowed in place by every later reload, refused or
/// not, that takes rules out (the judges of running executors decide by the narrowed rules
/// from their next attempt on), with how many times they were: an address the
/// generation's resolvers handed out before a narrowing was screened by fewer blocks.
#[derive(Debug, Default)]
pub struct Origins {
    /// The rules, and how many narrowings made them, read and written together.
    rules: std::sync::RwLock<(Arc<OriginMap>, u64)>,
    /// The same count, for the resolvers to stamp their answers with; moved under the
    /// rules' write lock, so a resolver that reads the new count judges by the new rules.
    narrowings: crate::dns::Narrowings,
}

impl Origins {
    /// Rules built from `principals`' per-origin destinations.
    pub fn of(principals: &[crate::config::PrincipalConfig]) -> Self {
        Origins {
            rules: std::sync::RwLock::new((Arc::new(Self::map(principals)), 0)),
            narrowings: Default::default(),
        }
    }

    /// How many times these rules were narrowed, shared with the resolvers they judge for.
    pub fn narrowings(&self) -> crate::dns::Narrowings {
        self.narrowings.clone()
    }

    fn map(principals: &[crate::config::PrincipalConfig]) -> OriginMap {
        principals
            .iter()
            .filter_map(|p| Some((p.id.clone(), p.destinations.clone()?)))
            .collect()
    }

    /// The rules decided by now.
    pub fn current(&self) -> Arc<OriginMap> {
        self.counted().0
    }

    /// The rules decided by now, with how many narrowings made them.
    pub fn counted(&self) -> (Arc<OriginMap>, u64) {
        match self.rules.read() {
            Ok(r) => r.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// From now on, each principal's rules as far as `principals` still give them (see
    /// [`narrowed_origin`]): a principal they no longer hold keeps its block rules alone,
    /// so a call of it still running is refused what it was refused, and allowed nothing
    /// more. Narrowing again by the same principals changes nothing; nothing is widened.
    pub fn narrow_by(&self, principals: &[crate::config::PrincipalConfig]) {
        let now = |id: &crate::ident::PrincipalId| {
            principals
                .iter()
                .find(|p| p.id == *id)
                .and_then(|p| p.destinations.as_ref())
        };
        // Under the write lock throughout: two narrowings at once both apply.
        let mut rules = match self.rules.write() {
            Ok(r) => r,
            Err(poisoned) => poisoned.into_inner(),
        };
        let current = &rules.0;
        let mut next = OriginMap::new();
        for (id, kept) in current.iter() {
            if let Some(kept) = narrowed_origin(Some(kept), now(id)) {
                next.insert(id.clone(), kept);
            }
        }
        for p in principals.iter().filter(|p| !current.contains_key(&p.id)) {
            if let Some(blocks) = narrowed_origin(None, p.destinations.as_ref()) {
                next.insert(p.id.clone(), blocks);
            }
        }
        if **current == next {
            return;
        }
        *rules = (Arc::new(next), rules.1 + 1);
        self.narrowings.add_one();
    }
}

/// A principal's per-origin destinations `old` as far as `new` still gives them: the allow
/// rules written the same in both, and every block rule of either.
pub(super) fn narrowed_origin(
    old: Option<&OriginRules>,
    new: Option<&OriginRules>,
) -> Option<OriginRules> {
    let mut kept = old.cloned().unwrap_or_default();
    kept.allow
        .retain(|r| new.is_some_and(|n| n.allow.contains(r)));
    for block in new.map(|n| n.block.as_slice()).unwrap_or_default() {
        if !kept.block.contains(block) {
            kept.block.push(block.clone());
        }
    }
    (old.is_some() || kept != OriginRules::default()).then_some(kept)
}

/// Judges one server's executors' attempts.
pub struct EgressJudge {
    /// The server.
    pub server_id: String,
    /// Its manifest digest.
    pub digest: String,
    /// The resolver.
    pub resolver: Arc<FlowResolver>,
    /// The record writer.
    pub records: RecordWriter,
    /// The server's destination rules.
    pub destinations: Arc<DestinationRules>,
    /// Per-origin destination rules, by principal (from the same configuration, narrowed
    /// by a refused reload that takes rules out).
    pub origins: Arc<Origins>,
    /// The host's counters (declaration mismatches per tool).
    pub counters: Arc<super::HostCounters>,
    /// Executors (by pid) already warned about for undeclared egress.
    pub warned: std::sync::Mutex<std::collections::HashSet<i32>>,
    /// The host's refusal folder: repeated refusals of one executor fold.
    pub refusals: Arc<super::refusals::RefusalFolder>,
}

/// Most executors remembered as warned; past it the memory starts over (a repeated warning
/// is better than unbounded growth).
const MAX_WARNED: usize = 4096;

/// The rules' view of a destination the broker decoded (every form has one), for an
/// address the executor did not get from a lookup the host answered.
pub fn rules_destination(d: &Destination) -> crate::destination::Destination {
    named_rules_destination(d, &[])
}

/// The rules' view of a destination the broker decoded, with what the executor's lookups
/// say of it ([`crate::dns::Naming`]): a lookup past the executor's own resolver is one no
/// rule reaches.
///
/// `narrowings` is how many narrowings made the rules it is judged by: names the resolver
/// gave under a smaller count ([`crate::dns::Naming::Names`]'s `counted`) were screened
/// by fewer block rules, and vouch for nothing.
pub fn judged_destination(
    d: &Destination,
    naming: &crate::dns::Naming,
    narrowings: u64,
) -> crate::destination::Destination {
    use crate::destination::Destination as R;
    match naming {
        crate::dns::Naming::PastResolver(addr) => R::LookupPastResolver(*addr),
        crate::dns::Naming::Names { names, counted } => match d {
            Destination::Inet(addr) if !names.is_empty() && *counted < narrowings => {
                R::HandedOutBeforeNarrowing(*addr)
            }
            _ => named_rules_destination(d, names),
        },
        crate::dns::Naming::BeforeNarrowing(addr) => R::HandedOutBeforeNarrowing(*addr),
    }
}

/// The rules' view of a destination the broker decoded; `names` are the host names the
/// executor's lookups got the address as an answer for, the last one first (empty: none).
pub fn named_rules_destination(
    d: &Destination,
    names: &[HostName],
) -> crate::destination::Destination {
    use crate::destination::Destination as R;
    match d {
        Destination::Inet(addr) => match names {
            [name, also @ ..] => R::Named {
                addr: *addr,
                name: name.clone(),
                also: also.to_vec(),
            },
            [] => R::Inet(*addr),
        },
        Destination::UnixPath(p) => R::UnixPath(p.clone()),
        Destination::UnixAbstract(n) => R::UnixAbstract(n.clone()),
        Destination::UnixUnnamed => R::UnixUnnamed,
        Destination::Netlink { port_id, .. } => R::Netlink { port_id: *port_id },
        Destination::Unspecified => R::Disconnect,
        other => match record_destination(other, &[]) {
            crate::records::Destination::Undecoded(u) => R::Undecidable(u.undecoded),
            // The unspecified IP: the kernel would pick the address, so no rule applies.
            crate::records::Destination::Inet(i) => {
                R::Undecidable(format!("unspecified_address_{}_{}", i.address, i.port))
            }
            _ => R::Undecidable("undecodable".into()),
        },
    }
}

/// The record form of a destination the broker decoded: every form has one (nothing the
/// broker saw is recorded without a destination). `names`: as for
/// [`named_rules_destination`].
fn record_destination(d: &Destination, names: &[HostName]) -> crate::records::Destination {
    use crate::records::{Destination as R, NetlinkDestination, UndecodedDestination};
    let undecoded = |what: String| R::Undecoded(UndecodedDestination { undecoded: what });
    match d {
        Destination::Inet(addr) | Destination::AnyAddress(addr) => R::Inet(InetDestination {
            address: addr.ip(),
            port: addr.port(),
            host_name: names.first().map(HostName::to_string),
            other_host_names: names.iter().skip(1).map(HostName::to_string).collect(),
        }),
        Destination::UnixPath(p) => R::Unix(UnixDestination {
            unix_path: p.display().to_string(),
        }),
        Destination::UnixAbstract(name) => R::Unix(UnixDestination {
            unix_path: format!("@{}", String::from_utf8_lossy(name)),
        }),
        Destination::UnixUnnamed => undecoded("unix_unnamed".into()),
        Destination::Netlink { port_id, groups } => R::Netlink(NetlinkDestination {
            netlink_port_id: *port_id,
            netlink_groups: *groups,
        }),
        Destination::Unspecified => undecoded("af_unspec".into()),
        Destination::Foreign {
            family,
            socket_family,
        } => undecoded(format!(
            "foreign_family_{family}_on_socket_family_{socket_family}"
        )),
        Destination::Scoped { address, scope_id } => undecoded(format!(
            "scoped_{}_interface_{scope_id}_port_{}",
            address.ip(),
            address.port()
        )),
        Destination::Other { family } => undecoded(format!("undecoded_family_{family}")),
        Destination::Malformed { family, len } => undecoded(match family {
            Some(f) => format!("malformed_family_{f}_len_{len}"),
            None => format!("malformed_len_{len}"),
        }),
    }
}

/// The record form of what the broker saw, for an address the executor did not get from a
/// lookup the host answered.
pub fn broker_details(info: &AttemptInfo) -> BrokerDetails {
    named_broker_details(info, &[])
}

/// The record form of what the broker saw (`names`: as for [`named_rules_destination`]).
pub fn named_broker_details(info: &AttemptInfo, names: &[HostName]) -> BrokerDetails {
    BrokerDetails {
        pid: info.pid.max(0) as u32,
        executable: info.executable.as_ref().map(|p| p.display().to_string()),
        syscall: info.syscall.as_str().to_string(),
        family: info.socket.family_name(),
        socket_type: Some(info.socket.type_name()),
        protocol: Some(info.socket.protocol_name()),
        destination: info
            .destination
            .as_ref()
            .map(|d| record_destination(d, names)),
        bytes: info.bytes.map(|b| b as u64),
        dns_query_type: None,
    }
}

/// The record form of one lookup executor `pid` sent to its resolver: an egress attempt of
/// syscall `dns_query` to the resolver's address, carrying the name and record type asked
/// (none for a query not served).
pub fn lookup_broker_details(lookup: &Lookup, pid: i32) -> BrokerDetails {
    BrokerDetails {
        pid: pid.max(0) as u32,
        executable: None,
        syscall: crate::records::DNS_QUERY_SYSCALL.into(),
        family: if lookup.resolver.is_ipv4() {
            "inet"
        } else {
            "inet6"
        }
        .into(),
        socket_type: Some(
            if lookup.transport == "tcp" {
                "stream"
            } else {
                "dgram"
            }
            .into(),
        ),
        protocol: Some(lookup.transport.into()),
        destination: Some(crate::records::Destination::Inet(InetDestination {
            address: lookup.resolver.ip(),
            port: lookup.resolver.port(),
            host_name: lookup.name().map(HostName::to_string),
            other_host_names: Vec::new(),
        })),
        bytes: Some(lookup.bytes as u64),
        dns_query_type: lookup.record_type().map(|t| t.to_string()),
    }
}

impl EgressJudge {
    /// Counts an egress attempt the signed declaration does not admit, and warns once per
    /// executor: the tool's publisher signed a declaration that the executor contradicts.
    fn undeclared_egress(&self, call: &CallInFlight) {
        if let Ok(mut counts) = self.counters.declaration_mismatches.lock() {
            *counts.entry(call.tool.clone()).or_insert(0) += 1;
        }
        let first = self.warned.lock().is_ok_and(|mut warned| {
            if warned.len() >= MAX_WARNED {
                warned.clear();
            }
            warned.insert(call.executor_pid)
        });
        if first {
            tracing::warn!(
                server = %self.server_id,
                tool = %call.tool,
                executor_pid = call.executor_pid,
                "the executor attempted outbound I/O although the signed manifest declares no egress for this tool; each attempt is judged as egress and recorded as undeclared_egress"
            );
        }
    }

    /// The facts recorded of one judged attempt: `judged` is the call in flight and the
    /// resolver's judgment, `None` when no call was in flight.
    fn facts(
        &self,
        judged: Option<(&CallInFlight, &crate::resolver::EgressJudgment)>,
        details: BrokerDetails,
    ) -> EgressFacts {
        let server = ServerInfo::mcp(&self.server_id, Some(&self.digest));
        let Some((call, v)) = judged else {
            return EgressFacts {
                server,
                tool_name: "(no call in flight)".into(),
                broker: details,
                verdict: Verdict::refused(Denial::NoCallInFlight),
                credential_alias: None,
                correlation: Correlation::none(),
                // No call, so no declaration was consulted: a basis saying one was
                // (declared: false) made the diff report the tool's declaration false.
                context: FlowContext::default(),
            };
        };
        let mismatch = (!call.plan.basis.declared).then(|| {
            self.undeclared_egress(call);
            DeclarationMismatch::UndeclaredEgress
        });
        EgressFacts {
            server,
            tool_name: call.tool.clone(),
            broker: details,
            verdict: v.verdict.clone(),
            credential_alias: None,
            correlation: call.correlation.clone(),
            context: FlowContext {
                principal: Some(call.plan.key.principal.to_string()),
                session: Some(call.plan.key.session.clone()),
                call_id: Some(call.call_id.clone()),
                source_label: Some(v.source.clone()),
                clearance_used: Some(v.clearances.clone()),
                egress_basis: Some(EgressBasis {
                    observed: true,
                    ..call.plan.basis
                }),
                declaration_mismatch: mismatch,
                grant: call
                    .plan
                    .grant
                    .as_ref()
                    .map(|g| crate::records::GrantFacts {
                        id: g.id.clone(),
                        purpose: g.purpose.to_string(),
                    }),
                ..FlowContext::default()
            },
        }
    }

    /// The record of a judged attempt, or `None` when it is a refusal folded with identical
    /// ones (see [`super::refusals`]): nothing is then written now.
    fn record_unless_folded(&self, facts: EgressFacts, executor: i32) -> Option<DecisionRecord> {
        let executor = u32::try_from(executor).unwrap_or(0);
        if self.refusals.admit_egress(&facts, executor) == super::refusals::Admit::Folded {
            return None;
        }
        Some(DecisionRecord::egress_attempt(facts))
    }

    async fn decide(
        &self,
        call: Option<Arc<CallInFlight>>,
        attempt: EgressAttempt,
        naming: crate::dns::Naming,
        executor: i32,
    ) -> Judgment {
        let info = attempt.info().clone();
        let details = named_broker_details(&info, naming.names());
        // The rules and their narrowing count, read together: names the resolver gave
        // before a narrowing these rules carry are refused.
        let (origins, narrowings) = self.origins.counted();
        let judged = match &call {
            None => None,
            Some(call) => Some(
                self.resolver
                    .decide_egress(
                        &call.plan,
                        info.destination
                            .as_ref()
                            .map(|d| judged_destination(d, &naming, narrowings))
                            .as_ref(),
                        &self.destinations,
                        origins.get(&call.plan.key.principal),
                    )
                    .await,
            ),
        };
        let facts = self.facts(call.as_deref().zip(judged.as_ref()), details);
        let under_grant = judged.as_ref().is_some_and(|v| v.under_grant);
        let allowed = judged.and_then(|v| v.verdict.allowed().then_some(v.source));
        let Some(record) = self.record_unless_folded(facts, executor) else {
            attempt.respond(BrokerVerdict::DENY);
            return Judgment::default();
        };
        match self.records.commit(record).await {
            Ok(_) => match allowed {
                Some(source) => {
                    attempt.respond(BrokerVerdict::Allow);
                    Judgment {
                        approved_under: Some(source),
                        under_grant,
                    }
                }
                None => {
                    attempt.respond(BrokerVerdict::DENY);
                    Judgment::default()
                }
            },
            Err(e) => {
                tracing::error!(server = %self.server_id, error = %e, "egress record not written; refusing the attempt");
                attempt.respond(BrokerVerdict::DENY);
                Judgment::default()
            }
        }
    }

    /// Judges one lookup of executor `pid` and records it, allowed or refused, as an egress
    /// attempt of syscall `dns_query` to the executor's resolver, carrying the name asked:
    /// the name leaves the host when it is asked upstream, so an allowed lookup's record is
    /// durable before that, and one that cannot be written refuses the lookup. An allowed
    /// lookup comes with the block rules of its call, by which the names its answer leads
    /// through are judged.
    async fn decide_lookup(
        &self,
        call: Option<Arc<CallInFlight>>,
        lookup: Lookup,
        pid: i32,
    ) -> (Judgment, NameBlocks) {
        let origins = self.origins.current();
        let origin = |call: &CallInFlight| origins.get(&call.plan.key.principal);
        let judged = match (&call, lookup.name()) {
            (None, _) => None,
            (Some(call), Some(name)) => Some(
                self.resolver
                    .decide_lookup(&call.plan, name, &self.destinations, origin(call))
                    .await,
            ),
            // A query not served names nothing to judge: the call's flow facts, refused
            // below.
            (Some(call), None) => Some(
                self.resolver
                    .decide_egress(&call.plan, None, &self.destinations, origin(call))
                    .await,
            ),
        };
        // A type not served is refused whatever the rules say (a flow refusal stands); a
        // query not served always is, and says so.
        let judged = judged.map(|mut v| {
            // A decision is replaced, never a failure to decide (a state read that failed is
            // recorded as such).
            let decided = matches!(
                v.verdict,
                Verdict::Authorized { .. } | Verdict::Refused { .. }
            );
            if let Some((denial, rule)) = lookup.refused_anyway()
                && (v.verdict.allowed() || (decided && lookup.name().is_none()))
            {
                v.verdict = Verdict::Refused {
                    denial,
                    rule: Some(rule),
                };
            }
            v
        });
        let blocks = match &call {
            Some(call) => NameBlocks::of(
                &self.destinations,
                origins
                    .get(&call.plan.key.principal)
                    .map(|o| (call.plan.key.principal.as_str(), o)),
            ),
            None => NameBlocks::default(),
        };
        let details = lookup_broker_details(&lookup, pid);
        let facts = self.facts(call.as_deref().zip(judged.as_ref()), details);
        let under_grant = judged.as_ref().is_some_and(|v| v.under_grant);
        let allowed = judged.and_then(|v| v.verdict.allowed().then_some(v.source));
        let Some(record) = self.record_unless_folded(facts, pid) else {
            return (Judgment::default(), blocks);
        };
        match self.records.commit(record).await {
            Ok(_) => (
                Judgment {
                    approved_under: allowed,
                    under_grant,
                },
                blocks,
            ),
            Err(e) => {
                tracing::error!(server = %self.server_id, error = %e, "lookup record not written; refusing the lookup");
                (Judgment::default(), blocks)
            }
        }
    }
}

impl AttemptSink<CallInFlight> for EgressJudge {
    fn judge(
        &self,
        call: Option<Arc<CallInFlight>>,
        attempt: EgressAttempt,
        naming: crate::dns::Naming,
        executor: i32,
    ) -> Pin<Box<dyn std::future::Future<Output = Judgment> + Send + '_>> {
        Box::pin(self.decide(call, attempt, naming, executor))
    }

    fn judge_lookup(
        &self,
        call: Option<Arc<CallInFlight>>,
        lookup: Lookup,
        pid: i32,
    ) -> Pin<Box<dyn std::future::Future<Output = (Judgment, NameBlocks)> + Send + '_>> {
        Box::pin(self.decide_lookup(call, lookup, pid))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refused reload narrows the rules its judges decide by in place: a principal it
    /// keeps has what is left of its rules, and one it takes out keeps its block rules,
    /// so a call of it still running is refused what it was refused. Before, a principal
    /// taken out lost its entry, and its running calls were judged by the server's rules
    /// alone, which its blocks had narrowed.
    #[test]
    fn narrowing_keeps_the_blocks_of_a_principal_taken_out() {
        let rule = |s: &str| s.parse::<crate::destination::DestinationRule>().unwrap();
        let principal = |id: &str, allow: &str, block: &str| crate::config::PrincipalConfig {
            id: crate::ident::PrincipalId::new(id).unwrap(),
            uids: vec![1],
            gids: vec![],
            tools: vec!["*".into()],
            destinations: Some(OriginRules {
                allow: vec![rule(allow)],
                block: vec![rule(block)],
            }),
        };
        let origins = Origins::of(&[
            principal("kept", "10.0.0.1:443", "10.0.0.2:443"),
            principal("gone", "10.0.0.3:443", "10.0.0.4:443"),
        ]);
        origins.narrow_by(&[principal("kept", "10.0.0.1:443", "10.0.0.2:443")]);
        let now = origins.current();
        let gone = &now[&crate::ident::PrincipalId::new("gone").unwrap()];
        assert!(gone.allow.is_empty());
        assert_eq!(gone.block, [rule("10.0.0.4:443")]);
        let kept = &now[&crate::ident::PrincipalId::new("kept").unwrap()];
        assert_eq!(kept.allow, [rule("10.0.0.1:443")]);
        // Counted once: narrowing again by the same principals changes nothing, and the
        // addresses the resolvers handed out since stay good.
        assert_eq!(origins.narrowings().count(), 1);
        origins.narrow_by(&[principal("kept", "10.0.0.1:443", "10.0.0.2:443")]);
        assert_eq!(origins.narrowings().count(), 1);
        assert_eq!(origins.counted().1, 1);
    }
}
