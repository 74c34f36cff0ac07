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

use super::super::connect::Ending;
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
    /// Text the run must pass on is not UTF-8: the derived configuration is TOML, which
    /// holds only UTF-8, and text changed to fit (U+FFFD for what is not) would run another
    /// command, or read another file, than the one given.
    #[error("{what} {shown:?} is not UTF-8, which the server's configuration needs")]
    NotUtf8 {
        /// What it is: an argument, a flag's path, a variable's value.
        what: String,
        /// It, with what is not UTF-8 shown as U+FFFD.
        shown: String,
    },
}

/// `text` as UTF-8, or [`McpSetupError::NotUtf8`] saying `what` it is.
fn utf8<'a>(what: &str, text: &'a std::ffi::OsStr) -> Result<&'a str, McpSetupError> {
    text.to_str().ok_or_else(|| McpSetupError::NotUtf8 {
        what: what.to_string(),
        shown: text.to_string_lossy().into_owned(),
    })
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
    /// The server's environment from `--env`: `NAME=VALUE` as given, `NAME` with its value
    /// here (`var` reads it), left out when it is not set here, as `sandbox run` leaves it
    /// (a server tells an empty value from none). A value that is not UTF-8 is refused.
    fn server_env(
        &self,
        var: impl Fn(&str) -> Option<OsString>,
    ) -> Result<serde_json::Map<String, serde_json::Value>, McpSetupError> {
        let mut env = serde_json::Map::new();
        for e in &self.common.env {
            match e.split_once('=') {
                Some((k, v)) => {
                    env.insert(k.into(), json!(v));
                }
                None => {
                    if let Some(value) = var(e) {
                        let what = format!("the value of --env {e}");
                        env.insert(e.clone(), json!(utf8(&what, &value)?));
                    }
                }
            }
        }
        Ok(env)
    }

    /// The server's command: its program found as `sandbox run` finds it, then its
    /// arguments, each as given (one that is not UTF-8 is refused).
    fn server_command(&self) -> Result<Vec<String>, McpSetupError> {
        let program =
            resolve_program(&self.command[0]).map_err(|e| McpSetupError::Config(e.to_string()))?;
        let mut command = vec![utf8("the command", program.as_os_str())?.to_string()];
        for (i, a) in self.command.iter().enumerate().skip(1) {
            command.push(utf8(&format!("argument {i} of the command"), a)?.to_string());
        }
        Ok(command)
    }

    /// The host configuration for this one server, as TOML. Every path in it must be UTF-8
    /// (see [`McpSetupError::NotUtf8`]).
    #[cfg(test)]
    fn host_config(
        &self,
        dir: &Path,
        records: &Path,
        health: &Path,
    ) -> Result<String, McpSetupError> {
        self.derived_config(dir, records, health)
            .map(|(text, _)| text)
    }

    /// The host configuration for this one server, as TOML, derived from the manifest as
    /// verified with `--key`, and that manifest's digest: the host reads the file again,
    /// and what it admits must be what the configuration was derived from.
    fn derived_config(
        &self,
        dir: &Path,
        records: &Path,
        health: &Path,
    ) -> Result<(String, crate::manifest::ManifestDigest), McpSetupError> {
        let manifest = absolute(&self.manifest)?;
        let shown = |what: &str, p: &Path| utf8(what, p.as_os_str()).map(str::to_string);
        let envelope = crate::manifest::load_envelope_file(&manifest)
            .map_err(|e| McpSetupError::Config(e.to_string()))?;
        // The clearances and purposes below come from this body: one that does not verify
        // (an unsigned body the file held a moment before a signed one) must not give them.
        let verifying = crate::keys::verifying_key_from_arg(&self.key)
            // The error names a key file's path itself; the argument is not echoed, since
            // it may be a private key's text.
            .map_err(|e| McpSetupError::Config(format!("--key: {e}")))?;
        envelope.verify(&verifying).map_err(|e| {
            McpSetupError::Config(format!("{}: not admitted: {e}", manifest.display()))
        })?;
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
        // The key is read here, once, by the daemon's rule (hex first, else a file read
        // from where the caller pointed), and the configuration names it by its hex: a file
        // named like the hex the caller gave (one a checked-out tree adds) is never read.
        let key = hex::encode(verifying.to_bytes());
        let command = self.server_command()?;
        let env = self.server_env(|name| std::env::var_os(name))?;
        let absolute_all = |flag: &str, paths: &[PathBuf]| {
            paths
                .iter()
                .map(|p| shown(flag, &in_cwd(p)?))
                .collect::<Result<Vec<_>, _>>()
        };
        let (profiles_dir, read_paths) = (
            absolute_all(
                "--profiles-dir",
                &self.common.profile_dirs().map_err(McpSetupError::Config)?,
            )?,
            absolute_all("--read", &self.common.read)?,
        );
        let manifest = shown("--manifest", &manifest)?;
        let private = |name: &str| shown("the run's private directory", &dir.join(name));
        let (records, health) = (
            shown("the records directory (--records)", records)?,
            shown("the health file (--health)", health)?,
        );
        let allow: Vec<String> = self.common.allow.iter().map(ToString::to_string).collect();
        // Like its tools' output floors: what the publisher signed, nothing more.
        let content_floor = (!body.resources().is_empty() || !body.prompts().is_empty())
            .then(InformationLabel::bottom);
        let mut config = json!({
            "host": {
                "socket": private("flowhost.sock")?,
                "socket_mode": "600",
                "state_dir": private("state")?,
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
        let text = toml::to_string(&config).map_err(|e| McpSetupError::Config(e.to_string()))?;
        Ok((text, envelope.digest()))
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
    let (text, derived_from) = args.derived_config(private, &records, &health_file)?;
    crate::files::write_atomic(&config_file, text.as_bytes(), 0o600)?;
    let (host, listener) = crate::daemon::Host::start(&config_file, None).await?;
    if let Err(e) = super::records_of_this_run_alone(&records, &host.records.status()) {
        host.begin_shutdown();
        let _ = host
            .finish_refused("nothing was served: the records directory held another run's records")
            .await;
        return Err(e.into());
    }
    // The host read the manifest file again: one replaced in between is not the one the
    // policy was derived from, and is not served under it.
    let admitted: Vec<_> = host
        .current()
        .registry
        .envelopes()
        .map(crate::manifest::SignedManifest::digest)
        .collect();
    // Nor read again later: a SIGHUP would reload the manifest under this policy.
    host.serve_what_it_started_with();
    if admitted != [derived_from] {
        // Stopped as a run stops, so that its records are closed and its health written.
        host.begin_shutdown();
        let _ = host
            .finish_refused(
                "nothing was served: the manifest changed while the run started, and the host \
                 read another than the one its policy was derived from",
            )
            .await;
        return Err(format!(
            "{}: the manifest changed while the run started (its policy was derived from \
             {derived_from}; the host read another): nothing was served",
            args.manifest.display()
        )
        .into());
    }
    let socket = host.current().config.socket.clone();
    let serving = tokio::spawn(crate::daemon::run(host.clone(), listener));
    let relayed = super::super::connect::bridge(&socket).await;
    // Whether the host was stopping (on a signal to this process) when the session ended,
    // read before this run asks it to stop.
    let stopping = host.stopping();
    host.begin_shutdown();
    let served = serving.await;
    // A signal that stopped the host while the client still had stdin open cut the run
    // short: what the client would have asked after was never served or observed. So did a
    // host that ended the session otherwise, and a relay that failed.
    let mut cut = Vec::new();
    if stopping && !matches!(relayed, Ok(Ending::ClientDone)) {
        cut.push(
            "a signal to flowhost sandbox mcp stopped the host before its client closed stdin"
                .to_string(),
        );
    }
    let ended = relayed
        .map_err(|e| format!("relaying the session: {e}"))
        .and_then(|ending| session_ended(ending, stopping));
    if let Err(why) = &ended {
        cut.push(format!(
            "{why}; what the client sent or was owed after it is not observed"
        ));
    }
    // What was cut short goes into the health file before anything else can fail the run:
    // the health of a run that fails below must not read as complete without it.
    let health = with_calls_cut_short(&health_file, &records, cut);
    if !matches!(served, Ok(crate::daemon::Served::Clean)) {
        return Err(
            "the host's stop did not complete (its records or health may not vouch \
                    for the end of the run): see the log above"
                .into(),
        );
    }
    // The host stopping first (a signal to this process) ends the run as the client
    // closing does: its records and health are concluded either way. A host that ended the
    // session for any other reason fails the run.
    ended?;
    // `conclude` writes the health again to --health, which is that same file.
    // The host's records are its own: a stop they did not let complete failed above.
    args.common.conclude(&evidence, &health?, 0, false)
}

/// The host's health in `health_file` with the calls of `records` a bound, their deadline
/// or the client cut short added, and `cut`, how the session itself was cut short (a
/// signal, the host ending it, a relay that failed), written back to the file. A call a bound or its deadline
/// ended is the run cut short (the daemon's health does not say so: there a call that runs
/// into its bound is service, not a test of the tool). Records that cannot be read cannot
/// tell: the run is then taken as cut short.
fn with_calls_cut_short(
    health_file: &Path,
    records: &Path,
    cut: Vec<String>,
) -> Result<crate::records::ToolObservationHealth, crate::records::health::HealthError> {
    let mut health = crate::records::ToolObservationHealth::read_from(health_file)?;
    health.cut_short.extend(cut);
    health.cut_short.extend(
        crate::harness::calls_cut_short(records).unwrap_or_else(|e| {
            vec![format!(
                "whether a bound ended a call cannot be told (the records: {e})"
            )]
        }),
    );
    let health = health.finalize();
    health.write_to(health_file)?;
    Ok(health)
}

/// Whether the session ended as a run may end: the client closed stdin, or the host was
/// stopping on a signal to this process. A host that ended the session otherwise, with the
/// client still sending, refused it (or a request): the client's later requests were never
/// answered, and the run must not pass for a finished session.
fn session_ended(ending: Ending, host_stopping: bool) -> Result<(), String> {
    match ending {
        Ending::ClientDone => Ok(()),
        Ending::HostClosed | Ending::Unanswered(_) if host_stopping => Ok(()),
        Ending::Unanswered(ids) => Err(format!(
            "the host ended the session with {} of the client's requests unanswered (id {}): \
             the log above and the records say why",
            ids.len(),
            super::super::connect::listed(&ids)
        )),
        Ending::HostClosed => Err(
            "the host ended the session before the client closed stdin: it refused the \
             session or a request (the log above and the records say which), and what the \
             client sent after that was never answered"
                .into(),
        ),
    }
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

    /// The host ending the session while the client still had stdin open (it refused the
    /// session, or a request) is no finished session: the run fails, saying so. Before, it
    /// exited 0, as if the client had closed stdin. A host stopping on a signal ends the run
    /// as the client's own end does.
    #[test]
    fn a_session_the_host_ended_fails_the_run_unless_it_was_stopping() {
        assert_eq!(session_ended(Ending::ClientDone, false), Ok(()));
        assert_eq!(session_ended(Ending::ClientDone, true), Ok(()));
        assert_eq!(session_ended(Ending::HostClosed, true), Ok(()));
        let e = session_ended(Ending::HostClosed, false).expect_err("a failed run");
        assert!(e.contains("before the client closed stdin"), "{e}");
        let owed = Ending::Unanswered(vec!["1".into(), "\"b\"".into()]);
        assert_eq!(session_ended(owed.clone(), true), Ok(()));
        let e = session_ended(owed, false).expect_err("a failed run");
        assert!(
            e.contains("2 of the client's requests unanswered (id 1, \"b\")"),
            "{e}"
        );
    }

    fn example(rel: &str) -> String {
        format!("{}/examples/harness_tool/{rel}", env!("CARGO_MANIFEST_DIR"))
    }

    fn args(extra: &[&str]) -> McpArgs {
        let extra: Vec<OsString> = extra.iter().map(OsString::from).collect();
        args_running(&extra, &["/bin/true".into(), "serve".into()])
    }

    /// The example's arguments with `extra`, serving `command`.
    fn args_running(extra: &[OsString], command: &[OsString]) -> McpArgs {
        let manifest = example("manifest.signed.json");
        let key = example("keys/status-probe.pub");
        let mut argv: Vec<OsString> = [
            "x",
            "--manifest",
            &manifest,
            "--key",
            &key,
            "--allow",
            "127.0.0.1:8080",
        ]
        .map(OsString::from)
        .to_vec();
        argv.extend_from_slice(extra);
        argv.push("--".into());
        argv.extend_from_slice(command);
        Wrapper::try_parse_from(argv).unwrap().args
    }

    fn config_of(args: &McpArgs) -> Result<String, McpSetupError> {
        let dir = tempfile::tempdir().unwrap();
        args.host_config(dir.path(), &dir.path().join("r"), &dir.path().join("h"))
    }

    /// A `--profiles-dir` given must be there: mistyped, the built-in profile of the same
    /// name would run in place of the operator's. Before, it was skipped. The default one
    /// is searched only when it is there.
    #[test]
    fn a_profiles_dir_given_must_be_there() {
        let e = config_of(&args(&["--profiles-dir", "/nonexistent/flowhost-profiles"]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--profiles-dir /nonexistent/flowhost-profiles: not there"),
            "{e}"
        );
        let there = tempfile::tempdir().unwrap();
        let text = config_of(&args(&["--profiles-dir", there.path().to_str().unwrap()])).unwrap();
        assert!(text.contains(there.path().to_str().unwrap()), "{text}");
    }

    /// The policy (clearances, purposes) is derived only from a manifest that verifies with
    /// `--key`. Before, it was derived from whatever the file held, and the host verified
    /// the file when it read it again: a body swapped in between gave its clearances to the
    /// signed one.
    #[test]
    fn the_policy_is_derived_only_from_a_manifest_that_verifies() {
        let other = hex::encode(
            ed25519_dalek::SigningKey::from_bytes(&[7; 32])
                .verifying_key()
                .to_bytes(),
        );
        let mut a = args(&[]);
        a.key = other.clone();
        let e = config_of(&a).unwrap_err().to_string();
        assert!(
            e.contains("manifest.signed.json") && e.contains(&other) && !e.contains("--key"),
            "{e}"
        );
        let dir = tempfile::tempdir().unwrap();
        let (_, digest) = args(&[])
            .derived_config(dir.path(), &dir.path().join("r"), &dir.path().join("h"))
            .unwrap();
        let envelope =
            crate::manifest::load_envelope_file(Path::new(&example("manifest.signed.json")))
                .unwrap();
        assert_eq!(digest, envelope.digest());
    }

    /// `--key HEX` is that key, whatever file is named like it where the run starts (a tree
    /// under test may add one, holding its own key). Before, such a file was read instead.
    #[test]
    fn a_hex_key_is_never_read_from_a_file_named_like_it() {
        let pinned = std::fs::read_to_string(example("keys/status-probe.pub"))
            .unwrap()
            .trim()
            .to_string();
        assert_eq!(pinned.len(), 64, "{pinned}");
        let other = hex::encode(
            ed25519_dalek::SigningKey::from_bytes(&[3; 32])
                .verifying_key()
                .to_bytes(),
        );
        // Named relative to where the run starts, as `--key HEX` would be read as a path.
        let decoy = std::path::PathBuf::from(&pinned);
        std::fs::write(&decoy, format!("{other}\n")).unwrap();
        let mut with_hex = args(&[]);
        with_hex.key = pinned.clone();
        let text = config_of(&with_hex);
        std::fs::remove_file(&decoy).unwrap();
        let key_of = |text: &str| {
            let config: toml::Value = toml::from_str(text).unwrap();
            config["server"][0]["key"].as_str().unwrap().to_string()
        };
        assert_eq!(key_of(&text.unwrap()), pinned);
        // A file given by its path is read, and named by the key it holds.
        assert_eq!(key_of(&config_of(&args(&[])).unwrap()), pinned);
    }

    /// `--env NAME` passes NAME as it is here, as `sandbox run` does: one that is not set is
    /// left out, not set empty (a server tells an empty value from none).
    #[test]
    fn an_env_name_not_set_here_is_left_out() {
        let args = args(&[
            "--env",
            "FLOWHOST_TEST_NEVER_SET_7C1",
            "--env",
            "GIVEN=x",
            "--env",
            "PRESENT",
        ]);
        let env = args
            .server_env(|name| (name == "PRESENT").then(|| "here".into()))
            .unwrap();
        assert_eq!(
            serde_json::Value::Object(env),
            json!({"GIVEN": "x", "PRESENT": "here"})
        );
        let text = config_of(&args).unwrap();
        assert!(!text.contains("FLOWHOST_TEST_NEVER_SET_7C1"), "{text}");
    }

    /// A value or an argument that is not UTF-8 cannot go into the derived configuration
    /// (TOML): it is refused, naming it, rather than changed into another one.
    #[test]
    fn a_value_or_argument_that_is_not_utf8_is_refused_not_changed() {
        use std::os::unix::ffi::OsStringExt;
        let raw = || OsString::from_vec(b"caf\xe9".to_vec());
        let e = args(&["--env", "LATIN1"])
            .server_env(|_| Some(raw()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("LATIN1") && e.contains("UTF-8"), "{e}");
        let e = config_of(&args_running(&[], &["/bin/true".into(), raw()]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("argument 1") && e.contains("UTF-8"), "{e}");
        let parent = tempfile::tempdir().unwrap();
        let mut dir = parent.path().as_os_str().to_owned();
        dir.push("/");
        dir.push(raw());
        // There, so that only its name is at fault (a --profiles-dir must exist).
        std::fs::create_dir(&dir).unwrap();
        for flag in ["--read", "--profiles-dir"] {
            let e = config_of(&args_running(
                &[flag.into(), dir.clone()],
                &["/bin/true".into()],
            ))
            .unwrap_err()
            .to_string();
            assert!(e.contains(flag) && e.contains("UTF-8"), "{e}");
        }
        let private = tempfile::tempdir().unwrap();
        let e = args(&[])
            .host_config(private.path(), Path::new(&dir), &private.path().join("h"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--records") && e.contains("UTF-8"), "{e}");
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
        assert!(registry.resource_route("test://static-text").is_ok());
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
