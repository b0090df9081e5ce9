//! Discrete-event simulator on virtual time: engines, network, gossip staleness,
//! policies and tuning.
//!
//! The simulator runs the very code the live system runs: per region one
//! [`gorgo_engine::Engine`] (the emulator's model), one routing node deciding with
//! [`gorgo_core::decision::decide`] over candidates built by the live node's own code
//! ([`gorgo_core::candidates::build_candidates`]: its [`gorgo_core::EngineView`] of its
//! engine, fed by its dispatches and by `/metrics` scrapes, or with
//! `SimConfig::exact_state` the engine's exact state; peers' [`gorgo_core::PeerSummary`]
//! and [`gorgo_core::QueueStats`] as of the last gossip round plus transit; its own
//! [`gorgo_core::cost::ForwardLedger`]), and, with tuning, one
//! [`gorgo_core::tuning::Tuner`] per node exchanging proposals and reports over the
//! simulated network. The `oracle` policy replaces the nodes with one router that sees
//! every engine's state at once, to measure what distribution costs.
//!
//! Everything is sans-IO: the trace comes in as an iterator and results come out as
//! values; [`report`] turns them into the one report format of `gorgo-report`.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

mod collect;
pub mod floor;
mod network;
pub mod report;
mod sim;

pub use collect::{DecisionLine, PolicyRun, Row, SimCounters, Sketches, TuningLine};
pub use network::{Network, RegionNet};
pub use sim::{
    check_time_scale, simulate, Progress, SimConfig, MAX_INTERVAL_MS, MAX_TIME_SCALE,
    MAX_VIRTUAL_MS,
};

/// The one error type of `gorgo-sim`.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A configuration value is out of range; `field` names it.
    #[error("invalid {field}: {reason}")]
    InvalidConfig {
        /// The offending field.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The trace could not be read (the message names the line).
    #[error("trace: {0}")]
    Trace(#[from] gorgo_workload::WorkloadError),
    /// The tuning state machine refused its configuration.
    #[error("core: {0}")]
    Core(#[from] gorgo_core::CoreError),
    /// Writing the report failed.
    #[error("report: {0}")]
    Report(#[from] gorgo_report::ReportError),
    /// A run's virtual time went past what f64 milliseconds resolve
    /// ([`MAX_VIRTUAL_MS`]), or stopped advancing; the message says which value
    /// took it there.
    #[error("virtual time {0}")]
    VirtualTime(String),
}

/// Convenience alias for this crate's results.
pub type Result<T, E = SimError> = std::result::Result<T, E>;

pub(crate) fn invalid(field: &str, reason: impl Into<String>) -> SimError {
    SimError::InvalidConfig {
        field: field.to_owned(),
        reason: reason.into(),
    }
}
