//! Loopback addressing for a local multi-region cluster, and starting every
//! relay such a cluster needs.
//!
//! Region `i` owns the address `127.0.0.(ip_base + i)`; on it, ports from
//! `base_port` are laid out as:
//!
//! | port | what |
//! |---|---|
//! | base + 0 | client-facing TCP relay (client delay) to the node's HTTP ingress |
//! | base + 1 | node HTTP ingress |
//! | base + 2 | node QUIC endpoint (gossip and forwarding) |
//! | base + 3 | engine emulator |
//! | base + 4 | node admin API |
//! | base + 5 | QUIC relay in front of the node: what peers dial and the node advertises |
//! | base + 6 | region 0's address only: `gorgo netem`'s control API ([`crate::serve_control`]) |
//!
//! Every region sends from its own address, so the one UDP relay in front of
//! node b tells its peers apart by source IP: datagrams from a's address cross
//! the a -> b link, and b's replies to them go back over b -> a. Node a reaches
//! b by dialling b's relay address (b advertises it as its QUIC address), b
//! reaches a by dialling a's; membership gossip spreads those same addresses,
//! so no path bypasses the emulation and nodes need no relay-aware code.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use serde::Serialize;

use crate::control::LinkTable;
use crate::relay::{RelayCounters, RelayHandle};
use crate::tcp::TcpRelay;
use crate::topology::Topology;
use crate::udp::{SourceRoutes, UdpRelay, UdpRelayOptions};
use crate::NetemError;

/// Where the cluster's addresses start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanOptions {
    /// Last octet of region 0's loopback address (`127.0.0.<ip_base>`).
    pub ip_base: u8,
    /// First port of each region's block of ports.
    pub base_port: u16,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            ip_base: 10,
            base_port: 7100,
        }
    }
}

/// Port offsets within a region's block; see the module docs.
const CLIENT_PORT: u16 = 0;
const NODE_HTTP_PORT: u16 = 1;
const NODE_QUIC_PORT: u16 = 2;
const ENGINE_PORT: u16 = 3;
const ADMIN_PORT: u16 = 4;
const QUIC_RELAY_PORT: u16 = 5;
/// On region 0's address only: one control API per cluster, at an address
/// every script can derive from `--ip-base` and `--base-port` alone.
const CONTROL_PORT: u16 = 6;

/// How one node reaches one peer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PeerRoute {
    /// The peer's region name.
    pub region: String,
    /// The address to dial to reach the peer: the UDP relay in front of its QUIC endpoint.
    pub relay_addr: SocketAddr,
    /// The peer's real QUIC address (the relay's target).
    pub quic_addr: SocketAddr,
    /// The emulated round-trip time to the peer, in ms.
    pub rtt_ms: f64,
}

/// Every address of one region in a local cluster.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RegionPlan {
    /// Region name.
    pub name: String,
    /// The region's loopback address.
    pub ip: IpAddr,
    /// What clients of this region connect to: a TCP relay with the client delay.
    pub client_addr: SocketAddr,
    /// The node's HTTP ingress (the client relay's target).
    pub node_http_addr: SocketAddr,
    /// The node's QUIC endpoint.
    pub node_quic_addr: SocketAddr,
    /// The UDP relay in front of the node's QUIC endpoint: what peers dial and
    /// what the node advertises.
    pub quic_relay_addr: SocketAddr,
    /// The engine emulator's HTTP address.
    pub engine_addr: SocketAddr,
    /// The node's admin API.
    pub admin_addr: SocketAddr,
    /// One route per other region, in topology order.
    pub peers: Vec<PeerRoute>,
}

/// The addresses of a whole local cluster, one entry per region in topology order.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClusterPlan {
    /// Regions in topology order.
    pub regions: Vec<RegionPlan>,
    /// Where `gorgo netem` serves its control API (partition and heal links).
    pub control_addr: SocketAddr,
}

/// Lays out loopback addresses and ports for every region of `topology`.
pub fn plan_cluster(topology: &Topology, options: &PlanOptions) -> Result<ClusterPlan, NetemError> {
    let n = topology.regions.len();
    if options.ip_base == 0 || usize::from(options.ip_base) + n > 255 {
        return Err(NetemError::Plan(format!(
            "ip_base {} leaves no room for {n} regions in 127.0.0.1-254",
            options.ip_base
        )));
    }
    if options.base_port == 0 || usize::from(options.base_port) + usize::from(CONTROL_PORT) > 65_535
    {
        // Every region uses the same ports on its own address, so only the
        // block's top, the control port, limits base_port; not the region count.
        return Err(NetemError::Plan(format!(
            "base_port {}: must be in [1, {}], as base_port + {CONTROL_PORT} (the control port) must not go above 65535",
            options.base_port,
            u16::MAX - CONTROL_PORT
        )));
    }
    let ip = |i: usize| IpAddr::V4(Ipv4Addr::new(127, 0, 0, options.ip_base + i as u8));
    let addr = |i: usize, offset: u16| SocketAddr::new(ip(i), options.base_port + offset);
    let regions = (0..n)
        .map(|a| RegionPlan {
            name: topology.regions[a].name.clone(),
            ip: ip(a),
            client_addr: addr(a, CLIENT_PORT),
            node_http_addr: addr(a, NODE_HTTP_PORT),
            node_quic_addr: addr(a, NODE_QUIC_PORT),
            quic_relay_addr: addr(a, QUIC_RELAY_PORT),
            engine_addr: addr(a, ENGINE_PORT),
            admin_addr: addr(a, ADMIN_PORT),
            peers: (0..n)
                .filter(|&b| b != a)
                .map(|b| PeerRoute {
                    region: topology.regions[b].name.clone(),
                    relay_addr: addr(b, QUIC_RELAY_PORT),
                    quic_addr: addr(b, NODE_QUIC_PORT),
                    rtt_ms: topology.one_way_ms[a][b] + topology.one_way_ms[b][a],
                })
                .collect(),
        })
        .collect();
    Ok(ClusterPlan {
        regions,
        control_addr: addr(0, CONTROL_PORT),
    })
}

/// One running relay of a cluster and what it connects.
#[derive(Debug)]
pub struct ClusterRelay {
    /// `client->us-ashburn` or `peers->us-ashburn`.
    pub name: String,
    /// `tcp` or `udp`.
    pub protocol: &'static str,
    /// The relay's target.
    pub target: SocketAddr,
    /// The running relay.
    pub handle: RelayHandle,
}

/// All relays of a local cluster: per region, one client TCP relay and one
/// UDP relay in front of the node's QUIC endpoint; and the gates that cut them.
#[derive(Debug)]
pub struct NetemCluster {
    /// Every relay, client relays first.
    pub relays: Vec<ClusterRelay>,
    /// The gate and parameters of every link: regions a and b share one (it
    /// drops a's datagrams at b's relay and b's at a's, and a change of its
    /// delay reaches both relays), each region's clients have one.
    pub links: LinkTable,
}

impl NetemCluster {
    /// Starts every relay `plan` calls for, with link parameters from `topology`.
    /// Each relay's loss and jitter draws derive from `seed`.
    pub async fn start(
        topology: &Topology,
        plan: &ClusterPlan,
        seed: u64,
    ) -> Result<Self, NetemError> {
        let mut relays = Vec::new();
        let links = LinkTable::new(topology);
        for (a, region) in plan.regions.iter().enumerate() {
            let handle = TcpRelay::start(
                region.client_addr,
                region.node_http_addr,
                links.client_link(a),
                seed ^ (a as u64 + 1),
            )
            .await?;
            relays.push(ClusterRelay {
                name: format!("client->{}", region.name),
                protocol: "tcp",
                target: region.node_http_addr,
                handle,
            });
        }
        for (b, region) in plan.regions.iter().enumerate() {
            let mut routes = SourceRoutes::default();
            for (a, peer) in plan.regions.iter().enumerate() {
                if a != b {
                    routes.by_ip.push((peer.ip, links.peer_link(a, b)));
                }
            }
            let handle = UdpRelay::start_routed(
                region.quic_relay_addr,
                region.node_quic_addr,
                routes,
                seed ^ ((b as u64 + 1) << 32),
                UdpRelayOptions::default(),
            )
            .await?;
            relays.push(ClusterRelay {
                name: format!("peers->{}", region.name),
                protocol: "udp",
                target: region.node_quic_addr,
                handle,
            });
        }
        Ok(NetemCluster { relays, links })
    }

    /// Counters of every relay by name.
    pub fn counters(&self) -> Vec<(String, RelayCounters)> {
        self.relays
            .iter()
            .map(|r| (r.name.clone(), r.handle.stats().snapshot()))
            .collect()
    }

    /// Whether any relay has stopped on its own (a fatal socket error).
    pub fn any_stopped(&self) -> bool {
        self.relays.iter().any(|r| r.handle.is_stopped())
    }

    /// Stops every relay and waits for all their tasks.
    pub async fn shutdown(self) {
        for relay in self.relays {
            relay.handle.shutdown().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_gives_each_node_its_own_relay_per_peer() {
        let text = r#"
            [[regions]]
            name = "a"
            client_delay_ms = 2
            [[regions]]
            name = "b"
            client_delay_ms = 3
            [one_way_ms]
            a = { b = 10 }
        "#;
        let t = Topology::from_toml(text).unwrap();
        let plan = plan_cluster(&t, &PlanOptions::default()).unwrap();
        let (a, b) = (&plan.regions[0], &plan.regions[1]);
        assert_eq!(a.client_addr, "127.0.0.10:7100".parse().unwrap());
        assert_eq!(b.node_quic_addr, "127.0.0.11:7102".parse().unwrap());
        assert_eq!(a.peers[0].relay_addr, "127.0.0.11:7105".parse().unwrap());
        assert_eq!(a.peers[0].relay_addr, b.quic_relay_addr);
        assert_eq!(a.peers[0].quic_addr, b.node_quic_addr);
        assert_eq!(b.peers[0].relay_addr, a.quic_relay_addr);
        assert_eq!(b.peers[0].rtt_ms, 20.0);
        assert_eq!(plan.control_addr, "127.0.0.10:7106".parse().unwrap());
        let bad = PlanOptions {
            ip_base: 254,
            base_port: 7100,
        };
        assert!(plan_cluster(&t, &bad).is_err());
    }

    /// The port check says what limits base_port: its block's top port.
    #[test]
    fn a_base_port_too_high_is_refused_saying_why() {
        let t = Topology::from_toml(
            r#"
            [[regions]]
            name = "a"
            client_delay_ms = 2
        "#,
        )
        .unwrap();
        let at = |base_port| {
            plan_cluster(
                &t,
                &PlanOptions {
                    ip_base: 10,
                    base_port,
                },
            )
        };
        let last = at(65_529).unwrap();
        assert_eq!(last.control_addr.port(), 65_535);
        let err = at(65_530).unwrap_err().to_string();
        assert!(
            err.contains("[1, 65529]") && err.contains("base_port + 6"),
            "{err}"
        );
        assert!(at(0).is_err());
    }
}
