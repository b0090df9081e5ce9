//! Cluster layer of GORGO: one QUIC endpoint per node with mutual TLS under a cluster
//! CA, foca SWIM membership over QUIC datagrams, gossip of prefix summaries (deltas on
//! uni-streams) and queue stats (foca broadcasts), bi-streams for forwarded requests,
//! and the concurrent peer table the router reads.
//!
//! Start a member with [`start`]; the node keeps the returned [`ClusterHandle`].
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod cluster;
pub mod config;
pub mod error;
pub mod gossip;
pub mod identity;
pub mod state;
pub mod tls;
mod transport;

pub use cluster::{
    start, AppMessage, ClusterHandle, ClusterSocket, IncomingForward, MembershipEvent,
};
pub use config::{system_clock, ClusterConfig, SwimTimings, WallClock};
pub use error::{ClusterError, Result};
pub use gossip::{HoldsSummary, SharedSummary, SummarySource};
pub use identity::{MemberId, MAX_SWIM_PACKET};
pub use state::{
    ClusterMetrics, IdentityRefusal, PeerEngineView, PeerState, PeerTable, PeerView,
    REFUSAL_TTL_ANNOUNCE_PERIODS, RTT_EWMA_ALPHA,
};
pub use tls::{
    quinn_client_config, validate_node_id, write_cluster_certs, write_secret, ClusterCa,
    IssuedNode, NodeCredentials, TlsFiles, CLUSTER_SERVER_NAME, MAX_NODE_CERT_DAYS, NODE_CERT_DAYS,
};
pub use tokio_util::sync::CancellationToken;
pub use transport::{MAX_APP_MESSAGE, MAX_GOSSIP_FRAME};
