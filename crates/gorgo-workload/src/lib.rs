//! Trace formats, the session-based workload generator and prompt synthesis from block ids.
//!
//! Everything here is IO-free logic over `std::io::Read`/`Write` handed in by the
//! caller (plus [`open_trace`], a thin convenience over a file path), so the live
//! replay client, the simulator and tests all read traces the same way.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod convention;
mod error;
pub mod generate;
pub mod prompt;
pub mod read;
pub mod record;
pub mod stats;
pub mod ties;
pub mod window;
pub mod write;

pub use convention::{
    clamp_to_context, context_prompt_limit, home_region, session_id, session_key,
    CHAT_TEMPLATE_TOKENS, DEFAULT_MODEL, MIN_CONTEXT_TOKENS,
};
pub use error::WorkloadError;
pub use generate::{generate, GeneratorConfig};
pub use prompt::{block_text, chat_body, synthesize_prompt};
pub use read::{detect_format, open_trace, TraceFormat, TraceReader};
pub use record::{BlockIds, TraceRequest};
pub use stats::{LengthSummary, StatsAccumulator, TraceStats};
pub use ties::spread_ties;
pub use window::{select_requests, slice_window};
pub use write::{write_jsonl, JsonlWriter};

/// Convenience alias for this crate's results.
pub type Result<T, E = WorkloadError> = std::result::Result<T, E>;
