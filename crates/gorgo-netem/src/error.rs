//! The one error type of this crate.

use std::net::SocketAddr;

/// Everything that can go wrong loading a topology or running relays.
#[derive(Debug, thiserror::Error)]
pub enum NetemError {
    /// The topology file could not be read.
    #[error("reading topology {path}: {source}")]
    Read {
        /// The file that failed.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The topology text is not valid TOML for the schema (serde names the field).
    #[error("parsing topology: {0}")]
    Parse(#[from] toml::de::Error),
    /// A field parsed but has a value that makes no sense.
    #[error("topology field `{field}`: {reason}")]
    Invalid {
        /// Dotted path of the offending field.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A region name that the topology does not list.
    #[error("unknown region `{0}`")]
    UnknownRegion(String),
    /// A link that cannot be cut or healed (a region paired with itself).
    #[error("link {0}")]
    Link(String),
    /// A control API parameter (a link change) with a value that makes no sense.
    #[error("parameter `{field}`: {reason}")]
    Param {
        /// The parameter, as the API names it.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The cluster plan does not fit in the address or port space.
    #[error("cluster plan: {0}")]
    Plan(String),
    /// Relay options the relay cannot work with (a chunk size of zero, say).
    #[error("relay option `{field}`: {reason}")]
    Options {
        /// The offending option.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A relay socket could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address we tried.
        addr: SocketAddr,
        /// Why it failed.
        source: std::io::Error,
    },
}

impl NetemError {
    pub(crate) fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        NetemError::Invalid {
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn param(field: impl Into<String>, reason: impl Into<String>) -> Self {
        NetemError::Param {
            field: field.into(),
            reason: reason.into(),
        }
    }
}
