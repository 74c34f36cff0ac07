//! Judging observed decisions against the declared surface: the matcher, the rule table (one
//! outcome per decision) and the accumulator that merges findings and tracks coverage.

use super::*;

/// Declared actions indexed by provider, then class.
pub(super) struct Matcher<'d> {
    pub(super) by_key: HashMap<&'d str, HashMap<&'d str, Vec<&'d DeclaredAction>>>,
}

impl<'d> Matcher<'d> {
    pub(super) fn new(declared: &'d DeclaredSurface) -> Self {
        let mut by_key: HashMap<&str, HashMap<&str, Vec<&DeclaredAction>>> = HashMap::new();
        for a in &declared.actions {
            by_key
                .entry(a.provider.as_str())
                .or_default()
                .entry(a.action_class.as_str())
                .or_default()
                .push(a);
        }
        Matcher { by_key }
    }

    pub(super) fn candidates(&self, provider: &str, class: &str) -> &[&'d DeclaredAction] {
        self.by_key
            .get(provider)
            .and_then(|m| m.get(class))
            .map_or(&[], Vec::as_slice)
    }
}

/// The outcome of one decision (`None`: no finding), with the reason text.
pub(super) fn judge(
    matcher: &Matcher<'_>,
    d: &ObsDecision<'_>,
) -> Result<Option<(FindingKind, &'static str)>, String> {
    let effect = match d.decision.effect.0.as_ref() {
        "allow" => crate::records::Effect::Allow,
        "deny" => crate::records::Effect::Deny,
        "error" => crate::records::Effect::Error,
        other => {
            return Err(format!(
                "decision.effect {other:?} is not allow, deny or error"
            ));
        }
    };
    match d.classification.0.as_ref() {
        "not_observed" => {
            return Ok(Some((
                FindingKind::InconclusiveObservationGap,
                "the producer marked this action not observed",
            )));
        }
        "redaction_failed" => {
            return Ok(Some((
                FindingKind::InconclusiveObservationGap,
                "the producer could not redact this record faithfully",
            )));
        }
        "observed_unknown_tool" => {
            return Ok(Some((
                FindingKind::UnclassifiedToolAction,
                "no record mapping classifies this tool",
            )));
        }
        "classified" | "classified_incomplete" => {}
        other => {
            return Err(format!(
                "classification {other:?} is not one of classified, classified_incomplete, observed_unknown_tool, redaction_failed, not_observed"
            ));
        }
    }
    let (Some(category), false) = (
        d.tool.category.as_ref(),
        d.action
            .class
            .as_ref()
            .is_some_and(|c| c.0 == "unclassified"),
    ) else {
        return Ok(Some((
            FindingKind::UnclassifiedToolAction,
            "the action has no category or class",
        )));
    };
    let empty = observed::ObsTarget::default();
    let target = d.action.target.as_ref().unwrap_or(&empty);
    let provider = target.provider().unwrap_or("");
    let network = provider == crate::records::projection::NETWORK_PROVIDER;
    let verb = d.action.verb.as_ref().map(|v| v.0.as_ref());
    // A name lookup is judged by the name it asked, not by the resolver it was sent to.
    let lookup = network && verb == Some(crate::records::DNS_QUERY_SYSCALL);
    // A listener opened (or an address taken for one) is no outbound traffic: only a
    // declaration naming its verb covers it.
    let inbound = network && matches!(verb, Some("bind" | "listen"));
    let get = |f: &str| match (f, verb) {
        ("verb", Some(v)) if network => Some(super::surface::ScalarView::Text(v)),
        _ => target.get(f),
    };
    // An address the host handed out for several names was judged by each of them (a
    // rule naming any allowed it): so is the declaration. A lookup has its one name.
    let others: Vec<&str> = match (&d.flowhost, network && !lookup && !inbound) {
        (Some(x), true) => x.other_host_names(),
        _ => Vec::new(),
    };
    // An error never matches a declared allow: the effect may have happened, and an allow
    // that failed is not the success the declaration describes.
    let mut undetermined = false;
    for a in matcher.candidates(provider, &category.0) {
        if !a.allowed_effects.contains(&effect) {
            continue;
        }
        let mut tested = if lookup {
            a.test_lookup_target(get)
        } else if inbound {
            a.test_inbound_target(get)
        } else {
            a.test_target(get)
        };
        for name in &others {
            if tested == TargetMatch::Match {
                break;
            }
            let named = |f: &str| match f {
                "host_name" => Some(super::surface::ScalarView::Text(name)),
                _ => get(f),
            };
            match (a.test_target(named), tested) {
                (TargetMatch::Match, _) => tested = TargetMatch::Match,
                (TargetMatch::Undetermined, TargetMatch::Mismatch) => {
                    tested = TargetMatch::Undetermined
                }
                _ => {}
            }
        }
        match tested {
            TargetMatch::Match => return Ok(None),
            TargetMatch::Undetermined => undetermined = true,
            TargetMatch::Mismatch => {}
        }
    }
    // A declared denial the target cannot be checked against (a record of refusals folded
    // without their destinations) is undecided, not undeclared.
    if effect == crate::records::Effect::Deny && !undetermined {
        return Ok(Some((
            FindingKind::AttemptedPrivilegedToolActionDenied,
            "denied, and no declared action expects this denial",
        )));
    }
    if undetermined {
        return Ok(Some((
            FindingKind::InconclusiveToolTarget,
            "a declared action covers the provider, class and effect, but the observed target lacks a field it constrains",
        )));
    }
    Ok(Some((
        FindingKind::NewPrivilegedToolAction,
        "no declared action covers this provider, class, target and effect",
    )))
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Key {
    pub(super) kind: FindingKind,
    pub(super) server: Option<String>,
    pub(super) tool: String,
    pub(super) provider: Option<String>,
    pub(super) category: Option<String>,
    pub(super) effect: String,
    pub(super) target: String,
}

#[derive(Debug, Default)]
pub(super) struct Acc {
    pub(super) decisions: u64,
    /// Decisions carrying the flowhost chain fields.
    pub(super) chained: u64,
    /// Chained decisions whose `flowhost.event` is `tool_call`.
    pub(super) tool_calls: u64,
    pub(super) order: Vec<Key>,
    pub(super) findings: HashMap<Key, Finding>,
}

impl Acc {
    /// Judges one decision; `at` builds its location (only when one is needed).
    pub(super) fn judge(
        &mut self,
        matcher: &Matcher<'_>,
        d: &ObsDecision<'_>,
        at: impl Fn() -> ObservedRef,
    ) -> Result<(), String> {
        self.decisions += 1;
        let x = d.flowhost.as_ref();
        let times = x.map_or(1, |x| x.times(&d.decision.effect.0));
        if let Some(x) = x.filter(|x| x.chained()) {
            self.chained += 1;
            if x.event_is("tool_call") {
                self.tool_calls += 1;
            }
        }
        // Borrowed: most decisions make no finding, and need no copy of either.
        let server = d
            .server
            .as_ref()
            .and_then(|s| s.id.as_ref())
            .map(|id| id.0.as_ref());
        let tool: &str = &d.tool.name.0;
        // A session-level refusal (a peer refused at initialize, a request that named no
        // tool) is evidence in the chain but no tool action: nothing to compare with a
        // declared surface. So is a content request (a read of a signed resource, a prompt,
        // a completion): it has no effect outside the session, whose label it raised; and a
        // relayed request of a call (judged with its call). Only flowhost's own chained
        // records, verified before any is judged, are taken at their word: another
        // producer's decision calling itself one of these is judged like any other.
        if x.filter(|x| x.chained()).is_some_and(|x| {
            x.event_is("session")
                || x.event_is("content_request")
                || x.event_is("content_outcome")
                || x.event_is("relay")
        }) {
            return Ok(());
        }
        if let Some((kind, reason)) = judge(matcher, d)? {
            let target = d.action.target.as_ref().map(observed::ObsTarget::to_json);
            let key = Key {
                kind,
                server: server.map(str::to_string),
                tool: tool.to_string(),
                provider: d
                    .action
                    .target
                    .as_ref()
                    .and_then(|t| t.provider())
                    .map(str::to_string),
                category: d.tool.category.as_ref().map(|c| c.0.to_string()),
                effect: d.decision.effect.0.to_string(),
                target: target.as_ref().map(|t| t.to_string()).unwrap_or_default(),
            };
            let message = format!(
                "{kind}: {} {} by tool {}: {reason}",
                match (&key.provider, &key.category) {
                    (Some(p), Some(c)) => format!("{p}/{c}"),
                    (None, Some(c)) => c.clone(),
                    _ => "unclassified action".to_string(),
                },
                key.effect,
                key.tool
            );
            self.add(key, message, target, (times, &at));
        }
        let undeclared = x.is_some_and(|x| {
            x.event_is("egress_attempt")
                && x.egress_basis.is_some_and(|b| b.undeclared_but_observed())
        });
        if undeclared {
            let message = format!(
                "undeclared_egress: tool {tool}{} attempted outbound I/O, but its signed declaration says egress: false (allowed or refused, the declaration is false)",
                server
                    .map(|s| format!(" of server {s}"))
                    .unwrap_or_default()
            );
            let key = Key {
                kind: FindingKind::UndeclaredEgress,
                server: server.map(str::to_string),
                tool: tool.to_string(),
                provider: None,
                category: None,
                effect: String::new(),
                target: String::new(),
            };
            self.add(key, message, None, (times, &at));
        }
        Ok(())
    }

    /// Counts `times` occurrences of the finding `key` (a folded record's refusals), creating
    /// it on first sight.
    pub(super) fn add(
        &mut self,
        key: Key,
        message: String,
        target: Option<serde_json::Value>,
        (times, at): (u64, &impl Fn() -> ObservedRef),
    ) {
        if let Some(f) = self.findings.get_mut(&key) {
            f.occurrences = f.occurrences.saturating_add(times);
            if f.examples.len() < MAX_EXAMPLES {
                f.examples.push(at());
            }
            return;
        }
        let f = Finding {
            kind: key.kind,
            severity: key.kind.severity(),
            message,
            server: key.server.clone(),
            tool: Some(key.tool.clone()),
            provider: key.provider.clone(),
            category: key.category.clone(),
            effect: (!key.effect.is_empty()).then(|| key.effect.clone()),
            target,
            occurrences: times,
            examples: vec![at()],
        };
        self.order.push(key.clone());
        self.findings.insert(key, f);
    }

    pub(super) fn shift_lines(&mut self, offset: u64) {
        for f in self.findings.values_mut() {
            for r in &mut f.examples {
                if let Some(l) = r.line.as_mut() {
                    *l += offset;
                }
            }
        }
    }

    /// Appends `later` (which comes after `self` in stream order).
    pub(super) fn merge(&mut self, later: Acc) {
        self.decisions += later.decisions;
        self.chained += later.chained;
        self.tool_calls += later.tool_calls;
        let mut later_findings = later.findings;
        for key in later.order {
            let Some(f) = later_findings.remove(&key) else {
                continue;
            };
            match self.findings.get_mut(&key) {
                Some(mine) => {
                    mine.occurrences = mine.occurrences.saturating_add(f.occurrences);
                    let room = MAX_EXAMPLES.saturating_sub(mine.examples.len());
                    mine.examples.extend(f.examples.into_iter().take(room));
                }
                None => {
                    self.order.push(key.clone());
                    self.findings.insert(key, f);
                }
            }
        }
    }

    pub(super) fn finish(
        mut self,
        mut evidence: EvidenceSet,
        health: &[ToolObservationHealth],
        options: DiffOptions,
    ) -> DiffReport {
        let mut gaps = match health {
            [] => vec![
                "no tool_observation_health was given (--health), so completeness is unknown"
                    .to_string(),
            ],
            [h] => {
                let mut gaps = incomplete(h).into_iter().collect::<Vec<_>>();
                gaps.extend(binding_gaps(h, &evidence.sources));
                gaps
            }
            // Each host's completeness from its own health is set here, and lowered below.
            fleet => fleet_gaps(fleet, &mut evidence.sources, &evidence.links),
        };
        let mut unattributed = false;
        if !options.unchained_from_other_observer {
            for s in &evidence.sources {
                if s.evidence == Evidence::Unchained && s.decisions > 0 {
                    unattributed = true;
                    gaps.push(format!(
                        "{}: {} decisions carry no flowhost chain (flowhost.seq, flowhost.prev_hash), so they cannot be verified or bound to a flowhost health; if another observer produced them, say so with --unchained-from-other-observer",
                        s.path.display(),
                        s.decisions
                    ));
                }
            }
        }
        for dir in &evidence.unanchored {
            gaps.push(format!(
                "{} has records but no head anchor ({}), so whole lines cut from its end cannot be detected",
                dir.display(),
                crate::records::store::HEAD_FILE
            ));
        }
        // Each verified source's completeness, once every gap is known: one health vouches
        // for the whole run; in a fleet, a host is also incomplete when its directory lost
        // its anchor, or when decisions nobody observed are about (they may be its own).
        let run_complete = gaps.is_empty();
        // With a source rejected, the health was never bound to the others (the rejection
        // decides the verdict): nothing says they are complete.
        let bound = !evidence
            .sources
            .iter()
            .any(|s| s.evidence == Evidence::Rejected);
        for s in evidence
            .sources
            .iter_mut()
            .filter(|s| s.evidence == Evidence::Verified)
        {
            s.observation_complete = match health {
                [] => None,
                [_] if !bound => None,
                [_] => Some(run_complete),
                _ => s
                    .observation_complete
                    .map(|own| own && !unattributed && !evidence.unanchored.contains(&s.path)),
            };
        }
        let mut findings: Vec<Finding> = rejections(&evidence.problems);
        findings.extend(self.order.iter().filter_map(|k| self.findings.remove(k)));
        if !gaps.is_empty() {
            findings.push(run_finding(
                FindingKind::InconclusiveObservationGap,
                format!("inconclusive_observation_gap: {}", gaps.join("; ")),
                1,
                None,
            ));
        }
        // Stable order: severity, then kind, then first appearance (already the order).
        findings.sort_by_key(|f| (f.severity, f.kind));
        let has = |pred: &dyn Fn(FindingKind) -> bool| findings.iter().any(|f| pred(f.kind));
        let verdict = if has(&|k| k == FindingKind::EvidenceRejected) {
            Verdict::EvidenceRejected
        } else if has(&|k| k != FindingKind::InconclusiveObservationGap) {
            Verdict::Findings
        } else if !gaps.is_empty() || has(&|k| k == FindingKind::InconclusiveObservationGap) {
            Verdict::Inconclusive
        } else {
            Verdict::Clean
        };
        let observation_complete = gaps.is_empty()
            && !has(&|k| {
                matches!(
                    k,
                    FindingKind::InconclusiveObservationGap | FindingKind::EvidenceRejected
                )
            });
        DiffReport {
            schema: DIFF_SCHEMA,
            verdict,
            observed_decisions: self.decisions,
            observation_complete,
            sources: evidence.sources,
            findings,
            exit_code: verdict.exit_code(),
        }
    }
}
