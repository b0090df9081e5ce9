//! The one error type of `gorgo-bench`.

use std::path::PathBuf;

/// What can stop a benchmark run as a whole (single request failures are recorded in
/// their outcome instead, never raised).
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A `--cluster` argument that is neither a run dir, a cluster.json nor a URL list.
    #[error("invalid cluster spec: {0}")]
    ClusterSpec(String),
    /// A file that could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A cluster.json that does not parse.
    #[error("{path}: {source}")]
    Json {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },
    /// A trace that could not be read.
    #[error("trace {path}: {reason}")]
    Trace {
        /// The trace file.
        path: PathBuf,
        /// What is wrong with it (line number included).
        reason: String,
    },
    /// A trace request whose home region has no URL in the cluster.
    #[error("no URL for region `{0}` in the cluster")]
    UnknownRegion(String),
    /// The HTTP client could not be built.
    #[error("http client: {0}")]
    Client(String),
    /// A replay configuration value out of range.
    #[error("invalid config `{field}`: {reason}")]
    InvalidConfig {
        /// The offending field.
        field: &'static str,
        /// Why it is invalid.
        reason: String,
    },
    /// Writing the report failed.
    #[error("report {path}: {reason}")]
    Report {
        /// The output dir.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// Starting or stopping a cluster failed.
    #[error("cluster {action} failed: {reason}")]
    Cluster {
        /// `up` or `down`.
        action: &'static str,
        /// What went wrong (exit status, log tail).
        reason: String,
    },
}
