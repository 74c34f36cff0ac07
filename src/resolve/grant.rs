//! Declassification grants: a signed, single-use permission for one call to run its egress
//! check against a strictly lower target label than the session's.
//!
//! A grant body (schema [`GRANT_SCHEMA`]) binds everything about the call it is for: the
//! principal and session, the server and tool, a purpose, the SHA-256 of the call's
//! arguments (RFC 8785 canonical JSON), the SHA-256 of the call's source label (the
//! session's label joined with the operator's input floor and the taint the classifier finds
//! in the arguments), the target label, a validity window in whole seconds, the grant's id and the id of
//! the authority that signed it. The envelope is `{"grant": BODY, "signature": HEX}`: Ed25519
//! over the canonical bytes of the body, verified with the key the operator configured for
//! that authority id (never a key carried in the grant).
//!
//! [`check`] applies the rules in a fixed order, each refusal its own [`GrantDenial`]:
//! untrusted authority (unknown id, or a signature that does not verify under its key); no
//! effective egress; a binding that does not match the call; not yet valid; expired; a target
//! that is not strictly lower than the call's source (or is `Top`); a purpose the tool's
//! signed purposes and the operator's policy do not both allow. Single use is the resolver's
//! (durable, in the flow state), and so is expiry during the call: the accepted grant carries
//! `expires_at`, and each later outbound attempt or client answer of the call is refused once
//! it has passed. A grant never lowers retained state: only the one egress check uses the
//! target.

use std::fmt;
use std::time::{Duration, Instant};

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::ident::{DeclassificationPurpose, PrincipalId};
use crate::label::InformationLabel;
use crate::registry::AdmittedToolSecurity;

/// The schema string of a grant body (the signature's domain version).
pub const GRANT_SCHEMA: &str = "flowhost.declassification_grant.v1";
/// Longest grant id, in bytes.
pub const MAX_GRANT_ID_BYTES: usize = 128;

/// A grant body, exactly as signed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrantBody {
    /// Always [`GRANT_SCHEMA`].
    pub schema: String,
    /// The grant's id (`[A-Za-z0-9._-]`, 1 to 128 bytes); single use is keyed by it.
    pub grant_id: String,
    /// The id of the authority that signed it (one the operator configured).
    pub authority: String,
    /// The principal the call must come from.
    pub principal: PrincipalId,
    /// The session the call must come from.
    pub session: String,
    /// The server of the call.
    pub server: String,
    /// The tool of the call.
    pub tool: String,
    /// Why the data may be released.
    pub purpose: DeclassificationPurpose,
    /// [`arguments_hash`] of the call's arguments.
    pub arguments_hash: String,
    /// [`label_hash`] of the call's source label: the session's label joined with the
    /// operator's input floor and the arguments' taint.
    pub source_label_hash: String,
    /// The label the egress check runs against instead of the source.
    pub target_label: InformationLabel,
    /// Valid from (Unix seconds, inclusive).
    pub issued_at: u64,
    /// Valid until (Unix seconds, exclusive).
    pub expires_at: u64,
}

/// A grant as received: the body, its canonical bytes and the signature over them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedGrant {
    body: GrantBody,
    canonical: Vec<u8>,
    signature: Signature,
}

/// Why a grant could not be read or made.
#[derive(Debug, thiserror::Error)]
pub enum GrantFormatError {
    /// Not strict JSON of the envelope's shape.
    #[error("not a declassification grant: {0}")]
    Shape(String),
    /// A field breaks a rule.
    #[error("declassification grant field {field}: {problem}")]
    Field {
        /// The field.
        field: &'static str,
        /// What is wrong.
        problem: String,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope {
    grant: Value,
    signature: String,
}

fn sha256_hex(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// Now, in Unix seconds, for judging a grant's window and marking it spent. A clock set
/// before 1970 cannot date one: it reads as the end of time, where every grant has expired
/// (as 0 it would make every grant valid that was "issued" at 0).
pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(u64::MAX, |d| d.as_secs())
}

/// [`now`], and the instant on the monotonic clock at which that whole second began: a
/// grant's time left, held on the monotonic clock from it, is then exact rather than up to
/// a second long (the wall clock read in whole seconds) or stale (read before a slow state
/// read).
pub fn clock() -> (u64, Instant) {
    let at = Instant::now();
    match std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        Ok(d) => (
            d.as_secs(),
            at.checked_sub(Duration::from_nanos(u64::from(d.subsec_nanos())))
                .unwrap_or(at),
        ),
        Err(_) => (u64::MAX, at),
    }
}

/// The hash a grant binds a call's arguments with: `sha256:` + hex of the SHA-256 of their
/// RFC 8785 canonical JSON. `None` for arguments no hash binds exactly: an integer beyond
/// ±2^53 is canonicalized as the nearest double, so other integers near it would hash the
/// same, and the tool would be handed one the grant never named.
pub fn arguments_hash(arguments: &Value) -> Option<String> {
    if !exactly_bound(arguments) {
        return None;
    }
    crate::canonical::canonical_bytes(arguments)
        .ok()
        .map(|bytes| sha256_hex(&bytes))
}

/// Whether every integer in `value` is within ±2^53.
fn exactly_bound(value: &Value) -> bool {
    match value {
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u <= crate::canonical::MAX_EXACT_INTEGER,
            (None, Some(i)) => i.unsigned_abs() <= crate::canonical::MAX_EXACT_INTEGER,
            (None, None) => true,
        },
        Value::Array(items) => items.iter().all(exactly_bound),
        Value::Object(map) => map.values().all(exactly_bound),
        _ => true,
    }
}

/// The hash a grant binds a session's label with: `sha256:` + hex of the SHA-256 of the
/// label's canonical JSON.
pub fn label_hash(label: &InformationLabel) -> String {
    sha256_hex(label.to_canonical_json().as_bytes())
}

fn check_body(body: &GrantBody) -> Result<(), GrantFormatError> {
    let bad = |field, problem: &str| {
        Err(GrantFormatError::Field {
            field,
            problem: problem.to_string(),
        })
    };
    if body.schema != GRANT_SCHEMA {
        return bad("schema", &format!("must be {GRANT_SCHEMA:?}"));
    }
    if body.grant_id.is_empty()
        || body.grant_id.len() > MAX_GRANT_ID_BYTES
        || !body
            .grant_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return bad("grant_id", "must be 1 to 128 of [A-Za-z0-9._-]");
    }
    for (field, hash) in [
        ("arguments_hash", &body.arguments_hash),
        ("source_label_hash", &body.source_label_hash),
    ] {
        let ok = hash.strip_prefix("sha256:").is_some_and(|h| {
            h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        });
        if !ok {
            return bad(field, "must be \"sha256:\" and 64 lowercase hex digits");
        }
    }
    for (field, text) in [
        ("authority", &body.authority),
        ("session", &body.session),
        ("server", &body.server),
        ("tool", &body.tool),
    ] {
        if text.is_empty() || text.len() > 256 || text.chars().any(char::is_control) {
            return bad(field, "must be 1 to 256 bytes without control characters");
        }
    }
    if body.target_label.is_top() {
        return bad("target_label", "must not be top");
    }
    if body.issued_at >= body.expires_at {
        return bad("expires_at", "must be after issued_at");
    }
    // A grant is read back strictly, where integers beyond 2^53 are refused: one signed
    // with a later time could never be used.
    if body.expires_at > MAX_EXACT_SECONDS {
        return bad("expires_at", "must be at most 2^53 seconds after 1970");
    }
    Ok(())
}

/// The latest time a grant may name (seconds since 1970): JSON integers are exact up to it.
const MAX_EXACT_SECONDS: u64 = 1 << 53;

impl SignedGrant {
    /// Signs `body` (checked first) with `key`.
    pub fn sign(body: GrantBody, key: &SigningKey) -> Result<Self, GrantFormatError> {
        check_body(&body)?;
        let value =
            serde_json::to_value(&body).map_err(|e| GrantFormatError::Shape(e.to_string()))?;
        let canonical = crate::canonical::canonical_bytes(&value)
            .map_err(|e| GrantFormatError::Shape(e.to_string()))?;
        let signature = key.sign(&canonical);
        Ok(SignedGrant {
            body,
            canonical,
            signature,
        })
    }

    /// Reads an envelope strictly: unknown fields, `null`s, integers beyond ±2^53 and broken
    /// rules are refused. The signature is checked by [`check`], against the configured key,
    /// over the canonical bytes of exactly the body read here.
    ///
    /// `value` was parsed already (a grant rides in a request's `_meta`), so a key the text
    /// repeated is no longer visible: the parser kept its last value, and that value is the
    /// one decoded and verified, so a repeated key cannot make the grant say anything its
    /// authority did not sign.
    pub fn from_value(value: &Value) -> Result<Self, GrantFormatError> {
        if !exactly_bound(value) {
            return Err(GrantFormatError::Shape(
                "an integer beyond ±2^53 has no exact canonical form".into(),
            ));
        }
        let envelope: Envelope = serde_json::from_value(value.clone())
            .map_err(|e| GrantFormatError::Shape(e.to_string()))?;
        let body: GrantBody = serde_json::from_value(envelope.grant.clone())
            .map_err(|e| GrantFormatError::Shape(format!("grant: {e}")))?;
        check_body(&body)?;
        let bytes =
            crate::keys::decode_lower_hex::<64>("signature", &envelope.signature).map_err(|e| {
                GrantFormatError::Field {
                    field: "signature",
                    problem: e.to_string(),
                }
            })?;
        let canonical = crate::canonical::canonical_bytes(&envelope.grant)
            .map_err(|e| GrantFormatError::Shape(e.to_string()))?;
        Ok(SignedGrant {
            body,
            canonical,
            signature: Signature::from_bytes(&bytes),
        })
    }

    /// The envelope as JSON.
    pub fn to_value(&self) -> Value {
        serde_json::json!({
            "grant": serde_json::to_value(&self.body).unwrap_or(Value::Null),
            "signature": hex::encode(self.signature.to_bytes()),
        })
    }

    /// The body.
    pub fn body(&self) -> &GrantBody {
        &self.body
    }
}

/// Why a grant was refused; each is its own record denial.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrantDenial {
    /// The authority id is not configured, or the signature does not verify under its key.
    UntrustedAuthority,
    /// The call has no effective egress, so there is nothing to declassify.
    NoEffectiveEgress,
    /// A bound field does not match the call.
    BindingMismatch(&'static str),
    /// `now` is before `issued_at`.
    NotYetValid,
    /// `now` is at or after `expires_at`.
    Expired,
    /// The target is not strictly lower than the call's source (or either is `Top`).
    TargetNotLower,
    /// The purpose is not one both the tool's signed manifest and the operator allow.
    PurposeNotAllowed,
    /// The grant was used before.
    Replayed,
}

impl GrantDenial {
    /// The snake_case record code.
    pub fn as_str(&self) -> &'static str {
        match self {
            GrantDenial::UntrustedAuthority => "grant_untrusted_authority",
            GrantDenial::NoEffectiveEgress => "grant_without_egress",
            GrantDenial::BindingMismatch(_) => "grant_binding_mismatch",
            GrantDenial::NotYetValid => "grant_not_yet_valid",
            GrantDenial::Expired => "grant_expired",
            GrantDenial::TargetNotLower => "grant_target_not_lower",
            GrantDenial::PurposeNotAllowed => "grant_purpose_not_allowed",
            GrantDenial::Replayed => "grant_replayed",
        }
    }
}

impl fmt::Display for GrantDenial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GrantDenial::UntrustedAuthority => f.write_str(
                "the grant's authority is not one the operator trusts, or its signature does not verify under that authority's key",
            ),
            GrantDenial::NoEffectiveEgress => {
                f.write_str("the call has no effective egress, so a grant has nothing to apply to")
            }
            GrantDenial::BindingMismatch("source_label_hash") => f.write_str(
                "the grant's source_label_hash is not that of this call's source label (the \
                 session's label with what its arguments carry: flowhost/session with the \
                 call's tool name and arguments returns it)",
            ),
            GrantDenial::BindingMismatch(field) => {
                write!(f, "the grant's {field} does not match this call")
            }
            GrantDenial::NotYetValid => f.write_str("the grant is not valid yet"),
            GrantDenial::Expired => f.write_str("the grant has expired"),
            GrantDenial::TargetNotLower => f.write_str(
                "the grant's target label is not strictly lower than the call's source label (and nothing declassifies top)",
            ),
            GrantDenial::PurposeNotAllowed => f.write_str(
                "the grant's purpose is not one the tool's signed manifest and the operator's policy both allow",
            ),
            GrantDenial::Replayed => f.write_str("the grant was already used (single use)"),
        }
    }
}

/// The operator's trusted declassification authorities, by id.
pub type Authorities = std::collections::BTreeMap<String, VerifyingKey>;

/// What a call is, as a grant sees it.
#[derive(Debug, Clone, Copy)]
pub struct CallFacts<'a> {
    /// The calling principal.
    pub principal: &'a PrincipalId,
    /// The session.
    pub session: &'a str,
    /// The server.
    pub server: &'a str,
    /// The tool.
    pub tool: &'a str,
    /// The call's arguments.
    pub arguments: &'a Value,
    /// The call's egress source (the session's label, the operator floor and the
    /// arguments' taint): what the grant's `source_label_hash` binds, so an authority
    /// approves exactly what leaves.
    pub source: &'a InformationLabel,
    /// The tool's admitted security.
    pub security: &'a AdmittedToolSecurity,
    /// Now, in Unix seconds.
    pub now: u64,
    /// The instant that second began (see [`clock`]).
    pub second_began: Instant,
}

/// A grant that passed every rule but single use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptedGrant {
    /// The grant's id.
    pub id: String,
    /// The authority that signed it, and the key it was verified with: the grant applies
    /// only while the operator trusts that authority with that key.
    pub authority: String,
    /// See `authority`.
    pub authority_key: VerifyingKey,
    /// Its purpose.
    pub purpose: DeclassificationPurpose,
    /// The label the egress check runs against.
    pub target: InformationLabel,
    /// Valid until (Unix seconds, exclusive): every later check of the call refuses the
    /// grant from then on (see [`AcceptedGrant::expired`]).
    pub expires_at: u64,
    /// The same end on the monotonic clock, from the time left when the grant was accepted:
    /// a wall clock stepped back mid-call does not lengthen the grant.
    pub expires_by: Instant,
}

impl AcceptedGrant {
    /// Whether the grant has expired at `now` (Unix seconds), or by the monotonic clock,
    /// whichever says so first.
    pub fn expired(&self, now: u64) -> bool {
        self.expired_at(now, Instant::now())
    }

    fn expired_at(&self, now: u64, instant: Instant) -> bool {
        now >= self.expires_at || instant >= self.expires_by
    }
}

/// Applies every rule of a grant to a call, in the documented order (single use excepted).
pub fn check(
    grant: &SignedGrant,
    authorities: &Authorities,
    call: &CallFacts<'_>,
) -> Result<AcceptedGrant, GrantDenial> {
    let b = &grant.body;
    let key = authorities
        .get(&b.authority)
        .ok_or(GrantDenial::UntrustedAuthority)?;
    key.verify_strict(&grant.canonical, &grant.signature)
        .map_err(|_| GrantDenial::UntrustedAuthority)?;
    if !call.security.effective_egress() {
        return Err(GrantDenial::NoEffectiveEgress);
    }
    let binding = [
        ("principal", b.principal == *call.principal),
        ("session", b.session == call.session),
        ("server", b.server == call.server),
        ("tool", b.tool == call.tool),
        (
            "arguments_hash",
            arguments_hash(call.arguments).is_some_and(|h| h == b.arguments_hash),
        ),
        (
            "source_label_hash",
            b.source_label_hash == label_hash(call.source),
        ),
    ];
    if let Some((field, _)) = binding.iter().find(|(_, ok)| !ok) {
        return Err(GrantDenial::BindingMismatch(field));
    }
    if call.now < b.issued_at {
        return Err(GrantDenial::NotYetValid);
    }
    if call.now >= b.expires_at {
        return Err(GrantDenial::Expired);
    }
    // Nothing declassifies `Top` (a history too large to know, or unknown).
    if b.target_label.is_top()
        || call.source.is_top()
        || b.target_label == *call.source
        || !b.target_label.flows_to(call.source)
    {
        return Err(GrantDenial::TargetNotLower);
    }
    if !call
        .security
        .declassification_purposes()
        .contains(&b.purpose)
    {
        return Err(GrantDenial::PurposeNotAllowed);
    }
    Ok(AcceptedGrant {
        id: b.grant_id.clone(),
        authority: b.authority.clone(),
        authority_key: *key,
        purpose: b.purpose.clone(),
        target: b.target_label.clone(),
        expires_at: b.expires_at,
        // `call.now < b.expires_at` (checked above). A window the monotonic clock could not
        // hold (none within the 2^53 seconds `expires_at` is held to) ends at once.
        expires_by: call
            .second_began
            .checked_add(Duration::from_secs(b.expires_at - call.now))
            .unwrap_or(call.second_began),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(now: u64) -> GrantBody {
        GrantBody {
            schema: GRANT_SCHEMA.into(),
            grant_id: "g-1".into(),
            authority: "board".into(),
            principal: PrincipalId::new("alice").unwrap(),
            session: "s1".into(),
            server: "inbox".into(),
            tool: "publish".into(),
            purpose: DeclassificationPurpose::new("reviewed-summary").unwrap(),
            arguments_hash: arguments_hash(&serde_json::json!({"m": 1})).unwrap(),
            source_label_hash: label_hash(&crate::resolver::tests::terms()),
            target_label: InformationLabel::bottom(),
            issued_at: now,
            expires_at: now + 60,
        }
    }

    #[test]
    fn envelopes_round_trip_strictly_and_bad_bodies_are_refused() {
        let key = SigningKey::from_bytes(&[7; 32]);
        let signed = SignedGrant::sign(body(10), &key).unwrap();
        let back = SignedGrant::from_value(&signed.to_value()).unwrap();
        assert_eq!(back, signed);
        let mut extra = signed.to_value();
        extra["grant"]["note"] = "x".into();
        assert!(SignedGrant::from_value(&extra).is_err(), "unknown field");
        let mut window = body(10);
        window.expires_at = 10;
        assert!(SignedGrant::sign(window, &key).is_err());
        let mut id = body(10);
        id.grant_id = "has space".into();
        assert!(SignedGrant::sign(id, &key).is_err());
        // Signed, it could never be read back: refused when signing.
        let mut forever = body(10);
        forever.expires_at = u64::MAX;
        assert!(SignedGrant::sign(forever, &key).is_err());
        let mut latest = body(10);
        latest.expires_at = 1 << 53;
        let signed = SignedGrant::sign(latest, &key).unwrap();
        assert!(SignedGrant::from_value(&signed.to_value()).is_ok());
    }

    /// Arguments are bound exactly or not at all: past ±2^53 two integers share a canonical
    /// form, so a grant for one would pass a call carrying the other.
    #[test]
    fn arguments_beyond_the_exact_integers_cannot_be_bound() {
        let near = |n: u64| arguments_hash(&serde_json::json!({"n": n}));
        assert!(near(1 << 53).is_some());
        assert_eq!(near((1 << 53) + 1), None);
        assert_eq!(
            arguments_hash(&serde_json::json!({"n": [-(1i64 << 53) - 1]})),
            None
        );
        assert_ne!(near(1), near(2));
    }

    /// A call as the grant tests vary it: owned, so each test edits what it needs.
    struct Call {
        principal: PrincipalId,
        session: &'static str,
        server: &'static str,
        tool: &'static str,
        arguments: Value,
        source: InformationLabel,
        now: u64,
    }

    /// Checks `grant` against a call that matches `body(10)` (at 10, from a source holding the
    /// lab's terms), with `edit` applied to the call first.
    fn check_call(
        grant: &SignedGrant,
        edit: impl FnOnce(&mut Call),
    ) -> Result<AcceptedGrant, GrantDenial> {
        let key = SigningKey::from_bytes(&[7; 32]);
        let authorities = Authorities::from([("board".to_string(), key.verifying_key())]);
        // The lab's public inbox: brokered (egress), purpose "reviewed-summary" allowed.
        let registry = crate::resolver::tests::registry();
        let tool = registry.tool("public-inbox", "publish").unwrap();
        let mut c = Call {
            principal: PrincipalId::new("alice").unwrap(),
            session: "s1",
            server: "inbox",
            tool: "publish",
            arguments: json!({"m": 1}),
            source: crate::resolver::tests::terms(),
            now: 10,
        };
        edit(&mut c);
        let call = CallFacts {
            principal: &c.principal,
            session: c.session,
            server: c.server,
            tool: c.tool,
            arguments: &c.arguments,
            source: &c.source,
            security: tool.security(),
            now: c.now,
            second_began: Instant::now(),
        };
        check(grant, &authorities, &call)
    }

    #[test]
    fn the_window_includes_issued_at_and_excludes_expires_at() {
        let grant = SignedGrant::sign(body(10), &SigningKey::from_bytes(&[7; 32])).unwrap();
        let at = |now| check_call(&grant, |c| c.now = now);
        let accepted = at(10).expect("valid from issued_at");
        assert_eq!((accepted.id.as_str(), accepted.expires_at), ("g-1", 70));
        assert_eq!(accepted.target, InformationLabel::bottom());
        assert!(at(69).is_ok(), "valid until the second before expires_at");
        assert_eq!(at(9), Err(GrantDenial::NotYetValid));
        assert_eq!(at(70), Err(GrantDenial::Expired));
        assert!(accepted.expired(70) && !accepted.expired(69));
        // The wall clock stepped back an hour mid-call gives the grant no more time than
        // it had left when accepted (60 s).
        let left = accepted.expires_by - Instant::now();
        assert!(left <= Duration::from_secs(60) && left > Duration::from_secs(59));
        assert!(!accepted.expired_at(10, accepted.expires_by - Duration::from_millis(1)));
        assert!(accepted.expired_at(10, accepted.expires_by));
        assert!(accepted.expired_at(0, accepted.expires_by + Duration::from_secs(1)));
    }

    /// The time left runs from when the call read the clock, not from when the grant was
    /// checked (after a state read that can take seconds on a shared database), and from
    /// the start of the whole second it read: before, both made the grant outlast its
    /// window by that much on the monotonic clock.
    #[test]
    fn the_time_left_runs_from_the_calls_reading_of_the_clock() {
        let grant = SignedGrant::sign(body(10), &SigningKey::from_bytes(&[7; 32])).unwrap();
        let read = Instant::now() - Duration::from_secs(5);
        let key = SigningKey::from_bytes(&[7; 32]);
        let authorities = Authorities::from([("board".to_string(), key.verifying_key())]);
        let registry = crate::resolver::tests::registry();
        let tool = registry.tool("public-inbox", "publish").unwrap();
        let (principal, arguments) = (PrincipalId::new("alice").unwrap(), json!({"m": 1}));
        let source = crate::resolver::tests::terms();
        let call = CallFacts {
            principal: &principal,
            session: "s1",
            server: "inbox",
            tool: "publish",
            arguments: &arguments,
            source: &source,
            security: tool.security(),
            now: 10,
            second_began: read,
        };
        let accepted = check(&grant, &authorities, &call).unwrap();
        assert_eq!(accepted.expires_by, read + Duration::from_secs(60));
        let (unix, began) = clock();
        let since = Instant::now() - began;
        // Less than a second before now, and whatever this thread waited meanwhile.
        assert!(since < Duration::from_millis(1500), "{since:?}");
        assert!(unix >= now().saturating_sub(1));
    }

    #[test]
    fn each_binding_must_match_the_call() {
        let grant = SignedGrant::sign(body(10), &SigningKey::from_bytes(&[7; 32])).unwrap();
        let mismatch = |field| Err(GrantDenial::BindingMismatch(field));
        let bob = || PrincipalId::new("bob").unwrap();
        assert_eq!(
            check_call(&grant, |c| c.principal = bob()),
            mismatch("principal")
        );
        assert_eq!(
            check_call(&grant, |c| c.session = "s2"),
            mismatch("session")
        );
        assert_eq!(
            check_call(&grant, |c| c.server = "other"),
            mismatch("server")
        );
        assert_eq!(check_call(&grant, |c| c.tool = "other"), mismatch("tool"));
        assert_eq!(
            check_call(&grant, |c| c.arguments = json!({"m": 2})),
            mismatch("arguments_hash")
        );
        // A source the authority was not shown (the operator's floor, or what the
        // classifier finds in the arguments, raised it past the session's label) is not the
        // one bound, though the target is still lower than it.
        let higher = crate::resolver::tests::terms().join_or_top(
            &InformationLabel::from_json(
                r#"{"kind":"known","owners":{},"compartments":["embargo"]}"#,
            )
            .unwrap(),
        );
        assert_eq!(
            check_call(&grant, |c| c.source = higher),
            mismatch("source_label_hash")
        );
    }

    #[test]
    fn nothing_declassifies_a_top_source() {
        let grant = SignedGrant::sign(body(10), &SigningKey::from_bytes(&[7; 32])).unwrap();
        assert!(check_call(&grant, |_| {}).is_ok());
        // Signed for the very source the call has, each time.
        let bound_to = |source: &InformationLabel| {
            let mut b = body(10);
            b.source_label_hash = label_hash(source);
            SignedGrant::sign(b, &SigningKey::from_bytes(&[7; 32])).unwrap()
        };
        assert_eq!(
            check_call(&bound_to(&InformationLabel::Top), |c| c.source =
                InformationLabel::Top),
            Err(GrantDenial::TargetNotLower)
        );
        // Nor a target no lower than the source.
        assert_eq!(
            check_call(&bound_to(&InformationLabel::bottom()), |c| c.source =
                InformationLabel::bottom()),
            Err(GrantDenial::TargetNotLower)
        );
    }

    /// A key repeated in the request's text is not visible in the parsed value (its last
    /// value is): what is decoded is what the signature is checked over, so a repeated key
    /// that changes the body fails verification.
    #[test]
    fn a_key_repeated_in_the_request_text_cannot_change_what_is_verified() {
        let key = SigningKey::from_bytes(&[7; 32]);
        let signed = SignedGrant::sign(body(10), &key)
            .unwrap()
            .to_value()
            .to_string();
        let purpose = "\"purpose\":\"reviewed-summary\"";
        let repeated = |second: &str| {
            let text = signed.replacen(purpose, &format!("{purpose},\"purpose\":{second}"), 1);
            // The request is parsed as the JSON-RPC reader parses it.
            SignedGrant::from_value(&serde_json::from_str(&text).unwrap()).unwrap()
        };
        let edited = repeated("\"other\"");
        assert_eq!(edited.body().purpose.as_str(), "other");
        assert_eq!(
            check_call(&edited, |_| {}),
            Err(GrantDenial::UntrustedAuthority)
        );
        assert!(check_call(&repeated("\"reviewed-summary\""), |_| {}).is_ok());
        // Integers the canonical form cannot hold exactly are still refused.
        let mut v = SignedGrant::sign(body(10), &key).unwrap().to_value();
        v["grant"]["issued_at"] = ((1u64 << 53) + 1).into();
        assert!(SignedGrant::from_value(&v).is_err());
    }

    #[test]
    fn an_edited_body_no_longer_verifies() {
        let key = SigningKey::from_bytes(&[7; 32]);
        let mut v = SignedGrant::sign(body(10), &key).unwrap().to_value();
        v["grant"]["purpose"] = "other".into();
        let edited = SignedGrant::from_value(&v).unwrap();
        let authorities = Authorities::from([("board".to_string(), key.verifying_key())]);
        assert!(
            authorities["board"]
                .verify_strict(&edited.canonical, &edited.signature)
                .is_err()
        );
    }
}
