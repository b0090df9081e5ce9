//! Cluster configuration: identity, addresses, TLS, gossip interval and SWIM timings.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::num::{NonZeroU8, NonZeroUsize};
use std::sync::Arc;
use std::time::Duration;

use gorgo_core::NodeId;

use crate::identity::MAX_SWIM_PACKET;
use crate::tls::NodeCredentials;

/// SWIM timings, tuned for a handful of WAN regions with RTTs up to ~250 ms.
///
/// foca's `new_wan` preset (5 s probe period, 3 s probe RTT, 30 s suspicion) takes well
/// over 30 s to declare a node down; a router that keeps forwarding to a dead region for
/// that long fails requests. With these defaults a crashed node is declared down in
/// `<= probe_period (wait to be probed) + probe_period (direct + indirect probe) +
/// suspect_to_down_after` = 0.8 + 0.8 + 1.6 = 3.2 s, plus one gossip hop to spread
/// the verdict; see `docs/cluster.md` for the measured figure. The suspicion timeout
/// is two probe periods so that a live node whose runtime is starved for a few hundred
/// ms (late acks, late refutation) is suspected but not declared down.
#[derive(Debug, Clone, PartialEq)]
pub struct SwimTimings {
    /// How often each node probes one random member.
    pub probe_period: Duration,
    /// How long to wait for a direct ack before asking others to probe (> one RTT).
    /// The indirect probe (two RTTs) must fit in `probe_period - probe_rtt`.
    pub probe_rtt: Duration,
    /// Members asked to probe indirectly.
    pub num_indirect_probes: usize,
    /// How long a suspect has to refute before it is declared down.
    pub suspect_to_down_after: Duration,
    /// How many times each membership update is piggybacked.
    pub max_transmissions: u8,
    /// How often foca pushes pending updates to a few members without waiting for a probe.
    pub periodic_gossip: Duration,
    /// How often a node announces itself to a random member (heals partitions where
    /// each side forgot the other), and re-announces to seeds while it knows nobody.
    pub announce_period: Duration,
    /// How long a down member is remembered (a restarted node rejoins with a new
    /// generation, so this can be short).
    pub remove_down_after: Duration,
}

impl Default for SwimTimings {
    fn default() -> Self {
        SwimTimings {
            probe_period: Duration::from_millis(800),
            probe_rtt: Duration::from_millis(280),
            num_indirect_probes: 2,
            suspect_to_down_after: Duration::from_millis(1600),
            max_transmissions: 6,
            periodic_gossip: Duration::from_millis(200),
            announce_period: Duration::from_secs(2),
            remove_down_after: Duration::from_secs(60),
        }
    }
}

impl SwimTimings {
    /// The foca configuration these timings describe.
    pub fn foca_config(&self) -> foca::Config {
        let mut c = foca::Config::simple();
        c.probe_period = self.probe_period;
        c.probe_rtt = self.probe_rtt;
        c.num_indirect_probes = NonZeroUsize::new(self.num_indirect_probes.max(1)).expect("max(1)");
        c.max_transmissions = NonZeroU8::new(self.max_transmissions.max(1)).expect("max(1)");
        c.suspect_to_down_after = self.suspect_to_down_after;
        c.remove_down_after = Some(self.remove_down_after);
        c.max_packet_size = NonZeroUsize::new(MAX_SWIM_PACKET).expect("non-zero const");
        c.notify_down_members = true;
        c.periodic_announce = Some(foca::PeriodicParams {
            frequency: self.announce_period,
            num_members: NonZeroUsize::new(1).expect("1"),
        });
        c.periodic_announce_to_down_members = Some(foca::PeriodicParams {
            frequency: self.announce_period,
            num_members: NonZeroUsize::new(2).expect("2"),
        });
        c.periodic_gossip = Some(foca::PeriodicParams {
            frequency: self.periodic_gossip,
            num_members: NonZeroUsize::new(2).expect("2"),
        });
        c
    }
}

/// Milliseconds since the UNIX epoch on the clock summary staleness is measured with.
/// Real nodes use the system clock; turmoil tests pass the simulated one.
pub type WallClock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// The system clock as a [`WallClock`].
pub fn system_clock() -> WallClock {
    Arc::new(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    })
}

/// Everything a node needs to join a cluster.
#[derive(Clone)]
pub struct ClusterConfig {
    /// This node's id; must match the id in its certificate.
    pub node_id: NodeId,
    /// The region this node serves.
    pub region: String,
    /// Where the QUIC endpoint binds (when the cluster binds it itself).
    pub listen: SocketAddr,
    /// The address peers dial (differs from `listen` behind a relay or NAT).
    pub advertise: SocketAddr,
    /// Addresses to announce to on start.
    pub seeds: Vec<SocketAddr>,
    /// Dial addresses by advertised address (seeds included): where this node must
    /// dial to reach a peer that advertises the key, e.g. a WAN-emulation relay chosen
    /// by this node's region. SWIM identities keep the advertised address.
    pub dial_overrides: HashMap<SocketAddr, SocketAddr>,
    /// CA, certificate and key.
    pub credentials: NodeCredentials,
    /// How often summary deltas go out (docs/design.md: 250 ms).
    pub gossip_interval: Duration,
    /// SWIM timings.
    pub swim: SwimTimings,
    /// QUIC idle timeout: a silent peer's connection is dropped after this.
    pub idle_timeout: Duration,
    /// QUIC keep-alive interval (well under `idle_timeout`).
    pub keep_alive: Duration,
    /// Identity generation; `None` takes the wall clock in ms so that a restart wins.
    pub generation: Option<u64>,
    /// Seed of foca's RNG; `None` derives one from node id and generation.
    pub rng_seed: Option<u64>,
    /// Clock for cross-node staleness measurement.
    pub wall_clock: WallClock,
}

impl std::fmt::Debug for ClusterConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterConfig")
            .field("node_id", &self.node_id)
            .field("region", &self.region)
            .field("listen", &self.listen)
            .field("advertise", &self.advertise)
            .field("seeds", &self.seeds)
            .field("dial_overrides", &self.dial_overrides)
            .field("gossip_interval", &self.gossip_interval)
            .field("swim", &self.swim)
            .finish_non_exhaustive()
    }
}

impl ClusterConfig {
    /// Defaults for everything but identity, address and TLS.
    pub fn new(
        node_id: NodeId,
        region: impl Into<String>,
        listen: SocketAddr,
        credentials: NodeCredentials,
    ) -> Self {
        ClusterConfig {
            node_id,
            region: region.into(),
            listen,
            advertise: listen,
            seeds: Vec::new(),
            dial_overrides: HashMap::new(),
            credentials,
            gossip_interval: Duration::from_millis(250),
            swim: SwimTimings::default(),
            idle_timeout: Duration::from_secs(5),
            keep_alive: Duration::from_secs(1),
            generation: None,
            rng_seed: None,
            wall_clock: system_clock(),
        }
    }
}
