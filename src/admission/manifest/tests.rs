//! Manifest decoding, signing and verification: one test per way a manifest is refused.

use ed25519_dalek::SigningKey;
use serde_json::{Value, json};

use super::*;
use crate::canonical::{JsonError, JsonPath};
use crate::files::FileError;
use crate::flow::ToolFlowError;
use crate::keys::public_key_to_hex;

fn key(seed: u8) -> SigningKey {
    SigningKey::from_bytes(&[seed; 32])
}

fn terms_label() -> Value {
    json!({"kind": "known", "owners": {"larkfield-pricing": ["larkfield-pricing"]},
           "compartments": ["harbor-goods-terms"]})
}

/// A body that uses every field, optional ones included, so tampering can reach them all.
fn full_body(key: &SigningKey) -> Value {
    json!({
        "schema": "flowhost.manifest.v1",
        "server_id": "workspace",
        "name": "Workspace",
        "description": "Contract documents of the pricing team.",
        "version": "1.0.0",
        "public_key": public_key_to_hex(&key.verifying_key()),
        "tools": [
            {
                "name": "read_terms",
                "description": "Reads \u{1b}[1mone\u{1b}[0m contract's terms.",
                "input_schema": {"type": "object", "properties": {"document": {"type": "string"}},
                                 "required": ["document"], "additionalProperties": false},
                "output_schema": {"type": "object", "properties": {"text": {"type": "string"}}},
                "pricing": {"model": "per_unit", "amount": "0.50", "currency": "EUR", "unit": "page"},
                "annotations": {"read_only": true, "destructive": false, "idempotent": true,
                                "requires_approval": false},
                "latency_hint": "fast",
                "flow": {"output_label": terms_label(), "input_clearance": terms_label(),
                         "egress": false, "declassification_purposes": ["audit"]}
            },
            {
                "name": "list_documents",
                "description": "Lists documents.",
                "input_schema": {"type": "object"},
                "annotations": {"read_only": true, "destructive": false, "idempotent": true,
                                "requires_approval": false}
            }
        ]
    })
}

fn envelope_value(body: Value, signer: &SigningKey) -> Value {
    SignedManifest::sign(body, signer).unwrap().to_json_value()
}

fn parse_value(value: &Value) -> Result<SignedManifest, ManifestError> {
    SignedManifest::parse(&serde_json::to_string(value).unwrap())
}

fn parse_body(value: Value) -> ManifestError {
    ManifestBody::from_json_value(&value, &JsonPath::root()).unwrap_err()
}

// ---------- round trip ----------

#[test]
fn sign_parse_verify_round_trip() {
    let k = key(1);
    let signed = SignedManifest::sign(full_body(&k), &k).unwrap();
    let text = signed.to_pretty_json();
    let back = SignedManifest::parse(&text).unwrap();
    back.verify(&k.verifying_key()).unwrap();
    assert_eq!(back.digest(), signed.digest());
    assert_eq!(
        back.to_pretty_json(),
        text,
        "re-serialization is byte-stable"
    );
    let body = back.body();
    assert_eq!(body.server_id(), "workspace");
    assert_eq!(body.tools().len(), 2);
    assert!(body.requires_flow_runtime());
    let tool = body.tool("read_terms").unwrap();
    assert_eq!(tool.sanitized_description(), "Reads one contract's terms.");
    assert!(tool.description().contains('\u{1b}'));
    assert_eq!(tool.latency_hint(), Some(LatencyHint::Fast));
    assert!(tool.annotations().read_only);
    assert!(matches!(tool.pricing(), Some(Pricing::PerUnit { unit, .. }) if unit == "page"));
    assert!(!tool.flow().unwrap().egress());
    let list = body.tool("list_documents").unwrap();
    assert!(list.flow().is_none() && list.pricing().is_none() && list.output_schema().is_none());
}

#[test]
fn digest_ignores_whitespace_and_key_order_but_not_content() {
    let k = key(1);
    let signed = SignedManifest::sign(full_body(&k), &k).unwrap();
    let compact = serde_json::to_string(&signed.to_json_value()).unwrap();
    let reparsed = SignedManifest::parse(&compact).unwrap();
    assert_eq!(reparsed.digest(), signed.digest());
    assert_eq!(
        signed.digest().to_string(),
        format!(
            "sha256:{}",
            hex::encode(<sha2::Sha256 as sha2::Digest>::digest(
                signed.canonical_body()
            ))
        )
    );
    let mut other = full_body(&k);
    other["version"] = json!("1.0.1");
    assert_ne!(
        SignedManifest::sign(other, &k).unwrap().digest(),
        signed.digest()
    );
}

#[test]
fn serialized_body_decodes_to_the_same_body() {
    let k = key(1);
    let body = ManifestBody::from_json_value(&full_body(&k), &JsonPath::root()).unwrap();
    let again =
        ManifestBody::from_json_value(&serde_json::to_value(&body).unwrap(), &JsonPath::root())
            .unwrap();
    assert_eq!(again, body);
}

#[test]
fn sign_refuses_a_body_naming_another_key() {
    let body = full_body(&key(1));
    assert!(matches!(
        SignedManifest::sign(body, &key(2)),
        Err(SignError::PublicKeyNotSigner { .. })
    ));
}

// ---------- files ----------

fn write(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn file_over_one_mebibyte_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let k = key(1);
    let mut body = full_body(&k);
    // Valid JSON padded with whitespace past the limit: the size alone is refused.
    let mut text = serde_json::to_string(&envelope_value(body.take(), &k)).unwrap();
    text.push_str(&" ".repeat(1024 * 1024));
    let path = write(&dir, "big.json", text.as_bytes());
    assert!(matches!(
        load_envelope_file(&path),
        Err(ManifestFileError::File(FileError::TooLarge { .. }))
    ));
}

#[test]
fn file_not_utf8_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(&dir, "latin1.json", b"{\"manifest\": \"caf\xe9\"}");
    assert!(matches!(
        load_envelope_file(&path),
        Err(ManifestFileError::File(FileError::NotUtf8 { .. }))
    ));
}

#[test]
fn symlinked_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let k = key(1);
    let text = SignedManifest::sign(full_body(&k), &k)
        .unwrap()
        .to_pretty_json();
    let target = write(&dir, "real.json", text.as_bytes());
    load_envelope_file(&target).unwrap();
    let link = dir.path().join("link.json");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    assert!(matches!(
        load_envelope_file(&link),
        Err(ManifestFileError::File(FileError::Symlink { .. }))
    ));
}

#[test]
fn file_errors_name_the_file_and_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let k = key(1);
    let mut body = full_body(&k);
    body["tools"][1]["description"] = json!("x".repeat(612));
    let text = serde_json::to_string(&body).unwrap();
    let path = write(&dir, "x.json", text.as_bytes());
    let err = load_body_file(&path).unwrap_err();
    assert!(matches!(
        err.manifest_error(),
        Some(ManifestError::DescriptionTooLong { chars: 612, .. })
    ));
    assert_eq!(
        err.to_string(),
        format!(
            "{}: tools[1].description is 612 characters; the limit is 500",
            path.display()
        )
    );
}

// ---------- one error per bad input ----------

#[test]
fn duplicate_keys_are_refused_before_decoding() {
    let k = key(1);
    let text = SignedManifest::sign(full_body(&k), &k)
        .unwrap()
        .to_pretty_json();
    // Repeat the egress flag with the opposite value: serde_json alone would keep the last.
    let doubled = text.replacen(
        "\"egress\": false",
        "\"egress\": false, \"egress\": true",
        1,
    );
    assert_ne!(doubled, text);
    match SignedManifest::parse(&doubled) {
        Err(ManifestError::Json(JsonError::DuplicateKey { path, key, .. })) => {
            assert_eq!(path.to_string(), "manifest.tools[0].flow");
            assert_eq!(key, "egress");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn unknown_fields_are_refused_everywhere() {
    let k = key(1);
    let env = envelope_value(full_body(&k), &k);
    type Locate = fn(&mut Value) -> &mut Value;
    let places: [(&str, Locate); 5] = [
        ("$", |v| v),
        ("manifest", |v| &mut v["manifest"]),
        ("manifest.tools[0]", |v| &mut v["manifest"]["tools"][0]),
        ("manifest.tools[0].annotations", |v| {
            &mut v["manifest"]["tools"][0]["annotations"]
        }),
        ("manifest.tools[0].pricing", |v| {
            &mut v["manifest"]["tools"][0]["pricing"]
        }),
    ];
    for (expected_path, at) in places {
        let mut tampered = env.clone();
        at(&mut tampered)
            .as_object_mut()
            .unwrap()
            .insert("unsigned_hint".into(), json!(1));
        match parse_value(&tampered) {
            Err(ManifestError::UnknownField { path, field, .. }) => {
                assert_eq!(path.to_string(), expected_path);
                assert_eq!(field, "unsigned_hint");
            }
            other => panic!("{expected_path}: {other:?}"),
        }
    }
    // Inside the flow block the flow decoder reports it.
    let mut tampered = env.clone();
    tampered["manifest"]["tools"][0]["flow"]["mode"] = json!("x");
    assert!(matches!(
        parse_value(&tampered),
        Err(ManifestError::MalformedFlow { .. })
    ));
}

#[test]
fn wrong_schema_string_is_refused() {
    let mut body = full_body(&key(1));
    body["schema"] = json!("chio.manifest.v2");
    assert!(matches!(
        parse_body(body),
        ManifestError::WrongSchema { found, .. } if found == "chio.manifest.v2"
    ));
}

#[test]
fn empty_tools_is_refused() {
    let mut body = full_body(&key(1));
    body["tools"] = json!([]);
    assert!(matches!(parse_body(body), ManifestError::EmptyTools { .. }));
}

#[test]
fn duplicate_tool_names_are_refused() {
    let mut body = full_body(&key(1));
    body["tools"][1]["name"] = json!("read_terms");
    match parse_body(body) {
        ManifestError::DuplicateToolName { path, name, first } => {
            assert_eq!(name, "read_terms");
            assert_eq!(path.to_string(), "tools[1].name");
            assert_eq!(first.to_string(), "tools[0].name");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn description_over_500_characters_is_refused() {
    let mut body = full_body(&key(1));
    // 500 multi-byte characters are fine: the limit counts characters, not bytes.
    body["tools"][0]["description"] = json!("é".repeat(500));
    ManifestBody::from_json_value(&body, &JsonPath::root()).unwrap();
    body["tools"][0]["description"] = json!("é".repeat(501));
    assert!(matches!(
        parse_body(body.clone()),
        ManifestError::DescriptionTooLong { chars: 501, .. }
    ));
    body["tools"][0]["description"] = json!("ok");
    body["description"] = json!("d".repeat(501));
    assert!(matches!(
        parse_body(body),
        ManifestError::DescriptionTooLong { chars: 501, .. }
    ));
}

#[test]
fn non_object_schemas_are_refused() {
    for bad in [json!("object"), json!([]), json!(true), json!(1)] {
        let mut body = full_body(&key(1));
        body["tools"][0]["input_schema"] = bad.clone();
        assert!(matches!(
            parse_body(body),
            ManifestError::SchemaNotObject { .. }
        ));
        let mut body = full_body(&key(1));
        body["tools"][0]["output_schema"] = bad;
        assert!(matches!(
            parse_body(body),
            ManifestError::SchemaNotObject { .. }
        ));
    }
}

#[test]
fn top_in_a_declaration_is_refused() {
    for (field, expected) in [
        ("output_label", ToolFlowError::TopOutputLabel),
        ("input_clearance", ToolFlowError::TopInputClearance),
    ] {
        let mut body = full_body(&key(1));
        body["tools"][0]["flow"][field] = json!({"kind": "top"});
        match parse_body(body) {
            ManifestError::TopInFlow { path, reason } => {
                assert_eq!(reason, expected);
                assert_eq!(path.to_string(), "tools[0].flow");
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn explicit_null_and_missing_fields_are_refused() {
    for field in ["output_schema", "pricing", "latency_hint", "flow"] {
        let mut body = full_body(&key(1));
        body["tools"][0][field] = Value::Null;
        assert!(
            matches!(parse_body(body), ManifestError::NullField { .. }),
            "{field}"
        );
    }
    let mut body = full_body(&key(1));
    body["description"] = Value::Null;
    assert!(matches!(parse_body(body), ManifestError::NullField { .. }));
    let mut body = full_body(&key(1));
    body["tools"][0]["flow"]["input_clearance"] = Value::Null;
    assert!(matches!(
        parse_body(body),
        ManifestError::MalformedFlow { .. }
    ));
    for field in ["name", "description", "input_schema", "annotations"] {
        let mut body = full_body(&key(1));
        body["tools"][0].as_object_mut().unwrap().remove(field);
        assert!(
            matches!(parse_body(body), ManifestError::MissingField { field: f, .. } if f == field),
            "{field}"
        );
    }
    let mut body = full_body(&key(1));
    body["tools"][0]["annotations"]
        .as_object_mut()
        .unwrap()
        .remove("idempotent");
    assert!(matches!(
        parse_body(body),
        ManifestError::MissingField {
            field: "idempotent",
            ..
        }
    ));
    // A required field holding null is the wrong type, not "absent".
    let mut body = full_body(&key(1));
    body["version"] = Value::Null;
    assert!(matches!(
        parse_body(body),
        ManifestError::WrongType { found: "null", .. }
    ));
}

#[test]
fn identifiers_are_checked() {
    for (field, bad) in [
        ("server_id", " workspace"),
        ("name", ""),
        ("version", "1.0\n"),
    ] {
        let mut body = full_body(&key(1));
        body[field] = json!(bad);
        assert!(
            matches!(parse_body(body), ManifestError::InvalidIdentifier { .. }),
            "{field}"
        );
    }
    for bad in ["read_terms ", "read\u{7}terms", "\u{85}x"] {
        let mut body = full_body(&key(1));
        body["tools"][0]["name"] = json!(bad);
        assert!(
            matches!(parse_body(body), ManifestError::InvalidIdentifier { .. }),
            "{bad:?}"
        );
    }
    // Clients call `server/tool`: a '/' in either made server `a`'s tool `b/c` and server
    // `a/b`'s tool `c` one name, and let a server offering bare names list `a/x` as its own.
    let mut body = full_body(&key(1));
    body["server_id"] = json!("acme/billing");
    let e = parse_body(body);
    assert!(
        matches!(
            &e,
            ManifestError::SeparatorInName {
                kind: "server id",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string().contains("server_id") && e.to_string().contains("'/'"),
        "{e}"
    );
    // A tool name or a version may hold '/' (GitHub's operation ids are `repos/get`): the
    // name clients call is split at its first '/', and a server id has none. Only a server
    // offering bare names may not (checked where the configuration says so).
    let mut body = full_body(&key(1));
    body["tools"][0]["name"] = json!("repos/get");
    body["version"] = json!("2024/1");
    let k = key(1);
    parse_value(&envelope_value(body, &k)).unwrap();
}

#[test]
fn pricing_rules() {
    let priced = |pricing: Value| {
        let mut body = full_body(&key(1));
        body["tools"][0]["pricing"] = pricing;
        ManifestBody::from_json_value(&body, &JsonPath::root())
    };
    assert!(priced(json!({"model": "free"})).is_ok());
    assert!(priced(json!({"model": "per_call", "amount": "0.002", "currency": "USD"})).is_ok());
    assert!(matches!(
        priced(json!({"model": "subscription"})),
        Err(ManifestError::UnknownPricingModel { .. })
    ));
    assert!(matches!(
        priced(json!({"model": "free", "amount": "1", "currency": "EUR"})),
        Err(ManifestError::PricingFieldNotAllowed {
            field: "amount",
            ..
        })
    ));
    assert!(matches!(
        priced(json!({"model": "per_call", "amount": "1", "currency": "EUR", "unit": "x"})),
        Err(ManifestError::PricingFieldNotAllowed { field: "unit", .. })
    ));
    assert!(matches!(
        priced(json!({"model": "per_call", "amount": 0.5, "currency": "EUR"})),
        Err(ManifestError::WrongType { .. })
    ));
    assert!(matches!(
        priced(json!({"model": "per_call", "amount": "1e3", "currency": "EUR"})),
        Err(ManifestError::InvalidAmount { .. })
    ));
    assert!(matches!(
        priced(json!({"model": "per_call", "amount": "1", "currency": "euro"})),
        Err(ManifestError::InvalidCurrency { .. })
    ));
    assert!(matches!(
        priced(json!({"model": "per_unit", "amount": "1", "currency": "EUR"})),
        Err(ManifestError::MissingField { field: "unit", .. })
    ));
}

#[test]
fn latency_hint_and_flow_shape() {
    let mut body = full_body(&key(1));
    body["tools"][0]["latency_hint"] = json!("glacial");
    assert!(matches!(
        parse_body(body),
        ManifestError::InvalidLatencyHint { .. }
    ));
    let mut body = full_body(&key(1));
    body["tools"][0]["flow"]["declassification_purposes"] = json!([]);
    assert!(matches!(
        parse_body(body),
        ManifestError::MalformedFlow { .. }
    ));
}

#[test]
fn envelope_encodings_are_checked() {
    let k = key(1);
    let env = envelope_value(full_body(&k), &k);
    let mut bad = env.clone();
    bad["signature"] = json!("00");
    assert!(matches!(
        parse_value(&bad),
        Err(ManifestError::InvalidSignatureEncoding { .. })
    ));
    let mut bad = env.clone();
    bad["signer_key"] = json!(public_key_to_hex(&k.verifying_key()).to_uppercase());
    assert!(matches!(
        parse_value(&bad),
        Err(ManifestError::InvalidPublicKey { .. })
    ));
    let mut bad = env.clone();
    bad["manifest"]["public_key"] = json!("zz");
    assert!(matches!(
        parse_value(&bad),
        Err(ManifestError::InvalidPublicKey { .. })
    ));
    let mut bad = env;
    bad.as_object_mut().unwrap().remove("manifest");
    assert!(matches!(
        parse_value(&bad),
        Err(ManifestError::MissingField {
            field: "manifest",
            ..
        })
    ));
    assert!(matches!(
        SignedManifest::parse(
            r#"{"manifest": {"schema": "flowhost.manifest.v1", "n": 9007199254740993}}"#
        ),
        Err(ManifestError::Json(JsonError::InexactInteger { .. }))
    ));
}

// ---------- verification ----------

#[test]
fn embedded_public_key_different_from_the_signer_is_refused() {
    let (publisher, other) = (key(1), key(2));
    // The body names `other`, but `publisher` signed it and says so in signer_key.
    let body = full_body(&other);
    let canonical = crate::canonical::canonical_bytes(&body).unwrap();
    let forged = json!({
        "manifest": body,
        "signature": hex::encode(ed25519_dalek::Signer::sign(&publisher, &canonical).to_bytes()),
        "signer_key": public_key_to_hex(&publisher.verifying_key()),
    });
    let parsed = parse_value(&forged).unwrap();
    assert!(matches!(
        parsed.verify(&publisher.verifying_key()),
        Err(VerifyError::PublicKeyMismatch { .. })
    ));
}

#[test]
fn wrong_registered_key_is_refused() {
    let (publisher, registered) = (key(1), key(2));
    let signed = SignedManifest::sign(full_body(&publisher), &publisher).unwrap();
    assert!(matches!(
        signed.verify(&registered.verifying_key()),
        Err(VerifyError::SignerNotRegistered { .. })
    ));
    signed.verify(&publisher.verifying_key()).unwrap();
}

#[test]
fn a_corrupted_signature_is_refused() {
    let k = key(1);
    let mut env = envelope_value(full_body(&k), &k);
    let sig = env["signature"].as_str().unwrap().to_owned();
    let flipped = format!(
        "{}{}",
        if sig.starts_with('0') { '1' } else { '0' },
        &sig[1..]
    );
    env["signature"] = json!(flipped);
    assert!(matches!(
        parse_value(&env).unwrap().verify(&k.verifying_key()),
        Err(VerifyError::BadSignature { .. })
    ));
}

#[derive(Debug)]
enum Outcome {
    Refused(ManifestError),
    Unverified(VerifyError),
    Accepted,
}

fn tamper(env: &Value, key: &SigningKey, change: impl FnOnce(&mut Value)) -> Outcome {
    let mut tampered = env.clone();
    change(&mut tampered["manifest"]);
    match parse_value(&tampered) {
        Err(e) => Outcome::Refused(e),
        Ok(parsed) => match parsed.verify(&key.verifying_key()) {
            Err(e) => Outcome::Unverified(e),
            Ok(()) => Outcome::Accepted,
        },
    }
}

#[test]
fn one_field_tamper_of_every_body_field_breaks_the_signature() {
    let k = key(1);
    let env = envelope_value(full_body(&k), &k);
    type Change = fn(&mut Value);
    let valid_changes: &[(&str, Change)] = &[
        ("server_id", |b| b["server_id"] = json!("workspace2")),
        ("name", |b| b["name"] = json!("Workspace!")),
        ("description", |b| b["description"] = json!("changed")),
        ("description removed", |b| {
            b.as_object_mut().unwrap().remove("description");
        }),
        ("version", |b| b["version"] = json!("1.0.1")),
        ("tools[0].name", |b| {
            b["tools"][0]["name"] = json!("read_all")
        }),
        ("tools[0].description", |b| {
            b["tools"][0]["description"] = json!("Reads terms.")
        }),
        ("tools[0].input_schema", |b| {
            b["tools"][0]["input_schema"]["additionalProperties"] = json!(true)
        }),
        ("tools[0].output_schema", |b| {
            b["tools"][0]["output_schema"]["required"] = json!(["text"])
        }),
        ("tools[0].output_schema removed", |b| {
            b["tools"][0]
                .as_object_mut()
                .unwrap()
                .remove("output_schema");
        }),
        ("tools[0].pricing.amount", |b| {
            b["tools"][0]["pricing"]["amount"] = json!("0.05")
        }),
        ("tools[0].pricing.currency", |b| {
            b["tools"][0]["pricing"]["currency"] = json!("USD")
        }),
        ("tools[0].pricing.unit", |b| {
            b["tools"][0]["pricing"]["unit"] = json!("document")
        }),
        ("tools[0].pricing", |b| {
            b["tools"][0]["pricing"] = json!({"model": "free"})
        }),
        ("tools[0].annotations.read_only", |b| {
            b["tools"][0]["annotations"]["read_only"] = json!(false)
        }),
        ("tools[0].annotations.destructive", |b| {
            b["tools"][0]["annotations"]["destructive"] = json!(true)
        }),
        ("tools[0].annotations.idempotent", |b| {
            b["tools"][0]["annotations"]["idempotent"] = json!(false)
        }),
        ("tools[0].annotations.requires_approval", |b| {
            b["tools"][0]["annotations"]["requires_approval"] = json!(true)
        }),
        ("tools[0].latency_hint", |b| {
            b["tools"][0]["latency_hint"] = json!("slow")
        }),
        ("tools[0].flow.egress", |b| {
            b["tools"][0]["flow"]["egress"] = json!(true)
        }),
        ("tools[0].flow.output_label", |b| {
            b["tools"][0]["flow"]["output_label"] =
                json!({"kind": "known", "owners": {}, "compartments": []})
        }),
        ("tools[0].flow.input_clearance", |b| {
            b["tools"][0]["flow"]["input_clearance"]["owners"]["larkfield-pricing"] =
                json!(["larkfield-pricing", "public"])
        }),
        ("tools[0].flow.declassification_purposes", |b| {
            b["tools"][0]["flow"]["declassification_purposes"] = json!(["audit", "support"])
        }),
        ("tools[0].flow removed", |b| {
            b["tools"][0].as_object_mut().unwrap().remove("flow");
        }),
        ("tools[1] flow added", |b| {
            b["tools"][1]["flow"] = json!({"egress": false})
        }),
        ("tools[1] removed", |b| {
            b["tools"].as_array_mut().unwrap().pop();
        }),
        ("tools reordered", |b| {
            b["tools"].as_array_mut().unwrap().reverse();
        }),
    ];
    for (what, change) in valid_changes {
        match tamper(&env, &k, change) {
            Outcome::Unverified(VerifyError::BadSignature { .. }) => {}
            other => panic!("{what}: expected BadSignature, got {other:?}"),
        }
    }
    // The remaining fields cannot be changed into another valid value without a different
    // refusal, each its own.
    assert!(matches!(
        tamper(&env, &k, |b| b["public_key"] =
            json!(public_key_to_hex(&key(2).verifying_key()))),
        Outcome::Unverified(VerifyError::PublicKeyMismatch { .. })
    ));
    assert!(matches!(
        tamper(&env, &k, |b| b["schema"] = json!("flowhost.manifest.v2")),
        Outcome::Refused(ManifestError::WrongSchema { .. })
    ));
}

/// Every scalar leaf of the body, changed on its own, is refused one way or another.
#[test]
fn every_leaf_change_is_refused() {
    fn leaves(value: &Value, pointer: String, out: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                for (k, v) in map {
                    leaves(
                        v,
                        format!("{pointer}/{}", k.replace('~', "~0").replace('/', "~1")),
                        out,
                    );
                }
            }
            Value::Array(items) => {
                for (i, v) in items.iter().enumerate() {
                    leaves(v, format!("{pointer}/{i}"), out);
                }
            }
            _ => out.push(pointer),
        }
    }
    let k = key(1);
    let env = envelope_value(full_body(&k), &k);
    let mut pointers = Vec::new();
    leaves(&env["manifest"], String::new(), &mut pointers);
    assert!(pointers.len() > 30, "{}", pointers.len());
    for pointer in pointers {
        let outcome = tamper(&env, &k, |b| {
            let leaf = b.pointer_mut(&pointer).unwrap();
            *leaf = match leaf.take() {
                Value::Bool(x) => Value::Bool(!x),
                Value::String(s) if s.len() == 64 => Value::String(s.replace('a', "b")),
                Value::String(s) => Value::String(format!("{s}x")),
                Value::Number(n) => json!(n.as_f64().unwrap() + 1.0),
                other => other,
            };
        });
        assert!(!matches!(outcome, Outcome::Accepted), "{pointer}");
    }
}

// ---------- value types ----------

#[test]
fn decimal_amounts() {
    for ok in ["0", "0.002", "12", "12.50", "100000"] {
        assert!(DecimalAmount::new(ok).is_some(), "{ok}");
    }
    for bad in [
        "", ".5", "5.", "01", "-1", "+1", "1e3", "1,5", "1.2.3", " 1", "NaN",
    ] {
        assert!(DecimalAmount::new(bad).is_none(), "{bad:?}");
    }
    assert!(DecimalAmount::new(&"9".repeat(41)).is_none());
}

#[test]
fn currency_codes() {
    assert!(CurrencyCode::new("EUR").is_some());
    for bad in ["eur", "EU", "EURO", "E1R", "ÉUR"] {
        assert!(CurrencyCode::new(bad).is_none(), "{bad}");
    }
}

#[test]
fn digest_text_round_trips_strictly() {
    let d = ManifestDigest::of_canonical_bytes(b"{}");
    let text = d.to_string();
    assert!(
        text.starts_with("sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a")
    );
    assert_eq!(text.parse::<ManifestDigest>().unwrap(), d);
    assert!(text.to_uppercase().parse::<ManifestDigest>().is_err());
    assert!(
        text.trim_start_matches("sha256:")
            .parse::<ManifestDigest>()
            .is_err()
    );
    let json = serde_json::to_string(&d).unwrap();
    assert_eq!(serde_json::from_str::<ManifestDigest>(&json).unwrap(), d);
}

#[test]
fn title_and_open_world_are_optional_and_strict() {
    // Absent: nothing declared (older manifests keep their meaning and digest).
    let body = full_body(&key(1));
    let m = ManifestBody::from_json_value(&body, &JsonPath::root()).unwrap();
    assert!(m.tools()[0].title().is_none());
    assert_eq!(m.tools()[0].annotations().open_world, None);
    // Present: carried as declared.
    let mut body = full_body(&key(1));
    body["tools"][0]["title"] = json!("Read the terms");
    body["tools"][0]["annotations"]["open_world"] = json!(true);
    let m = ManifestBody::from_json_value(&body, &JsonPath::root()).unwrap();
    assert_eq!(m.tools()[0].title(), Some("Read the terms"));
    assert_eq!(m.tools()[0].annotations().open_world, Some(true));
    // Wrong types, null and an over-long title are refused, naming the field.
    for (field, value) in [("title", json!(7)), ("title", Value::Null)] {
        let mut body = full_body(&key(1));
        body["tools"][0][field] = value;
        assert!(
            matches!(
                parse_body(body),
                ManifestError::WrongType { .. } | ManifestError::NullField { .. }
            ),
            "{field}"
        );
    }
    let mut body = full_body(&key(1));
    body["tools"][0]["title"] = json!("x".repeat(501));
    assert!(matches!(
        parse_body(body),
        ManifestError::DescriptionTooLong { .. }
    ));
    for value in [json!("yes"), Value::Null] {
        let mut body = full_body(&key(1));
        body["tools"][0]["annotations"]["open_world"] = value;
        assert!(matches!(
            parse_body(body),
            ManifestError::WrongType { .. } | ManifestError::NullField { .. }
        ));
    }
}

// ---------- resources and prompts ----------

fn with_content(resources: Value, prompts: Value) -> Value {
    let mut body = full_body(&key(1));
    body["resources"] = resources;
    body["prompts"] = prompts;
    body
}

fn content_body() -> Value {
    with_content(
        json!([
            {"uri": "test://static-text", "name": "static-text", "mime_type": "text/plain",
             "flow": {"output_label": terms_label()}},
            {"uri_template": "test://template/{id}/data", "name": "template",
             "title": "Data by id", "description": "Data for an id"}
        ]),
        json!([
            {"name": "simple", "description": "A prompt"},
            {"name": "with_args", "arguments": [
                {"name": "arg1", "required": true}, {"name": "arg2", "description": "second"}]}
        ]),
    )
}

#[test]
fn resources_and_prompts_round_trip_signed_and_route() {
    let k = key(1);
    let signed = SignedManifest::sign(content_body(), &k).unwrap();
    let text = signed.to_pretty_json();
    let back = SignedManifest::parse(&text).unwrap();
    back.verify(&k.verifying_key()).unwrap();
    assert_eq!(
        back.to_pretty_json(),
        text,
        "re-serialization is byte-stable"
    );
    let body = back.body();
    assert_eq!(body.resources().len(), 2);
    let text_resource = body.resource_for("test://static-text").unwrap();
    assert_eq!(text_resource.mime_type(), Some("text/plain"));
    assert_eq!(
        text_resource.flow().unwrap().output_label,
        serde_json::from_value(terms_label()).unwrap()
    );
    assert_eq!(
        body.resource_for("test://template/123/data")
            .unwrap()
            .name(),
        "template"
    );
    for not_declared in [
        "test://template//data",
        "test://template/1/2/data",
        "test://template/123/data/more",
        "test://other",
    ] {
        assert!(body.resource_for(not_declared).is_err(), "{not_declared}");
    }
    // Another spelling of a URI is never routed: an executor that decoded it or resolved
    // its dot segments would read something other than what the route (and its label)
    // was chosen for.
    for other_spelling in [
        "test://template/%31%32%33/data",
        "test://template/%2E%2E/data",
        "test://template/..%2Fstatic-text/data",
        "test://template/a%5Cb/data",
        "test://template/%zz/data",
        "test://template/%4/data",
        "test://template/../data",
        "test://template/./data",
    ] {
        assert!(
            body.resource_for(other_spelling).is_err(),
            "{other_spelling}"
        );
    }
    // Escapes of what a variable must encode are fine.
    assert!(body.resource_for("test://template/a%20b/data").is_ok());
    assert!(body.resource_for("test://template/..x/data").is_ok());
    let long = |n: usize| format!("test://template/{}/data", "x".repeat(n));
    let fits = MAX_CLIENT_URI_BYTES - long(0).len();
    assert!(body.resource_for(&long(fits)).is_ok());
    assert!(body.resource_for(&long(fits + 1)).is_err());
    let prompt = body.prompt("with_args").unwrap();
    assert!(prompt.check_arguments(Some(&json!({"arg1": "a"}))).is_ok());
    assert!(prompt.check_arguments(None).unwrap_err().contains("arg1"));
    assert!(prompt.check_arguments(Some(&json!({"arg1": 1}))).is_err());
    assert!(
        prompt
            .check_arguments(Some(&json!({"arg1": "a", "other": "b"})))
            .unwrap_err()
            .contains("other")
    );
    assert!(body.prompt("simple").unwrap().check_arguments(None).is_ok());
}

#[test]
fn bad_resources_and_prompts_are_refused_naming_the_field() {
    type Case = (Value, Value, fn(&ManifestError) -> bool, &'static str);
    let cases: Vec<Case> = vec![
        (
            json!([]),
            json!([{"name": "p"}]),
            |e| matches!(e, ManifestError::EmptyList { .. }),
            "resources",
        ),
        (
            json!([{"name": "r"}]),
            json!([{"name": "p"}]),
            |e| matches!(e, ManifestError::ResourceLocatorChoice { .. }),
            "resources[0]",
        ),
        (
            json!([{"name": "r", "uri": "test://a", "uri_template": "test://{x}"}]),
            json!([{"name": "p"}]),
            |e| matches!(e, ManifestError::ResourceLocatorChoice { .. }),
            "resources[0]",
        ),
        (
            json!([{"name": "r", "uri": "no scheme"}]),
            json!([{"name": "p"}]),
            |e| matches!(e, ManifestError::InvalidResourceUri { .. }),
            "resources[0].uri",
        ),
        (
            json!([{"name": "r", "uri": "nocolon"}]),
            json!([{"name": "p"}]),
            |e| matches!(e, ManifestError::InvalidResourceUri { .. }),
            "resources[0].uri",
        ),
        // A right-to-left override makes `test://gpj.exe` show as another URI in a client's
        // list; a zero-width space makes two URIs look alike.
        (
            json!([{"name": "r", "uri": "test://\u{202e}exe.jpg"}]),
            json!([{"name": "p"}]),
            |e| matches!(e, ManifestError::InvalidResourceUri { .. }),
            "resources[0].uri",
        ),
        (
            json!([{"name": "r", "uri_template": "test://a\u{200b}/{id}"}]),
            json!([{"name": "p"}]),
            |e| matches!(e, ManifestError::InvalidResourceUri { .. }),
            "resources[0].uri_template",
        ),
        // The zero-width joiner spells words in identifiers; in a URI it only makes one
        // look like another (`READ\u{200d}ME.md` and `README.md`).
        (
            json!([{"name": "r", "uri": "file:///repo/READ\u{200d}ME.md"}]),
            json!([{"name": "p"}]),
            |e| matches!(e, ManifestError::InvalidResourceUri { .. }),
            "resources[0].uri",
        ),
        (
            json!([{"name": "r", "uri": "file:///repo/READ\u{200c}ME.md"}]),
            json!([{"name": "p"}]),
            |e| matches!(e, ManifestError::InvalidResourceUri { .. }),
            "resources[0].uri",
        ),
        (
            json!([{"name": "r", "uri_template": "test://{a}{b}"}]),
            json!([{"name": "p"}]),
            |e| matches!(e, ManifestError::InvalidResourceUri { .. }),
            "resources[0].uri_template",
        ),
        (
            json!([{"name": "r", "uri_template": "test://{+path}"}]),
            json!([{"name": "p"}]),
            |e| matches!(e, ManifestError::InvalidResourceUri { .. }),
            "resources[0].uri_template",
        ),
        (
            json!([{"name": "r", "uri_template": "test://{open"}]),
            json!([{"name": "p"}]),
            |e| matches!(e, ManifestError::InvalidResourceUri { .. }),
            "resources[0].uri_template",
        ),
        (
            json!([{"name": "r", "uri_template": "test://plain"}]),
            json!([{"name": "p"}]),
            |e| matches!(e, ManifestError::InvalidResourceUri { .. }),
            "resources[0].uri_template",
        ),
        (
            json!([{"name": "r", "uri": "test://a"}, {"name": "s", "uri": "test://a"}]),
            json!([{"name": "p"}]),
            |e| matches!(e, ManifestError::DuplicateName { .. }),
            "resources[1].uri",
        ),
        (
            json!([{"name": "r", "uri": "test://a", "flow": {"output_label": {"kind": "top"}}}]),
            json!([{"name": "p"}]),
            |e| matches!(e, ManifestError::TopInFlow { .. }),
            "resources[0].flow.output_label",
        ),
        (
            json!([{"name": "r", "uri": "test://a", "flow": {"output_label": "x"}}]),
            json!([{"name": "p"}]),
            |e| matches!(e, ManifestError::MalformedFlow { .. }),
            "resources[0].flow.output_label",
        ),
        (
            json!([{"name": "r", "uri": "test://a", "flow": {"egress": true}}]),
            json!([{"name": "p"}]),
            |e| matches!(e, ManifestError::UnknownField { .. }),
            "resources[0].flow",
        ),
        (
            json!([{"name": "r", "uri": "test://a", "mime_type": null}]),
            json!([{"name": "p"}]),
            |e| matches!(e, ManifestError::NullField { .. }),
            "resources[0].mime_type",
        ),
        (
            json!([{"name": "r", "uri": "test://a"}]),
            json!([{"name": "p"}, {"name": "p"}]),
            |e| matches!(e, ManifestError::DuplicateName { .. }),
            "prompts[1].name",
        ),
        (
            json!([{"name": "r", "uri": "test://a"}]),
            json!([{"name": "p", "arguments": [{"name": "a"}, {"name": "a"}]}]),
            |e| matches!(e, ManifestError::DuplicateName { .. }),
            "prompts[0].arguments[1].name",
        ),
        (
            json!([{"name": "r", "uri": "test://a"}]),
            json!([{"name": "p", "arguments": [{"name": "a", "required": "yes"}]}]),
            |e| matches!(e, ManifestError::WrongType { .. }),
            "prompts[0].arguments[0].required",
        ),
        (
            json!([{"name": "r", "uri": "test://a"}]),
            json!([{"name": " p"}]),
            |e| matches!(e, ManifestError::InvalidIdentifier { .. }),
            "prompts[0].name",
        ),
        (
            json!([{"name": "r", "uri": "test://a"}]),
            json!({"name": "p"}),
            |e| matches!(e, ManifestError::WrongType { .. }),
            "prompts",
        ),
    ];
    for (resources, prompts, expected, path) in cases {
        let e = parse_body(with_content(resources.clone(), prompts.clone()));
        assert!(expected(&e), "{resources} {prompts}: {e:?}");
        assert!(
            e.to_string().starts_with(path),
            "{resources} {prompts}: {e} does not name {path}"
        );
    }
}

/// A signed exact URI is reached only by its own spelling, never through a template that
/// matches another spelling of it; and a URI two templates of one server match is served by
/// neither. Before, `file:///srv/docs/salaries%282025%29.csv` (which the executor reads as
/// the signed `salaries(2025).csv`) was routed through `file:///srv/docs/{name}` and its
/// lower label, and the first of two matching templates won.
#[test]
fn another_spelling_or_a_second_template_never_routes_a_read() {
    let body = with_content(
        json!([
            {"uri": "file:///srv/docs/salaries(2025).csv", "name": "salaries",
             "flow": {"output_label": terms_label()}},
            {"uri": "file:///srv/docs/caf%C3%A9", "name": "cafe",
             "flow": {"output_label": terms_label()}},
            {"uri_template": "file:///srv/docs/{name}", "name": "docs"},
            {"uri_template": "docs://{id}", "name": "all"},
            {"uri_template": "docs://secret-{id}", "name": "secrets",
             "flow": {"output_label": terms_label()}}
        ]),
        json!([{"name": "p"}]),
    );
    let k = key(1);
    let body = parse_value(&envelope_value(body, &k))
        .unwrap()
        .body()
        .clone();
    let name = |uri: &str| body.resource_for(uri).map(|r| r.name().to_owned());
    assert_eq!(
        name("file:///srv/docs/salaries(2025).csv").unwrap(),
        "salaries"
    );
    assert_eq!(name("file:///srv/docs/caf%C3%A9").unwrap(), "cafe");
    assert_eq!(name("file:///srv/docs/notes").unwrap(), "docs");
    for other_spelling in [
        "file:///srv/docs/salaries%282025%29.csv",
        "file:///srv/docs/caf%c3%a9",
        "file:///srv/docs/caf\u{e9}",
        "file:///srv/docs/a%3Ab",
        "file:///srv/docs/a b",
        "file:///srv/docs/a\\b",
        // A NUL a C file API ends the name at, and a scheme or host an executor may take
        // in lower case.
        "file:///srv/docs/salaries(2025).csv%00x",
        "FILE:///srv/docs/notes",
        "docs://SECRET-42",
    ] {
        assert!(
            matches!(
                body.resource_for(other_spelling),
                Err(UnroutableUri::Spelling { .. })
            ),
            "{other_spelling}: {:?}",
            name(other_spelling)
        );
    }
    let ambiguous = body.resource_for("docs://secret-42").unwrap_err();
    let UnroutableUri::Ambiguous {
        first,
        second,
        server_id,
        ..
    } = &ambiguous
    else {
        panic!("{:?}", name("docs://secret-42"));
    };
    assert_eq!(
        (first.as_str(), second.as_str()),
        ("docs://{id}", "docs://secret-{id}")
    );
    // A client is told neither the server nor its templates (before, both).
    let told = ambiguous.client_words();
    assert!(
        !told.contains(server_id.as_str()) && !told.contains("{id}"),
        "{told}"
    );
    assert_eq!(name("docs://42").unwrap(), "all");
    // An escape in the authority keeps its upper-case hex digits.
    assert_eq!(name("docs://caf%C3%A9").unwrap(), "all");
    // What a client could never reach as signed is refused at admission.
    for (resource, field) in [
        (json!({"uri": "file:///srv/caf\u{e9}", "name": "r"}), "uri"),
        (json!({"uri": "file:///srv/a%28b%29", "name": "r"}), "uri"),
        (json!({"uri": "file:///srv/a%2f", "name": "r"}), "uri"),
        (json!({"uri": "file:///srv/../etc", "name": "r"}), "uri"),
        (
            json!({"uri_template": "file:///srv/caf\u{e9}/{x}", "name": "r"}),
            "uri_template",
        ),
        (
            json!({"uri_template": "file:///srv/%7e/{x}", "name": "r"}),
            "uri_template",
        ),
        (json!({"uri": "Test://a", "name": "r"}), "uri"),
        (
            json!({"uri_template": "docs://Secret-{id}", "name": "r"}),
            "uri_template",
        ),
    ] {
        let e = parse_body(with_content(
            json!([resource.clone()]),
            json!([{"name": "p"}]),
        ));
        assert!(
            matches!(e, ManifestError::InvalidResourceUri { .. })
                && e.to_string().starts_with(&format!("resources[0].{field}")),
            "{resource}: {e}"
        );
    }
}

#[test]
fn templates_overlap_conservatively() {
    let t = |s: &str| ResourceLocator::Template(UriTemplate::parse(s).unwrap());
    let u = |s: &str| ResourceLocator::Uri(s.to_string());
    assert!(t("test://a/{x}").may_overlap(&u("test://a/1")));
    assert!(!t("test://a/{x}").may_overlap(&u("test://b/1")));
    assert!(t("test://a/{x}").may_overlap(&t("test://a/{y}/z")));
    assert!(!t("test://a/{x}").may_overlap(&t("test://b/{y}")));
    assert!(!t("test://{x}/data").may_overlap(&t("test://{x}/meta")));
    assert!(u("test://a").may_overlap(&u("test://a")));
    assert!(!u("test://a").may_overlap(&u("test://b")));
}

#[test]
fn template_matching_takes_polynomial_time_on_hostile_uris() {
    // Every split of the dots between three variables used to be tried before the final
    // '!' refused them all: about 10^13 steps. The URI comes from clients.
    let template = UriTemplate::parse("db://{s}.{t}.{c}").unwrap();
    let uri = format!("db://{}!", ".".repeat(50_000));
    let (done, finished) = std::sync::mpsc::channel();
    // In a thread, so a regression fails this test instead of hanging the suite.
    std::thread::spawn(move || {
        let _ = done.send(template.matches(&uri));
    });
    let matched = finished
        .recv_timeout(std::time::Duration::from_secs(5))
        .expect("matching did not finish within 5 s");
    assert!(!matched);
    // Without the '!' it matches, and as quickly.
    let template = UriTemplate::parse("db://{s}.{t}.{c}").unwrap();
    assert!(template.matches(&format!("db://{}", ".".repeat(50_000))));
}

#[test]
fn template_matching_semantics() {
    let matches = |template: &str, uri: &str| UriTemplate::parse(template).unwrap().matches(uri);
    for (template, uri, expected) in [
        ("db://{s}.{t}.{c}", "db://a.b.c", true),
        // A variable may hold dots, so the split is the matcher's to find.
        ("db://{s}.{t}.{c}", "db://a.b.c.d", true),
        ("db://{s}.{t}.{c}", "db://a...b", true),
        ("db://{s}.{t}.{c}", "db://a..b", false),
        ("db://{s}.{t}.{c}", "db://a.b.", false),
        ("db://{s}.{t}.{c}", "db://a.b", false),
        // A variable is one or more unreserved or percent characters: never empty, never a
        // '/', never other characters.
        ("test://items/{id}/data", "test://items/x%20y/data", true),
        (
            "test://items/{id}/data",
            "test://items/a-b_c~d.e/data",
            true,
        ),
        ("test://items/{id}/data", "test://items//data", false),
        ("test://items/{id}/data", "test://items/a/b/data", false),
        ("test://items/{id}/data", "test://items/a b/data", false),
        ("test://items/{id}/data", "test://items/\u{e9}/data", false),
        ("test://items/{id}/data", "test://items/a/data/", false),
        ("test://items/{id}", "test://items/", false),
        ("test://items/{id}", "test://items/a", true),
        ("test://{a}x{b}", "test://xxx", true),
        ("test://{a}x{b}", "test://xx", false),
        ("test://{a}xx{b}y", "test://axxxxby", true),
        ("test://{a}xx{b}y", "test://axxby", true),
        ("test://{a}xx{b}y", "test://axby", false),
    ] {
        assert_eq!(matches(template, uri), expected, "{template} {uri}");
    }
}

/// The matcher agrees with a regular expression of the same language (compiled by the
/// `regex` crate, which has no backtracking) on every short URI over a small alphabet.
#[test]
fn template_matching_agrees_with_a_regular_expression() {
    fn as_regex(template: &str) -> regex::Regex {
        let mut pattern = String::from("^");
        for (i, part) in template.split(['{', '}']).enumerate() {
            // Odd parts are variable names, even ones literal text.
            if i % 2 == 1 {
                pattern.push_str("[A-Za-z0-9._~%-]+");
            } else {
                pattern.push_str(&regex::escape(part));
            }
        }
        pattern.push('$');
        regex::Regex::new(&pattern).unwrap()
    }
    let templates = [
        "t://{a}",
        "t://{a}.{b}",
        "t://{a}..{b}.",
        "t://{a}/{b}",
        "t://x{a}x{b}x",
        "t://{a}a{b}",
        "t://{a}!{b}!",
        "t://{a}.a{b}/",
    ];
    let alphabet = ['a', '.', '/', '%', 'x', '!'];
    let mut uris = vec![String::new()];
    let mut last = vec![String::new()];
    for _ in 0..6 {
        last = last
            .iter()
            .flat_map(|u| alphabet.iter().map(move |c| format!("{u}{c}")))
            .collect();
        uris.extend(last.iter().cloned());
    }
    for template in templates {
        let parsed = UriTemplate::parse(template).unwrap();
        let regex = as_regex(template);
        for tail in &uris {
            let uri = format!("t://{tail}");
            assert_eq!(
                parsed.matches(&uri),
                regex.is_match(&uri),
                "{template} {uri}"
            );
        }
    }
}

/// The tool of `full_body` with `schema` as its input schema, compiled.
fn compiled(schema: Value) -> Result<jsonschema::Validator, SchemaCompileError> {
    let mut body = full_body(&key(1));
    body["tools"][0]["input_schema"] = schema;
    let body = ManifestBody::from_json_value(&body, &JsonPath::root()).unwrap();
    body.tools()[0].compile_schemas().map(|s| s.input)
}

/// A schema whose subschemas apply to one value in a cycle is validated in bounded depth,
/// on a thread with the stack of the host's workers (2 MiB). Before (jsonschema 0.33), the
/// validator followed such a cycle without end at the first call and the stack overflow
/// took the daemon down. Recursion into the value (a tree) validates as deep as the value.
#[test]
fn a_schema_that_applies_itself_to_one_value_does_not_take_the_stack() {
    let schemas = [
        json!({"type": "object", "$ref": "#/$defs/a",
               "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}),
        json!({"type": "object", "allOf": [{"$ref": "#"}]}),
        json!({"type": "object", "anyOf": [{"not": {"$ref": "#/anyOf/0"}}]}),
        json!({"type": "object", "$ref": "#/$defs/a%20b", "$defs": {"a b": {"$ref": "#/$defs/a%20b"}}}),
    ];
    let ran = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || {
            for schema in schemas {
                if let Ok(v) = compiled(schema) {
                    let _ = v.is_valid(&json!({}));
                }
            }
            // A tree: each node's children are nodes.
            let tree = json!({"type": "object", "properties": {"root": {"$ref": "#/$defs/node"}},
                              "$defs": {"node": {"type": "object", "properties": {
                                  "name": {"type": "string"},
                                  "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}});
            let v = compiled(tree).unwrap();
            let deep = json!({"root": {"name": "a", "children": [{"name": "b", "children": [{"name": "c"}]}]}});
            assert!(v.is_valid(&deep));
            assert!(!v.is_valid(&json!({"root": {"children": [{"name": 7}]}})));
        })
        .unwrap()
        .join();
    assert!(ran.is_ok());
}

/// `format` is checked: an argument its schema calls an email, a date-time or an IPv4
/// address must be one. Before, any string passed.
#[test]
fn formats_are_checked() {
    let v = compiled(json!({"type": "object", "properties": {
        "to": {"type": "string", "format": "email"},
        "at": {"type": "string", "format": "date-time"},
        "ip": {"type": "string", "format": "ipv4"}}}))
    .unwrap();
    assert!(v.is_valid(
        &json!({"to": "a@example.com", "at": "2026-12-06T10:00:00Z", "ip": "192.0.2.1"})
    ));
    for bad in [
        json!({"to": "x\r\nBcc: y"}),
        json!({"at": "yesterday"}),
        json!({"ip": "192.0.2.1; rm -rf /"}),
    ] {
        assert!(!v.is_valid(&bad), "{bad}");
    }
}

/// A URI is rewritten in its one spelling where one stands for it: needless escapes
/// decoded, other escapes upper-cased, bytes a URI does not hold escaped, scheme and
/// authority lower-cased; none for a control character, a backslash, a broken escape or a
/// dot segment.
#[test]
fn a_uri_is_rewritten_in_its_one_spelling() {
    use super::content::one_spelling;
    for (given, spelt) in [
        ("docs://q3%3Aplan", "docs://q3:plan"),
        ("file:///d/a%28b%29", "file:///d/a(b)"),
        ("DOCS://Secret/X", "docs://secret/X"),
        (
            "file:///home/u/Report%20%28final%29%2Bv2.pdf",
            "file:///home/u/Report%20(final)+v2.pdf",
        ),
        ("file:///a b/%c3%a9", "file:///a%20b/%C3%A9"),
        ("test://static-text", "test://static-text"),
    ] {
        assert_eq!(one_spelling(given).as_deref(), Some(spelt), "{given}");
        assert!(super::content::uri_fault(spelt).is_none(), "{spelt}");
    }
    for none in [
        "x:%00",
        "x:/a/../b",
        "x:/a%2",
        "x:/a%+1",
        "no-scheme/a b",
        "x:\\a",
    ] {
        assert_eq!(one_spelling(none), None, "{none}");
    }
}
