//! Turmoil harness: quinn over turmoil's simulated UDP, and helpers to run a cluster of
//! nodes on simulated time with configured link latencies. Seedable and deterministic.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{self, IoSliceMut};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use gorgo_cluster::{ClusterConfig, ClusterHandle, ClusterSocket, NodeCredentials, SharedSummary};
use gorgo_core::summary::LocalSummary;
use gorgo_core::NodeId;
use parking_lot::Mutex;
use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use tokio::sync::mpsc;

/// The port every node listens on.
pub const PORT: u16 = 7000;

/// quinn's socket abstraction over a turmoil UDP socket: sends are synchronous in
/// turmoil; receives are pumped by a task into a channel that `poll_recv` polls.
#[derive(Debug)]
pub struct TurmoilUdp {
    socket: Arc<turmoil::net::UdpSocket>,
    rx: Mutex<mpsc::UnboundedReceiver<(Bytes, SocketAddr)>>,
    local: SocketAddr,
}

impl TurmoilUdp {
    /// Bind `port` on the current host (named `host`) and start the receive pump.
    pub async fn bind(host: &str, port: u16) -> io::Result<Arc<Self>> {
        let socket = Arc::new(
            turmoil::net::UdpSocket::bind((IpAddr::V4(Ipv4Addr::UNSPECIFIED), port)).await?,
        );
        let local = SocketAddr::new(turmoil::lookup(host), port);
        let (tx, rx) = mpsc::unbounded_channel();
        let pump = socket.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            while let Ok((n, from)) = pump.recv_from(&mut buf).await {
                if tx.send((Bytes::copy_from_slice(&buf[..n]), from)).is_err() {
                    return;
                }
            }
        });
        Ok(Arc::new(TurmoilUdp {
            socket,
            rx: Mutex::new(rx),
            local,
        }))
    }
}

#[derive(Debug)]
struct AlwaysWritable;

impl UdpPoller for AlwaysWritable {
    fn poll_writable(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // turmoil's UDP has no backpressure: a send never blocks.
        Poll::Ready(Ok(()))
    }
}

impl AsyncUdpSocket for TurmoilUdp {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        Box::pin(AlwaysWritable)
    }

    fn try_send(&self, transmit: &Transmit<'_>) -> io::Result<()> {
        // A full queue or a crashed peer looks like loss to QUIC, which is what it is.
        let _ = self
            .socket
            .try_send_to(transmit.contents, transmit.destination);
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let mut rx = self.rx.lock();
        match rx.poll_recv(cx) {
            Poll::Ready(Some((data, from))) => {
                let n = data.len().min(bufs[0].len());
                bufs[0][..n].copy_from_slice(&data[..n]);
                meta[0] = RecvMeta {
                    addr: from,
                    len: n,
                    stride: n,
                    ..RecvMeta::default()
                };
                Poll::Ready(Ok(1))
            }
            Poll::Ready(None) => Poll::Ready(Err(io::Error::other("socket closed"))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }

    fn may_fragment(&self) -> bool {
        false
    }
}

/// Handles of the running nodes, by host name, readable between simulation steps.
pub type Handles = Arc<Mutex<BTreeMap<String, ClusterHandle>>>;

/// The simulated clock as a wall clock (ms since the simulated epoch).
pub fn sim_clock() -> gorgo_cluster::WallClock {
    Arc::new(|| {
        turmoil::since_epoch()
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    })
}

/// A turmoil simulation with deterministic latencies (set per link by the caller).
pub fn sim<'a>(seed: u64, duration: Duration) -> turmoil::Sim<'a> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    turmoil::Builder::new()
        .rng_seed(seed)
        .simulation_duration(duration)
        .tick_duration(Duration::from_millis(1))
        .min_message_latency(Duration::from_millis(1))
        .max_message_latency(Duration::from_millis(1))
        .udp_capacity(1 << 16)
        .build()
}

/// One node of a test cluster.
#[derive(Clone)]
pub struct NodeSpec {
    pub name: String,
    pub region: String,
    pub credentials: NodeCredentials,
    pub seeds: Vec<String>,
    /// Background summary churn: every `period`, add `adds` new fingerprints and drop
    /// the oldest beyond `capacity`, until `until` of simulated time.
    pub churn: Option<Churn>,
    pub generation: u64,
}

/// Synthetic churn on a node's summary.
#[derive(Debug, Clone, Copy)]
pub struct Churn {
    pub period: Duration,
    pub adds: u32,
    pub shared: u32,
    pub capacity: usize,
    pub until: Duration,
}

/// Start a cluster member for `spec` on the current turmoil host.
pub async fn start_node(
    spec: &NodeSpec,
) -> Result<(ClusterHandle, Arc<SharedSummary>), Box<dyn std::error::Error>> {
    start_node_with(spec, |_| {}).await
}

/// [`start_node`] with a last say on the config (timings, intervals).
pub async fn start_node_with(
    spec: &NodeSpec,
    tweak: impl FnOnce(&mut ClusterConfig),
) -> Result<(ClusterHandle, Arc<SharedSummary>), Box<dyn std::error::Error>> {
    let socket = TurmoilUdp::bind(&spec.name, PORT).await?;
    let addr = socket.local_addr()?;
    let mut cfg = ClusterConfig::new(
        NodeId(spec.name.clone()),
        spec.region.clone(),
        addr,
        spec.credentials.clone(),
    );
    cfg.seeds = spec
        .seeds
        .iter()
        .map(|s| SocketAddr::new(turmoil::lookup(s.as_str()), PORT))
        .collect();
    // Generation 0: take the (simulated) wall clock, as a real restart would.
    cfg.generation = Some(if spec.generation == 0 {
        turmoil::since_epoch().map_or(1, |d| d.as_millis() as u64)
    } else {
        spec.generation
    });
    cfg.rng_seed = Some(gorgo_core::hash::hash_bytes(spec.name.as_bytes()));
    cfg.wall_clock = sim_clock();
    tweak(&mut cfg);
    let summary = SharedSummary::new(LocalSummary::new().starting_at(1_000), sim_clock());
    let handle = gorgo_cluster::start(
        cfg,
        ClusterSocket::Custom {
            socket,
            runtime: Arc::new(quinn::TokioRuntime),
        },
        summary.clone(),
        gorgo_cluster::CancellationToken::new(),
    )
    .await?;
    Ok((handle, summary))
}

/// Register `spec` as a host; its handle appears in `handles` once started.
pub fn add_node(sim: &mut turmoil::Sim<'_>, spec: NodeSpec, handles: Handles) {
    let name = spec.name.clone();
    sim.host(name.as_str(), move || {
        let spec = spec.clone();
        let handles = handles.clone();
        async move {
            let (handle, summary) = start_node(&spec).await?;
            handles.lock().insert(spec.name.clone(), handle.clone());
            if let Some(c) = spec.churn {
                churn(&spec.name, &summary, c).await;
            }
            std::future::pending::<()>().await;
            Ok(())
        }
    });
}

/// Insert chains of new and shared fingerprints, evicting the oldest at capacity.
async fn churn(name: &str, summary: &SharedSummary, c: Churn) {
    let mut order = std::collections::VecDeque::new();
    let mut n: u64 = 0;
    let salt = gorgo_core::hash::hash_bytes(name.as_bytes());
    let mut tick = tokio::time::interval(c.period);
    loop {
        tick.tick().await;
        if turmoil::elapsed() >= c.until {
            return;
        }
        summary.update(|s| {
            for i in 0..c.shared {
                // Shared prefix blocks: the same fingerprints on every node.
                s.record_add(gorgo_core::hash::fingerprint(gorgo_core::hash::hash_bytes(
                    &(i as u64).to_le_bytes(),
                )));
            }
            for _ in 0..c.adds {
                n += 1;
                let fp = gorgo_core::hash::fingerprint(
                    salt ^ gorgo_core::hash::hash_bytes(&n.to_le_bytes()),
                );
                s.record_add(fp);
                order.push_back(fp);
            }
            while order.len() > c.capacity {
                if let Some(fp) = order.pop_front() {
                    s.record_remove(fp);
                }
            }
        });
    }
}

/// Step the simulation until `cond(simulated time)` holds or `limit` of simulated time passes; returns
/// the simulated time at which it held.
pub fn run_until(
    sim: &mut turmoil::Sim<'_>,
    limit: Duration,
    mut cond: impl FnMut(Duration) -> bool,
) -> Option<Duration> {
    let deadline = sim.elapsed() + limit;
    while sim.elapsed() < deadline {
        sim.step().expect("simulation step");
        if cond(sim.elapsed()) {
            return Some(sim.elapsed());
        }
    }
    None
}

/// Run the simulation for `d` of simulated time.
pub fn run_for(sim: &mut turmoil::Sim<'_>, d: Duration) {
    let deadline = sim.elapsed() + d;
    while sim.elapsed() < deadline {
        sim.step().expect("simulation step");
    }
}

/// True when every node in `names` sees every other as alive.
pub fn converged(handles: &Handles, names: &[&str]) -> bool {
    let h = handles.lock();
    names.iter().all(|n| {
        h.get(*n).is_some_and(|handle| {
            let alive = handle.alive_peers();
            names
                .iter()
                .filter(|m| *m != n)
                .all(|m| alive.contains(&NodeId((*m).to_owned())))
        })
    })
}

/// The spec of the `i`-th of `names`: region `region-{i}`, the first node the seed of
/// the others, no churn, `generation` (0: the simulated wall clock, as a real restart
/// takes).
pub fn seeded_spec(
    names: &[&str],
    i: usize,
    creds: &BTreeMap<String, NodeCredentials>,
    generation: u64,
) -> NodeSpec {
    NodeSpec {
        name: names[i].to_owned(),
        region: format!("region-{i}"),
        credentials: creds[names[i]].clone(),
        seeds: if i == 0 {
            vec![]
        } else {
            vec![names[0].to_owned()]
        },
        churn: None,
        generation,
    }
}

/// Add every one of `names` as a node ([`seeded_spec`]) on WAN-like links, and run
/// until they all see each other.
pub fn converged_cluster(
    sim: &mut turmoil::Sim<'_>,
    names: &[&str],
    creds: &BTreeMap<String, NodeCredentials>,
    generation: u64,
    handles: &Handles,
) {
    for i in 0..names.len() {
        add_node(
            sim,
            seeded_spec(names, i, creds, generation),
            handles.clone(),
        );
    }
    set_wan_latencies(sim, names);
    converge(sim, handles, names);
}

/// Run until every node in `names` sees every other alive (at most 10 s of simulated
/// time, else the test fails).
pub fn converge(sim: &mut turmoil::Sim<'_>, handles: &Handles, names: &[&str]) {
    run_until(sim, Duration::from_secs(10), |_| converged(handles, names))
        .expect("full membership within 10 s of simulated time");
}

/// Issue credentials for `names` from one fresh CA.
pub fn credentials(names: &[&str]) -> BTreeMap<String, NodeCredentials> {
    let ca = gorgo_cluster::ClusterCa::generate("test CA").expect("ca");
    names
        .iter()
        .map(|n| {
            (
                (*n).to_owned(),
                ca.issue(&NodeId((*n).to_owned()))
                    .expect("issue")
                    .credentials,
            )
        })
        .collect()
}

/// One-way latency between the `i`-th and `j`-th node (`i < j`): 45..=125 ms.
pub fn one_way_ms(i: usize, j: usize) -> u64 {
    45 + ((i * 7 + j * 13) % 5) as u64 * 20
}

/// One-way latencies of a WAN-like topology: 45 to 125 ms (RTT up to 250 ms).
pub fn set_wan_latencies(sim: &mut turmoil::Sim<'_>, names: &[&str]) {
    for (i, a) in names.iter().enumerate() {
        for (j, b) in names.iter().enumerate().skip(i + 1) {
            sim.set_link_latency(*a, *b, Duration::from_millis(one_way_ms(i, j)));
        }
    }
}

/// A connection to `target` from a raw QUIC endpoint on `host` (port 9001: its own
/// address, as behind a relay), with `creds`' certificate: a process holding that
/// node's certificate, whatever it then does with it (the identity and fuzz tests).
pub async fn raw_connection(
    host: &str,
    creds: &NodeCredentials,
    target: std::net::SocketAddr,
) -> Result<(quinn::Endpoint, quinn::Connection), Box<dyn std::error::Error>> {
    let socket = TurmoilUdp::bind(host, 9001).await?;
    let mut endpoint = quinn::Endpoint::new_with_abstract_socket(
        quinn::EndpointConfig::default(),
        None,
        socket,
        Arc::new(quinn::TokioRuntime),
    )?;
    endpoint.set_default_client_config(gorgo_cluster::quinn_client_config(creds)?);
    let conn = endpoint
        .connect(target, gorgo_cluster::CLUSTER_SERVER_NAME)?
        .await?;
    Ok((endpoint, conn))
}
