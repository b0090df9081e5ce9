//! `gorgo`: the one binary. Each subcommand lives in `src/cmd/<name>.rs` and is a
//! thin driver over the library crates.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

mod cmd;

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

fn main() -> anyhow::Result<()> {
    // One crypto provider for the whole process: rustls with ring.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
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
