//! Authenticating an HTTP caller as a configured principal, never a default: a bearer
//! token whose SHA-256 is configured (compared in constant time), or a JWT access token
//! signed by a key of the configured issuer's key set, for this server's audience, whose
//! principal claim maps to a configured principal. Loopback callers without credentials act
//! as `unauthenticated_loopback_principal` only when the operator names one.

use std::collections::HashMap;

use hyper::header::{AUTHORIZATION, HeaderMap};
use jsonwebtoken::{Algorithm, DecodingKey, Validation, errors::ErrorKind};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::{UnreadableHeader, single_header};
use crate::config::{BearerToken, HttpConfig, HttpCredentials, JwtConfig};
use crate::ident::PrincipalId;

/// Why an HTTP caller was not authenticated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthRefusal {
    /// No `Authorization` header.
    #[error("no credentials: send Authorization: Bearer <token>")]
    Missing,
    /// An `Authorization` header sent more than once or not in visible ASCII: refused, never
    /// taken as no credentials (which a loopback principal would let act).
    #[error("the Authorization header {0}")]
    Unreadable(UnreadableHeader),
    /// An `Authorization` header that is not `Bearer <token>`.
    #[error("the Authorization header is not a bearer token")]
    Malformed,
    /// A token that is neither a configured bearer token nor a JWT this server accepts.
    #[error("the token is not one this server accepts")]
    UnknownToken,
    /// A JWT whose audience is not this server.
    #[error("the access token's audience is not this server")]
    WrongAudience,
    /// A JWT past its expiry.
    #[error("the access token has expired")]
    Expired,
    /// A JWT whose `nbf` (not before) is still ahead.
    #[error("the access token is not valid yet (nbf)")]
    NotYetValid,
    /// A JWT from another issuer.
    #[error("the access token's issuer is not trusted")]
    WrongIssuer,
    /// A JWT that does not verify or is malformed.
    #[error("the access token is invalid: {0}")]
    InvalidToken(String),
    /// A request without credentials that a proxy forwarded: the unauthenticated loopback
    /// principal is for callers on this machine, and a proxy's caller may be anywhere.
    #[error(
        "no credentials, and the request was forwarded by a proxy ({header}), so it may come \
         from anywhere: send Authorization: Bearer <token>"
    )]
    Forwarded {
        /// The forwarding header found.
        header: &'static str,
    },
    /// A request without credentials on a connection whose source is not a loopback
    /// address: the listener is bound to loopback, but a host routing outside packets there
    /// (`route_localnet`, a DNAT rule) delivers other machines' connections to it.
    #[error(
        "no credentials, and the connection comes from {peer}, not this machine's loopback: \
         send Authorization: Bearer <token>"
    )]
    NotLocal {
        /// The connection's source address.
        peer: std::net::IpAddr,
    },
    /// A JWT whose principal claim maps to no configured principal.
    #[error("the access token's {claim} {value:?} is not mapped to a principal")]
    UnknownPrincipal {
        /// The claim.
        claim: String,
        /// Its value.
        value: String,
    },
}

impl AuthRefusal {
    /// The OAuth error code for `WWW-Authenticate` (none when no token was sent).
    pub fn oauth_error(&self) -> Option<&'static str> {
        match self {
            AuthRefusal::Missing | AuthRefusal::Forwarded { .. } | AuthRefusal::NotLocal { .. } => {
                None
            }
            AuthRefusal::Malformed | AuthRefusal::Unreadable(_) => Some("invalid_request"),
            _ => Some("invalid_token"),
        }
    }
}

/// Why the authenticator could not be built.
#[derive(Debug, thiserror::Error)]
pub enum AuthSetupError {
    /// The key set file could not be read or parsed.
    #[error("{path}: {message}")]
    KeySet {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
}

/// The asymmetric algorithms a JWT may use (a shared-secret algorithm would let anyone who
/// can read the key set mint tokens).
const ALGORITHMS: [Algorithm; 9] = [
    Algorithm::RS256,
    Algorithm::RS384,
    Algorithm::RS512,
    Algorithm::PS256,
    Algorithm::PS384,
    Algorithm::PS512,
    Algorithm::ES256,
    Algorithm::ES384,
    Algorithm::EdDSA,
];

/// Headers a proxy adds to what it forwards: a request carrying one may come from anywhere,
/// so it is never the unauthenticated loopback principal.
const FORWARDING_HEADERS: [&str; 9] = [
    "forwarded",
    "via",
    "x-real-ip",
    "x-client-ip",
    "x-cluster-client-ip",
    "cf-connecting-ip",
    "true-client-ip",
    "fastly-client-ip",
    "x-envoy-external-address",
];

/// The prefix of the `X-Forwarded-*` headers proxies add (`-For`, `-Host`, `-Proto`, ...).
const FORWARDED_PREFIX: &str = "x-forwarded-";

/// The first header of `headers` a proxy adds, if any.
fn forwarding_header(headers: &HeaderMap) -> Option<&'static str> {
    if let Some(h) = FORWARDING_HEADERS
        .into_iter()
        .find(|h| headers.contains_key(*h))
    {
        return Some(h);
    }
    headers
        .keys()
        .any(|k| k.as_str().starts_with(FORWARDED_PREFIX))
        .then_some("x-forwarded-*")
}

/// Largest key set file read.
const MAX_KEY_SET_BYTES: u64 = 1024 * 1024;

/// Seconds of clock skew tolerated on `exp` and `nbf`.
const LEEWAY_SECS: u64 = 30;

struct Jwt {
    config: JwtConfig,
    /// The key set read last (at start, then at each reload).
    keys: std::sync::RwLock<KeySet>,
    /// The subjects that act as principals: `config.principals`, less those a reload's
    /// configuration no longer maps (they are revoked at once; additions wait for a
    /// restart).
    principals: std::sync::RwLock<std::collections::BTreeMap<String, PrincipalId>>,
}

/// An issuer's key set as read from its file: keys by `kid` (keys without one are tried
/// when a token names none), each with the SHA-256 of its JWK, which tells one key from
/// another across reads, and the one algorithm it names, if it does.
#[derive(Default)]
pub struct KeySet(HashMap<Option<String>, Vec<SigningKey>>);

/// One key of a set that may verify signatures.
struct SigningKey {
    fingerprint: [u8; 32],
    key: DecodingKey,
    /// The algorithm its JWK names (`alg`): it verifies only tokens signed with that one.
    alg: Option<Algorithm>,
}

impl KeySet {
    /// Whether this set holds the key `fingerprint` under `kid`.
    fn holds(&self, kid: &Option<String>, fingerprint: &[u8; 32]) -> bool {
        self.0
            .get(kid)
            .is_some_and(|keys| keys.iter().any(|k| &k.fingerprint == fingerprint))
    }
}

/// Who a request authenticated as, and with what: what it opens (a stream, a call answered
/// later) is served only while [`Authenticator::still_accepts`] the credential.
#[derive(Debug, Clone)]
pub struct Credential {
    /// The principal it authenticates.
    pub principal: PrincipalId,
    by: By,
}

/// What a [`Credential`] was presented as.
#[derive(Debug, Clone)]
enum By {
    /// No `Authorization` at all, on loopback.
    Loopback,
    /// A configured bearer token (its SHA-256).
    Token([u8; 32]),
    /// A JWT: the key that verified it, the subject it was mapped by, and its `exp`.
    Jwt {
        kid: Option<String>,
        fingerprint: [u8; 32],
        subject: String,
        expires: u64,
    },
}

/// Maps credentials to principals (see the module docs).
pub struct Authenticator {
    /// The configured tokens, less those a reload's configuration no longer lists.
    tokens: std::sync::RwLock<Vec<BearerToken>>,
    jwt: Option<Jwt>,
    /// The unauthenticated loopback principal, until a reload's configuration drops or
    /// changes it.
    loopback: std::sync::RwLock<Option<PrincipalId>>,
}

impl Authenticator {
    /// Builds the authenticator of `config`, reading the JWT key set if one is configured.
    pub fn new(config: &HttpConfig) -> Result<Self, AuthSetupError> {
        let jwt = match &config.jwt {
            None => None,
            Some(j) => Some(Jwt {
                keys: std::sync::RwLock::new(load_keys(&j.jwks)?),
                principals: std::sync::RwLock::new(j.principals.clone()),
                config: j.clone(),
            }),
        };
        Ok(Authenticator {
            tokens: std::sync::RwLock::new(config.tokens.clone()),
            jwt,
            loopback: std::sync::RwLock::new(config.unauthenticated_loopback_principal.clone()),
        })
    }

    /// The principal a request's `Authorization` header authenticates, on a connection from
    /// `peer`. Only a request that sends no `Authorization` at all, over a connection from a
    /// loopback address, and not forwarded by a proxy, is the unauthenticated loopback
    /// principal (when one is configured: the listener is then on loopback); one sent twice,
    /// or with bytes outside visible ASCII, is refused like any other bad credential.
    pub fn authenticate(
        &self,
        headers: &HeaderMap,
        peer: std::net::IpAddr,
    ) -> Result<Credential, AuthRefusal> {
        let authorization =
            single_header(headers, AUTHORIZATION.as_str()).map_err(AuthRefusal::Unreadable)?;
        if authorization.is_none() && self.loopback_principal().is_some() {
            if let Some(header) = forwarding_header(headers) {
                return Err(AuthRefusal::Forwarded { header });
            }
            // The listener's address says nothing of where a connection came from.
            if !peer.to_canonical().is_loopback() {
                return Err(AuthRefusal::NotLocal { peer });
            }
        }
        self.credential(authorization)
    }

    /// The unauthenticated loopback principal now, if there is one.
    fn loopback_principal(&self) -> Option<PrincipalId> {
        self.loopback
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether `credential` would still authenticate now: a JWT until its `exp` (with the
    /// clock skew tolerated), while the key that verified it and its subject's mapping are
    /// kept; a bearer token while it is configured (a reload takes one out).
    pub fn still_accepts(&self, credential: &Credential) -> bool {
        match &credential.by {
            By::Loopback => self.loopback_principal().as_ref() == Some(&credential.principal),
            By::Token(digest) => self
                .tokens
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .any(|t| t.sha256 == *digest && t.principal == credential.principal),
            By::Jwt {
                kid,
                fingerprint,
                subject,
                expires,
            } => self.jwt.as_ref().is_some_and(|j| {
                crate::grant::now() < expires.saturating_add(LEEWAY_SECS)
                    && j.keys
                        .read()
                        .unwrap_or_else(|p| p.into_inner())
                        .holds(kid, fingerprint)
                    && j.principals
                        .read()
                        .unwrap_or_else(|p| p.into_inner())
                        .get(subject)
                        == Some(&credential.principal)
            }),
        }
    }

    /// The principal an `Authorization` value (`None`: not sent) authenticates.
    #[cfg(test)]
    fn authenticate_value(&self, authorization: Option<&str>) -> Result<PrincipalId, AuthRefusal> {
        self.credential(authorization).map(|c| c.principal)
    }

    /// The credential an `Authorization` value (`None`: not sent) is.
    fn credential(&self, authorization: Option<&str>) -> Result<Credential, AuthRefusal> {
        let Some(header) = authorization else {
            return self
                .loopback_principal()
                .map(|principal| Credential {
                    principal,
                    by: By::Loopback,
                })
                .ok_or(AuthRefusal::Missing);
        };
        // The scheme's name is case-insensitive (RFC 9110, section 11.1).
        let token = header
            .split_once(' ')
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .filter(|t| !t.is_empty())
            .ok_or(AuthRefusal::Malformed)?;
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        // Every configured hash is compared, so the time taken does not tell which matched.
        let mut found: Option<PrincipalId> = None;
        for t in self.tokens.read().unwrap_or_else(|p| p.into_inner()).iter() {
            if bool::from(t.sha256.ct_eq(&digest)) {
                found = Some(t.principal.clone());
            }
        }
        if let Some(principal) = found {
            return Ok(Credential {
                principal,
                by: By::Token(digest),
            });
        }
        match &self.jwt {
            Some(jwt) if token.split('.').count() == 3 => jwt.credential(token),
            _ => Err(AuthRefusal::UnknownToken),
        }
    }

    /// The JWT configuration, for the protected resource metadata.
    pub fn jwt(&self) -> Option<&JwtConfig> {
        self.jwt.as_ref().map(|j| &j.config)
    }

    /// Reads the issuer's key set file again (`None`: no JWTs are taken). Nothing changes
    /// until [`Authenticator::use_key_set`]: a reload that fails later keeps the keys in use.
    pub fn read_key_set(&self) -> Result<Option<KeySet>, AuthSetupError> {
        self.jwt
            .as_ref()
            .map(|j| load_keys(&j.config.jwks))
            .transpose()
    }

    /// Stops verifying tokens with any key `newer` lacks, adding none: a reload that fails
    /// after reading the key set keeps the keys in use, except those taken out of the file
    /// (revoked), which must not wait for a reload that succeeds.
    pub fn revoke_keys_absent_from(&self, newer: &KeySet) {
        if let Some(j) = &self.jwt {
            let mut set = j.keys.write().unwrap_or_else(|p| p.into_inner());
            for (kid, keys) in set.0.iter_mut() {
                keys.retain(|k| newer.holds(kid, &k.fingerprint));
            }
            set.0.retain(|_, keys| !keys.is_empty());
        }
    }

    /// Stops taking any JWT: the key set could not be read at a reload, so which keys the
    /// operator still trusts is unknown (a key taken out of the file must not go on
    /// authenticating because the file was then written wrong).
    pub fn revoke_all_keys(&self) {
        self.use_key_set(KeySet::default());
    }

    /// Stops taking the bearer tokens and JWT subjects `newer` (a reload's `[http]` table)
    /// no longer maps to the same principal, and the loopback principal unless it names the
    /// same one, adding none: `[http]` changes only at a restart, but a credential the
    /// operator took out must not wait for one.
    pub fn revoke_credentials_absent_from(&self, newer: Option<&HttpCredentials>) {
        {
            let mut loopback = self.loopback.write().unwrap_or_else(|p| p.into_inner());
            if loopback.as_ref() != newer.and_then(|n| n.loopback.as_ref()) {
                *loopback = None;
            }
        }
        let kept_token = |t: &BearerToken| {
            newer.is_some_and(|n| {
                n.tokens
                    .iter()
                    .any(|k| k.sha256 == t.sha256 && k.principal == t.principal)
            })
        };
        self.tokens
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .retain(kept_token);
        if let Some(j) = &self.jwt {
            j.principals
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|subject, principal| {
                    newer.is_some_and(|n| n.jwt_subjects.get(subject) == Some(principal))
                });
        }
    }

    /// Verifies tokens with `keys` from now on: a key taken out of the file (revoked) no
    /// longer verifies any.
    pub fn use_key_set(&self, keys: KeySet) {
        if let Some(j) = &self.jwt {
            // A poisoned lock holds a whole key set (the swap is one assignment).
            *j.keys.write().unwrap_or_else(|p| p.into_inner()) = keys;
        }
    }
}

impl Jwt {
    fn credential(&self, token: &str) -> Result<Credential, AuthRefusal> {
        let header = jsonwebtoken::decode_header(token)
            .map_err(|e| AuthRefusal::InvalidToken(e.to_string()))?;
        if !ALGORITHMS.contains(&header.alg) {
            return Err(AuthRefusal::InvalidToken(format!(
                "algorithm {:?} is not accepted",
                header.alg
            )));
        }
        let set = self.keys.read().unwrap_or_else(|p| p.into_inner());
        let keys = set.0.get(&header.kid).ok_or_else(|| {
            AuthRefusal::InvalidToken("no key of the issuer's set signs it".into())
        })?;
        let mut validation = Validation::new(header.alg);
        validation.algorithms = vec![header.alg];
        validation.leeway = LEEWAY_SECS;
        // Not checked unless asked for: a token issued for later must not work now.
        validation.validate_nbf = true;
        validation.set_issuer(&[&self.config.issuer]);
        validation.set_audience(&[&self.config.audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud"]);
        let mut last = AuthRefusal::InvalidToken("no key of the issuer's set verifies it".into());
        // A key that names its algorithm verifies tokens of that one only (a key published
        // for RS256 is no PS256 key).
        for k in keys
            .iter()
            .filter(|k| k.alg.is_none_or(|alg| alg == header.alg))
        {
            match jsonwebtoken::decode::<serde_json::Value>(token, &k.key, &validation) {
                Ok(data) => {
                    let (subject, principal) = self.map(&data.claims)?;
                    // Verified, `exp` is a number (RFC 7519 allows fractions, taken down to
                    // the second); one that is neither ends what it opens at once.
                    let exp = &data.claims["exp"];
                    let expires = exp
                        .as_u64()
                        .or_else(|| exp.as_f64().map(|s| s as u64))
                        .unwrap_or(0);
                    return Ok(Credential {
                        principal,
                        by: By::Jwt {
                            kid: header.kid.clone(),
                            fingerprint: k.fingerprint,
                            subject,
                            expires,
                        },
                    });
                }
                Err(e) => {
                    last = match e.kind() {
                        ErrorKind::ExpiredSignature => AuthRefusal::Expired,
                        ErrorKind::ImmatureSignature => AuthRefusal::NotYetValid,
                        ErrorKind::InvalidAudience => AuthRefusal::WrongAudience,
                        ErrorKind::InvalidIssuer => AuthRefusal::WrongIssuer,
                        ErrorKind::MissingRequiredClaim(c) if c == "aud" => {
                            AuthRefusal::WrongAudience
                        }
                        _ => AuthRefusal::InvalidToken(e.to_string()),
                    };
                    // A token that verified but failed a claim check fails with every key.
                    if !matches!(last, AuthRefusal::InvalidToken(_)) {
                        return Err(last);
                    }
                }
            }
        }
        Err(last)
    }

    /// The subject claim's value and the principal it maps to.
    fn map(&self, claims: &serde_json::Value) -> Result<(String, PrincipalId), AuthRefusal> {
        let claim = &self.config.principal_claim;
        let value = claims
            .get(claim)
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| AuthRefusal::InvalidToken(format!("no string claim {claim:?}")))?;
        self.principals
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(value)
            .map(|principal| (value.to_string(), principal.clone()))
            .ok_or_else(|| AuthRefusal::UnknownPrincipal {
                claim: claim.clone(),
                value: value.chars().take(128).collect(),
            })
    }
}

fn load_keys(path: &std::path::Path) -> Result<KeySet, AuthSetupError> {
    let fail = |message: String| AuthSetupError::KeySet {
        path: path.display().to_string(),
        message,
    };
    // The key set decides who may act: a file others could change would let them add a
    // key of their own.
    // Nor may its directories be ones others could change: they could move another file
    // of the host's (a key set from before a key was revoked) in under its name.
    let bytes = crate::files::trusted_target(path)
        .and_then(|_| crate::files::read_trusted(path, MAX_KEY_SET_BYTES, false))
        .map_err(|e| fail(format!("cannot be trusted: {e}")))?;
    let text = String::from_utf8(bytes).map_err(|_| fail("not UTF-8 text".into()))?;
    /// The set's shape alone: each key is read on its own, so that one of a kind flowhost
    /// cannot read (an X25519 encryption key, Ed448, secp256k1, a type newer than this
    /// build) is passed over with a warning rather than refusing the set's other keys.
    #[derive(serde::Deserialize)]
    struct Set {
        keys: Vec<serde_json::Value>,
    }
    let set: Set =
        serde_json::from_str(&text).map_err(|e| fail(format!("not a JSON Web Key Set: {e}")))?;
    let mut read = Vec::new();
    for (i, key) in set.keys.into_iter().enumerate() {
        let kid = key.get("kid").and_then(|k| k.as_str().map(str::to_string));
        match serde_json::from_value::<jsonwebtoken::jwk::Jwk>(key) {
            Ok(jwk) => read.push((i, jwk)),
            Err(e) => tracing::warn!(
                key = i,
                "JWT key set {}: key {i} ({:?}) is of a kind flowhost cannot read ({e}); not used",
                path.display(),
                kid.as_deref().unwrap_or("no kid")
            ),
        }
    }
    let mut keys: HashMap<Option<String>, Vec<SigningKey>> = HashMap::new();
    for (i, jwk) in &read {
        let (i, jwk) = (*i, jwk);
        // A key published for encryption, or for operations that do not include verifying,
        // verifies no signature (RFC 7517, sections 4.2 and 4.3); nor does one naming an
        // algorithm that is not a signature algorithm.
        let common = &jwk.common;
        let not_for_signatures = common
            .public_key_use
            .as_ref()
            .is_some_and(|u| *u != jsonwebtoken::jwk::PublicKeyUse::Signature)
            || common
                .key_operations
                .as_ref()
                .is_some_and(|ops| !ops.contains(&jsonwebtoken::jwk::KeyOperations::Verify));
        let alg = match common.key_algorithm {
            None => None,
            Some(named) => match format!("{named:?}").parse::<Algorithm>() {
                Ok(alg) if ALGORITHMS.contains(&alg) => Some(alg),
                _ => {
                    tracing::warn!(
                        key = i,
                        "JWT key set {}: key {i} ({:?}) names an algorithm flowhost does not verify with; not used",
                        path.display(),
                        common.key_id.as_deref().unwrap_or("no kid")
                    );
                    continue;
                }
            },
        };
        if not_for_signatures {
            tracing::warn!(
                key = i,
                "JWT key set {}: key {i} ({:?}) is not for signatures (use, key_ops); not used",
                path.display(),
                common.key_id.as_deref().unwrap_or("no kid")
            );
            continue;
        }
        if matches!(
            jwk.algorithm,
            jsonwebtoken::jwk::AlgorithmParameters::OctetKey(_)
        ) {
            return Err(fail(format!(
                "key {i} is a shared secret; only public keys are accepted"
            )));
        }
        if let Some(unfit) = unfit_key(&jwk.algorithm, alg) {
            tracing::warn!(
                key = i,
                "JWT key set {}: key {i} ({:?}) {unfit}; not used",
                path.display(),
                common.key_id.as_deref().unwrap_or("no kid")
            );
            continue;
        }
        let key = DecodingKey::from_jwk(jwk).map_err(|e| fail(format!("key {i}: {e}")))?;
        let text = serde_json::to_vec(jwk).map_err(|e| fail(format!("key {i}: {e}")))?;
        let fingerprint: [u8; 32] = Sha256::digest(&text).into();
        keys.entry(jwk.common.key_id.clone())
            .or_default()
            .push(SigningKey {
                fingerprint,
                key,
                alg,
            });
    }
    if keys.is_empty() {
        return Err(fail(
            "the key set has no keys for verifying signatures".into(),
        ));
    }
    Ok(KeySet(keys))
}

/// RSA moduli flowhost verifies with: below 2048 bits a key may be factored (NIST SP
/// 800-131A retired them), above 4096 the verifier refuses it at every use.
const RSA_BITS: std::ops::RangeInclusive<usize> = 2048..=4096;

/// Why a key of the set cannot be trusted with signatures (`None`: it can): an RSA
/// modulus outside [`RSA_BITS`], or a curve other than the one its named algorithm uses.
fn unfit_key(
    params: &jsonwebtoken::jwk::AlgorithmParameters,
    alg: Option<Algorithm>,
) -> Option<String> {
    use base64::Engine;
    use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve};
    match params {
        AlgorithmParameters::RSA(rsa) => {
            let n = base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(rsa.n.trim_end_matches('='))
                .ok()?;
            let n = &n[n.iter().take_while(|b| **b == 0).count()..];
            let bits = n
                .first()
                .map_or(0, |top| n.len() * 8 - top.leading_zeros() as usize);
            (!RSA_BITS.contains(&bits)).then(|| {
                format!(
                    "has a {bits}-bit RSA modulus; flowhost verifies with {} to {} bits",
                    RSA_BITS.start(),
                    RSA_BITS.end()
                )
            })
        }
        AlgorithmParameters::EllipticCurve(ec) => {
            let wanted = match alg? {
                Algorithm::ES256 => EllipticCurve::P256,
                Algorithm::ES384 => EllipticCurve::P384,
                _ => return None,
            };
            (ec.curve != wanted).then(|| {
                format!(
                    "names {alg:?} but is a key of curve {:?}",
                    ec.curve,
                    alg = alg
                )
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection from this machine.
    const LOCAL: std::net::IpAddr = std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
    use crate::lab::{JwtIssuer as Issuer, unix_now as now};
    use serde_json::json;

    fn authenticator(dir: &std::path::Path, issuer: &Issuer) -> Authenticator {
        let jwks = dir.join("jwks.json");
        std::fs::write(&jwks, &issuer.jwks).unwrap();
        let text = format!(
            r#"[host]
socket = "s.sock"
state_dir = "state"
records_dir = "records"
[[principal]]
id = "alice"
tools = ["*"]
[http]
resource = "https://mcp.example/mcp"
[[http.token]]
principal = "alice"
sha256 = "{}"
[http.jwt]
issuer = "https://as.example"
jwks = "jwks.json"
principals = {{ "user-1" = "alice" }}
"#,
            hex::encode(Sha256::digest(b"s3cret"))
        );
        let config = crate::config::HostConfig::parse(&dir.join("host.toml"), &text).unwrap();
        Authenticator::new(config.http.as_ref().unwrap()).unwrap()
    }

    /// The key set decides who may act, so it is read as a trusted file. Before, any file
    /// at the path was read: one others could write (or its owner, a deploy user) let them
    /// add their own key, and a FIFO or a symbolic link to `/dev/zero` hung or exhausted
    /// the host at start or reload.
    #[test]
    fn a_key_set_others_may_change_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let issuer = Issuer::new(7);
        let dir = tempfile::tempdir().unwrap();
        authenticator(dir.path(), &issuer);
        let jwks = dir.path().join("jwks.json");
        let setup = |dir: &std::path::Path| {
            let config = crate::config::HostConfig::parse(
                &dir.join("host.toml"),
                "[host]\nsocket = \"s\"\nstate_dir = \"st\"\nrecords_dir = \"r\"\n[[principal]]\nid = \"alice\"\ntools = [\"*\"]\n[http]\nresource = \"https://mcp.example/mcp\"\n[http.jwt]\nissuer = \"https://as.example\"\njwks = \"jwks.json\"\nprincipals = { \"user-1\" = \"alice\" }\n",
            )
            .unwrap();
            Authenticator::new(config.http.as_ref().unwrap()).map(|_| ())
        };
        setup(dir.path()).unwrap();
        std::fs::set_permissions(&jwks, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = setup(dir.path()).unwrap_err().to_string();
        assert!(e.contains("jwks.json") && e.contains("go-w"), "{e}");
        std::fs::remove_file(&jwks).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &jwks).unwrap();
        assert!(setup(dir.path()).is_err());
        std::fs::remove_file(&jwks).unwrap();
        nix::unistd::mkfifo(&jwks, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert!(setup(dir.path()).is_err());
        // A key set in a directory others may change: they could move a revoked key set's
        // file (still the host's, still 0644) in under the name. Before, it was taken.
        std::fs::remove_file(&jwks).unwrap();
        std::fs::write(&jwks, &issuer.jwks).unwrap();
        setup(dir.path()).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = setup(dir.path()).unwrap_err().to_string();
        assert!(e.contains("jwks.json") && e.contains("go-w"), "{e}");
    }

    /// A reload whose configuration drops the loopback principal (or names another) revokes
    /// it at once, and what a request without credentials opened stops with it. Before, it
    /// was kept until a restart.
    #[test]
    fn the_loopback_principal_is_revoked_when_a_reload_drops_it() {
        let parse = |http: &str| {
            crate::config::HostConfig::parse(
                std::path::Path::new("/etc/h.toml"),
                &format!("[host]\nsocket = \"s\"\nstate_dir = \"st\"\nrecords_dir = \"r\"\n[[principal]]\nid = \"a\"\nuids = [6]\ntools = [\"*\"]\n[[principal]]\nid = \"b\"\nuids = [7]\ntools = [\"*\"]\n[http]\n{http}"),
            )
            .unwrap()
        };
        let config = parse("unauthenticated_loopback_principal = \"a\"\n");
        let a = Authenticator::new(config.http.as_ref().unwrap()).unwrap();
        let opened = a.authenticate(&HeaderMap::new(), LOCAL).unwrap();
        a.revoke_credentials_absent_from(
            config.http.as_ref().map(HttpConfig::credentials).as_ref(),
        );
        assert!(a.still_accepts(&opened));
        a.revoke_credentials_absent_from(
            parse("unauthenticated_loopback_principal = \"b\"\n")
                .http
                .as_ref()
                .map(HttpConfig::credentials)
                .as_ref(),
        );
        assert!(!a.still_accepts(&opened));
        assert_eq!(
            a.authenticate(&HeaderMap::new(), LOCAL)
                .map(|c| c.principal),
            Err(AuthRefusal::Missing)
        );
    }

    /// A connection from elsewhere than loopback reaches a loopback listener where the host
    /// routes outside packets there (`route_localnet`, a DNAT rule): without credentials it
    /// is not the loopback principal. Before, the source was never looked at.
    #[test]
    fn a_request_without_credentials_from_off_the_machine_is_not_the_loopback_principal() {
        let config = crate::config::HostConfig::parse(
            std::path::Path::new("/etc/h.toml"),
            "[host]\nsocket = \"s\"\nstate_dir = \"st\"\nrecords_dir = \"r\"\n[[principal]]\nid = \"a\"\ntools = [\"*\"]\n[http]\nunauthenticated_loopback_principal = \"a\"\n",
        )
        .unwrap();
        let a = Authenticator::new(config.http.as_ref().unwrap()).unwrap();
        for peer in ["192.0.2.7", "2001:db8::7", "::ffff:192.0.2.7"] {
            let peer: std::net::IpAddr = peer.parse().unwrap();
            assert_eq!(
                a.authenticate(&HeaderMap::new(), peer).map(|c| c.principal),
                Err(AuthRefusal::NotLocal { peer })
            );
        }
        for peer in ["127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"] {
            let peer: std::net::IpAddr = peer.parse().unwrap();
            assert_eq!(
                a.authenticate(&HeaderMap::new(), peer)
                    .unwrap()
                    .principal
                    .as_str(),
                "a",
                "{peer}"
            );
        }
    }

    /// A request a proxy forwarded may come from anywhere: without credentials it is not the
    /// loopback principal, which a local reverse proxy (whose requests all come from
    /// loopback) would otherwise give every remote caller.
    #[test]
    fn a_forwarded_request_without_credentials_is_not_the_loopback_principal() {
        let config = crate::config::HostConfig::parse(
            std::path::Path::new("/etc/h.toml"),
            "[host]\nsocket = \"s\"\nstate_dir = \"st\"\nrecords_dir = \"r\"\n[[principal]]\nid = \"a\"\ntools = [\"*\"]\n[http]\nunauthenticated_loopback_principal = \"a\"\n",
        )
        .unwrap();
        let a = Authenticator::new(config.http.as_ref().unwrap()).unwrap();
        for header in FORWARDING_HEADERS {
            let mut h = HeaderMap::new();
            h.insert(
                header,
                hyper::header::HeaderValue::from_static("203.0.113.9"),
            );
            assert_eq!(
                a.authenticate(&h, LOCAL).map(|c| c.principal),
                Err(AuthRefusal::Forwarded { header })
            );
        }
        for header in ["x-forwarded-for", "x-forwarded-prefix", "X-Forwarded-Ssl"] {
            let mut h = HeaderMap::new();
            h.insert(
                hyper::header::HeaderName::from_bytes(header.as_bytes()).unwrap(),
                hyper::header::HeaderValue::from_static("on"),
            );
            assert_eq!(
                a.authenticate(&h, LOCAL).map(|c| c.principal),
                Err(AuthRefusal::Forwarded {
                    header: "x-forwarded-*"
                })
            );
        }
        assert_eq!(
            a.authenticate(&HeaderMap::new(), LOCAL)
                .unwrap()
                .principal
                .as_str(),
            "a"
        );
    }

    /// An `Authorization` header that is sent but unreadable, or sent twice, is refused even
    /// where a request without one acts as the loopback principal.
    #[test]
    fn an_unreadable_or_repeated_authorization_is_refused_not_taken_as_absent() {
        let config = crate::config::HostConfig::parse(
            std::path::Path::new("/etc/h.toml"),
            "[host]\nsocket = \"s\"\nstate_dir = \"st\"\nrecords_dir = \"r\"\n[[principal]]\nid = \"a\"\ntools = [\"*\"]\n[http]\nunauthenticated_loopback_principal = \"a\"\n",
        )
        .unwrap();
        let a = Authenticator::new(config.http.as_ref().unwrap()).unwrap();
        let with = |values: &[&[u8]]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(
                    AUTHORIZATION,
                    hyper::header::HeaderValue::from_bytes(v).unwrap(),
                );
            }
            a.authenticate(&h, LOCAL).map(|c| c.principal)
        };
        assert_eq!(with(&[]).unwrap().as_str(), "a");
        assert_eq!(with(&[b"Bearer garbage"]), Err(AuthRefusal::UnknownToken));
        assert_eq!(
            with(&[b"Bearer \xe9\xff"]),
            Err(AuthRefusal::Unreadable(UnreadableHeader::NotAscii))
        );
        assert_eq!(
            with(&[b"Bearer x", b"Bearer y"]),
            Err(AuthRefusal::Unreadable(UnreadableHeader::Repeated))
        );
        assert_eq!(
            AuthRefusal::Unreadable(UnreadableHeader::NotAscii).to_string(),
            "the Authorization header is not visible ASCII"
        );
    }

    /// A key published for encryption, or for operations without `verify`, verifies no
    /// token, and a key naming its algorithm verifies only tokens of that one. Before, every
    /// key of the set verified tokens of any accepted algorithm its type could check.
    #[test]
    fn a_key_verifies_only_what_its_jwk_says_it_is_for() {
        let issuer = Issuer::new(7);
        let token = issuer
            .token(
                &json!({"iss": "https://as.example", "aud": "https://mcp.example/mcp",
                           "exp": now() + 300, "sub": "user-1"}),
            )
            .unwrap();
        let bearer = format!("Bearer {token}");
        let with = |change: serde_json::Value| {
            let dir = tempfile::tempdir().unwrap();
            let a = authenticator(dir.path(), &issuer);
            let mut set: serde_json::Value = serde_json::from_str(&issuer.jwks).unwrap();
            let key = set["keys"][0].as_object_mut().unwrap();
            for (k, v) in change.as_object().unwrap() {
                key.insert(k.clone(), v.clone());
            }
            // Alongside, so the set is not empty of keys for signatures.
            let other =
                serde_json::from_str::<serde_json::Value>(&Issuer::new(9).jwks).unwrap()["keys"][0]
                    .clone();
            set["keys"].as_array_mut().unwrap().push(other);
            let jwks = dir.path().join("jwks.json");
            std::fs::write(&jwks, set.to_string()).unwrap();
            a.use_key_set(load_keys(&jwks).unwrap());
            a.authenticate_value(Some(&bearer))
        };
        assert_eq!(with(json!({})).unwrap().as_str(), "alice");
        assert_eq!(
            with(json!({"use": "sig", "key_ops": ["verify"]}))
                .unwrap()
                .as_str(),
            "alice"
        );
        for refused in [
            json!({"use": "enc"}),
            json!({"key_ops": ["encrypt"]}),
            json!({"alg": "ES256"}),
            json!({"alg": "RSA-OAEP"}),
        ] {
            assert!(with(refused.clone()).is_err(), "{refused}");
        }
    }

    /// An RSA key too short to trust (a 1024-bit modulus can be factored), or too long for
    /// the verifier, and an EC key of another curve than its `alg`, verify nothing: they are
    /// left out of the set (and said), the set's other keys stay. Before, a 1024-bit key was
    /// loaded and verified tokens like any other.
    #[test]
    fn rsa_keys_outside_2048_to_4096_bits_and_mismatched_curves_are_left_out() {
        use base64::Engine;
        let b64 = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
        let rsa = |kid: &str, bits: usize| {
            // The modulus's size is what is judged; its value is never used here.
            let mut n = vec![0xc5u8; bits / 8];
            n.insert(0, 0);
            json!({"kty": "RSA", "kid": kid, "n": b64(&n), "e": "AQAB"})
        };
        let ec = json!({"kty": "EC", "kid": "p384-as-es256", "alg": "ES256", "crv": "P-384",
                        "x": b64(&[1; 48]), "y": b64(&[2; 48])});
        let ed: serde_json::Value = serde_json::from_str(&Issuer::new(7).jwks).unwrap();
        let mut ed = ed["keys"][0].clone();
        ed["kid"] = json!("ed");
        let set = json!({"keys": [rsa("rsa-1024", 1024), rsa("rsa-2048", 2048),
                                   rsa("rsa-4096", 4096), rsa("rsa-8192", 8192), ec, ed]});
        let dir = tempfile::tempdir().unwrap();
        let jwks = dir.path().join("jwks.json");
        std::fs::write(&jwks, set.to_string()).unwrap();
        let loaded = load_keys(&jwks).unwrap();
        let mut kids: Vec<&str> = loaded.0.keys().filter_map(|k| k.as_deref()).collect();
        kids.sort();
        assert_eq!(kids, ["ed", "rsa-2048", "rsa-4096"]);
    }

    /// A key of a kind flowhost cannot read at all (an X25519 encryption key, secp256k1, a
    /// type newer than this build) is passed over, and the set's other keys serve. Before,
    /// one such key failed the whole set: every JWT refused, the reload or start with it.
    #[test]
    fn a_key_of_a_kind_flowhost_cannot_read_leaves_the_others() {
        let ed: serde_json::Value = serde_json::from_str(&Issuer::new(7).jwks).unwrap();
        let mut ed = ed["keys"][0].clone();
        ed["kid"] = json!("ed");
        let set = json!({"keys": [
            {"kty": "OKP", "crv": "X25519", "use": "enc", "kid": "x", "x": "AAAA"},
            {"kty": "EC", "crv": "secp256k1", "kid": "k1", "x": "AAAA", "y": "AAAA"},
            {"kty": "AKP", "alg": "ML-DSA-44", "kid": "pq", "pub": "AAAA"},
            ed,
        ]});
        let dir = tempfile::tempdir().unwrap();
        let jwks = dir.path().join("jwks.json");
        std::fs::write(&jwks, set.to_string()).unwrap();
        let loaded = load_keys(&jwks).unwrap();
        let kids: Vec<&str> = loaded.0.keys().filter_map(|k| k.as_deref()).collect();
        assert_eq!(kids, ["ed"]);
        // Nothing readable at all is still no key set.
        std::fs::write(
            &jwks,
            json!({"keys": [{"kty": "AKP", "pub": "AAAA"}]}).to_string(),
        )
        .unwrap();
        assert!(load_keys(&jwks).is_err());
    }

    #[test]
    fn tokens_and_jwts_map_to_principals_and_everything_else_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let issuer = Issuer::new(7);
        let a = authenticator(dir.path(), &issuer);
        let claims = |aud: &str, exp: u64, sub: &str| json!({"iss": "https://as.example", "aud": aud, "exp": exp, "sub": sub});
        let bearer = |t: &str| format!("Bearer {t}");
        assert_eq!(
            a.authenticate_value(Some("Bearer s3cret"))
                .unwrap()
                .as_str(),
            "alice"
        );
        assert_eq!(a.authenticate_value(None), Err(AuthRefusal::Missing));
        assert_eq!(
            a.authenticate_value(Some("Basic eDp5")),
            Err(AuthRefusal::Malformed)
        );
        assert_eq!(
            a.authenticate_value(Some("Bearer wrong")),
            Err(AuthRefusal::UnknownToken)
        );
        let good = issuer
            .token(&claims("https://mcp.example/mcp", now() + 300, "user-1"))
            .unwrap();
        assert_eq!(
            a.authenticate_value(Some(&bearer(&good))).unwrap().as_str(),
            "alice"
        );
        let aud = issuer
            .token(&claims("https://other.example/mcp", now() + 300, "user-1"))
            .unwrap();
        assert_eq!(
            a.authenticate_value(Some(&bearer(&aud))),
            Err(AuthRefusal::WrongAudience)
        );
        let expired = issuer
            .token(&claims("https://mcp.example/mcp", now() - 600, "user-1"))
            .unwrap();
        assert_eq!(
            a.authenticate_value(Some(&bearer(&expired))),
            Err(AuthRefusal::Expired)
        );
        let mut later = claims("https://mcp.example/mcp", now() + 900, "user-1");
        later["nbf"] = json!(now() + 600);
        let later = issuer.token(&later).unwrap();
        assert_eq!(
            a.authenticate_value(Some(&bearer(&later))),
            Err(AuthRefusal::NotYetValid)
        );
        assert_eq!(
            a.authenticate_value(Some(&format!("BEARER {good}")))
                .unwrap()
                .as_str(),
            "alice"
        );
        let stranger = issuer
            .token(&claims("https://mcp.example/mcp", now() + 300, "user-2"))
            .unwrap();
        assert!(matches!(
            a.authenticate_value(Some(&bearer(&stranger))),
            Err(AuthRefusal::UnknownPrincipal { .. })
        ));
        let forged = Issuer::new(8)
            .token(&claims("https://mcp.example/mcp", now() + 300, "user-1"))
            .unwrap();
        assert!(matches!(
            a.authenticate_value(Some(&bearer(&forged))),
            Err(AuthRefusal::InvalidToken(_))
        ));
    }
}
