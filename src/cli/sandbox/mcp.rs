//! `flowhost sandbox mcp --manifest SIGNED --key PUB [--profile NAME] [--allow RULE]...
//! [--records DIR] -- CMD [ARGS]`: one MCP server on stdio, governed exactly as the daemon
//! governs it, so that any MCP client test (in any language) can drive a governed server.
//!
//! It is the daemon: a host configuration for this one server is derived from the flags
//! (kept in a private directory for the run), the host starts from it as `flowhost serve`
//! would (the manifest verified against the key and admitted, the broker required, the
//! profile checked, a fresh flow state, the record writer opened, an executor proven), and
//! stdin/stdout are one session of it, made by the calling user (its principal). When stdin
//! ends, the host stops as on SIGTERM: executors are stopped, the records closed and the
//! health written; then `--declared` runs the gate.
//!
//! The operator policy of each tool is what its signed flow declaration asks for: its input
//! clearance (bottom when it declares none), a bottom output floor (the declared output
//! label still applies), and its declassification purposes.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use serde_json::json;

use super::{CliResult, CommonArgs, resolve_program};
use crate::label::InformationLabel;
use crate::records::ToolMapping;

#[derive(Debug, clap::Args)]
pub(super) struct McpArgs {
    /// The server's signed manifest envelope.
    #[arg(long)]
    manifest: PathBuf,
    /// The public key the manifest must verify with (hex, or a file of hex).
    #[arg(long)]
    key: String,
    /// Execution profile name (looked up in --profiles-dir, then among the built-in ones).
    #[arg(long, default_value = "brokered")]
    profile: String,
    #[command(flatten)]
    common: CommonArgs,
    /// Record mappings: a TOML table per tool name, as `record = {...}` in a host
    /// configuration (provider, category, verb, resource_type, required_scope, plain,
    /// hashed, required). Unmapped tools are recorded as `observed_unknown_tool`.
    #[arg(long, value_name = "FILE")]
    mappings: Option<PathBuf>,
    /// The principal the calling user acts as.
    #[arg(long, default_value = "tester")]
    principal: String,
    /// Per-call timeout in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    call_timeout_ms: u64,
    /// The server's command and its arguments (after `--`).
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<OsString>,
}

/// Why the derived host configuration could not be made.
#[derive(Debug, thiserror::Error)]
enum McpSetupError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    Mappings { path: PathBuf, message: String },
    #[error("{0}")]
    Config(String),
}

fn absolute(p: &Path) -> Result<PathBuf, McpSetupError> {
    std::fs::canonicalize(p).map_err(|source| McpSetupError::Io {
        path: p.to_path_buf(),
        source,
    })
}

/// `p` made absolute against the working directory (not resolving links: it may not exist).
fn in_cwd(p: &Path) -> Result<PathBuf, McpSetupError> {
    std::path::absolute(p).map_err(|source| McpSetupError::Io {
        path: p.to_path_buf(),
        source,
    })
}

/// The record mappings of `--mappings`, each checked, for tools the manifest has.
fn read_mappings(
    path: &Path,
    tools: &[String],
) -> Result<BTreeMap<String, ToolMapping>, McpSetupError> {
    let text = std::fs::read_to_string(path).map_err(|source| McpSetupError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mappings: BTreeMap<String, ToolMapping> =
        toml::from_str(&text).map_err(|e| McpSetupError::Mappings {
            path: path.to_path_buf(),
            message: e.to_string().trim_end().to_string(),
        })?;
    if let Some(unknown) = mappings.keys().find(|t| !tools.contains(t)) {
        return Err(McpSetupError::Mappings {
            path: path.to_path_buf(),
            message: format!(
                "[{unknown}]: the signed manifest has no tool {unknown:?} (it has {tools:?})"
            ),
        });
    }
    Ok(mappings)
}

impl McpArgs {
    /// The host configuration for this one server, as TOML.
    fn host_config(
        &self,
        dir: &Path,
        records: &Path,
        health: &Path,
    ) -> Result<String, McpSetupError> {
        let manifest = absolute(&self.manifest)?;
        let envelope = crate::manifest::load_envelope_file(&manifest)
            .map_err(|e| McpSetupError::Config(e.to_string()))?;
        let body = envelope.body();
        let tool_names: Vec<String> = body.tools().iter().map(|t| t.name().to_string()).collect();
        let mappings = match &self.mappings {
            Some(p) => read_mappings(p, &tool_names)?,
            None => BTreeMap::new(),
        };
        let mut tools = serde_json::Map::new();
        for t in body.tools() {
            let flow = t.flow();
            let clearance = flow
                .and_then(|f| f.input_clearance())
                .cloned()
                .unwrap_or_else(InformationLabel::bottom);
            let purposes: Vec<String> = flow
                .map(|f| {
                    f.declassification_purposes
                        .iter()
                        .map(ToString::to_string)
                        .collect()
                })
                .unwrap_or_default();
            let mut entry = json!({"policy": {
                "input_clearances": [clearance],
                "output_floor": InformationLabel::bottom(),
                "declassification_purposes": purposes,
            }});
            if let Some(m) = mappings.get(t.name()) {
                entry["record"] =
                    serde_json::to_value(m).map_err(|e| McpSetupError::Config(e.to_string()))?;
            }
            tools.insert(t.name().to_string(), entry);
        }
        // A key given as a file is read from where the caller pointed, not from `dir`.
        let key = if Path::new(&self.key).exists() {
            absolute(Path::new(&self.key))?.display().to_string()
        } else {
            self.key.clone()
        };
        let mut command = vec![
            resolve_program(&self.command[0])
                .map_err(|e| McpSetupError::Config(e.to_string()))?
                .display()
                .to_string(),
        ];
        command.extend(
            self.command[1..]
                .iter()
                .map(|a| a.to_string_lossy().into_owned()),
        );
        let mut env = serde_json::Map::new();
        for e in &self.common.env {
            match e.split_once('=') {
                Some((k, v)) => env.insert(k.into(), json!(v)),
                None => env.insert(e.clone(), json!(std::env::var(e).unwrap_or_default())),
            };
        }
        let absolute_all = |paths: &[PathBuf]| {
            paths
                .iter()
                .map(|p| in_cwd(p))
                .collect::<Result<Vec<_>, _>>()
        };
        let (profiles_dir, read_paths) = (
            absolute_all(&self.common.profiles_dir)?,
            absolute_all(&self.common.read)?,
        );
        let allow: Vec<String> = self.common.allow.iter().map(ToString::to_string).collect();
        // Like its tools' output floors: what the publisher signed, nothing more.
        let content_floor = (!body.resources().is_empty() || !body.prompts().is_empty())
            .then(InformationLabel::bottom);
        let mut config = json!({
            "host": {
                "socket": dir.join("flowhost.sock"),
                "socket_mode": "600",
                "state_dir": dir.join("state"),
                "records_dir": records,
                "health_file": health,
                "profiles_dir": profiles_dir,
                "classifier_version": "flowhost-sandbox-mcp",
                "call_timeout_ms": self.call_timeout_ms,
                // The one session is the caller's own: a client that starts slowly (an
                // interpreter loading its SDK) still gets to initialize.
                "initialize_timeout_ms": 600_000,
            },
            "principal": [{
                "id": self.principal,
                "uids": [nix::unistd::getuid().as_raw()],
                "tools": ["*"],
            }],
            "server": [{
                "id": body.server_id(),
                "manifest": manifest,
                "key": key,
                "command": command,
                "profile": self.profile,
                "read_paths": read_paths,
                "env": env,
                "pool_size": 1,
                "destinations": { "allow": allow },
                "tools": tools,
            }],
        });
        if let Some(floor) = content_floor {
            config["server"][0]["content_floor"] = json!(floor);
        }
        toml::to_string(&config).map_err(|e| McpSetupError::Config(e.to_string()))
    }
}

pub(super) async fn serve(args: McpArgs) -> CliResult {
    crate::logging::init_with_default(crate::logging::LogFormat::Text, "warn");
    let evidence = args.common.evidence()?;
    let private = evidence.private()?;
    let records = evidence
        .records
        .clone()
        .unwrap_or_else(|| private.join("records"));
    let health_file = args
        .common
        .health
        .clone()
        .unwrap_or_else(|| private.join("health.json"));
    // The derived configuration lives elsewhere: paths the caller gave relative to where
    // it runs are made absolute first.
    let (records, health_file) = (in_cwd(&records)?, in_cwd(&health_file)?);
    let config_file = private.join("host.toml");
    let text = args.host_config(private, &records, &health_file)?;
    crate::files::write_atomic(&config_file, text.as_bytes(), 0o600)?;
    let (host, listener) = crate::daemon::Host::start(&config_file, None).await?;
    let socket = host.current().config.socket.clone();
    let serving = tokio::spawn(crate::daemon::run(host.clone(), listener));
    let relayed = super::super::connect::bridge(&socket).await;
    host.begin_shutdown();
    if !matches!(serving.await, Ok(crate::daemon::Served::Clean)) {
        return Err(
            "the host's stop did not complete (its records or health may not vouch \
                    for the end of the run): see the log above"
                .into(),
        );
    }
    // The host stopping first (a signal to this process) ends the run as the client
    // closing does: its records and health are concluded either way.
    relayed.map_err(|e| format!("relaying the session: {e}"))?;
    let health = crate::records::ToolObservationHealth::read_from(&health_file)?;
    // The host wrote the health; `conclude` writes it again to --health, which is that same
    // file, with the same content.
    args.common.conclude(&evidence, &health, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Wrapper {
        #[command(flatten)]
        args: McpArgs,
    }

    fn example(rel: &str) -> String {
        format!("{}/examples/harness_tool/{rel}", env!("CARGO_MANIFEST_DIR"))
    }

    fn args(extra: &[&str]) -> McpArgs {
        let manifest = example("manifest.signed.json");
        let key = example("keys/status-probe.pub");
        let mut argv = vec![
            "x",
            "--manifest",
            &manifest,
            "--key",
            &key,
            "--allow",
            "127.0.0.1:8080",
        ];
        argv.extend_from_slice(extra);
        argv.extend_from_slice(&["--", "/bin/true", "serve"]);
        Wrapper::try_parse_from(argv).unwrap().args
    }

    #[test]
    fn the_derived_configuration_is_one_the_daemon_accepts() {
        let dir = tempfile::tempdir().unwrap();
        let mappings = example("mappings.toml");
        let text = args(&["--mappings", &mappings])
            .host_config(
                dir.path(),
                &dir.path().join("records"),
                &dir.path().join("h.json"),
            )
            .unwrap();
        let file = dir.path().join("host.toml");
        let config = crate::config::HostConfig::parse(&file, &text).unwrap();
        assert_eq!(config.principals.len(), 1);
        assert_eq!(config.principals[0].uids, [nix::unistd::getuid().as_raw()]);
        assert!(config.principals[0].may_call("status-probe", "check"));
        let server = &config.servers[0];
        assert_eq!(server.id, "status-probe");
        assert_eq!(server.command, ["/bin/true", "serve"]);
        assert_eq!(server.profile, "brokered");
        assert_eq!(server.destinations.allow.len(), 1);
        assert_eq!(server.record_mappings.len(), 2);
        // The policy is what the signed declaration asks for, so the registry admits it.
        let (registry, _) = crate::daemon::verify_registry(&config).unwrap();
        assert_eq!(registry.tools().count(), 2);
    }

    #[test]
    fn a_server_with_signed_resources_and_prompts_gets_a_content_floor() {
        let dir = tempfile::tempdir().unwrap();
        let fixture =
            |rel: &str| format!("{}/fixtures/conformance/{rel}", env!("CARGO_MANIFEST_DIR"));
        let (manifest, key) = (
            fixture("conformance.signed.json"),
            fixture("keys/conformance.pub"),
        );
        let args = Wrapper::try_parse_from([
            "x",
            "--manifest",
            &manifest,
            "--key",
            &key,
            "--",
            "/bin/true",
        ])
        .unwrap()
        .args;
        let text = args
            .host_config(
                dir.path(),
                &dir.path().join("records"),
                &dir.path().join("h.json"),
            )
            .unwrap();
        let config =
            crate::config::HostConfig::parse(&dir.path().join("host.toml"), &text).unwrap();
        assert_eq!(
            config.servers[0].content_floor,
            Some(InformationLabel::bottom())
        );
        let (registry, _) = crate::daemon::verify_registry(&config).unwrap();
        assert!(registry.resource_route("test://static-text").is_some());
        // Without resources or prompts, none is set.
        let text = self::args(&[])
            .host_config(
                dir.path(),
                &dir.path().join("records"),
                &dir.path().join("h.json"),
            )
            .unwrap();
        assert!(!text.contains("content_floor"), "{text}");
    }

    #[test]
    fn mappings_for_tools_the_manifest_does_not_have_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("mappings.toml");
        std::fs::write(
            &bad,
            "[fetch]\nprovider = \"p\"\ncategory = \"c\"\nverb = \"v\"\nresource_type = \"r\"\nrequired_scope = \"s\"\n",
        )
        .unwrap();
        let e = args(&["--mappings", bad.to_str().unwrap()])
            .host_config(dir.path(), &dir.path().join("r"), &dir.path().join("h"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("mappings.toml") && e.contains("[fetch]") && e.contains("check"),
            "{e}"
        );
    }
}
