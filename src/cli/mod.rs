//! The `flowhost` command line: one module per subcommand family.
//!
//! Each subcommand returns an [`ExitCode`] or an error; `main` prints errors with their
//! source chain and exits non-zero. Subcommands with documented exit codes (for example
//! `manifest verify`, `diff`) return them as `Ok(code)`.

#[macro_use]
mod output;

mod connect;
mod demo;
mod diff;
mod grant;
mod health;
pub mod key;
pub mod manifest;
mod profile;
mod records;
mod reload;
mod sandbox;
mod serve;
mod state;

use std::process::ExitCode;

use clap::{FromArgMatches, Parser, Subcommand};

/// Boxed error for the CLI boundary: every module error is a typed `thiserror` enum; the
/// CLI only prints them.
pub type CliResult<T = ExitCode> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// flowhost: a Linux process host for governed tools.
#[derive(Debug, Parser)]
#[command(name = "flowhost", version, about, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Print the label of a JSON label file in canonical form (a quick well-formedness check).
    Label(LabelArgs),
    /// Check execution profiles.
    Profile(profile::ProfileArgs),
    /// Run any command under the broker.
    Sandbox(sandbox::SandboxArgs),
    /// Run the host daemon.
    Serve(serve::ServeArgs),
    /// Reload a running daemon and wait for its verdict (systemd's ExecReload). Exit 0
    /// reloaded, 1 refused, 2 no verdict.
    Reload(reload::ReloadArgs),
    /// Bridge stdio to the daemon's socket (for MCP clients that launch stdio servers).
    Connect(connect::ConnectArgs),
    /// Run the pricing lab end to end: keys, signed manifests, the host with the real broker
    /// and executors, the workflow, records, health and the diff.
    Demo(demo::DemoArgs),
    /// Serve one of the embedded example tools on stdio (used by the demo's executors).
    #[command(hide = true)]
    ExampleTool(demo::ExampleToolArgs),
    /// Generate manifest signing keys.
    #[command(subcommand)]
    Key(key::KeyCommand),
    /// Sign, verify, digest and convert tool manifests.
    #[command(subcommand)]
    Manifest(manifest::ManifestCommand),
    /// Declassification grants.
    #[command(subcommand)]
    Grant(grant::GrantCommand),
    /// Export or verify observed decision records.
    #[command(subcommand)]
    Records(records::RecordsCommand),
    /// The flow state and the decision records (rebuild the state from the records).
    #[command(subcommand)]
    State(state::StateCommand),
    /// Compute the record side of tool_observation_health from a record directory (offline;
    /// daemon-only fields stay unknown, so it is never complete).
    Health(health::HealthArgs),
    /// Compare observed decisions with a declared tool surface. Exit codes by precedence:
    /// 2 usage or input error, or the report not written; 4 evidence rejected (observed
    /// flowhost records do not verify);
    /// 1 findings; 3 no findings but observation incomplete or not bound to the records;
    /// 0 clean.
    Diff(diff::DiffArgs),
}

/// The parser of `flowhost sandbox` alone (see [`Cli::from_args`]): the same name, version,
/// texts and arguments as [`Cli`]'s `sandbox` (a test holds them equal).
/// flowhost: a Linux process host for governed tools.
#[derive(Debug, Parser)]
#[command(name = "flowhost", version, about, propagate_version = true)]
struct SandboxCli {
    #[command(subcommand)]
    command: SandboxOnly,
}

#[derive(Debug, Subcommand)]
enum SandboxOnly {
    /// Run any command under the broker.
    Sandbox(sandbox::SandboxArgs),
}

#[derive(Debug, clap::Args)]
struct LabelArgs {
    /// A file holding one information label as JSON.
    file: std::path::PathBuf,
}

impl Cli {
    /// Parses the process's command line as [`Parser::parse`] does (help, version and
    /// usage errors print and exit). For `flowhost sandbox ...` only that subcommand's
    /// parser is built: a sandbox run is a whole process the user waits for, and building
    /// the parsers of every subcommand was a visible part of its start-up.
    pub fn from_args() -> Cli {
        if std::env::args_os().nth(1).is_none_or(|a| a != "sandbox") {
            return Cli::parse();
        }
        let matches = <SandboxCli as clap::CommandFactory>::command().get_matches();
        let parsed = SandboxCli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
        let SandboxOnly::Sandbox(args) = parsed.command;
        Cli {
            command: Command::Sandbox(args),
        }
    }

    /// Runs the selected subcommand.
    pub fn run(self) -> CliResult {
        match self.command {
            Command::Label(args) => {
                let text = std::fs::read_to_string(&args.file)
                    .map_err(|e| format!("{}: {e}", args.file.display()))?;
                let label = crate::InformationLabel::from_json(&text)
                    .map_err(|e| format!("{}: {e}", args.file.display()))?;
                outln!("{}", label.to_canonical_json())?;
                Ok(ExitCode::SUCCESS)
            }
            Command::Profile(args) => args.run(),
            Command::Sandbox(args) => args.run(),
            Command::Serve(args) => args.run(),
            Command::Reload(args) => args.run(),
            Command::Connect(args) => args.run(),
            Command::Demo(args) => args.run(),
            Command::ExampleTool(args) => args.run(),
            Command::Key(command) => command.run(),
            Command::Manifest(command) => command.run(),
            Command::Grant(command) => command.run(),
            Command::Records(cmd) => records::run(cmd),
            Command::State(command) => command.run(),
            Command::Health(args) => health::run(args),
            Command::Diff(args) => diff::run(args),
        }
    }
}

/// Prints `error` and every error in its source chain to stderr, one per line, each line
/// with its control characters escaped: an error can quote what a hostile file held (a
/// decoder naming an unknown field or variant), and must not drive the terminal.
/// Under systemd every line (messages may span several, e.g. a TOML parse error) carries
/// the journal's error priority.
/// A stderr nobody can read (closed, a terminal that hung up) loses the text, never the exit
/// status: `eprintln!` would panic there, and the process would exit 101 instead.
pub fn report(error: &(dyn std::error::Error + 'static)) {
    use std::io::Write;
    let p = crate::logging::fatal_line_prefix();
    let print = |head: &str, text: String| {
        let mut stderr = std::io::stderr().lock();
        for (i, line) in text.lines().enumerate() {
            let _ = writeln!(
                stderr,
                "{p}{}{}",
                if i == 0 { head } else { "  " },
                flowhost_broker::Escaped(line)
            );
        }
    };
    print("flowhost: error: ", error.to_string());
    let mut source = error.source();
    while let Some(cause) = source {
        print("  caused by: ", cause.to_string());
        source = cause.source();
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn the_command_line_definition_is_consistent() {
        super::Cli::command().debug_assert();
        super::SandboxCli::command().debug_assert();
    }

    /// What a command line prints (help, version, usage error) or parses to.
    fn outcome(command: clap::Command, line: &[&str]) -> String {
        match command.try_get_matches_from(line) {
            Ok(m) => format!("{:?}", m.subcommand_matches("sandbox")),
            Err(e) => format!("{:?}: {}", e.kind(), e.render()),
        }
    }

    #[test]
    fn the_sandbox_parser_alone_is_the_full_parsers_sandbox() {
        let lines: &[&[&str]] = &[
            &["flowhost", "sandbox"],
            &["flowhost", "sandbox", "--help"],
            &["flowhost", "sandbox", "-h"],
            &["flowhost", "sandbox", "--version"],
            &["flowhost", "sandbox", "run", "--help"],
            &["flowhost", "sandbox", "run", "-h"],
            &["flowhost", "sandbox", "mcp", "--help"],
            &["flowhost", "sandbox", "help", "run"],
            &["flowhost", "sandbox", "run", "--profile", "isolated"],
            &["flowhost", "sandbox", "run", "--bogus", "--", "/bin/true"],
            &["flowhost", "sandbox", "rn"],
            &[
                "flowhost",
                "sandbox",
                "run",
                "--quiet",
                "--profile",
                "isolated",
                "--allow",
                "127.0.0.1:80",
                "--env",
                "A=b",
                "--timeout",
                "5",
                "--",
                "/bin/true",
                "-x",
            ],
        ];
        for line in lines {
            let full = outcome(super::Cli::command(), line);
            let alone = outcome(super::SandboxCli::command(), line);
            assert_eq!(full, alone, "{line:?}");
        }
    }
}
