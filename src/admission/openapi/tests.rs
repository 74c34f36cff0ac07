//! OpenAPI to manifest and back.

use ed25519_dalek::SigningKey;
use serde_json::json;

use super::*;
use crate::manifest::SignedManifest;

fn key() -> SigningKey {
    SigningKey::from_bytes(&[3; 32])
}

fn identity() -> ManifestIdentity {
    ManifestIdentity {
        server_id: "workspace".into(),
        name: "Workspace".into(),
        description: None,
        version: "1.0.0".into(),
        public_key: key().verifying_key(),
    }
}

fn terms_label() -> Value {
    json!({"kind": "known", "owners": {"larkfield-pricing": ["larkfield-pricing"]},
           "compartments": ["harbor-goods-terms"]})
}

fn doc() -> Value {
    json!({
        "openapi": "3.1.0",
        "info": {"title": "t", "version": "1"},
        "paths": {
            "/documents/{document}/terms": {
                "parameters": [{"name": "document", "in": "path", "required": true,
                                "schema": {"type": "string"}}],
                "get": {
                    "operationId": "read_terms",
                    "summary": "Reads terms.",
                    "parameters": [{"$ref": "#/components/parameters/Version"}],
                    "responses": {
                        "404": {"description": "missing"},
                        "200": {"$ref": "#/components/responses/Terms"}
                    },
                    "x-flowhost-flow": {"output_label": terms_label(),
                                        "input_clearance": terms_label(), "egress": false}
                },
                "delete": {
                    "operationId": "delete_terms",
                    "description": "Deletes terms.",
                    "responses": {"204": {"description": "gone"}}
                }
            },
            "/summaries": {
                "post": {
                    "operationId": "summarize_terms",
                    "requestBody": {"required": true, "content": {"application/json; charset=utf-8": {
                        "schema": {"$ref": "#/components/schemas/SummaryRequest"}}}},
                    "x-flowhost-annotations": {"read_only": true, "destructive": false,
                                               "idempotent": true, "requires_approval": false},
                    "x-flowhost-flow": {"egress": false}
                }
            }
        },
        "components": {
            "parameters": {"Version": {"name": "version", "in": "query",
                                       "schema": {"type": "integer", "minimum": 1}}},
            "responses": {"Terms": {"description": "ok", "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/Terms"}}}}},
            "schemas": {
                "Terms": {"type": "object", "properties": {"text": {"type": "string"},
                          "parts": {"type": "array", "items": {"$ref": "#/components/schemas/Terms"}}},
                          "example": {"$ref": "not a reference, just data"}},
                "SummaryRequest": {"type": "object", "properties": {"text": {"type": "string"},
                                   "example": {"$ref": "#/components/schemas/Terms"}},
                                   "required": ["text"]}
            }
        }
    })
}

fn tool<'a>(body: &'a Value, name: &str) -> &'a Value {
    body["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .unwrap()
}

#[test]
fn operations_become_tools() {
    let body = manifest_from_openapi(&doc(), &identity()).unwrap();
    let names: Vec<&str> = body["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    // Path order, then method order (get before delete).
    assert_eq!(names, ["read_terms", "delete_terms", "summarize_terms"]);

    let read = tool(&body, "read_terms");
    assert_eq!(read["description"], "Reads terms.");
    assert_eq!(
        read["input_schema"],
        json!({"type": "object", "additionalProperties": false, "required": ["document"],
               "properties": {"document": {"type": "string"},
                              "version": {"type": "integer", "minimum": 1}}})
    );
    // The lowest 2xx response, its component schema copied into $defs (recursion kept).
    let output = &read["output_schema"];
    assert_eq!(output["$ref"], "#/$defs/Terms");
    assert_eq!(
        output["$defs"]["Terms"]["properties"]["parts"]["items"]["$ref"],
        "#/$defs/Terms"
    );
    assert_eq!(
        output["$defs"]["Terms"]["example"]["$ref"],
        "not a reference, just data"
    );
    assert_eq!(read["annotations"]["read_only"], true);
    assert_eq!(read["flow"]["input_clearance"], terms_label());

    let delete = tool(&body, "delete_terms");
    assert_eq!(delete["annotations"]["destructive"], true);
    assert!(delete.get("flow").is_none() && delete.get("output_schema").is_none());

    // A body-only operation takes the body's schema as its input.
    let summarize = tool(&body, "summarize_terms");
    assert_eq!(summarize["input_schema"]["$ref"], "#/$defs/SummaryRequest");
    assert_eq!(
        summarize["input_schema"]["$defs"]["SummaryRequest"]["required"],
        json!(["text"])
    );
    assert_eq!(
        summarize["annotations"]["read_only"], true,
        "extension overrides"
    );
    assert_eq!(summarize["flow"], json!({"egress": false}));

    // The result signs, verifies and admits schemas that compile.
    let signed = SignedManifest::sign(body, &key()).unwrap();
    signed.verify(&key().verifying_key()).unwrap();
    for t in signed.body().tools() {
        jsonschema::validator_for(&Value::Object(t.input_schema().clone())).unwrap();
    }
}

#[test]
fn parameters_and_body_together() {
    let mut d = doc();
    d["paths"]["/summaries"]["post"]["parameters"] =
        json!([{"name": "lang", "in": "query", "required": true, "schema": {"type": "string"}}]);
    let body = manifest_from_openapi(&d, &identity()).unwrap();
    let input = &tool(&body, "summarize_terms")["input_schema"];
    assert_eq!(input["required"], json!(["lang", "body"]));
    assert_eq!(
        input["properties"]["body"]["$ref"],
        "#/$defs/SummaryRequest"
    );
    // A parameter literally named "body" would collide.
    d["paths"]["/summaries"]["post"]["parameters"] =
        json!([{"name": "body", "in": "query", "schema": {"type": "string"}}]);
    assert!(matches!(
        manifest_from_openapi(&d, &identity()),
        Err(OpenApiError::InputNameConflict { .. })
    ));
}

#[test]
fn refusals() {
    let check = |change: fn(&mut Value), expected: fn(&OpenApiError) -> bool| {
        let mut d = doc();
        change(&mut d);
        let err = manifest_from_openapi(&d, &identity()).unwrap_err();
        assert!(expected(&err), "{err:?}");
    };
    check(
        |d| d["openapi"] = json!("2.0"),
        |e| matches!(e, OpenApiError::NotOpenApi3 { .. }),
    );
    check(
        |d| d["paths"] = json!({}),
        |e| matches!(e, OpenApiError::NoOperations),
    );
    check(
        |d| {
            d["paths"]["/summaries"]["post"]
                .as_object_mut()
                .unwrap()
                .remove("operationId");
        },
        |e| matches!(e, OpenApiError::MissingOperationId { .. }),
    );
    check(
        |d| d["paths"]["/summaries"]["post"]["operationId"] = json!("read_terms"),
        |e| matches!(e, OpenApiError::DuplicateOperationId { .. }),
    );
    check(
        |d| {
            d["components"]["schemas"]["Terms"]["properties"]["text"] =
                json!({"$ref": "https://schemas.example/text.json"})
        },
        |e| matches!(e, OpenApiError::UnsupportedRef { .. }),
    );
    check(
        |d| {
            d["paths"]["/summaries"]["post"]["requestBody"]["content"]["application/json; charset=utf-8"]
                ["schema"] = json!({"$ref": "#/components/schemas/Missing"})
        },
        |e| matches!(e, OpenApiError::UnsupportedRef { .. }),
    );
    check(
        |d| {
            let version = &mut d["components"]["parameters"]["Version"];
            version.as_object_mut().unwrap().remove("in");
        },
        |e| matches!(e, OpenApiError::ParameterField { field: "in", .. }),
    );
    check(
        |d| {
            d["paths"]["/summaries"]["post"]["requestBody"] =
                json!({"content": {"text/plain": {"schema": {"type": "string"}}}})
        },
        |e| matches!(e, OpenApiError::NonJsonRequestBody { .. }),
    );
    check(
        |d| {
            d["paths"]["/summaries"]["post"]["x-flowhost-flow"] =
                json!({"egress": true, "input_clearance": {"kind": "top"}})
        },
        |e| matches!(e, OpenApiError::Manifest(ManifestError::TopInFlow { .. })),
    );
    check(
        |d| {
            d["paths"]["/summaries"]["post"]["x-flowhost-flow"] =
                json!({"egress": true, "via": "x"})
        },
        |e| {
            matches!(
                e,
                OpenApiError::Manifest(ManifestError::MalformedFlow { .. })
            )
        },
    );
    check(
        |d| d["paths"]["/summaries"]["post"]["description"] = json!("d".repeat(501)),
        |e| {
            matches!(
                e,
                OpenApiError::Manifest(ManifestError::DescriptionTooLong { .. })
            )
        },
    );
    check(
        |d| d["paths"]["/summaries"]["post"]["operationId"] = json!("summarize terms "),
        |e| {
            matches!(
                e,
                OpenApiError::Manifest(ManifestError::InvalidIdentifier { .. })
            )
        },
    );
}

#[test]
fn errors_name_the_operation() {
    let mut d = doc();
    d["paths"]["/summaries"]["post"]["x-flowhost-flow"] =
        json!({"egress": true, "output_label": {"kind": "top"}});
    let err = manifest_from_openapi(&d, &identity()).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("paths[\"/summaries\"].post.x-flowhost-flow: "),
        "{err}"
    );
}

#[test]
fn export_replaces_adds_and_removes_declarations() {
    let body_json = manifest_from_openapi(&doc(), &identity()).unwrap();
    let mut body_json = body_json;
    // The signed manifest differs from the document: read_terms now egresses, delete_terms
    // gains a declaration, summarize_terms loses its own.
    body_json["tools"][0]["flow"]["egress"] = json!(true);
    body_json["tools"][1]["flow"] = json!({"egress": false});
    body_json["tools"][2]
        .as_object_mut()
        .unwrap()
        .remove("flow");
    let signed = SignedManifest::sign(body_json, &key()).unwrap();
    let mut d = doc();
    let actions = export_flow_declarations(&mut d, signed.body()).unwrap();
    assert_eq!(
        actions,
        [
            ("read_terms".to_owned(), ExportAction::Replaced),
            ("delete_terms".to_owned(), ExportAction::Added),
            ("summarize_terms".to_owned(), ExportAction::Removed),
        ]
    );
    let read = &d["paths"]["/documents/{document}/terms"]["get"]["x-flowhost-flow"];
    assert_eq!(read["egress"], true);
    assert_eq!(
        d["paths"]["/documents/{document}/terms"]["delete"]["x-flowhost-flow"],
        json!({"egress": false})
    );
    assert!(
        d["paths"]["/summaries"]["post"]
            .get("x-flowhost-flow")
            .is_none()
    );
    // Everything else is untouched, and a second export changes nothing.
    assert_eq!(d["components"], doc()["components"]);
    let again = export_flow_declarations(&mut d, signed.body()).unwrap();
    assert_eq!(
        again.iter().map(|(_, a)| *a).collect::<Vec<_>>(),
        [
            ExportAction::Unchanged,
            ExportAction::Unchanged,
            ExportAction::Absent
        ]
    );
    // Round trip: generating again from the exported document gives the signed flows.
    let regenerated = manifest_from_openapi(&d, &identity()).unwrap();
    for (i, t) in signed.body().tools().iter().enumerate() {
        let flow = regenerated["tools"][i].get("flow").cloned();
        assert_eq!(flow, t.flow().map(|f| serde_json::to_value(f).unwrap()));
    }
}

#[test]
fn export_needs_an_operation_for_every_tool() {
    let mut body_json = manifest_from_openapi(&doc(), &identity()).unwrap();
    body_json["tools"][1]["name"] = json!("archive_terms");
    let signed = SignedManifest::sign(body_json, &key()).unwrap();
    let mut d = doc();
    assert!(matches!(
        export_flow_declarations(&mut d, signed.body()),
        Err(OpenApiError::ToolWithoutOperation { tool }) if tool == "archive_terms"
    ));
}

#[test]
fn both_flow_extension_names_are_read_and_must_agree() {
    fn post(d: &mut Value) -> &mut Map<String, Value> {
        d["paths"]["/summaries"]["post"].as_object_mut().unwrap()
    }
    // The other name, x-chio-flow, alone.
    let mut d = doc();
    let flow = post(&mut d).remove("x-flowhost-flow").unwrap();
    post(&mut d).insert("x-chio-flow".into(), flow.clone());
    let body = manifest_from_openapi(&d, &identity()).unwrap();
    assert_eq!(tool(&body, "summarize_terms")["flow"], flow);
    // Both names, the same declaration: accepted.
    post(&mut d).insert("x-flowhost-flow".into(), flow.clone());
    let body = manifest_from_openapi(&d, &identity()).unwrap();
    assert_eq!(tool(&body, "summarize_terms")["flow"], flow);
    // Both names, different declarations: refused, naming the operation.
    post(&mut d).insert("x-flowhost-flow".into(), json!({"egress": true}));
    let err = manifest_from_openapi(&d, &identity()).unwrap_err();
    assert!(
        matches!(&err, OpenApiError::ConflictingFlowExtensions { path }
            if path.to_string() == "paths[\"/summaries\"].post"),
        "{err:?}"
    );
}

#[test]
fn look_alike_flow_extensions_are_refused() {
    for name in [
        "x-flowhst-flow",
        "x-acme-flow",
        "X-Chio-Flow",
        "x-flow",
        // Before, these were taken for ordinary extensions and their declarations dropped.
        "x-chioFlow",
        "x-flowhost_flow",
        "x-chio-flows",
        "x-chio-flow-v1",
        "x-chio-flow ",
    ] {
        let mut d = doc();
        d["paths"]["/summaries"]["post"][name] = json!({"egress": false});
        let err = manifest_from_openapi(&d, &identity()).unwrap_err();
        let OpenApiError::UnknownFlowExtension { path, key: found } = &err else {
            panic!("{name}: {err:?}");
        };
        assert_eq!(found, name);
        let expected = if name.contains(' ') {
            format!("paths[\"/summaries\"].post[{name:?}]")
        } else {
            format!("paths[\"/summaries\"].post.{name}")
        };
        assert_eq!(path.to_string(), expected);
        // Export refuses the same document rather than writing beside the look-alike.
        let signed =
            SignedManifest::sign(manifest_from_openapi(&doc(), &identity()).unwrap(), &key())
                .unwrap();
        assert!(matches!(
            export_flow_declarations(&mut d, signed.body()),
            Err(OpenApiError::UnknownFlowExtension { .. })
        ));
    }
    // Other extensions are not flow declarations.
    let mut d = doc();
    d["paths"]["/summaries"]["post"]["x-flowrate"] = json!(1);
    d["paths"]["/summaries"]["post"]["x-workflow-id"] = json!("a");
    d["paths"]["/summaries"]["post"]["x-workflow"] = json!({"steps": 2});
    manifest_from_openapi(&d, &identity()).unwrap();
}

/// Annotations under any other name than `x-flowhost-annotations` were ignored, so the
/// method's defaults (which never require approval) were signed in their place: a
/// `requires_approval: true` written as `x-flowhost-annotation` was lost.
#[test]
fn look_alike_annotations_are_refused() {
    let approval = json!({"read_only": false, "destructive": true, "idempotent": false,
                          "requires_approval": true});
    for name in [
        "x-flowhost-annotation",
        "x-flowhost_annotations",
        "x-flowhostAnnotations",
        "x-acme-annotations",
        "x-flowhost-annotations-v2",
    ] {
        let mut d = doc();
        d["paths"]["/summaries"]["post"][name] = approval.clone();
        let err = manifest_from_openapi(&d, &identity()).unwrap_err();
        let OpenApiError::UnknownAnnotationsExtension { path, key: found } = &err else {
            panic!("{name}: {err:?}");
        };
        assert_eq!(found, name);
        assert_eq!(
            path.to_string(),
            format!("paths[\"/summaries\"].post.{name}")
        );
        assert!(err.to_string().contains("x-flowhost-annotations"), "{err}");
    }
    // Not an extension at all (OpenAPI's are case-sensitive), or no such operation field:
    // whatever it meant would be dropped.
    for name in [
        "X-Flowhost-Annotations",
        "annotations",
        "x_chio_flow",
        "operationID",
    ] {
        let mut d = doc();
        d["paths"]["/summaries"]["post"][name] = approval.clone();
        let err = manifest_from_openapi(&d, &identity()).unwrap_err();
        assert!(
            matches!(&err, OpenApiError::UnknownOperationField { key, .. } if key == name),
            "{name}: {err:?}"
        );
    }
    // A path item's key that is no field of one (a method in capitals) held an operation
    // that was skipped without a word.
    let mut d = doc();
    d["paths"]["/summaries"]["PATCH"] = json!({"operationId": "patch_summary", "responses": {}});
    let err = manifest_from_openapi(&d, &identity()).unwrap_err();
    assert!(
        matches!(&err, OpenApiError::UnknownPathItemField { key, .. } if key == "PATCH"),
        "{err:?}"
    );
    // The accepted name outside an operation, where none is read.
    for (at, path) in [
        (
            vec!["paths", "/summaries"],
            "paths[\"/summaries\"].x-flowhost-annotations",
        ),
        (vec!["paths"], "paths.x-flowhost-annotations"),
        (vec![], "x-flowhost-annotations"),
    ] {
        let mut d = doc();
        let mut target = &mut d;
        for segment in at {
            target = &mut target[segment];
        }
        target["x-flowhost-annotations"] = approval.clone();
        let err = manifest_from_openapi(&d, &identity()).unwrap_err();
        assert!(
            matches!(&err, OpenApiError::MisplacedAnnotationsExtension { path: p, .. } if p.to_string() == path),
            "{path}: {err:?}"
        );
    }
    // Other extensions, and the accepted one on the operation, are fine.
    let mut d = doc();
    d["paths"]["/summaries"]["post"]["x-annotated-by"] = json!("ops");
    d["paths"]["/summaries"]["post"]["x-flowhost-annotations"] = approval.clone();
    let body = manifest_from_openapi(&d, &identity()).unwrap();
    assert_eq!(
        tool(&body, "summarize_terms")["annotations"]["requires_approval"],
        true
    );
}

/// POST, PATCH and PUT were signed as non-destructive by default, so a client that runs
/// non-destructive tools without asking ran `POST /accounts/{id}/close`.
#[test]
fn writing_methods_are_destructive_unless_declared_otherwise() {
    let mut d = doc();
    let summaries = d["paths"]["/summaries"].as_object_mut().unwrap();
    let post = summaries.get_mut("post").unwrap().as_object_mut().unwrap();
    post.remove("x-flowhost-annotations");
    let post = Value::Object(post.clone());
    for method in ["put", "patch", "post"] {
        let mut op = post.clone();
        op["operationId"] = json!(format!("{method}_summary"));
        summaries.insert(method.to_owned(), op);
    }
    let body = manifest_from_openapi(&d, &identity()).unwrap();
    for (method, idempotent) in [("put", true), ("patch", false), ("post", false)] {
        let a = &tool(&body, &format!("{method}_summary"))["annotations"];
        assert_eq!(
            (
                a["read_only"].clone(),
                a["destructive"].clone(),
                a["idempotent"].clone()
            ),
            (json!(false), json!(true), json!(idempotent)),
            "{method}"
        );
    }
}

#[test]
fn export_writes_under_the_name_in_use() {
    let body = manifest_from_openapi(&doc(), &identity()).unwrap();
    let mut with_flows = body.clone();
    for t in with_flows["tools"].as_array_mut().unwrap() {
        t["flow"] = json!({"egress": true});
    }
    let signed = SignedManifest::sign(with_flows, &key()).unwrap();
    let names = |d: &Value, route: &str, method: &str| -> Vec<String> {
        d["paths"][route][method]
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| k.ends_with("-flow"))
            .cloned()
            .collect()
    };
    // A document with no declaration anywhere gets x-chio-flow, the default name when writing.
    let mut bare = doc();
    for (route, method) in [
        ("/documents/{document}/terms", "get"),
        ("/summaries", "post"),
    ] {
        bare["paths"][route][method]
            .as_object_mut()
            .unwrap()
            .remove("x-flowhost-flow");
    }
    export_flow_declarations(&mut bare, signed.body()).unwrap();
    assert_eq!(names(&bare, "/summaries", "post"), ["x-chio-flow"]);
    // An operation keeps its own name; one with none takes the name the document uses.
    let mut mixed = doc();
    let post = mixed["paths"]["/summaries"]["post"]
        .as_object_mut()
        .unwrap();
    let flow = post.remove("x-flowhost-flow").unwrap();
    post.insert("x-chio-flow".into(), flow);
    export_flow_declarations(&mut mixed, signed.body()).unwrap();
    assert_eq!(names(&mixed, "/summaries", "post"), ["x-chio-flow"]);
    let terms = "/documents/{document}/terms";
    assert_eq!(names(&mixed, terms, "get"), ["x-flowhost-flow"]);
    // Two names in the document: the new declaration takes the default.
    assert_eq!(names(&mixed, terms, "delete"), ["x-chio-flow"]);
    // An operation with both names has both replaced, so they still agree.
    let mut both = doc();
    both["paths"]["/summaries"]["post"]["x-chio-flow"] = json!({"egress": false});
    export_flow_declarations(&mut both, signed.body()).unwrap();
    let post = &both["paths"]["/summaries"]["post"];
    assert_eq!(post["x-chio-flow"], json!({"egress": true}));
    assert_eq!(post["x-flowhost-flow"], json!({"egress": true}));
    manifest_from_openapi(&both, &identity()).unwrap();
}

/// A signed manifest made from the unchanged [`doc`], for export tests on changed documents.
fn signed_doc() -> SignedManifest {
    SignedManifest::sign(manifest_from_openapi(&doc(), &identity()).unwrap(), &key()).unwrap()
}

#[test]
fn flow_declarations_outside_operations_are_refused_naming_where() {
    // (where, key, the path the error names): the document root, `paths` itself and a path
    // item are all places flowhost reads no declaration from, so the tools would be signed
    // with no flow at all.
    type Place = fn(&mut Value) -> &mut Value;
    let cases: [(Place, &str, &str); 7] = [
        (|d| d, "x-chio-flow", "x-chio-flow"),
        (|d| d, "x-flowhost-flow", "x-flowhost-flow"),
        (|d| d, "X-Acme-Flow", "X-Acme-Flow"),
        (|d| &mut d["paths"], "x-chio-flow", "paths.x-chio-flow"),
        (|d| &mut d["paths"], "x-acme-flow", "paths.x-acme-flow"),
        (
            |d| &mut d["paths"]["/summaries"],
            "x-flowhost-flow",
            "paths[\"/summaries\"].x-flowhost-flow",
        ),
        (
            |d| &mut d["paths"]["/summaries"],
            "x-chio-flow",
            "paths[\"/summaries\"].x-chio-flow",
        ),
    ];
    for (place, name, expected) in cases {
        let mut d = doc();
        place(&mut d)[name] = json!({"egress": false});
        let err = manifest_from_openapi(&d, &identity()).unwrap_err();
        let OpenApiError::MisplacedFlowExtension { path, key: found } = &err else {
            panic!("{name} at {expected}: {err:?}");
        };
        assert_eq!(found, name);
        assert_eq!(path.to_string(), expected);
        assert!(err.to_string().contains("operation"), "{err}");
        // Export refuses the same document rather than writing beside it.
        assert!(
            matches!(
                export_flow_declarations(&mut d, signed_doc().body()),
                Err(OpenApiError::MisplacedFlowExtension { .. })
            ),
            "{name} at {expected}"
        );
    }
}

#[test]
fn path_item_references_are_refused_not_skipped() {
    // A path item that is only a reference has no method keys of its own; its operations
    // must not silently become "no tools here".
    let mut d = doc();
    d["paths"]["/archive"] = json!({"$ref": "#/components/pathItems/Archive"});
    d["components"]["pathItems"] = json!({"Archive": {"post": {
        "operationId": "archive", "responses": {"204": {"description": "ok"}}}}});
    let err = manifest_from_openapi(&d, &identity()).unwrap_err();
    assert!(
        matches!(&err, OpenApiError::UnsupportedRef { path, reference, .. }
            if path.to_string() == "paths[\"/archive\"][\"$ref\"]"
                && reference == "#/components/pathItems/Archive"),
        "{err:?}"
    );
    assert!(matches!(
        export_flow_declarations(&mut d, signed_doc().body()),
        Err(OpenApiError::UnsupportedRef { .. })
    ));
    // Beside operations too (OpenAPI leaves the merge undefined), and whatever its type.
    for reference in [json!("#/components/pathItems/Archive"), json!(7)] {
        let mut d = doc();
        d["paths"]["/summaries"]["$ref"] = reference;
        let err = manifest_from_openapi(&d, &identity()).unwrap_err();
        assert!(
            matches!(&err, OpenApiError::UnsupportedRef { path, .. }
                if path.to_string() == "paths[\"/summaries\"][\"$ref\"]"),
            "{err:?}"
        );
    }
}

#[test]
fn other_extensions_under_paths_are_ignored() {
    let mut d = doc();
    d["paths"]["x-foo"] = json!("bar");
    // An extension is not a path item, even one shaped like it.
    d["paths"]["x-internal"] = json!({"get": {"operationId": "hidden"}});
    let body = manifest_from_openapi(&d, &identity()).unwrap();
    assert_eq!(body, manifest_from_openapi(&doc(), &identity()).unwrap());
    export_flow_declarations(&mut d, signed_doc().body()).unwrap();
    assert_eq!(d["paths"]["x-foo"], "bar");
}

#[test]
fn fields_of_the_wrong_type_are_refused_not_defaulted() {
    const TERMS: &str = "paths[\"/documents/{document}/terms\"]";
    type Change = fn(&mut Value);
    let cases: [(Change, String, &str); 17] = [
        (
            |d| {
                d["components"]["securitySchemes"] =
                    json!({"key": {"type": "ApiKey", "in": "header", "name": "K"}})
            },
            "components.securitySchemes.key.type".into(),
            "apiKey, http, mutualTLS, oauth2 or openIdConnect",
        ),
        (
            |d| d["components"]["securitySchemes"] = json!({"key": {"in": "header", "name": "K"}}),
            "components.securitySchemes.key.type".into(),
            "apiKey, http, mutualTLS, oauth2 or openIdConnect",
        ),
        (
            |d| {
                d["components"]["securitySchemes"] = json!({"key": {"type": "apiKey", "name": "K"}})
            },
            "components.securitySchemes.key.in".into(),
            "header, query or cookie",
        ),
        (
            |d| {
                d["components"]["securitySchemes"] =
                    json!({"key": {"type": "apiKey", "in": "Header", "name": "K"}})
            },
            "components.securitySchemes.key.in".into(),
            "header, query or cookie",
        ),
        // Where an API key goes, read as absent, let its key become an argument.
        (
            |d| d["components"]["securitySchemes"] = json!([{"type": "apiKey"}]),
            "components.securitySchemes".into(),
            "an object",
        ),
        (
            |d| {
                d["components"]["securitySchemes"] =
                    json!({"key": {"type": "apiKey", "in": ["header"], "name": "X-Api-Key"}})
            },
            "components.securitySchemes.key.in".into(),
            "a string",
        ),
        (
            |d| {
                d["components"]["securitySchemes"] =
                    json!({"key": {"type": "apiKey", "in": "header", "name": 7}})
            },
            "components.securitySchemes.key.name".into(),
            "a string",
        ),
        (
            |d| d["components"]["securitySchemes"] = json!({"key": "apiKey"}),
            "components.securitySchemes.key".into(),
            "an object",
        ),
        // A query parameter's `required: "true"` used to become "optional".
        (
            |d| d["components"]["parameters"]["Version"]["required"] = json!("true"),
            format!("{TERMS}.get.parameters[0].required"),
            "a boolean",
        ),
        (
            |d| d["paths"]["/documents/{document}/terms"]["parameters"][0]["required"] = json!(1),
            format!("{TERMS}.parameters[0].required"),
            "a boolean",
        ),
        (
            |d| d["paths"]["/summaries"]["post"]["requestBody"]["required"] = json!("true"),
            "paths[\"/summaries\"].post.requestBody.required".into(),
            "a boolean",
        ),
        // Used to be reported as missing.
        (
            |d| d["paths"]["/summaries"]["post"]["operationId"] = json!(42),
            "paths[\"/summaries\"].post.operationId".into(),
            "a string",
        ),
        // Used to fall back to the summary, or to "".
        (
            |d| d["paths"]["/documents/{document}/terms"]["get"]["description"] = json!(5),
            format!("{TERMS}.get.description"),
            "a string",
        ),
        (
            |d| d["paths"]["/documents/{document}/terms"]["get"]["summary"] = json!(["x"]),
            format!("{TERMS}.get.summary"),
            "a string",
        ),
        (
            |d| d["paths"]["/summaries"]["post"]["description"] = json!({"text": "x"}),
            "paths[\"/summaries\"].post.description".into(),
            "a string",
        ),
        // Used to be read as no output schema.
        (
            |d| d["paths"]["/documents/{document}/terms"]["get"]["responses"] = json!(["200"]),
            format!("{TERMS}.get.responses"),
            "an object",
        ),
        (
            |d| d["components"]["responses"]["Terms"]["content"] = json!("application/json"),
            format!("{TERMS}.get.responses.200.content"),
            "an object",
        ),
    ];
    for (change, at, what) in cases {
        let mut d = doc();
        change(&mut d);
        let err = manifest_from_openapi(&d, &identity()).unwrap_err();
        assert!(
            matches!(&err, OpenApiError::WrongType { path, expected, .. }
                if path.to_string() == at && *expected == what),
            "{at}: {err:?}"
        );
    }
    // Export finds operations by operationId, so it refuses one of the wrong type too.
    let mut d = doc();
    d["paths"]["/summaries"]["post"]["operationId"] = json!(42);
    assert!(matches!(
        export_flow_declarations(&mut d, signed_doc().body()),
        Err(OpenApiError::WrongType { .. })
    ));
}

#[test]
fn path_parameters_are_always_required() {
    let document = |body: &Value| tool(body, "read_terms")["input_schema"]["required"].clone();
    // Without `required`, a path parameter is still required: the URL has no other form.
    let mut d = doc();
    d["paths"]["/documents/{document}/terms"]["parameters"][0]
        .as_object_mut()
        .unwrap()
        .remove("required");
    let body = manifest_from_openapi(&d, &identity()).unwrap();
    assert_eq!(document(&body), json!(["document"]));
    // `required: false` contradicts OpenAPI and the author's intent is unclear: refused.
    d["paths"]["/documents/{document}/terms"]["parameters"][0]["required"] = json!(false);
    let err = manifest_from_openapi(&d, &identity()).unwrap_err();
    assert!(
        matches!(&err, OpenApiError::OptionalPathParameter { path, name }
            if path.to_string() == "paths[\"/documents/{document}/terms\"].parameters[0].required"
                && name == "document"),
        "{err:?}"
    );
    assert!(err.to_string().contains("required"), "{err}");
    // Also through a reference to a component parameter.
    let mut d = doc();
    d["components"]["parameters"]["Version"]["in"] = json!("path");
    d["components"]["parameters"]["Version"]["required"] = json!(false);
    assert!(matches!(
        manifest_from_openapi(&d, &identity()),
        Err(OpenApiError::OptionalPathParameter { .. })
    ));
    // Other locations keep their own `required`, absent meaning optional.
    let body = manifest_from_openapi(&doc(), &identity()).unwrap();
    assert_eq!(document(&body), json!(["document"]));
}

#[test]
fn export_refuses_duplicate_operation_ids() {
    // Two operations with one id: which one should get the declaration is unknowable, and
    // the first used to be silently forgotten.
    let mut d = doc();
    d["paths"]["/summaries"]["post"]["operationId"] = json!("read_terms");
    let before = d.clone();
    let err = export_flow_declarations(&mut d, signed_doc().body()).unwrap_err();
    assert!(
        matches!(&err, OpenApiError::DuplicateOperationId { path, name, first }
            if name == "read_terms"
                && path.to_string() == "paths[\"/summaries\"].post"
                && first.to_string() == "paths[\"/documents/{document}/terms\"].get"),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(message.contains("paths[\"/summaries\"].post"), "{message}");
    assert!(
        message.contains("paths[\"/documents/{document}/terms\"].get"),
        "{message}"
    );
    assert_eq!(d, before, "nothing is written on refusal");
}

/// A parameter listed twice in one list replaced the first, and its constraints with it;
/// an `in` OpenAPI does not know (`"Path"`) made a path parameter optional. Both refused.
#[test]
fn parameters_listed_twice_or_placed_nowhere_are_refused() {
    let twice = json!([
        {"name": "id", "in": "path", "required": true, "schema": {"type": "string", "pattern": "^[0-9]+$"}},
        {"name": "id", "in": "path", "required": true, "schema": {}}
    ]);
    let mut d = doc();
    d["paths"]["/summaries"]["post"]["parameters"] = twice;
    let err = manifest_from_openapi(&d, &identity()).unwrap_err();
    assert!(
        matches!(&err, OpenApiError::DuplicateParameter { name, .. } if name == "id"),
        "{err:?}"
    );
    let mut d = doc();
    d["paths"]["/summaries"]["post"]["parameters"] =
        json!([{"name": "id", "in": "Path", "schema": {"type": "string"}}]);
    let err = manifest_from_openapi(&d, &identity()).unwrap_err();
    assert!(
        matches!(&err, OpenApiError::UnknownParameterLocation { found, .. } if found == "Path"),
        "{err:?}"
    );
    // An operation's parameter overriding its path item's is OpenAPI's rule, and kept.
    let mut d = doc();
    d["paths"]["/summaries"]["parameters"] =
        json!([{"name": "q", "in": "query", "schema": {"type": "string"}}]);
    d["paths"]["/summaries"]["post"]["parameters"] =
        json!([{"name": "q", "in": "query", "required": true, "schema": {"type": "string"}}]);
    manifest_from_openapi(&d, &identity()).unwrap();
}

/// Header names are compared without case, as HTTP compares them: an operation's `x-tenant`
/// overrides its path item's `X-Tenant`, and one list naming both names one header twice.
/// Before, both became arguments, and the operation's narrower schema never replaced the
/// path item's (`X-Tenant: admin` passed beside `x-tenant: public`).
#[test]
fn header_parameters_are_told_apart_without_case() {
    let mut d = doc();
    d["paths"]["/summaries"]["parameters"] = json!([{"name": "X-Tenant", "in": "header", "required": true, "schema": {"type": "string"}}]);
    d["paths"]["/summaries"]["post"]["parameters"] = json!([
        {"name": "x-tenant", "in": "header", "required": true, "schema": {"enum": ["public"]}}
    ]);
    let body = manifest_from_openapi(&d, &identity()).unwrap();
    let tool = body["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["input_schema"]["properties"].get("x-tenant").is_some())
        .expect("the operation's header");
    let properties = tool["input_schema"]["properties"].as_object().unwrap();
    assert!(!properties.contains_key("X-Tenant"), "{tool}");
    assert_eq!(properties["x-tenant"]["enum"], json!(["public"]));
    let mut d = doc();
    d["paths"]["/summaries"]["post"]["parameters"] = json!([
        {"name": "X-A", "in": "header", "schema": {"type": "string"}},
        {"name": "x-a", "in": "header", "schema": {"type": "string"}}
    ]);
    let err = manifest_from_openapi(&d, &identity()).unwrap_err();
    assert!(
        matches!(&err, OpenApiError::DuplicateParameter { name, .. } if name == "x-a"),
        "{err:?}"
    );
}

/// `servers` and `security` have no place in a manifest: the import says each one it does
/// not carry, rather than letting a publisher believe the signed tools are bound to them;
/// so are `callbacks`, `webhooks` and a header parameter OpenAPI ignores. Before, callbacks
/// and webhooks were dropped unsaid, and an `Authorization` header parameter became a
/// required tool argument, inviting a caller to pass a credential through the model.
#[test]
fn contracts_a_manifest_does_not_carry_are_named() {
    let doc = serde_json::json!({
        "openapi": "3.1.0",
        "servers": [{"url": "https://api.example.com"}],
        "security": [],
        "webhooks": {"itemAdded": {"post": {"operationId": "hook"}}},
        "components": {
            "parameters": {"Auth": {
                "name": "authorization", "in": "header", "required": true,
                "schema": {"type": "string"}
            }},
            "securitySchemes": {
                "key": {"$ref": "#/components/securitySchemes/realKey"},
                "realKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
                "bearer": {"type": "http", "scheme": "bearer"}
            }
        },
        "paths": {
            "/items": {
                "servers": [{"url": "https://other.example.com"}],
                "get": {
                    "operationId": "list",
                    "security": [{"oauth": ["read"]}],
                    "parameters": [
                        {"name": "Accept", "in": "header", "schema": {"type": "string"}},
                        {"name": "q", "in": "query", "schema": {"type": "string"}},
                        {"$ref": "#/components/parameters/Auth"},
                        {"name": "x-api-key", "in": "header", "required": true, "schema": {"type": "string"}},
                        {"name": "X-API-Key", "in": "query", "schema": {"type": "string"}}
                    ]
                },
                "post": {
                    "operationId": "add",
                    "callbacks": {"done": {"{$request.body#/url}": {"post": {}}}}
                }
            },
            "x-extension": {"servers": [1]}
        }
    });
    let named: Vec<String> = super::contracts_not_carried(&doc)
        .into_iter()
        .map(|n| n.at)
        .collect();
    assert_eq!(
        named,
        [
            "servers",
            "webhooks",
            r#"paths["/items"].servers"#,
            r#"paths["/items"].get.security"#,
            r#"paths["/items"].get.parameters[0]"#,
            r#"paths["/items"].get.parameters[2]"#,
            r#"paths["/items"].get.parameters[3]"#,
            r#"paths["/items"].post.callbacks"#,
        ]
    );
    let body = manifest_from_openapi(&doc, &identity()).unwrap();
    let list = body["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "list")
        .unwrap();
    assert_eq!(
        list["input_schema"]["properties"]
            .as_object()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        ["X-API-Key", "q"],
        "{list}: the key's header is no argument; a query parameter of its name is one"
    );
    assert!(list["input_schema"].get("required").is_none(), "{list}");
    // A scheme whose reference cannot be followed (another file) refuses the import: where
    // its key goes cannot be known.
    let mut split = doc.clone();
    split["components"]["securitySchemes"]["key"] =
        serde_json::json!({"$ref": "./common.yaml#/components/securitySchemes/ApiKey"});
    let e = manifest_from_openapi(&split, &identity()).unwrap_err();
    assert!(matches!(e, OpenApiError::UnsupportedRef { .. }), "{e:?}");
}

/// Of several JSON media types, the contract is the one `application/json` carries (its
/// type told apart without case), whatever sorts first; others carrying a different schema
/// are refused as ambiguous, and a JSON media type that is not an object is refused at its
/// path. Before, the first JSON type in key order was taken alone: an `application/hal+json`
/// with no schema before `application/json` with one signed a tool with no output schema,
/// so any result passed; one with a looser schema signed that one.
#[test]
fn of_several_json_media_types_application_json_is_the_contract() {
    let strict = json!({"type": "object", "required": ["id"],
                        "properties": {"id": {"type": "string"}}});
    let mut d = doc();
    d["components"]["responses"]["Terms"]["content"] = json!({
        "application/hal+json": {"example": {"id": "x"}},
        "Application/JSON": {"schema": strict},
    });
    let body = manifest_from_openapi(&d, &identity()).unwrap();
    assert_eq!(tool(&body, "read_terms")["output_schema"], strict);
    // The same schema under both: the same contract.
    d["components"]["responses"]["Terms"]["content"]["application/hal+json"] =
        json!({"schema": strict});
    let body = manifest_from_openapi(&d, &identity()).unwrap();
    assert_eq!(tool(&body, "read_terms")["output_schema"], strict);
    // A looser one beside it: which one a client gets is not known, so neither is signed.
    d["components"]["responses"]["Terms"]["content"]["application/hal+json"] =
        json!({"schema": {"type": "object"}});
    let e = manifest_from_openapi(&d, &identity())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("application/hal+json")
            && e.contains("Application/JSON")
            && e.contains("different"),
        "{e}"
    );
    // A JSON media type of the wrong type is refused at its path, not taken as absent.
    d["components"]["responses"]["Terms"]["content"] = json!({"application/json": "schema"});
    let e = manifest_from_openapi(&d, &identity())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("content[\"application/json\"]") || e.contains("application/json"),
        "{e}"
    );
    assert!(e.contains("string"), "{e}");
    // A request body: the same choice.
    let mut d = doc();
    d["paths"]["/summaries"]["post"]["requestBody"]["content"] = json!({
        "application/geo+json": {"example": {}},
        "application/json": {"schema": {"$ref": "#/components/schemas/SummaryRequest"}},
    });
    let body = manifest_from_openapi(&d, &identity()).unwrap();
    let plain = manifest_from_openapi(&doc(), &identity()).unwrap();
    assert_eq!(
        tool(&body, "summarize_terms")["input_schema"],
        tool(&plain, "summarize_terms")["input_schema"]
    );
}
