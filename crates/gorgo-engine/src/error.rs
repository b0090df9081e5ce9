//! The one error type of `gorgo-engine`.

/// Everything that can go wrong in this crate: bad configuration or a failed listener.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A profile name that is not one of the built-in profiles.
    #[error("unknown engine profile `{name}` (built-in: {known})")]
    UnknownProfile {
        /// The name asked for.
        name: String,
        /// The built-in names, comma-separated.
        known: String,
    },
    /// An emulated engine kind other than `sglang` or `vllm`.
    #[error("unknown engine kind `{name}` (expected sglang or vllm)")]
    UnknownKind {
        /// The name asked for.
        name: String,
    },
    /// A profile file that does not parse; the message names the field.
    #[error("invalid engine profile {source_name}: {message}")]
    InvalidProfile {
        /// Where the profile came from (file path or built-in name).
        source_name: String,
        /// What is wrong, naming the field.
        message: String,
    },
    /// A profile file that cannot be read.
    #[error("cannot read engine profile {path}: {source}")]
    ReadProfile {
        /// The path given.
        path: String,
        /// The IO error.
        source: std::io::Error,
    },
    /// The emulator server failed (listener or connection IO).
    #[error("emulator server: {0}")]
    Serve(#[from] std::io::Error),
}
