//! Envelope parsing and verification on arbitrary input: never a panic, and every envelope
//! that parses re-serializes to one that parses to the same digest.

#![no_main]

use ed25519_dalek::SigningKey;
use flowhost::{ManifestBody, SignedManifest};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // The same text read as a bare body must not panic either.
    let _ = ManifestBody::parse(text);
    let Ok(envelope) = SignedManifest::parse(text) else {
        return;
    };
    // Against the key the envelope names (the interesting path: a real signature check)
    // and against an unrelated registered key.
    let _ = envelope.verify(envelope.signer_key());
    let unrelated = SigningKey::from_bytes(&[7; 32]).verifying_key();
    assert!(envelope.verify(&unrelated).is_err() || *envelope.signer_key() == unrelated);
    for tool in envelope.body().tools() {
        let _ = tool.sanitized_description();
    }
    let again = SignedManifest::parse(&envelope.to_pretty_json())
        .expect("a parsed envelope re-serializes to a parseable one");
    assert_eq!(again.digest(), envelope.digest());
    assert_eq!(again.canonical_body(), envelope.canonical_body());
});
