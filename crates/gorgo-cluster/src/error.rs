//! The one error type of `gorgo-cluster`.

use gorgo_core::NodeId;

/// Everything that can go wrong in the cluster layer.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// Certificates or keys that cannot be loaded or used.
    #[error("tls: {0}")]
    Tls(String),
    /// rcgen failed to generate or sign a certificate.
    #[error("certificate generation: {0}")]
    CertGen(#[from] rcgen::Error),
    /// Socket or file IO.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// A configuration value out of its valid range, or a file it names that cannot
    /// be used (`tls.key`: not the certificate's key).
    #[error("invalid config `{field}`: {reason}")]
    Config {
        /// The offending field.
        field: &'static str,
        /// Why it was refused.
        reason: String,
    },
    /// No live connection or membership entry for this peer.
    #[error("unknown peer {0}")]
    UnknownPeer(NodeId),
    /// Dialing a peer failed before the handshake.
    #[error("connect: {0}")]
    Connect(#[from] quinn::ConnectError),
    /// A QUIC connection failed or was closed.
    #[error("connection: {0}")]
    Connection(#[from] quinn::ConnectionError),
    /// Writing to a QUIC stream failed.
    #[error("stream write: {0}")]
    Write(#[from] quinn::WriteError),
    /// A dial to this address failed moments ago (the transport backs off for 500 ms):
    /// not dialed again yet, with why the last one failed.
    #[error("{addr}: not dialed again yet; the last dial failed: {last}")]
    Backoff {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why the last dial failed.
        last: String,
    },
    /// The peer presented a certificate for another node than the one dialed.
    #[error("peer identity mismatch: expected {expected}, got {got}")]
    PeerMismatch {
        /// The node we meant to reach.
        expected: NodeId,
        /// The node its certificate names.
        got: String,
    },
    /// A message over its size cap.
    #[error("message too large: {size} bytes (limit {limit})")]
    TooLarge {
        /// Its size.
        size: usize,
        /// The cap.
        limit: usize,
    },
    /// Bytes from the network that do not decode.
    #[error("decode: {0}")]
    Decode(String),
    /// The cluster task has stopped.
    #[error("cluster shut down")]
    Shutdown,
}

/// Result alias of this crate.
pub type Result<T, E = ClusterError> = std::result::Result<T, E>;
