//! `flowhost-bench`: run with `cargo run --release -p flowhost-bench -- all` (or one suite by
//! name). Prints one Markdown table of medians and ratios; see BENCHMARKS.md for the method.

#[allow(dead_code)] // percentile and interleaved serve the suites added with the broker and daemon.
mod harness;
mod lattice;
mod records;

use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Suite {
    All,
    Lattice,
    Records,
}

/// flowhost's benchmark suite.
#[derive(Debug, Parser)]
struct Args {
    /// Which suite to run.
    #[arg(value_enum, default_value = "all")]
    suite: Suite,
    /// Scale sample counts down (for a quick smoke run).
    #[arg(long)]
    quick: bool,
}

fn main() {
    let args = Args::parse();
    let mut rows = Vec::new();
    let want = |s: Suite| args.suite == Suite::All || args.suite == s;
    if want(Suite::Lattice) {
        rows.extend(lattice::run(args.quick));
    }
    if want(Suite::Records) {
        rows.extend(records::run(args.quick));
    }
    harness::print_table(&rows);
}
