//! `flowhost key` and `flowhost manifest`, run as the real binary on real files.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{Value, json};

fn flowhost(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(args)
        .output()
        .expect("run flowhost")
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8(out.stderr.clone()).unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Runs `key generate` into `dir` and returns the printed public key.
fn generate_key(dir: &Path, name: &str) -> String {
    let out = flowhost(&["key", "generate", "--out", s(dir), "--name", name]);
    assert!(out.status.success(), "{}", stderr(&out));
    stdout(&out).trim().to_owned()
}

struct Lab {
    dir: tempfile::TempDir,
    public_hex: String,
}

impl Lab {
    fn new() -> Lab {
        let dir = tempfile::tempdir().unwrap();
        let public_hex = generate_key(&dir.path().join("keys"), "pub");
        Lab { dir, public_hex }
    }

    /// A second publisher's public key (hex), generated once per lab.
    fn other_public_key(&self) -> String {
        generate_key(&self.path("other"), "k")
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn key(&self) -> PathBuf {
        self.path("keys/pub.key")
    }

    fn public(&self) -> PathBuf {
        self.path("keys/pub.pub")
    }

    fn body(&self) -> Value {
        json!({
            "schema": "flowhost.manifest.v1",
            "server_id": "team-inbox",
            "name": "Team inbox",
            "version": "1.0.0",
            "public_key": self.public_hex,
            "tools": [{
                "name": "publish",
                "description": "Posts a message.",
                "input_schema": {"type": "object",
                                 "properties": {"message": {"type": "string"}, "sink": {"type": "string"}},
                                 "required": ["message", "sink"]},
                "annotations": {"read_only": false, "destructive": false, "idempotent": false,
                                "requires_approval": false},
                "flow": {"egress": true, "input_clearance": {"kind": "known", "owners": {}, "compartments": []}}
            }]
        })
    }

    fn write(&self, name: &str, value: &Value) -> PathBuf {
        let path = self.path(name);
        std::fs::write(&path, serde_json::to_string_pretty(value).unwrap()).unwrap();
        path
    }

    /// Runs `manifest sign` on `body` written to `body.json`, into `signed.json`.
    fn run_sign(&self, body: &Value) -> (Output, PathBuf) {
        let body_path = self.write("body.json", body);
        let envelope = self.path("signed.json");
        let out = flowhost(&[
            "manifest",
            "sign",
            "--key",
            s(&self.key()),
            "--manifest",
            s(&body_path),
            "--out",
            s(&envelope),
        ]);
        (out, envelope)
    }

    /// Runs `manifest sign` on `body` written compact (as a tool may write a large one).
    fn run_sign_compact(&self, body: &Value) -> (Output, PathBuf) {
        let body_path = self.path("compact.json");
        std::fs::write(&body_path, body.to_string()).unwrap();
        let envelope = self.path("signed.json");
        let out = flowhost(&[
            "manifest",
            "sign",
            "--key",
            s(&self.key()),
            "--manifest",
            s(&body_path),
            "--out",
            s(&envelope),
        ]);
        (out, envelope)
    }

    /// Signs `body` into `signed.json`; returns the envelope path and the printed digest.
    fn sign(&self, body: &Value) -> (PathBuf, String) {
        let (out, envelope) = self.run_sign(body);
        assert!(out.status.success(), "{}", stderr(&out));
        (envelope, stdout(&out).trim().to_owned())
    }
}

#[test]
fn key_generate_writes_private_0600_and_refuses_to_overwrite() {
    let lab = Lab::new();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&lab.key()), 0o600);
    assert_eq!(mode(&lab.public()), 0o644);
    assert_eq!(lab.public_hex.len(), 64);
    assert_eq!(
        std::fs::read_to_string(lab.public()).unwrap().trim(),
        lab.public_hex
    );
    let before = std::fs::read(lab.key()).unwrap();
    let again = flowhost(&[
        "key",
        "generate",
        "--out",
        s(&lab.path("keys")),
        "--name",
        "pub",
    ]);
    assert_eq!(again.status.code(), Some(2));
    assert!(
        stderr(&again).contains("already exists"),
        "{}",
        stderr(&again)
    );
    assert_eq!(std::fs::read(lab.key()).unwrap(), before);
    let bad_name = flowhost(&[
        "key",
        "generate",
        "--out",
        s(lab.dir.path()),
        "--name",
        "../x",
    ]);
    assert_eq!(bad_name.status.code(), Some(2));
}

#[test]
fn sign_then_verify_and_digest_agree() {
    let lab = Lab::new();
    let (envelope, printed) = lab.sign(&lab.body());
    assert!(
        printed.starts_with("sha256:") && printed.len() == 71,
        "{printed}"
    );
    // The key given as hex and as a file.
    for key in [lab.public_hex.clone(), s(&lab.public()).to_owned()] {
        let out = verify(&key, &envelope);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        assert!(stdout(&out).contains("server team-inbox"));
        assert!(stdout(&out).contains(&printed));
    }
    for file in [envelope.clone(), lab.path("body.json")] {
        let out = flowhost(&["manifest", "digest", s(&file)]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert_eq!(stdout(&out).trim(), printed);
    }
    // Re-signing the same body gives the same bytes (Ed25519 is deterministic).
    let first = std::fs::read(&envelope).unwrap();
    lab.sign(&lab.body());
    assert_eq!(std::fs::read(&envelope).unwrap(), first);
}

fn verify(key: &str, envelope: &Path) -> Output {
    flowhost(&["manifest", "verify", "--key", key, s(envelope)])
}

#[test]
fn verify_exits_1_with_the_reason() {
    let lab = Lab::new();
    let (envelope, _) = lab.sign(&lab.body());
    // Another publisher's key.
    let out = verify(&lab.other_public_key(), &envelope);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("signed by"), "{}", stderr(&out));

    // A one-field change of the flow block.
    let mut tampered: Value = serde_json::from_slice(&std::fs::read(&envelope).unwrap()).unwrap();
    tampered["manifest"]["tools"][0]["flow"]["egress"] = json!(false);
    let out = verify(&lab.public_hex, &lab.write("tampered.json", &tampered));
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("does not verify"), "{}", stderr(&out));

    // A malformed envelope names the file and the field.
    let mut long = tampered.clone();
    long["manifest"]["tools"][0]["description"] = json!("x".repeat(612));
    let long_path = lab.write("long.json", &long);
    let out = verify(&lab.public_hex, &long_path);
    assert_eq!(out.status.code(), Some(1));
    let expected = format!(
        "{}: manifest.tools[0].description is 612 characters; the limit is 500",
        long_path.display()
    );
    assert!(stderr(&out).contains(&expected), "{}", stderr(&out));

    // A symlink is refused.
    let link = lab.path("link.json");
    std::os::unix::fs::symlink(&envelope, &link).unwrap();
    let out = verify(&lab.public_hex, &link);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("symbolic link"), "{}", stderr(&out));

    // A key that cannot be read is a usage error, not a verdict.
    assert_eq!(verify("/nonexistent.pub", &envelope).status.code(), Some(2));
}

#[test]
fn sign_refuses_a_readable_key_a_foreign_body_and_a_broken_schema() {
    let lab = Lab::new();
    std::fs::set_permissions(lab.key(), std::fs::Permissions::from_mode(0o644)).unwrap();
    let (out, envelope) = lab.run_sign(&lab.body());
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("chmod 600"), "{}", stderr(&out));
    assert!(!envelope.exists());

    std::fs::set_permissions(lab.key(), std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut body = lab.body();
    body["public_key"] = json!("11".repeat(32));
    let (out, envelope) = lab.run_sign(&body);
    assert_eq!(out.status.code(), Some(2));
    let prefix = format!(
        "{}: the manifest's public_key",
        lab.path("body.json").display()
    );
    assert!(stderr(&out).contains(&prefix), "{}", stderr(&out));
    assert!(!envelope.exists());

    // A schema no host would compile is refused at signing time.
    let mut body = lab.body();
    body["tools"][0]["input_schema"] = json!({"type": "no-such-type"});
    let (out, envelope) = lab.run_sign(&body);
    assert_eq!(out.status.code(), Some(2));
    let reason = "tool \"publish\": input_schema is not a usable JSON Schema";
    assert!(stderr(&out).contains(reason), "{}", stderr(&out));
    assert!(!envelope.exists());

    // A body small as written (80 KB) whose indented envelope would pass what a host reads:
    // refused, naming the limit. Before, it was written, and no host would load it.
    let mut nested = json!(vec![0; 40_000]);
    for _ in 0..100 {
        nested = json!([nested]);
    }
    let mut body = lab.body();
    body["tools"][0]["output_schema"] = json!({"type": "object", "examples": [nested]});
    let (out, envelope) = lab.run_sign_compact(&body);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("over the 1048576 a host reads"),
        "{}",
        stderr(&out)
    );
    assert!(!envelope.exists());

    // Nested as deep as the parser reads, less than a host's retained set wraps it in: a
    // host would admit it and then fail every later start reading the set back. Refused,
    // saying how deep it nests.
    let mut nested = json!(0);
    for _ in 0..118 {
        nested = json!([nested]);
    }
    let mut body = lab.body();
    body["tools"][0]["output_schema"] = json!({"type": "object", "examples": [nested]});
    let (out, envelope) = lab.run_sign_compact(&body);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("nests 123 levels deep; a manifest may nest at most 120"),
        "{}",
        stderr(&out)
    );
    assert!(!envelope.exists());
}

fn export(envelope: &Path, key: &str, doc: &Path, out: &Path) -> Output {
    flowhost(&[
        "manifest",
        "export-openapi",
        "--envelope",
        s(envelope),
        "--key",
        key,
        s(doc),
        "--out",
        s(out),
    ])
}

#[test]
fn openapi_to_manifest_and_back() {
    let lab = Lab::new();
    let doc = json!({
        "openapi": "3.0.3",
        "info": {"title": "inbox", "version": "1"},
        "paths": {"/messages": {"post": {
            "operationId": "publish",
            "summary": "Posts a message.",
            "requestBody": {"required": true, "content": {"application/json": {"schema": {
                "type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}}}},
            "x-flowhost-flow": {"egress": false}
        }}}
    });
    let doc_path = lab.write("openapi.json", &doc);
    let body_path = lab.path("body.json");
    let out = flowhost(&[
        "manifest",
        "from-openapi",
        s(&doc_path),
        "--server-id",
        "inbox",
        "--name",
        "Inbox",
        "--version",
        "2.0.0",
        "--public-key",
        s(&lab.public()),
        "--out",
        s(&body_path),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut body: Value = serde_json::from_slice(&std::fs::read(&body_path).unwrap()).unwrap();
    assert_eq!(body["version"], "2.0.0");
    assert_eq!(body["tools"][0]["flow"], json!({"egress": false}));
    // The publisher changes the declaration before signing; export writes it back.
    body["tools"][0]["flow"] = json!({"egress": true, "declassification_purposes": ["audit"]});
    let (envelope, _) = lab.sign(&body);
    let exported = lab.path("exported.json");
    let out = export(&envelope, &lab.public_hex, &doc_path, &exported);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("publish: declaration replaced"),
        "{}",
        stderr(&out)
    );
    let exported: Value = serde_json::from_slice(&std::fs::read(&exported).unwrap()).unwrap();
    assert_eq!(
        exported["paths"]["/messages"]["post"]["x-flowhost-flow"],
        json!({"egress": true, "declassification_purposes": ["audit"]})
    );
    // An envelope that does not verify is not exported.
    let other_hex = lab.other_public_key();
    let out = export(&envelope, &other_hex, &doc_path, &lab.path("never.json"));
    assert_eq!(out.status.code(), Some(2));
    assert!(!lab.path("never.json").exists());
    // A Top clearance in the document is refused, naming the document and operation.
    let mut bad = doc.clone();
    bad["paths"]["/messages"]["post"]["x-flowhost-flow"] =
        json!({"egress": true, "input_clearance": {"kind": "top"}});
    let bad_path = lab.write("bad-openapi.json", &bad);
    let out = from_openapi(&lab, &bad_path, &lab.path("x.json"));
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains(
            "paths[\"/messages\"].post.x-flowhost-flow: tool input clearance cannot be top"
        ),
        "{}",
        stderr(&out)
    );
}

fn from_openapi(lab: &Lab, doc: &Path, out: &Path) -> Output {
    flowhost(&[
        "manifest",
        "from-openapi",
        s(doc),
        "--server-id",
        "inbox",
        "--name",
        "Inbox",
        "--version",
        "1",
        "--public-key",
        &lab.public_hex,
        "--out",
        s(out),
    ])
}

#[test]
fn openapi_flow_extension_names_are_never_dropped() {
    let lab = Lab::new();
    let terms = json!({"egress": false, "declassification_purposes": ["audit"]});
    let doc = json!({
        "openapi": "3.0.3",
        "info": {"title": "inbox", "version": "1"},
        "paths": {"/messages": {"post": {
            "operationId": "publish",
            "requestBody": {"content": {"application/json": {"schema": {"type": "object"}}}},
            "x-chio-flow": terms
        }}}
    });
    // The other extension name, `x-chio-flow`, is read, not signed as flow: null.
    let doc_path = lab.write("chio.json", &doc);
    let body_path = lab.path("body.json");
    let out = from_openapi(&lab, &doc_path, &body_path);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut body: Value = serde_json::from_slice(&std::fs::read(&body_path).unwrap()).unwrap();
    assert_eq!(body["tools"][0]["flow"], terms);

    // Export writes back under the name the document uses, adding no second name.
    body["tools"][0]["flow"] = json!({"egress": true});
    let (envelope, _) = lab.sign(&body);
    let exported = lab.path("exported.json");
    let out = export(&envelope, &lab.public_hex, &doc_path, &exported);
    assert!(out.status.success(), "{}", stderr(&out));
    let exported: Value = serde_json::from_slice(&std::fs::read(&exported).unwrap()).unwrap();
    let post = &exported["paths"]["/messages"]["post"];
    assert_eq!(post["x-chio-flow"], json!({"egress": true}));
    assert!(post.get("x-flowhost-flow").is_none(), "{post}");

    // Both names with one value are fine; with different values, refused.
    let mut both = doc.clone();
    both["paths"]["/messages"]["post"]["x-flowhost-flow"] = terms.clone();
    let both_path = lab.write("both.json", &both);
    let out = from_openapi(&lab, &both_path, &lab.path("both-body.json"));
    assert!(out.status.success(), "{}", stderr(&out));
    both["paths"]["/messages"]["post"]["x-flowhost-flow"] = json!({"egress": true});
    let both_path = lab.write("both-differ.json", &both);
    let never = lab.path("never.json");
    // Each refusal exits 2, writes nothing, and names file, operation and keys.
    let refused = |doc: &Path, needles: &[&str]| {
        let out = from_openapi(&lab, doc, &never);
        assert_eq!(out.status.code(), Some(2));
        let err = stderr(&out);
        for needle in needles {
            assert!(err.contains(needle), "{needle:?} in {err}");
        }
        assert!(!never.exists());
    };
    refused(
        &both_path,
        &[
            "both-differ.json",
            "paths[\"/messages\"].post",
            "x-chio-flow",
            "x-flowhost-flow",
        ],
    );

    // A look-alike name is refused, naming file, operation and key.
    let mut typo = doc.clone();
    let post = typo["paths"]["/messages"]["post"].as_object_mut().unwrap();
    let value = post.remove("x-chio-flow").unwrap();
    post.insert("x-flowhst-flow".into(), value);
    let typo_path = lab.write("typo.json", &typo);
    refused(
        &typo_path,
        &["typo.json", "paths[\"/messages\"].post", "x-flowhst-flow"],
    );

    // A declaration where none is read (the document root, directly under `paths`) is
    // refused, naming where it is, rather than the tools being signed with no flow.
    let mut at_root = doc.clone();
    let post = at_root["paths"]["/messages"]["post"]
        .as_object_mut()
        .unwrap();
    let value = post.remove("x-chio-flow").unwrap();
    at_root["x-chio-flow"] = value.clone();
    let root_path = lab.write("root.json", &at_root);
    refused(
        &root_path,
        &["root.json", "x-chio-flow", "outside any operation"],
    );
    let mut under_paths = at_root.clone();
    under_paths.as_object_mut().unwrap().remove("x-chio-flow");
    under_paths["paths"]["x-chio-flow"] = value;
    let under_path = lab.write("under-paths.json", &under_paths);
    refused(
        &under_path,
        &[
            "under-paths.json",
            "paths.x-chio-flow",
            "outside any operation",
        ],
    );
    // A path item that only refers elsewhere would drop its operations: refused.
    let mut referenced = doc.clone();
    referenced["paths"]["/archive"] = json!({"$ref": "#/components/pathItems/Archive"});
    let referenced_path = lab.write("referenced.json", &referenced);
    refused(
        &referenced_path,
        &[
            "referenced.json",
            "paths[\"/archive\"]",
            "#/components/pathItems/Archive",
        ],
    );
}

/// A key written into a directory whose entries cannot be synced (write and search, no
/// read: the directory cannot be opened to sync it) is not durable: it is taken away again
/// and the error says why, so no half of a pair is left and a retry is not refused.
#[test]
fn a_key_whose_directory_cannot_be_synced_is_reported_as_not_durable() {
    if !nix::unistd::geteuid().is_root() || !common::have("setpriv") {
        eprintln!("SKIP: needs root and setpriv to run as another user");
        return;
    }
    let top = tempfile::tempdir().unwrap();
    std::fs::set_permissions(top.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let dir = top.path().join("keys");
    std::fs::create_dir(&dir).unwrap();
    std::os::unix::fs::chown(&dir, Some(990), Some(990)).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o300)).unwrap();
    let out = Command::new("setpriv")
        .args(["--reuid", "990", "--regid", "990", "--clear-groups", "--"])
        .arg(common::shared_flowhost())
        .args(["key", "generate", "--out", s(&dir), "--name", "k"])
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("k.key: not written: its directory could not be synced"),
        "{err}"
    );
    assert!(!dir.join("k.key").exists() && !dir.join("k.pub").exists());
}
