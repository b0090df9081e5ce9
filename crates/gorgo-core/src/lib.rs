//! Sans-IO routing core of GORGO.
//!
//! Everything here is a plain state machine: inputs and the current time (`now_ms`,
//! milliseconds on whatever clock the driver uses) go in, outputs come out. No IO, no
//! tokio, no wall clock. The live node, the simulator and the deterministic tests all
//! run this very code.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod error;
pub mod types;

pub use error::CoreError;
pub use types::{NodeId, QueueStats, Weights};
pub mod hash;
pub use hash::HashChain;
pub mod index;
pub mod prompt;
pub mod sketch;
pub mod summary;
pub mod wire;
pub use index::ShadowIndex;
pub use prompt::{BytesPerToken, Endpoint, PromptHasher, TokenCounter};
pub use sketch::{percentile, summarize, LatencySketch, LatencyStats};
pub use summary::{LocalSummary, PeerSummary, SummaryDelta, SummarySnapshot};
pub mod cost;
pub mod fit;
pub mod decision;
pub mod policy;
pub mod es;
pub mod tuning;
