//! Manifest verification and registry admission.
//!
//! Verification of a 5-tool signed manifest is measured side by side with its floor: the
//! bare Ed25519 strict verification of the same canonical bytes (interleaved, one run).
//! Registration of 1,000 five-tool manifests (each verified, checked against its policies
//! and its five input schemas compiled) is timed whole, several times, median reported.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use ed25519_dalek::SigningKey;
use flowhost::keys::public_key_to_hex;
use flowhost::{InformationLabel, RuntimeTopology, SignedManifest, ToolPolicy, VerifiedRegistry};
use serde_json::{Value, json};

use crate::harness::{Row, Samples, fmt_duration, interleaved};

const TOOLS: usize = 5;
const MANIFESTS: usize = 1_000;

fn tool_names() -> Vec<String> {
    (0..TOOLS).map(|i| format!("tool_{i}")).collect()
}

/// A five-tool body resembling the pricing lab's: real schemas, every tool with a flow
/// declaration carrying a label.
fn label() -> Value {
    json!({"kind": "known", "owners": {"larkfield-pricing": ["larkfield-pricing"]},
           "compartments": ["harbor-goods-terms"]})
}

fn body(server_id: &str, key: &SigningKey) -> Value {
    let label = label();
    let tools: Vec<Value> = tool_names()
        .iter()
        .map(|name| {
            json!({
                "name": name,
                "description": format!("Benchmark tool {name}: reads a document and returns its terms."),
                "input_schema": {
                    "type": "object",
                    "properties": {
                        "document": {"type": "string", "minLength": 1, "maxLength": 256},
                        "sink": {"type": "string", "pattern": "^[A-Za-z0-9.-]+:[0-9]{1,5}$"},
                        "limit": {"type": "integer", "minimum": 1, "maximum": 100}
                    },
                    "required": ["document"],
                    "additionalProperties": false
                },
                "output_schema": {"type": "object", "properties": {"text": {"type": "string"}}},
                "annotations": {"read_only": true, "destructive": false, "idempotent": true,
                                "requires_approval": false},
                "latency_hint": "fast",
                "flow": {"output_label": label, "input_clearance": label, "egress": false}
            })
        })
        .collect();
    json!({
        "schema": "flowhost.manifest.v1",
        "server_id": server_id,
        "name": "Benchmark server",
        "version": "1.0.0",
        "public_key": public_key_to_hex(&key.verifying_key()),
        "tools": tools,
    })
}

fn row(
    name: &str,
    flowhost: String,
    baseline: Option<(String, String)>,
    comparison: String,
    goal: &str,
    met: bool,
) -> Row {
    Row {
        name: name.into(),
        flowhost,
        baseline,
        comparison,
        goal: goal.into(),
        met,
    }
}

/// Runs the manifest benchmarks.
pub fn run(quick: bool) -> Vec<Row> {
    let key = SigningKey::from_bytes(&[42; 32]);
    let registered = key.verifying_key();
    let envelope =
        SignedManifest::sign(body("bench", &key), &key).expect("benchmark body is valid");
    envelope
        .verify(&registered)
        .expect("benchmark envelope verifies");
    let canonical = envelope.canonical_body().to_vec();
    let signature = *envelope.signature();

    let samples = if quick { 20 } else { 200 };
    let (verify, bare) = interleaved(
        samples,
        50,
        || {
            black_box(black_box(&envelope).verify(black_box(&registered))).ok();
        },
        || {
            black_box(registered.verify_strict(black_box(&canonical), black_box(&signature))).ok();
        },
    );
    let (v, b) = (verify.median(), bare.median());
    let mut rows = vec![row(
        "verify a 5-tool signed manifest (median)",
        fmt_duration(v),
        Some((
            "bare Ed25519 verify_strict of the same bytes".into(),
            fmt_duration(b),
        )),
        format!(
            "{:.2}x the bare verify",
            v.as_secs_f64() / b.as_secs_f64().max(1e-12)
        ),
        "<= 100 µs",
        v <= Duration::from_micros(100),
    )];

    // Parsing the envelope text as well (what loading a file costs beyond the read).
    let text = envelope.to_pretty_json();
    let parse = crate::harness::per_call(samples, 20, || {
        let parsed = SignedManifest::parse(black_box(&text)).expect("parses");
        black_box(parsed.verify(&registered)).ok();
    });
    rows.push(row(
        &format!("parse + verify the same envelope ({} bytes)", text.len()),
        fmt_duration(parse.median()),
        Some(("bare verify".into(), fmt_duration(b))),
        format!(
            "{:.2}x the bare verify",
            parse.median().as_secs_f64() / b.as_secs_f64().max(1e-12)
        ),
        "— (informational)",
        true,
    ));

    // 1,000 manifests, signed once up front; each run registers clones into a new registry.
    let envelopes: Vec<SignedManifest> = (0..MANIFESTS)
        .map(|i| SignedManifest::sign(body(&format!("server-{i:04}"), &key), &key).expect("valid"))
        .collect();
    // The operator clears each tool for the label its declaration names.
    let clearance = InformationLabel::from_json(&label().to_string()).expect("valid label");
    let policy = ToolPolicy::new(
        vec![clearance],
        InformationLabel::bottom(),
        Default::default(),
    )
    .expect("not top");
    let policies: BTreeMap<String, ToolPolicy> = tool_names()
        .into_iter()
        .map(|n| (n, policy.clone()))
        .collect();
    let topologies: BTreeMap<String, RuntimeTopology> = tool_names()
        .into_iter()
        .map(|n| (n, RuntimeTopology::Local))
        .collect();
    let runs = if quick { 3 } else { 9 };
    let mut totals = Vec::with_capacity(runs);
    for _ in 0..runs {
        let batch = envelopes.clone();
        let start = Instant::now();
        let mut registry = VerifiedRegistry::new();
        for envelope in batch {
            registry
                .register(envelope, &registered, &policies, &topologies)
                .expect("benchmark manifests are admitted");
        }
        totals.push(start.elapsed());
        assert_eq!(black_box(&registry).len(), MANIFESTS);
    }
    let total = Samples(totals).median();
    let per = total / MANIFESTS as u32;
    rows.push(row(
        "register 1,000 five-tool manifests (median of runs)",
        fmt_duration(total),
        Some((
            "verify alone x 1,000".into(),
            fmt_duration(b * MANIFESTS as u32),
        )),
        format!("{} per manifest", fmt_duration(per)),
        "< 0.5 s",
        total < Duration::from_millis(500),
    ));
    rows
}
