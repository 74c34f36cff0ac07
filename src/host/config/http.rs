//! The `[http]` table: MCP over Streamable HTTP for remote agents (see the README, "Remote
//! agents"). Every HTTP caller maps to a configured principal through a bearer token (kept
//! as its SHA-256 only) or a JWT access token from a configured issuer; a listener that is
//! not on loopback must use TLS.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::ident::PrincipalId;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHttp {
    #[serde(default = "default_listen")]
    listen: SocketAddr,
    #[serde(default = "default_path")]
    path: String,
    #[serde(default)]
    allowed_hosts: Option<Vec<String>>,
    #[serde(default)]
    allowed_origins: Vec<String>,
    #[serde(default)]
    resource: Option<String>,
    #[serde(default)]
    tls: Option<RawTls>,
    #[serde(default)]
    token: Vec<RawToken>,
    #[serde(default)]
    jwt: Option<RawJwt>,
    #[serde(default)]
    unauthenticated_loopback_principal: Option<PrincipalId>,
    #[serde(default = "default_per_source")]
    max_connections_per_source: usize,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    cert: PathBuf,
    key: PathBuf,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawToken {
    principal: PrincipalId,
    sha256: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJwt {
    issuer: String,
    jwks: PathBuf,
    #[serde(default)]
    audience: Option<String>,
    #[serde(default = "default_claim")]
    principal_claim: String,
    // Absent reads as empty, which `validate` leaves dangling: taking the table out is how
    // an operator revokes every subject, and the lenient read must still see that.
    #[serde(default)]
    principals: BTreeMap<String, PrincipalId>,
    #[serde(default)]
    authorization_servers: Vec<String>,
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 8931))
}
fn default_path() -> String {
    "/mcp".into()
}
fn default_claim() -> String {
    "sub".into()
}
fn default_per_source() -> usize {
    DEFAULT_MAX_CONNECTIONS_PER_SOURCE
}

/// Most HTTP connections the listener keeps open at once (each holds one of the daemon's
/// descriptors, which the Unix socket and the executors need too).
pub const MAX_CONNECTIONS: usize = 512;

/// How many of [`MAX_CONNECTIONS`] one source (an IPv4 address, an IPv6 /64) may hold
/// unless `max_connections_per_source` says otherwise: room for several clients behind one
/// address, each with its session's GET stream and some requests in flight (a request in
/// flight holds a connection of its own), while it takes eight such sources to fill the
/// listener.
pub const DEFAULT_MAX_CONNECTIONS_PER_SOURCE: usize = 64;

/// The names a loopback listener answers to by default.
const LOOPBACK_HOSTS: [&str; 3] = ["localhost", "127.0.0.1", "[::1]"];

/// The host of an authority (`host[:port]`, an IPv6 address in brackets), lower case.
fn authority_host(authority: &str) -> String {
    let host = match authority.strip_prefix('[') {
        Some(rest) => rest
            .split(']')
            .next()
            .map_or(authority.to_string(), |h| format!("[{h}]")),
        None => authority.split(':').next().unwrap_or(authority).to_string(),
    };
    host.to_ascii_lowercase()
}

/// Whether `host` (from [`authority_host`]) names this machine: `localhost` and its
/// subdomains, or a loopback address.
fn is_loopback_name(host: &str) -> bool {
    if host == "localhost" || host.ends_with(".localhost") {
        return true;
    }
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    bare.parse::<std::net::IpAddr>()
        .is_ok_and(|a| a.is_loopback())
}

/// The HTTP listener.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Where to listen (default `127.0.0.1:8931`).
    pub listen: SocketAddr,
    /// The MCP endpoint's path (default `/mcp`).
    pub path: String,
    /// Host names (without port, IPv6 in brackets) the `Host` header may name; a request
    /// naming another is refused (DNS rebinding). Default: the loopback names.
    pub allowed_hosts: Vec<String>,
    /// Origins (`scheme://host[:port]`) a browser request may come from, beyond those whose
    /// host is an allowed host; a request from another origin is refused.
    pub allowed_origins: Vec<String>,
    /// This server's canonical URI (what JWT audiences must name, and the protected
    /// resource metadata's `resource`).
    pub resource: Option<String>,
    /// The certificate chain and private key (PEM) when serving TLS.
    pub tls: Option<TlsFiles>,
    /// Bearer tokens, by SHA-256.
    pub tokens: Vec<BearerToken>,
    /// The JWT resource-server role.
    pub jwt: Option<JwtConfig>,
    /// The principal of callers without credentials, only on a loopback listener (for local
    /// tools that cannot send a token; any local process can then act as it).
    pub unauthenticated_loopback_principal: Option<PrincipalId>,
    /// Most connections open at once from one source (1 to [`MAX_CONNECTIONS`]; default
    /// [`DEFAULT_MAX_CONNECTIONS_PER_SOURCE`]). Counted from the moment a connection is
    /// accepted, before any authentication: what it bounds is what an unknown host can hold.
    pub max_connections_per_source: usize,
}

/// TLS files.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// PEM certificate chain.
    pub cert: PathBuf,
    /// PEM private key.
    pub key: PathBuf,
}

/// A bearer token: only its SHA-256 is kept.
#[derive(Clone)]
pub struct BearerToken {
    /// The principal the token authenticates.
    pub principal: PrincipalId,
    /// SHA-256 of the token's bytes.
    pub sha256: [u8; 32],
}

/// Shows the token's digest only as a fingerprint keyed by a secret of this process: two
/// shown alike hold the same digest (a reload's comparison of `[http]` tables relies on
/// it), but what is shown (in a refused reload's message, the journal, the unit's status
/// text) cannot be used to test guesses of a token offline, as its SHA-256 could.
impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BearerToken")
            .field("principal", &self.principal)
            .field("fingerprint", &crate::host::fingerprint::of(&self.sha256))
            .finish()
    }
}

/// The credentials an `[http]` table maps to principals: what a reload compares with those
/// in use to revoke the ones taken out (see
/// `Authenticator::revoke_credentials_absent_from`).
#[derive(Debug, Clone, Default)]
pub struct HttpCredentials {
    /// The bearer tokens.
    pub tokens: Vec<BearerToken>,
    /// The JWT claim values and their principals (empty without `[http.jwt]`).
    pub jwt_subjects: BTreeMap<String, PrincipalId>,
    /// The principal of unauthenticated loopback callers, if one is named.
    pub loopback: Option<PrincipalId>,
}

impl HttpConfig {
    /// The credentials this table maps.
    pub fn credentials(&self) -> HttpCredentials {
        HttpCredentials {
            tokens: self.tokens.clone(),
            jwt_subjects: (self.jwt.iter())
                .flat_map(|j| j.principals.clone())
                .collect(),
            loopback: self.unauthenticated_loopback_principal.clone(),
        }
    }
}

impl HttpCredentials {
    /// The credentials an `[http]` table's TOML maps, read from the TOML alone, for a file
    /// that does not load: one not written as a loaded file would hold it (a hash that is no
    /// 64 lowercase hex digits, a principal that is no identifier) is left out, and so
    /// revoked, never kept.
    pub(crate) fn in_toml(http: &toml::Table) -> HttpCredentials {
        let principal = |v: &toml::Value| v.as_str().and_then(|p| PrincipalId::new(p).ok());
        let tokens = (http
            .get("token")
            .and_then(toml::Value::as_array)
            .into_iter()
            .flatten())
        .filter_map(|t| {
            let hex = t.get("sha256")?.as_str()?;
            let mut sha256 = [0u8; 32];
            (!hex.bytes().any(|b| b.is_ascii_uppercase())).then_some(())?;
            hex::decode_to_slice(hex, &mut sha256).ok()?;
            Some(BearerToken {
                principal: principal(t.get("principal")?)?,
                sha256,
            })
        })
        .collect();
        let jwt_subjects = (http.get("jwt").and_then(|j| j.get("principals")))
            .and_then(toml::Value::as_table)
            .into_iter()
            .flatten()
            .filter_map(|(claim, p)| Some((claim.clone(), principal(p)?)))
            .collect();
        HttpCredentials {
            tokens,
            jwt_subjects,
            loopback: http
                .get("unauthenticated_loopback_principal")
                .and_then(principal),
        }
    }
}

/// Validating JWT access tokens (the MCP authorization spec's resource-server role).
#[derive(Debug, Clone)]
pub struct JwtConfig {
    /// The `iss` every token must carry.
    pub issuer: String,
    /// The JSON Web Key Set file of the issuer's signing keys.
    pub jwks: PathBuf,
    /// The `aud` a token must include (this server's canonical URI).
    pub audience: String,
    /// The claim naming the caller (default `sub`).
    pub principal_claim: String,
    /// Claim values to principals; a caller whose claim is not here is refused.
    pub principals: BTreeMap<String, PrincipalId>,
    /// Authorization servers advertised in the protected resource metadata (default: the
    /// issuer).
    pub authorization_servers: Vec<String>,
}

impl HttpConfig {
    /// Every principal id this table names (each must be configured).
    pub fn named_principals(&self) -> impl Iterator<Item = (String, &PrincipalId)> {
        let tokens = self
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (format!("http.token[{i}].principal"), &t.principal));
        let jwt = self
            .jwt
            .iter()
            .flat_map(|j| j.principals.iter())
            .map(|(claim, p)| (format!("http.jwt.principals.{claim:?}"), p));
        let anon = self
            .unauthenticated_loopback_principal
            .iter()
            .map(|p| ("http.unauthenticated_loopback_principal".to_string(), p));
        tokens.chain(jwt).chain(anon)
    }
}

/// Validates the raw table (`resolve` makes paths absolute). `Err` is `(key, message)`.
/// A table left with no credential at all, or a JWT issuer with no subject mapped, is
/// pushed to `dangling` (`(key, message)`) rather than refused here: taking the last
/// credential out is how an operator revokes it, and a reload refused for that must still
/// revoke it (the lenient read; a strict one refuses the file for what is in `dangling`).
pub(super) fn validate(
    mut raw: RawHttp,
    resolve: impl Fn(&Path) -> PathBuf,
    dangling: &mut Vec<(String, String)>,
) -> Result<HttpConfig, (String, String)> {
    let bad = |k: &str, m: String| Err((format!("http.{k}"), m));
    if !raw.path.starts_with('/') || raw.path.contains(['?', '#']) {
        return bad("path", format!("{:?} is not an absolute path", raw.path));
    }
    let loopback = raw.listen.ip().is_loopback();
    if !loopback && raw.tls.is_none() {
        return bad(
            "listen",
            format!(
                "{} is not a loopback address: remote callers need TLS (set http.tls)",
                raw.listen
            ),
        );
    }
    if !loopback && raw.unauthenticated_loopback_principal.is_some() {
        return bad(
            "unauthenticated_loopback_principal",
            format!("only allowed on a loopback listener, not {}", raw.listen),
        );
    }
    let allowed_hosts: Vec<String> = match raw.allowed_hosts {
        Some(h) if !h.is_empty() => h.into_iter().map(|h| h.to_ascii_lowercase()).collect(),
        Some(_) => return bad("allowed_hosts", "name at least one host".into()),
        None if loopback => LOOPBACK_HOSTS.iter().map(ToString::to_string).collect(),
        None => {
            return bad(
                "allowed_hosts",
                "a listener that is not on loopback must name the host names it answers to".into(),
            );
        }
    };
    // Compared with the Host header's host alone (its port is not): an entry with a port,
    // or an IPv6 address without brackets, would match no request.
    for (i, h) in allowed_hosts.iter().enumerate() {
        if authority_host(h) != *h {
            return bad(
                &format!("allowed_hosts[{i}]"),
                format!(
                    "{h:?} is not a host as a Host header names it: give the host without a \
                     port (any port is taken), an IPv6 address in brackets"
                ),
            );
        }
    }
    // Browsers send an origin's scheme and host in lower case.
    raw.allowed_origins = raw
        .allowed_origins
        .iter()
        .map(|o| o.to_ascii_lowercase())
        .collect();
    for (i, o) in raw.allowed_origins.iter().enumerate() {
        if !(o.starts_with("http://") || o.starts_with("https://")) || o.ends_with('/') {
            return bad(
                &format!("allowed_origins[{i}]"),
                format!("{o:?} is not scheme://host[:port]"),
            );
        }
    }
    // Callers without credentials act as this principal only because they are on this
    // machine: a host name or origin that is not (a reverse proxy's public name) would let
    // anyone reaching the proxy act as it.
    if raw.unauthenticated_loopback_principal.is_some() {
        let origin_hosts = raw.allowed_origins.iter().map(|o| {
            let authority = o.split_once("://").map_or(o.as_str(), |(_, a)| a);
            authority_host(authority)
        });
        if let Some(name) = allowed_hosts
            .iter()
            .map(|h| authority_host(h))
            .chain(origin_hosts)
            .find(|h| !is_loopback_name(h))
        {
            return bad(
                "unauthenticated_loopback_principal",
                format!(
                    "callers are only taken for it on this machine, but the listener answers to \
                     {name:?} (allowed_hosts or allowed_origins), which is not a loopback name: \
                     behind a proxy, give callers tokens instead"
                ),
            );
        }
    }
    if !(1..=MAX_CONNECTIONS).contains(&raw.max_connections_per_source) {
        return bad(
            "max_connections_per_source",
            format!(
                "{} is outside 1 to {MAX_CONNECTIONS} (the listener's limit of connections in all)",
                raw.max_connections_per_source
            ),
        );
    }
    let mut tokens = Vec::new();
    for (i, t) in raw.token.into_iter().enumerate() {
        let mut sha256 = [0u8; 32];
        if hex::decode_to_slice(&t.sha256, &mut sha256).is_err()
            || t.sha256.bytes().any(|b| b.is_ascii_uppercase())
        {
            return bad(
                &format!("token[{i}].sha256"),
                "must be 64 lowercase hex digits (sha256sum of the token)".into(),
            );
        }
        if tokens.iter().any(|o: &BearerToken| o.sha256 == sha256) {
            return bad(
                &format!("token[{i}].sha256"),
                "the same token is configured twice".into(),
            );
        }
        tokens.push(BearerToken {
            principal: t.principal,
            sha256,
        });
    }
    let jwt = match raw.jwt {
        None => None,
        Some(j) => {
            let audience = match j.audience.or_else(|| raw.resource.clone()) {
                Some(a) if !a.is_empty() => a,
                _ => {
                    return bad(
                        "jwt.audience",
                        "set http.resource (or http.jwt.audience) to this server's canonical URI"
                            .into(),
                    );
                }
            };
            if j.issuer.is_empty() {
                return bad("jwt.issuer", "must not be empty".into());
            }
            if j.principals.is_empty() {
                dangling.push((
                    "http.jwt.principals".into(),
                    "map at least one claim value to a principal".into(),
                ));
            }
            let authorization_servers = if j.authorization_servers.is_empty() {
                vec![j.issuer.clone()]
            } else {
                j.authorization_servers
            };
            Some(JwtConfig {
                issuer: j.issuer,
                jwks: resolve(&j.jwks),
                audience,
                principal_claim: j.principal_claim,
                principals: j.principals,
                authorization_servers,
            })
        }
    };
    if tokens.is_empty() && jwt.is_none() && raw.unauthenticated_loopback_principal.is_none() {
        dangling.push((
            "http.token".into(),
            "configure at least one way to authenticate (http.token, http.jwt)".into(),
        ));
    }
    Ok(HttpConfig {
        listen: raw.listen,
        path: raw.path,
        allowed_hosts,
        allowed_origins: raw.allowed_origins,
        resource: raw.resource,
        tls: raw.tls.map(|t| TlsFiles {
            cert: resolve(&t.cert),
            key: resolve(&t.key),
        }),
        tokens,
        jwt,
        unauthenticated_loopback_principal: raw.unauthenticated_loopback_principal,
        max_connections_per_source: raw.max_connections_per_source,
    })
}

#[cfg(test)]
mod tests {
    /// A refused reload shows both `[http]` tables: a token's digest must not be in them
    /// (whoever reads the journal or `systemctl status` could test guesses of a weak token
    /// against it), while two tables that differ in a token must still show differently.
    #[test]
    fn a_tokens_digest_is_never_shown() {
        let token = |sha256| super::BearerToken {
            principal: crate::ident::PrincipalId::new("a").unwrap(),
            sha256,
        };
        let shown = format!("{:?}", token([0xab; 32]));
        assert!(
            !shown.contains("171, 171") && !shown.contains(&"ab".repeat(8)),
            "{shown}"
        );
        assert_eq!(shown, format!("{:?}", token([0xab; 32])));
        assert_ne!(shown, format!("{:?}", token([0xac; 32])));
    }

    use super::*;

    fn parse(text: &str) -> Result<HttpConfig, (String, String)> {
        let raw: RawHttp = toml::from_str(text).unwrap();
        let mut dangling = Vec::new();
        let c = validate(raw, |p| Path::new("/etc/flowhost").join(p), &mut dangling)?;
        match dangling.into_iter().next() {
            Some(left_out) => Err(left_out),
            None => Ok(c),
        }
    }

    const TOKEN: &str = "[[token]]\nprincipal = \"alice\"\nsha256 = \"2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824\"\n";

    #[test]
    fn loopback_defaults_and_a_token() {
        let c = parse(TOKEN).unwrap();
        assert_eq!(c.listen.to_string(), "127.0.0.1:8931");
        assert_eq!(c.allowed_hosts, ["localhost", "127.0.0.1", "[::1]"]);
        assert_eq!(c.tokens[0].principal.as_str(), "alice");
    }

    #[test]
    fn refusals_name_the_key() {
        let no_auth = parse("").unwrap_err();
        assert_eq!(no_auth.0, "http.token");
        let remote = parse(&format!("listen = \"0.0.0.0:443\"\n{TOKEN}")).unwrap_err();
        assert_eq!(remote.0, "http.listen");
        assert!(remote.1.contains("TLS"), "{}", remote.1);
        let upper = parse("[[token]]\nprincipal = \"a\"\nsha256 = \"2CF24DBA5FB0A30E26E83B2AC5B9E29E1B161E5C1FA7425E73043362938B9824\"\n").unwrap_err();
        assert_eq!(upper.0, "http.token[0].sha256");
        let jwt = parse(
            "[jwt]\nissuer = \"https://as\"\njwks = \"k.json\"\nprincipals = { u1 = \"alice\" }\n",
        )
        .unwrap_err();
        assert_eq!(jwt.0, "http.jwt.audience");
        let anon = parse(
            "listen = \"0.0.0.0:443\"\nallowed_hosts = [\"mcp.example\"]\nunauthenticated_loopback_principal = \"a\"\n[tls]\ncert = \"c\"\nkey = \"k\"\n",
        )
        .unwrap_err();
        assert_eq!(anon.0, "http.unauthenticated_loopback_principal");
    }

    /// A loopback listener answering to a public name is a reverse proxy's backend: a
    /// caller without credentials there may be anyone reaching the proxy, and was taken
    /// for the unauthenticated loopback principal.
    #[test]
    fn the_unauthenticated_principal_needs_loopback_names_only() {
        let anon = "unauthenticated_loopback_principal = \"ops\"\n";
        for extra in [
            "allowed_hosts = [\"mcp.example.org\"]\n",
            "allowed_hosts = [\"localhost\", \"10.0.0.5\"]\n",
            "allowed_origins = [\"https://mcp.example.org\"]\n",
        ] {
            let e = parse(&format!("{extra}{anon}")).unwrap_err();
            assert_eq!(e.0, "http.unauthenticated_loopback_principal", "{extra}");
            assert!(e.1.contains("not a loopback name"), "{}", e.1);
        }
        for extra in [
            "",
            "allowed_hosts = [\"localhost\", \"127.0.0.2\", \"[::1]\", \"a.localhost\"]\n",
            "allowed_origins = [\"http://localhost:3000\", \"http://[::1]:3000\"]\n",
        ] {
            parse(&format!("{extra}{anon}")).unwrap_or_else(|e| panic!("{extra}: {e:?}"));
        }
        // A port, or an IPv6 address without brackets, would match no Host header: before,
        // accepted, and every request was then forbidden.
        for host in ["localhost:8931", "[::1]:9", "::1"] {
            let e = parse(&format!("allowed_hosts = [\"{host}\"]\n{anon}")).unwrap_err();
            assert_eq!(e.0, "http.allowed_hosts[0]", "{host}");
            assert!(e.1.contains("without a port"), "{}", e.1);
        }
    }

    #[test]
    fn the_connections_per_source_are_within_the_listeners_limit() {
        assert_eq!(
            parse(TOKEN).unwrap().max_connections_per_source,
            DEFAULT_MAX_CONNECTIONS_PER_SOURCE
        );
        let raised = parse(&format!("max_connections_per_source = 512\n{TOKEN}")).unwrap();
        assert_eq!(raised.max_connections_per_source, 512);
        for bad in ["0", "513"] {
            let e = parse(&format!("max_connections_per_source = {bad}\n{TOKEN}")).unwrap_err();
            assert_eq!(e.0, "http.max_connections_per_source");
            assert!(e.1.contains(bad) && e.1.contains("1 to 512"), "{}", e.1);
        }
    }

    #[test]
    fn jwt_audience_defaults_to_the_resource() {
        let c = parse("resource = \"https://mcp.example/mcp\"\n[jwt]\nissuer = \"https://as\"\njwks = \"k.json\"\nprincipals = { u1 = \"alice\" }\n").unwrap();
        let j = c.jwt.unwrap();
        assert_eq!(j.audience, "https://mcp.example/mcp");
        assert_eq!(j.jwks, Path::new("/etc/flowhost/k.json"));
        assert_eq!(j.authorization_servers, ["https://as"]);
    }
}
