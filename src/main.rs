//! `gorgo`: the one binary. Each subcommand lives in `src/cmd/<name>.rs` and is a
//! thin driver over the library crates.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

mod cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// GORGO: peer-to-peer regional routers for LLM inference.
#[derive(Parser, Debug)]
#[command(name = "gorgo", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a router node beside a region's inference engine.
    Node(cmd::node::NodeArgs),
    /// Run the OpenAI-compatible engine emulator.
    Engine(cmd::engine::EngineArgs),
    /// Run user-space WAN relays from a topology file.
    Netem(cmd::netem::NetemArgs),
    /// Start a local multi-region cluster (engines, nodes, WAN relays).
    Up(cmd::up::UpArgs),
    /// Stop a cluster started with `gorgo up --detach`.
    Down(cmd::up::DownArgs),
    /// Restart one node (or engine) of a cluster started with `gorgo up --detach`.
    Restart(cmd::up::RestartArgs),
    /// Replay a trace against a running cluster.
    Bench(cmd::bench::BenchArgs),
    /// Run every policy on the same workload and compare them.
    Compare(cmd::bench::CompareArgs),
    /// Discrete-event simulation of a trace on virtual time.
    Sim(cmd::sim::SimArgs),
    /// Every policy at several offered loads (simulated or live) and goodput at an SLO.
    Sweep(cmd::sweep::SweepArgs),
    /// The best fixed weights of a policy on one workload and load (a simulated grid):
    /// the reference online tuning should approach.
    TuneOffline(cmd::tune_offline::TuneOfflineArgs),
    /// Three regions, a bundled workload, all main policies: one command.
    Demo(cmd::bench::DemoArgs),
    /// Generate a cluster CA and node certificates.
    Certs(cmd::certs::CertsArgs),
    /// Inspect, convert and generate traces.
    Trace(cmd::trace::TraceArgs),
    /// Generate a topology of N regions on a sphere (great-circle delays).
    Topology(cmd::topology::TopologyArgs),
}

fn main() -> ExitCode {
    // One crypto provider for the whole process: rustls with ring.
    let _ = rustls::crypto::ring::default_provider().install_default();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprint!("{}", report(&e));
            if e.backtrace().status() == std::backtrace::BacktraceStatus::Captured {
                eprintln!("\nStack backtrace:\n{}", e.backtrace());
            }
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes as anyhow's `main` would print them, less each cause the
/// line above already ends with: the library errors put their source in their own
/// message (so a log line of one error is complete) and also return it as `source()`,
/// which anyhow would print a second time.
fn report(e: &anyhow::Error) -> String {
    let mut out = format!("Error: {e}\n");
    let mut shown = e.to_string();
    let mut causes = Vec::new();
    for cause in e.chain().skip(1) {
        let text = cause.to_string();
        if !shown.ends_with(&text) {
            causes.push(text.clone());
        }
        shown = text;
    }
    if !causes.is_empty() {
        out.push_str("\nCaused by:\n");
        for c in causes {
            out.push_str(&format!("    {c}\n"));
        }
    }
    out
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Node(a) => cmd::node::run(a),
        Command::Engine(a) => cmd::engine::run(a),
        Command::Netem(a) => cmd::netem::run(a),
        Command::Up(a) => cmd::up::run_up(a),
        Command::Down(a) => cmd::up::run_down(a),
        Command::Restart(a) => cmd::up::run_restart(a),
        Command::Bench(a) => cmd::bench::run_bench(a),
        Command::Compare(a) => cmd::bench::run_compare(a),
        Command::Sim(a) => cmd::sim::run(a),
        Command::Sweep(a) => cmd::sweep::run(a),
        Command::TuneOffline(a) => cmd::tune_offline::run(a),
        Command::Demo(a) => cmd::bench::run_demo(a),
        Command::Certs(a) => cmd::certs::run(a),
        Command::Trace(a) => cmd::trace::run(a),
        Command::Topology(a) => cmd::topology::run(a),
    }
}

#[cfg(test)]
mod tests {
    use super::report;

    /// Shaped like the library errors: the source in the message and in `source()`.
    #[derive(Debug)]
    struct Read(std::io::Error);

    impl std::fmt::Display for Read {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "reading topology t.toml: {}", self.0)
        }
    }

    impl std::error::Error for Read {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_cause_the_message_already_ends_with_is_not_printed_again() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let e = anyhow::Error::new(Read(io)).context("starting relays");
        let r = report(&e);
        assert_eq!(
            r.lines().filter(|l| l.contains("no such file")).count(),
            1,
            "{r}"
        );
        assert!(r.starts_with("Error: starting relays\n"), "{r}");
        assert!(
            r.contains("    reading topology t.toml: no such file"),
            "{r}"
        );
    }

    #[test]
    fn causes_that_add_something_are_all_printed() {
        let e = anyhow::anyhow!("connection refused")
            .context("engine at 127.0.0.1:1")
            .context("loading config");
        let r = report(&e);
        assert_eq!(
            r,
            "Error: loading config\n\nCaused by:\n    engine at 127.0.0.1:1\n    connection refused\n"
        );
    }
}
