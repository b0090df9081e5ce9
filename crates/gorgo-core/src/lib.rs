//! Sans-IO routing core of GORGO.
//!
//! Everything here is a plain state machine: inputs and the current time (`now_ms`,
//! milliseconds on whatever clock the driver uses) go in, outputs come out. No IO, no
//! tokio, no wall clock. The live node, the simulator and the deterministic tests all
//! run this very code.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod accounting;
pub mod calendar;
pub mod candidates;
pub mod cost;
pub mod decision;
pub mod engine_metrics;
pub mod error;
pub mod es;
pub mod fit;
pub mod gossip;
pub mod hash;
pub mod headers;
pub mod health;
pub mod hold;
pub mod index;
pub mod kv_events;
pub mod kv_wire;
pub mod policy;
pub mod prompt;
pub mod sketch;
pub mod summary;
pub mod token_ratio;
pub mod tuning;
pub mod types;
pub mod wire;
pub mod zmtp;

pub use accounting::{EngineView, ViewConfig};
pub use engine_metrics::{EngineKind, EngineMetrics};
pub use error::CoreError;
pub use hash::HashChain;
pub use index::ShadowIndex;
pub use kv_events::{IndexSource, KvEventFollower, KvFollowerConfig, NodeBlockChange};
pub use prompt::{BytesPerToken, Endpoint, PromptHasher, PromptShape, TokenCounter};
pub use sketch::{percentile, spearman, summarize, LatencySketch, LatencyStats};
pub use summary::{
    LocalSummary, PeerSummary, SampleChooser, SampleSetting, SummaryDelta, SummarySample,
    SummarySnapshot,
};
pub use token_ratio::TokenRatio;
pub use types::{EngineSlots, NodeId, QueueStats, Weights};
