//! The one error type of `gorgo-core`.

/// Everything that can go wrong in the core: bad input, never a bug.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum CoreError {
    /// A request body that is not a valid OpenAI request.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// Bytes from the network that do not decode.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// Bytes from the network over the allowed size.
    #[error("message too large: {size} bytes (limit {limit})")]
    TooLarge { size: usize, limit: usize },
    /// A summary delta that does not follow the version we hold.
    #[error("summary version gap: have {have}, delta starts at {from}")]
    SummaryGap { have: u64, from: u64 },
    /// A configuration value out of its valid range.
    #[error("invalid config `{field}`: {reason}")]
    InvalidConfig { field: String, reason: String },
}
