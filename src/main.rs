//! The `flowhost` command line (see `flowhost --help`).

#![deny(clippy::unwrap_used, clippy::expect_used)]

use std::process::ExitCode;

use flowhost::cli::{Cli, report};

fn main() -> ExitCode {
    match Cli::from_args().run() {
        Ok(code) => code,
        Err(error) => {
            report(error.as_ref());
            ExitCode::from(2)
        }
    }
}
