//! The one error type of `gorgo-node`.

/// Everything that can stop the node or fail a request inside it.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The configuration is invalid; the message names the field.
    #[error("config: {0}")]
    Config(String),
    /// One field of the configuration (or of an admin call's body, which is a piece of
    /// it) is invalid: a config error whose field the code knows, so that the admin
    /// API can name it in the error's `param`.
    #[error("config: invalid `{field}`: {reason}")]
    InvalidField {
        /// The field as the file (`engines[2].url`) or the body (`url`) names it.
        field: String,
        /// Why it was refused.
        reason: String,
    },
    /// A change asked of the running node conflicts with its state (removing its
    /// last engine): the admin API's 409, not a config error.
    #[error("{0}")]
    Conflict(String),
    /// A socket could not be bound or served.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// The cluster layer failed to start or to forward.
    #[error("cluster: {0}")]
    Cluster(String),
    /// A peer sent bytes that break the forward protocol.
    #[error("forward protocol: {0}")]
    Protocol(String),
    /// A peer's forward would take the node's budget of request bodies being read
    /// past `limits.max_body_bytes_in_flight`: refused before it is read.
    #[error("request bodies being read would exceed limits.max_body_bytes_in_flight")]
    BodyBudget,
    /// A peer took a forward and sent no response head within the first-byte timeout,
    /// or answered 504 itself: nothing reached the client; the client's answer, where
    /// nothing else can serve, is a 504 (a wait), not a 503 (no room).
    #[error("{0}")]
    HeadTimeout(String),
    /// Membership declared the peer a forward went to dead (or saw it restart) before
    /// it answered: nothing reached the client, so the request may be served
    /// elsewhere.
    #[error("peer {0} declared dead before it answered")]
    PeerGone(gorgo_core::NodeId),
    /// The peer refused the forward: serving it there would cost more than serving it
    /// here (`gorgo_core::decision::refuse_forward`). Nothing reached the client.
    #[error("peer {peer} refused the forward ({:.0} ms there against {:.0} ms here)", refusal.local_cost_ms, refusal.origin_cost_ms)]
    Refused {
        /// The peer.
        peer: gorgo_core::NodeId,
        /// Its figures.
        refusal: gorgo_core::decision::Refusal,
    },
    /// The peer's engine answered the forward with a server error of its own and the
    /// peer had nowhere else to serve it ([`crate::api::ENGINE_ANSWER_HEADER`]).
    /// Nothing reached the client: the request may be served elsewhere, and a client
    /// with nowhere else to go gets the engine's answer.
    #[error("peer {peer}: {}", answer.message())]
    EngineAnswered {
        /// The peer.
        peer: gorgo_core::NodeId,
        /// Its engine's answer, read whole.
        answer: crate::api::EngineAnswer,
    },
    /// The trace exporter could not be built from `[telemetry]`.
    #[error("telemetry: {0}")]
    Telemetry(String),
    /// A request's prompt could not be tokenised: the body's fault (a template that
    /// cannot render it; a 400).
    #[error(transparent)]
    Tokenize(#[from] gorgo_tokenizer::TokenizerError),
    /// A task of the node failed on its own (a tokenizer that panicked): the node's
    /// fault, not the request's (a 500).
    #[error("internal: {0}")]
    Internal(String),
}

impl NodeError {
    /// [`NodeError::InvalidField`]: `field` refused for `reason`.
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        NodeError::InvalidField {
            field: field.into(),
            reason: reason.into(),
        }
    }
}
