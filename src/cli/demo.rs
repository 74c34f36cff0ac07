//! `flowhost demo`: the main job on an embedded default (see [`crate::demo`]).

use std::path::PathBuf;
use std::process::ExitCode;

use super::CliResult;

/// Run the pricing lab end to end.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Where to put keys, signed manifests, state and records (replaced if it holds an
    /// earlier demo).
    #[arg(long, default_value = ".research")]
    dir: PathBuf,
}

impl DemoArgs {
    /// Runs the demo; exit 0 only when every outcome was the expected one.
    pub fn run(self) -> CliResult {
        // The demo prints its own story; the host's routine log lines would bury it.
        crate::logging::init_with_default(crate::logging::LogFormat::Text, "warn");
        Ok(if crate::demo::run(&self.dir)? {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        })
    }
}

/// The example executors embedded in this program (the demo runs them; so can a host).
#[derive(Debug, clap::Args)]
pub struct ExampleToolArgs {
    /// `workspace` or `publisher`.
    tool: String,
    /// The tool's own arguments (see `flowhost-example-tools`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

impl ExampleToolArgs {
    /// Serves MCP on stdio until stdin closes.
    pub fn run(self) -> CliResult {
        match self.tool.as_str() {
            "workspace" => flowhost_example_tools::workspace_main(),
            "publisher" => flowhost_example_tools::publisher_main(),
            other => {
                return Err(
                    format!("no example tool named {other:?} (workspace, publisher)").into(),
                );
            }
        }
        Ok(ExitCode::SUCCESS)
    }
}
