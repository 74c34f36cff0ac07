//! Coverage: turning verification problems into rejections, and binding each health to the
//! records it vouches for (one per host in a fleet), naming every mismatch.

use super::*;

/// A finding about the run rather than one decision.
pub(super) fn run_finding(
    kind: FindingKind,
    message: String,
    occurrences: u64,
    at: Option<&Location>,
) -> Finding {
    Finding {
        kind,
        severity: kind.severity(),
        message,
        server: None,
        tool: None,
        provider: None,
        category: None,
        effect: None,
        target: None,
        occurrences,
        examples: at
            .map(|l| ObservedRef {
                file: l.file.clone(),
                line: l.line,
                index: l.index,
                seq: None,
            })
            .into_iter()
            .collect(),
    }
}

/// One `evidence_rejected` finding per verification problem (the first [`MAX_REJECTIONS`];
/// the rest counted in one more).
pub(super) fn rejections(problems: &[Problem]) -> Vec<Finding> {
    let mut out: Vec<Finding> = problems
        .iter()
        .take(MAX_REJECTIONS)
        .map(|p| {
            run_finding(
                FindingKind::EvidenceRejected,
                format!("evidence_rejected: {p}"),
                1,
                Some(&p.at),
            )
        })
        .collect();
    if problems.len() > MAX_REJECTIONS {
        let rest = problems.len() - MAX_REJECTIONS;
        out.push(run_finding(
            FindingKind::EvidenceRejected,
            format!(
                "evidence_rejected: {rest} more problems; `flowhost records verify` lists them all"
            ),
            rest as u64,
            problems.get(MAX_REJECTIONS).map(|p| &p.at),
        ));
    }
    out
}

/// Why `h` says observation was incomplete, if it does.
pub(super) fn incomplete(h: &ToolObservationHealth) -> Option<String> {
    let reasons = h.assess();
    (!reasons.is_empty()).then(|| format!("observation was incomplete: {}", reasons.join("; ")))
}

/// A fleet: several healths, each paired with the verified record stream whose chain head it
/// names. Every stream needs its own complete, bound health; a health that pairs with no
/// stream is a gap too (it vouches for records nobody gave).
pub(super) fn fleet_gaps(
    healths: &[ToolObservationHealth],
    sources: &mut [ObservedSource],
    links: &[Vec<ChainLink>],
) -> Vec<String> {
    let mut gaps = Vec::new();
    let mut used = vec![false; healths.len()];
    if sources.iter().any(|s| s.evidence == Evidence::Rejected) {
        // Rejected records decide the verdict; pairing what is left would only add noise.
        return healths.iter().filter_map(incomplete).collect();
    }
    gaps.extend(one_chain_twice(sources, links));
    for s in sources
        .iter_mut()
        .filter(|s| s.evidence == Evidence::Verified)
    {
        let head = s.chain_head.clone().unwrap_or_else(|| GENESIS_HASH.into());
        let paired = healths.iter().enumerate().position(|(i, h)| {
            !used[i] && h.records.chain_head.as_deref().unwrap_or(GENESIS_HASH) == head
        });
        let mine: Vec<String> = match paired {
            None => vec![format!(
                "no --health names chain head {head}, so its observation is unknown"
            )],
            Some(i) => {
                used[i] = true;
                let h = &healths[i];
                incomplete(h)
                    .into_iter()
                    .chain(binding_gaps(h, std::slice::from_ref(s)))
                    .collect()
            }
        };
        s.observation_complete = Some(mine.is_empty());
        gaps.extend(
            mine.into_iter()
                .map(|g| format!("{}: {g}", s.path.display())),
        );
    }
    for (i, h) in healths.iter().enumerate().filter(|(i, _)| !used[*i]) {
        gaps.push(format!(
            "--health #{} (chain head {}) pairs with no observed flowhost record stream",
            i + 1,
            h.records.chain_head.as_deref().unwrap_or(GENESIS_HASH)
        ));
    }
    gaps
}

/// A record's link to the one before it, as a key two streams can share: the first 128 bits
/// of its `prev_hash` (`None` for the genesis, which every host's first record links to, and
/// for a hash of another form). Two hosts' streams of `a` and `b` records share a key by a
/// chance of about a·b/2^128 (none, for any fleet), which could only make the fleet look
/// incomplete.
pub(super) fn chain_link(prev_hash: &str) -> Option<ChainLink> {
    if prev_hash == GENESIS_HASH {
        return None;
    }
    let hex = prev_hash.strip_prefix("sha256:")?.get(..32)?;
    ChainLink::from_str_radix(hex, 16).ok()
}

/// See [`chain_link`].
pub(super) type ChainLink = u128;

/// A verified stream's keys for [`one_chain_twice`]: its records' links and its head
/// (together, every record it holds and the one before its first), sorted, each once.
pub(super) fn chain_keys(mut links: Vec<ChainLink>, head: Option<&str>) -> Vec<ChainLink> {
    links.extend(head.and_then(chain_link));
    links.sort_unstable();
    links.dedup();
    links
}

/// Verified streams that are parts of one host's chain: one holds a record of the other, or
/// begins right after one (an older copy of a host's records, with the health its run wrote
/// then, beside the newer; a copy given twice; a later piece of one stream). Each would pair
/// with a health of its own, and another host's records would go unjudged. `keys` holds
/// each source's [`chain_keys`] (empty for one that is not verified records).
pub(super) fn one_chain_twice(sources: &[ObservedSource], keys: &[Vec<ChainLink>]) -> Vec<String> {
    let verified: Vec<usize> = (0..sources.len())
        .filter(|&i| sources[i].evidence == Evidence::Verified)
        .collect();
    let mut pairs: Vec<(usize, usize)> = Vec::new();
    for (n, &j) in verified.iter().enumerate() {
        for &i in &verified[n + 1..] {
            if let (Some(a), Some(b)) = (keys.get(j), keys.get(i))
                && share_one(a, b)
            {
                pairs.push((j, i));
            }
        }
    }
    pairs
        .into_iter()
        .map(|(j, i)| {
            format!(
                "{} and {} hold parts of one record chain (one holds a record of the other, or begins right after one): one host's records were given twice, so another host's records are missing",
                sources[j].path.display(),
                sources[i].path.display()
            )
        })
        .collect()
}

/// Whether two sorted key sets share one.
fn share_one(a: &[ChainLink], b: &[ChainLink]) -> bool {
    let (mut x, mut y) = (a.iter().peekable(), b.iter().peekable());
    while let (Some(p), Some(q)) = (x.peek(), y.peek()) {
        match p.cmp(q) {
            std::cmp::Ordering::Less => {
                x.next();
            }
            std::cmp::Ordering::Greater => {
                y.next();
            }
            std::cmp::Ordering::Equal => return true,
        }
    }
    false
}

/// How `health` fails to describe the verified flowhost records among `sources` (empty:
/// bound). See the module docs for the contract.
pub(super) fn binding_gaps(h: &ToolObservationHealth, sources: &[ObservedSource]) -> Vec<String> {
    if sources.iter().any(|s| s.evidence == Evidence::Rejected) {
        // Rejected records decide the verdict; binding to what is left would only add noise.
        return Vec::new();
    }
    // A running producer's carrier binds only when written as its run ended: one asked for
    // while it went on says nothing of what came after it, and records that end where it
    // does may only mean that later attempts were refused without one (a writer that failed)
    // or that the producer died before its last word.
    let ran = matches!(h.producer, HealthProducer::Daemon | HealthProducer::Sandbox);
    if ran && h.run_ended != Some(true) {
        return vec![format!(
            "run_ended: the health {}, so it vouches for nothing after it; judge with the health its producer wrote as the run ended",
            match h.run_ended {
                Some(false) => "was written on demand, before its run ended",
                _ =>
                    "does not say whether it was written as its run ended (a carrier from before the field?)",
            }
        )];
    }
    let verified: Vec<&ObservedSource> = sources
        .iter()
        .filter(|s| s.evidence == Evidence::Verified)
        .collect();
    if verified.len() > 1 {
        return vec![format!(
            "one health carrier binds one record stream, but {} flowhost record sources were given ({})",
            verified.len(),
            verified
                .iter()
                .map(|s| s.path.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )];
    }
    let (range, head, tool_calls) = match verified.first() {
        Some(s) => (
            (s.first_seq, s.last_seq),
            s.chain_head.clone().unwrap_or_else(|| GENESIS_HASH.into()),
            s.tool_calls,
        ),
        None => ((None, None), GENESIS_HASH.to_string(), 0),
    };
    let mut gaps = Vec::new();
    let vouched = (h.records.first_seq, h.records.last_seq);
    if vouched != range {
        gaps.push(format!(
            "records.first_seq..records.last_seq: the health says {}, the records hold {}",
            show_range(vouched),
            show_range(range)
        ));
    }
    let vouched_head = h.records.chain_head.as_deref().unwrap_or(GENESIS_HASH);
    if vouched_head != head {
        gaps.push(format!(
            "records.chain_head: the health says {vouched_head}, the records end in {head}"
        ));
    }
    if let Some(n) = h.tool_calls_observed
        && n != tool_calls
    {
        gaps.push(format!(
            "tool_calls_observed: the health says {n}, the records hold {tool_calls}"
        ));
    }
    gaps
}

pub(super) fn show_range((first, last): (Option<u64>, Option<u64>)) -> String {
    match (first, last) {
        (Some(a), Some(b)) => format!("seq {a}..={b}"),
        (Some(a), None) => format!("seq {a}.."),
        (None, Some(b)) => format!("seq ..={b}"),
        (None, None) => "no records".to_string(),
    }
}
