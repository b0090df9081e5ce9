//! Live replay client, metrics, reports and policy comparison.
//!
//! `gorgo bench` replays a trace against a running cluster and measures every request
//! at the client (TTFT at the first content chunk, E2E, ITL, serving region, hops);
//! `gorgo compare` and `gorgo demo` run one cluster per policy on the same workload.
//! The pieces are split so each can be tested alone: [`sse`] parses streams without
//! IO, [`client`] measures one request, [`replay`](mod@replay) schedules a workload.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod client;
pub mod cluster;
pub mod compare;
pub mod error;
pub mod lifecycle;
pub mod replay;
pub mod report;
pub mod sse;
pub mod workload;

pub use cluster::{parse_region_urls, ClusterInfo, RegionEndpoint};
pub use compare::{compare, CompareSpec, Comparison, PolicyFailure, PolicyRun};
pub use error::BenchError;
pub use lifecycle::{RunningCluster, UpOptions};
pub use replay::{
    replay, BodyBuilder, LoadMode, ReplayConfig, ReplayItem, ReplayOutput, RequestOutcome,
};

/// Re-exported so the CLI drives progress bars and cancellation with the very types
/// this crate uses.
pub use indicatif;
/// Cancels a replay or a comparison (the CLI fires it on Ctrl-C).
pub use tokio_util::sync::CancellationToken;
