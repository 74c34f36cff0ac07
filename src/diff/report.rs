//! Rendering a [`DiffReport`]: plain text for people, JSON for tools, SARIF 2.1.0 for code
//! scanning (one result per finding).

use flowhost_broker::Escaped;
use serde_json::{Value, json};

use super::{DiffReport, FindingKind, Severity, Verdict};

/// The text report: one line per finding, then a summary line naming the exit code. What the
/// observed input named (tool and server names, targets, file names) is shown with every
/// control character (C0, DEL, C1) escaped, so no input can drive the terminal.
pub fn to_text(report: &DiffReport) -> String {
    let mut out = String::new();
    for f in &report.findings {
        out.push_str(&format!(
            "{:<7} {}",
            f.severity.to_string(),
            Escaped(&f.message)
        ));
        if let Some(server) = &f.server {
            out.push_str(&format!("\n        server {}", Escaped(server)));
        }
        if let Some(t) = &f.target {
            out.push_str(&format!("\n        target {}", Escaped(t)));
        }
        if f.occurrences > 1 {
            out.push_str(&format!("\n        {} occurrences", f.occurrences));
        }
        for e in &f.examples {
            out.push_str(&format!("\n        at {}", Escaped(e)));
        }
        out.push('\n');
    }
    let verdict = match report.verdict {
        Verdict::Clean => "clean: no findings and observation complete",
        Verdict::Findings => "findings",
        Verdict::Inconclusive => {
            "no findings, but observation is incomplete or not bound to the records: not a clean result"
        }
        Verdict::EvidenceRejected => {
            "evidence rejected: observed flowhost records do not verify, so nothing can be concluded from them"
        }
    };
    out.push_str(&format!(
        "{} observed decisions, {} findings, exit {}: {verdict}\n",
        report.observed_decisions,
        report.findings.len(),
        report.exit_code
    ));
    out
}

/// The JSON report (`flowhost.diff.v1`).
pub fn to_json(report: &DiffReport) -> String {
    // A report of strings, numbers and plain JSON values always serialises.
    serde_json::to_string_pretty(report).unwrap_or_default()
}

fn level(s: Severity) -> &'static str {
    match s {
        Severity::Error => "error",
        Severity::Warning => "warning",
        Severity::Note => "note",
    }
}

/// The SARIF 2.1.0 log: one run, one rule per outcome kind, one result per finding. A result
/// is located at its first observed decision (file and line for JSONL input).
pub fn to_sarif(report: &DiffReport) -> String {
    let rules: Vec<Value> = FindingKind::ALL
        .iter()
        .map(|k| {
            json!({
                "id": k.as_str(),
                "shortDescription": {"text": k.description()},
                "defaultConfiguration": {"level": level(k.severity())},
            })
        })
        .collect();
    let results: Vec<Value> = report
        .findings
        .iter()
        .map(|f| {
            let rule_index = FindingKind::ALL.iter().position(|k| *k == f.kind);
            let locations: Vec<Value> = f
                .examples
                .first()
                .map(|e| {
                    let mut physical = json!({
                        "artifactLocation": {"uri": e.file.to_string_lossy()},
                    });
                    if let Some(line) = e.line {
                        physical["region"] = json!({"startLine": line});
                    }
                    vec![json!({"physicalLocation": physical})]
                })
                .unwrap_or_default();
            json!({
                "ruleId": f.kind.as_str(),
                "ruleIndex": rule_index,
                "level": level(f.severity),
                "message": {"text": f.message},
                "locations": locations,
                "properties": {
                    "occurrences": f.occurrences,
                    "server": f.server,
                    "tool": f.tool,
                    "provider": f.provider,
                    "category": f.category,
                    "effect": f.effect,
                    "target": f.target,
                    "examples": f.examples,
                },
            })
        })
        .collect();
    let log = json!({
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {
                "name": "flowhost",
                "version": env!("CARGO_PKG_VERSION"),
                "rules": rules,
            }},
            "results": results,
            "properties": {
                "observed_decisions": report.observed_decisions,
                "observation_complete": report.observation_complete,
                "verdict": report.verdict,
                "exit_code": report.exit_code,
            },
        }],
    });
    serde_json::to_string_pretty(&log).unwrap_or_default()
}
