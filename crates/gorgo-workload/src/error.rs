//! The one error type of `gorgo-workload`.

/// What can go wrong reading, writing or generating a trace: bad input, never a bug.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// The underlying reader or writer failed.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// A trace line that does not parse; `line` is 1-based.
    #[error("line {line}: {reason}")]
    Parse {
        /// 1-based line number in the input (the CSV header is line 1).
        line: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// A row a writer was handed that the trace readers would refuse
    /// (`crate::read::check_request`, the line length): written, the trace would not
    /// read back, so nothing is written of it.
    #[error("output line {line}{request}: {reason} (the trace readers would refuse it)")]
    Unreadable {
        /// 1-based line of the output the row would have been.
        line: u64,
        /// ` (request <id>)` when the row has an id, else empty.
        request: String,
        /// What is wrong with it, naming the field.
        reason: String,
    },
    /// The input matches none of the known trace formats.
    #[error("unknown trace format: {0}")]
    UnknownFormat(String),
    /// A generator parameter file that does not parse (the message names the field).
    #[error("generator config file: {0}")]
    ConfigFile(String),
    /// A generator parameter out of its valid range.
    #[error("invalid generator config `{field}`: {reason}")]
    InvalidConfig {
        /// The parameter's name as in [`crate::GeneratorConfig`].
        field: &'static str,
        /// Why it is rejected.
        reason: String,
    },
}
