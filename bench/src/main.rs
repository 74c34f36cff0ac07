//! `flowhost-bench`: run with `cargo run --release -p flowhost-bench -- all` (or one suite by
//! name). Prints one Markdown table of medians and ratios; see BENCHMARKS.md for the method.

mod broker;
mod broker_parts;
mod broker_peer;
mod daemon;
#[allow(dead_code)] // percentile serves the suites added with the daemon.
mod harness;
mod http;
mod lattice;
mod manifest;
mod records;
mod scale;
mod support;

use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Suite {
    All,
    Lattice,
    Manifest,
    Broker,
    /// Internal: only the broker suite's connect and sendto loops and their parts.
    #[value(hide = true)]
    BrokerLoops,
    /// Internal: a timed connect loop run inside the sandbox.
    #[value(hide = true)]
    LoopConnect,
    /// Internal: a timed sendto loop run inside the sandbox.
    #[value(hide = true)]
    LoopSendto,
    /// Internal: a timed unix connect loop run inside the sandbox.
    #[value(hide = true)]
    LoopUnixConnect,
    /// Internal: a timed unix datagram sendto loop run inside the sandbox.
    #[value(hide = true)]
    LoopUnixSendto,
    /// Internal: open and hold sessions on a socket (run as another principal's uid).
    #[value(hide = true)]
    HoldSessions,
    /// Internal: a daemon as its own process, driven by serial then pipelined calls for
    /// `rest[0]` seconds each, its pid printed first (for `perf record -p` / `perf stat -p`).
    #[value(hide = true)]
    Drive,
    Records,
    Daemon,
    /// Sessions and executors from 1 to 256 / 64, with daemon memory.
    Scale,
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
    /// Arguments of the internal loop modes.
    #[arg(hide = true)]
    rest: Vec<String>,
}

fn main() {
    let args = Args::parse();
    if args.suite == Suite::HoldSessions {
        scale::hold_sessions(&args.rest);
        return;
    }
    if args.suite == Suite::Drive {
        scale::drive(&args.rest);
        return;
    }
    if let Suite::LoopConnect | Suite::LoopSendto | Suite::LoopUnixConnect | Suite::LoopUnixSendto =
        args.suite
    {
        let kind = match args.suite {
            Suite::LoopConnect => "connect",
            Suite::LoopSendto => "sendto",
            Suite::LoopUnixConnect => "unix-connect",
            _ => "unix-sendto",
        };
        let n = args
            .rest
            .get(1)
            .and_then(|n| n.parse().ok())
            .unwrap_or(1000);
        broker::child_loop(kind, args.rest.first().map(String::as_str).unwrap_or(""), n);
        return;
    }
    let mut rows = Vec::new();
    let want = |s: Suite| args.suite == Suite::All || args.suite == s;
    if want(Suite::Lattice) {
        rows.extend(lattice::run(args.quick));
    }
    if want(Suite::Manifest) {
        rows.extend(manifest::run(args.quick));
    }
    if want(Suite::Broker) {
        rows.extend(broker::run(args.quick));
    }
    if args.suite == Suite::BrokerLoops {
        rows.extend(broker::run_loops(args.quick));
    }
    if want(Suite::Records) {
        rows.extend(records::run(args.quick));
    }
    if want(Suite::Daemon) {
        rows.extend(daemon::run(args.quick));
    }
    if want(Suite::Scale) {
        rows.extend(scale::run(args.quick));
    }
    harness::print_table(&rows);
}
