//! User-space WAN emulation: UDP and TCP relays with delay, jitter, loss and
//! rate from a topology file. It exists because the development machine's
//! kernel has no `sch_netem`; the same topologies drive `tc netem` scripts
//! ([`tc_script`]) where the kernel has it.
//!
//! Layers: [`Topology`] (the file), [`LinkShaper`] (sans-IO: a packet and
//! `now` in, a delivery time or a drop out), [`UdpRelay`] / [`TcpRelay`]
//! (thin tokio drivers), [`plan_cluster`] / [`NetemCluster`] (a whole local
//! cluster on loopback addresses), [`LinkTable`] / [`serve_control`] (cutting,
//! healing and reshaping its links while it runs).
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

mod control;
mod error;
mod link;
mod plan;
mod relay;
pub mod sphere;
mod tc;
mod tcp;
mod topology;
mod udp;

pub use control::{
    serve_control, DirectionStatus, LinkChange, LinkShape, LinkStatus, LinkTable, CLIENTS,
    MAX_URI_BYTES,
};
pub use error::NetemError;
pub use link::{
    DuplexLink, LinkParams, LinkShaper, Mode, SharedLinkParams, Verdict, DATAGRAM_OVERHEAD_BYTES,
    DEFAULT_QUEUE_LIMIT_BYTES,
};
pub use plan::{
    plan_cluster, ClusterPlan, ClusterRelay, NetemCluster, PeerRoute, PlanOptions, RegionPlan,
};
pub use relay::{LinkGate, RelayCounters, RelayHandle, RelayStats};
pub use tc::tc_script;
pub use tcp::{TcpRelay, TcpRelayOptions};
pub use topology::{Region, Topology, MAX_REGIONS};
pub use udp::{SourceRoutes, UdpRelay, UdpRelayOptions};
