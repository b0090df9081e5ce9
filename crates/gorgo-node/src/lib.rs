//! The GORGO router daemon: HTTP ingress, engine adapter, forwarding, admin API, metrics.
//!
//! One node runs per region beside the region's inference engine. For each request it
//! asks the routing core where the request is cheapest to serve (locally or at a peer)
//! and moves the bytes accordingly. The cost model lives in `gorgo-core`; this crate
//! drives sockets and clocks.
//!
//! Entry point: [`start`] with a [`ValidatedConfig`], bound [`NodeListeners`] (tests
//! bind port 0), a [`PeerSource`] (the QUIC cluster, or [`mesh::Mesh`] in-process), the
//! channel of forwards peers open to us, and a shutdown token.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod admin;
pub mod api;
pub mod cluster;
pub mod config;
pub mod engine;
pub mod error;
pub mod forward;
pub mod ingress;
pub mod kv_events;
pub mod listen;
pub mod mesh;
pub mod metrics;
pub mod peers;
pub mod route;
pub mod serve;
pub mod shadow;
pub mod telemetry;
pub mod tokens;
pub mod tuning;
pub mod usage;
pub mod validate;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gorgo_core::{NodeId, QueueStats, Weights};
use parking_lot::{Mutex, RwLock};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

pub use config::{NodeConfig, ValidatedConfig};
pub use error::NodeError;
pub use peers::{IncomingForward, IncomingForwards, NoPeers, PeerSource, PeerView};
pub use tokio_util::sync::CancellationToken;

/// Everything a running node shares between its tasks.
pub struct NodeState {
    /// The config, checked once where it was read.
    pub config: ValidatedConfig,
    /// This node's id.
    pub id: NodeId,
    /// The local engine.
    pub engine: Arc<engine::EngineAdapter>,
    /// The cluster view.
    pub peers: Arc<dyn PeerSource>,
    /// The weights routing uses now: a mirror of [`NodeState::tuning`]'s, refreshed
    /// after every tuning step (requests take theirs from [`tuning::TuningDriver::admit`]).
    pub weights: Arc<RwLock<Weights>>,
    /// Online tuning of the weights (docs/design.md, "Online tuning").
    pub tuning: tuning::TuningDriver,
    /// Decisions and the forward ledger.
    pub router: route::Router,
    /// Model of the local engine's prefix cache.
    pub shadow: Mutex<shadow::LocalCache>,
    /// The engine's KV events, when `engine.kv_events` is set: the index follows them
    /// while the stream is healthy.
    pub kv_events: Option<kv_events::KvEvents>,
    /// The configured policy.
    pub policy: gorgo_core::policy::PolicyKind,
    /// Canonical prompt hashing (block size), the chain of every request without a
    /// tokenizer; its own counter is the fixed `routing.bytes_per_token` (the requests'
    /// counts come from `tokens`, learned per prompt shape).
    pub hasher: gorgo_core::PromptHasher,
    /// How prompt tokens are counted: the engine's tokenizer, or the learned ratio.
    pub tokens: tokens::PromptTokens,
    /// Prometheus metrics.
    pub metrics: metrics::NodeMetrics,
    /// Ingress concurrency cap.
    pub permits: Arc<Semaphore>,
    /// Cap on forwards served for peers.
    pub forward_permits: Arc<Semaphore>,
    /// Set when the node starts draining (SIGTERM): `/readyz` answers 503 so load
    /// balancers stop sending, while in-flight requests finish.
    draining: AtomicBool,
    /// Cancelled by a drain once local work is done: the listeners stop accepting and
    /// close connections after their in-flight requests (a child of shutdown).
    closing: CancellationToken,
    started: Instant,
    next_id: AtomicU64,
}

impl std::fmt::Debug for NodeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeState").field("id", &self.id).finish()
    }
}

impl NodeState {
    /// Build the shared state (no sockets yet).
    pub fn new(
        config: ValidatedConfig,
        peers: Arc<dyn PeerSource>,
    ) -> Result<Arc<Self>, NodeError> {
        let engine = engine::EngineAdapter::new(&config.engine, &config.limits)?;
        let engine = Arc::new(engine);
        let policy = config.routing.policy;
        let tokens = tokens::PromptTokens::new(&config)?;
        let hasher = gorgo_core::PromptHasher::new(
            config.routing.block_bytes,
            Box::new(gorgo_core::BytesPerToken(
                config.routing.bytes_per_token.min(u32::MAX as usize) as u32,
            )),
        )
        .map_err(|e| NodeError::Config(format!("invalid `routing.block_bytes`: {e}")))?;
        let metrics = metrics::NodeMetrics::new();
        metrics.bytes_per_token.set(tokens.bytes_per_token());
        let capacity = engine.kv_capacity_tokens();
        let learned = config
            .tuning
            .weights_file
            .as_deref()
            .map(tuning::read_learned_weights)
            .transpose()?;
        let tuning_cfg = config.tuning.core_config(learned);
        let kv_events = kv_events::KvEvents::from_config(&config, 0)?;
        let id = NodeId(config.node.id.clone());
        let tuning = tuning::TuningDriver::new(
            id.clone(),
            tuning_cfg,
            learned.unwrap_or(config.routing.weights),
        )?
        .with_learned_weights_out(config.tuning.learned_weights_out.clone());
        Ok(Arc::new(NodeState {
            id,
            weights: Arc::new(RwLock::new(tuning.weights())),
            tuning,
            router: route::Router::new(
                config.routing.decision_log,
                gorgo_core::hash::hash_bytes(config.node.id.as_bytes()),
            ),
            shadow: Mutex::new(shadow::LocalCache::new(
                capacity,
                config.cluster.summary_sample,
            )),
            kv_events,
            policy,
            hasher,
            metrics,
            tokens,
            permits: Arc::new(Semaphore::new(config.limits.max_concurrency)),
            forward_permits: Arc::new(Semaphore::new(config.limits.max_forwards)),
            draining: AtomicBool::new(false),
            closing: CancellationToken::new(),
            started: Instant::now(),
            next_id: AtomicU64::new(1),
            engine,
            peers,
            config,
        }))
    }

    /// Milliseconds since the node started: the `now` handed to the core.
    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Mark the node as draining (see [`NodeState::is_draining`]).
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Whether the node is draining: not ready for new traffic.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Whether this node is ready for traffic (`/readyz`): not draining, and its own
    /// engine is confirmed healthy. A node whose engine is down could still forward,
    /// but a load balancer does better sending its clients to a node with an engine.
    pub fn is_ready(&self) -> bool {
        !self.is_draining() && self.engine.is_ready()
    }

    /// A fresh request id.
    pub fn next_request_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// This node's queue stats: its view of its engine (with the current fit) and
    /// the tuning epoch it routes with.
    pub fn local_stats(&self) -> QueueStats {
        self.engine.queue_stats(self.tuning.epoch())
    }

    /// Keep the summary's sample in step with the cluster's size
    /// (`cluster.summary_sample`): the live peer count goes to the shadow index's
    /// [`gorgo_core::SampleChooser`], and the summary changes a new rate causes are
    /// gossiped like any other.
    pub fn summary_sample_tick(&self) {
        let live = self.peers.peers().iter().filter(|p| p.alive).count();
        let delta = self.shadow.lock().follow_peers(live, self.now_ms());
        if let Some(delta) = delta {
            self.peers.publish_summary(&delta);
        }
    }

    /// One tuning tick: follow the membership view, then lead, take over or report.
    pub fn tuning_tick(&self) {
        let live = self
            .peers
            .peers()
            .into_iter()
            .filter(|p| p.alive)
            .map(|p| p.id);
        let fx = self.tuning.tick(live, self.now_ms());
        self.apply_tuning(fx);
    }

    /// A tuning message from peer `from`.
    pub fn on_tuning_message(&self, from: &NodeId, msg: gorgo_core::tuning::TuningMessage) {
        let fx = self.tuning.handle(from, msg, self.now_ms());
        self.apply_tuning(fx);
    }

    /// Switch the tuning mode (`PUT /admin/weights`); see
    /// [`tuning::TuningDriver::set_mode`].
    pub fn set_tuning_mode(
        &self,
        mode: gorgo_core::es::TuningMode,
        weights: Option<Weights>,
    ) -> Result<(), NodeError> {
        self.tuning.set_mode(mode, weights)?;
        self.apply_tuning(tuning::Effects::default());
        Ok(())
    }

    /// Carry out what a tuning step asked for: send, count, write learned weights,
    /// refresh the weights mirror.
    fn apply_tuning(&self, fx: tuning::Effects) {
        for send in fx.sends {
            match send {
                tuning::TuningSend::All(m) => self.peers.broadcast_tuning(&m),
                tuning::TuningSend::To(to, m) => self.peers.send_tuning(&to, &m),
            }
        }
        for r in &fx.decided {
            let verdict = serde_json::to_value(r.verdict)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default();
            self.metrics
                .tuning_trials
                .get_or_create(&metrics::VerdictLabels { verdict })
                .inc();
            tracing::info!(
                epoch = r.epoch,
                w_rtt = r.candidate.w_rtt,
                w_queue = r.candidate.w_queue,
                p95_ttft_ms = r.score_p95_ttft_ms,
                incumbent_p95_ttft_ms = r.incumbent_p95_ttft_ms,
                accepted = r.accepted,
                samples = r.samples,
                "tuning trial decided"
            );
        }
        if let Some(w) = fx.frozen {
            tracing::info!(
                w_rtt = w.w_rtt,
                w_queue = w.w_queue,
                "tuning converged and froze"
            );
        }
        *self.weights.write() = self.tuning.weights();
        self.metrics
            .tuning_epoch
            .set(self.tuning.epoch().min(i64::MAX as u64) as i64);
        self.metrics
            .tuning_leader
            .set(self.tuning.is_leader() as i64);
    }

    /// Update the gauges that are read at scrape time.
    pub fn refresh_gauges(&self) {
        let peers = self.peers.peers();
        self.metrics
            .peers_alive
            .set(peers.iter().filter(|p| p.alive).count() as i64);
        self.metrics
            .engine_healthy
            .set(self.engine.is_healthy() as i64);
        self.metrics
            .engine_breaker
            .set(self.engine.breaker().code());
        let g = self.peers.gossip_counters();
        let m = &self.metrics;
        for (gauge, count) in [
            (&m.gossip_bytes_sent, g.bytes_sent),
            (&m.gossip_bytes_received, g.bytes_received),
            (&m.cluster_identity_conflicts, g.identity_conflicts),
            (&m.cluster_own_id_claimed, g.own_id_claimed),
        ] {
            gauge.set(count.min(i64::MAX as u64) as i64);
        }
        for p in peers {
            let label = metrics::PeerLabels {
                peer: p.id.0.clone(),
            };
            if let Some(age_ms) = p.summary_age_ms {
                self.metrics
                    .prefixes_age
                    .get_or_create(&label)
                    .set(age_ms as f64 / 1000.0);
            }
            if let Some(age_ms) = p.stats_age_ms {
                self.metrics
                    .stats_age
                    .get_or_create(&label)
                    .set(age_ms as f64 / 1000.0);
            }
        }
    }
}

/// The node's TCP listeners, bound by the caller (tests bind port 0).
#[derive(Debug)]
pub struct NodeListeners {
    /// Client ingress.
    pub http: TcpListener,
    /// Admin API and metrics.
    pub admin: TcpListener,
}

impl NodeListeners {
    /// Bind the addresses in the config.
    pub async fn bind(config: &NodeConfig) -> Result<Self, NodeError> {
        Ok(NodeListeners {
            http: TcpListener::bind(config.listen.http).await?,
            admin: TcpListener::bind(config.listen.admin).await?,
        })
    }
}

/// A running node.
#[derive(Debug)]
pub struct NodeHandle {
    /// Where clients connect.
    pub http_addr: SocketAddr,
    /// Where the admin API listens.
    pub admin_addr: SocketAddr,
    /// Shared state (tests inspect it).
    pub state: Arc<NodeState>,
    tasks: JoinSet<()>,
}

impl NodeHandle {
    /// The graceful stop (SIGTERM), before shutdown: `/readyz` turns 503 so load
    /// balancers stop sending, peers are told this node is leaving so they stop
    /// forwarding to it, new client requests go to peers while any is alive, and the
    /// requests in flight (clients' and peers' forwards) finish, for up to `deadline`.
    /// Returns how many were still in flight at the end (0: a clean drain). The caller
    /// then leaves the cluster (`PeerSource::leave`) and cancels the shutdown token.
    pub async fn drain(&self, deadline: Duration) -> usize {
        drain(&self.state, deadline).await
    }

    /// Wait until every task of the node ended (after shutdown).
    pub async fn wait(mut self) {
        while self.tasks.join_next().await.is_some() {}
    }
}

/// [`NodeHandle::drain`] on the node's shared state. In order: readiness off and
/// peers told (its stats say `draining`: they stop forwarding here, `PeerSource::
/// drain`); new client requests go to peers; once the
/// local engine's requests and peers' forwards are done, the client listener stops
/// accepting and each connection closes after its in-flight requests (HTTP/1
/// `Connection: close`, HTTP/2 GOAWAY: clients reconnect elsewhere); then the client
/// requests still being relayed finish. Waiting on relayed requests alone would never
/// end under load: keep-alive clients keep sending.
pub async fn drain(state: &Arc<NodeState>, deadline: Duration) -> usize {
    state.start_draining();
    state.peers.drain();
    let started = Instant::now();
    let limits = &state.config.limits;
    let local_work = || {
        state.engine.inflight() as usize
            + (limits.max_forwards - state.forward_permits.available_permits())
    };
    let clients = || limits.max_concurrency - state.permits.available_permits();
    for phase in ["local work", "client requests"] {
        loop {
            let n = if phase == "local work" {
                local_work()
            } else {
                clients()
            };
            if n == 0 {
                tracing::info!(
                    phase,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "drained"
                );
                break;
            }
            if started.elapsed() >= deadline {
                tracing::warn!(phase, in_flight = n, "drain deadline passed");
                state.closing.cancel();
                return local_work() + clients();
            }
            // A stop is rare and this is not a test: a short poll is the simple way to
            // watch the counters.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        state.closing.cancel();
    }
    0
}

/// Start a node: serve the ingress and the admin API, health-check and scrape the
/// engine, publish queue stats to peers, and serve incoming forwards, until `shutdown`.
pub async fn start(
    state: Arc<NodeState>,
    listeners: NodeListeners,
    incoming: impl Into<IncomingForwards>,
    shutdown: CancellationToken,
) -> Result<NodeHandle, NodeError> {
    use futures::StreamExt;
    let mut incoming: IncomingForwards = incoming.into();
    let http_addr = listeners.http.local_addr()?;
    let admin_addr = listeners.admin.local_addr()?;
    let mut tasks = JoinSet::new();

    let fd_limit = listen::raise_fd_limit();
    let client_limits = listen::ConnLimits::client(&state.config.limits, fd_limit);
    tracing::info!(
        fd_limit,
        max_connections = client_limits.max_connections,
        "connection caps"
    );
    tasks.spawn(listen::run(
        listeners.http,
        ingress::router(state.clone()),
        client_limits,
        "client",
        state.metrics.connections.clone(),
        state.closing.clone(),
        shutdown.clone(),
    ));
    // The admin port stays up through a drain (probes see `draining`) until shutdown.
    tasks.spawn(listen::run(
        listeners.admin,
        admin::router(state.clone()),
        listen::ConnLimits::admin(&state.config.limits),
        "admin",
        state.metrics.connections.clone(),
        shutdown.child_token(),
        shutdown.clone(),
    ));

    let engine = state.engine.clone();
    let health_every = Duration::from_millis(state.config.engine.health_interval_ms);
    let metrics_every = (state.config.engine.metrics_interval_ms > 0)
        .then(|| Duration::from_millis(state.config.engine.metrics_interval_ms));
    tasks.spawn(engine.run_background(health_every, metrics_every, shutdown.clone()));

    let st = state.clone();
    let sd = shutdown.clone();
    tasks.spawn(async move {
        let mut tick =
            tokio::time::interval(Duration::from_millis(st.config.cluster.gossip_interval_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = sd.cancelled() => return,
                _ = tick.tick() => {
                    // Follow the engine's KV capacity once its metrics report it.
                    let capacity = st.engine.kv_capacity_tokens();
                    let delta = st.shadow.lock().set_capacity(capacity);
                    if let Some(delta) = delta {
                        st.peers.publish_summary(&delta);
                    }
                    st.summary_sample_tick();
                    st.peers.publish_stats(st.local_stats());
                    st.tuning_tick();
                }
            }
        }
    });

    if state.kv_events.is_some() {
        tasks.spawn(kv_events::run(state.clone(), shutdown.clone()));
    }

    let st = state.clone();
    let sd = shutdown.clone();
    tasks.spawn(async move {
        let mut running = JoinSet::new();
        loop {
            tokio::select! {
                _ = sd.cancelled() => break,
                next = incoming.next() => match next {
                    Some(fwd) => {
                        running.spawn(forward::handle_incoming(st.clone(), fwd, |state, req| async move {
                            serve::serve(&state, req).await
                        }));
                    }
                    None => break,
                },
                Some(_) = running.join_next(), if !running.is_empty() => {}
            }
        }
        // Shutdown is a stop: forwards still being served end here, and their origins
        // fall back or report the cut. A graceful stop drains first
        // ([`NodeHandle::drain`]).
        running.shutdown().await;
    });

    tracing::info!(node = %state.id, %http_addr, %admin_addr, "node started");
    Ok(NodeHandle {
        http_addr,
        admin_addr,
        state,
        tasks,
    })
}
