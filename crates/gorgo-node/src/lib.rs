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
pub mod budget;
pub mod cluster;
pub mod config;
pub mod engine;
pub mod error;
pub mod forward;
pub mod ingress;
pub mod kv_events;
pub mod kv_guard;
pub mod listen;
pub mod local;
pub mod mesh;
pub mod metrics;
pub mod peers;
pub mod route;
pub mod serve;
pub mod shadow;
pub mod sse;
pub mod stream_usage;
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
pub use peers::{IncomingForward, IncomingForwards, NoPeers, PeerEngine, PeerSource, PeerView};
pub use tokio_util::sync::CancellationToken;

/// Everything a running node shares between its tasks.
pub struct NodeState {
    /// The config, checked once where it was read.
    pub config: ValidatedConfig,
    /// This node's id.
    pub id: NodeId,
    /// The engines this node fronts (replicas), in replica order; see
    /// [`NodeState::engines`].
    engines: RwLock<local::EngineSet>,
    /// The replica number the next engine added takes (never reused within a run);
    /// its lock also makes each change of the engine set (add, remove) one at a time.
    next_replica: Mutex<u16>,
    /// The node's shutdown, once started: engines added at run time run their tasks
    /// under it.
    shutdown: std::sync::OnceLock<CancellationToken>,
    /// The cluster view.
    pub peers: Arc<dyn PeerSource>,
    /// The weights routing uses now: a mirror of [`NodeState::tuning`]'s, refreshed
    /// after every tuning step (requests take theirs from [`tuning::TuningDriver::admit`]).
    pub weights: Arc<RwLock<Weights>>,
    /// Online tuning of the weights (docs/design.md, "Online tuning").
    pub tuning: tuning::TuningDriver,
    /// Decisions and the forward ledger.
    pub router: route::Router,
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
    /// Cap on forwards: those served for peers, and client requests relayed to a peer
    /// because the ingress cap was full (overflow).
    pub forward_permits: Arc<Semaphore>,
    /// One permit held by each overflow relay besides its forward permit: the count
    /// that tells a drain's "local work" (peers' forwards served here) from client
    /// requests that only pass through to peers.
    pub overflow_permits: Arc<Semaphore>,
    /// Bytes of request bodies being read at once, clients' and peers' together.
    pub body_budget: budget::BodyBudget,
    /// The last `/health_generate` probe's outcome (`Err`: why it failed) and when it
    /// ended, held while a probe runs: probes run one at a time, and those that arrive
    /// during one share its answer, so unauthenticated callers cannot turn the route
    /// into unbounded engine work.
    pub(crate) health_probe: tokio::sync::Mutex<Option<(Instant, Result<(), String>)>>,
    /// The last `/metrics` encoding of each format (OpenMetrics, Prometheus text) and
    /// when it started, held while one runs: scrapes run one at a time, off the async
    /// workers, and those that arrive during one wait for the next and share it, so
    /// a flood of scrapes (no token needed) neither parks the workers the client
    /// ingress runs on nor encodes the registry once each.
    pub(crate) scrapes: tokio::sync::Mutex<[Option<(Instant, bytes::Bytes)>; 2]>,
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
        let engines = config
            .engines()
            .iter()
            .enumerate()
            .map(|(i, e)| {
                local::LocalEngine::new(&config, e, i as u16, CancellationToken::new(), 0)
                    .map(Arc::new)
            })
            .collect::<Result<Vec<_>, _>>()?;
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
        let learned = config
            .tuning
            .weights_file
            .as_deref()
            .map(tuning::read_learned_weights)
            .transpose()?;
        let tuning_cfg = config.tuning.core_config(learned);
        let id = NodeId(config.node.id.clone());
        let tuning = tuning::TuningDriver::new(
            id.clone(),
            tuning_cfg,
            learned.unwrap_or(config.routing.start_weights()),
        )?
        .with_learned_weights_out(config.tuning.learned_weights_out.clone());
        let body_budget = budget::BodyBudget::new(
            config.limits.max_body_bytes_in_flight,
            metrics.body_bytes_reading.clone(),
        );
        Ok(Arc::new(NodeState {
            id,
            weights: Arc::new(RwLock::new(tuning.weights())),
            tuning,
            router: route::Router::new(
                config.routing.decision_log,
                gorgo_core::hash::hash_bytes(config.node.id.as_bytes()),
            ),
            next_replica: Mutex::new(engines.len() as u16),
            engines: RwLock::new(Arc::new(engines)),
            shutdown: std::sync::OnceLock::new(),
            policy,
            hasher,
            metrics,
            tokens,
            permits: Arc::new(Semaphore::new(config.limits.max_concurrency)),
            forward_permits: Arc::new(Semaphore::new(config.limits.max_forwards)),
            overflow_permits: Arc::new(Semaphore::new(config.limits.max_forwards)),
            body_budget,
            health_probe: tokio::sync::Mutex::new(None),
            scrapes: tokio::sync::Mutex::new([None, None]),
            draining: AtomicBool::new(false),
            closing: CancellationToken::new(),
            started: Instant::now(),
            next_id: AtomicU64::new(1),
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

    /// Whether a drain has got past the work only this node can finish (its engines'
    /// requests, peers' forwards) and closed the client listener ([`drain`]).
    pub fn is_closing(&self) -> bool {
        self.closing.is_cancelled()
    }

    /// Whether this node is ready for traffic (`/readyz`): not draining, and one of its
    /// own engines (not drained) is confirmed healthy. A node whose engine is down could still forward,
    /// but a load balancer does better sending its clients to a node with an engine.
    /// Nor is a node whose peers refuse its id and none is alive
    /// ([`peers::refused_island`]): a second process with a live node's id.
    pub fn is_ready(&self) -> bool {
        !self.is_draining()
            && self
                .engines()
                .iter()
                .any(|e| e.status() == local::EngineStatus::Serving && e.adapter.is_ready())
            && peers::refused_island(&*self.peers).is_empty()
    }

    /// The engines this node fronts now, in replica order (a snapshot: an engine
    /// added or removed meanwhile makes a new set).
    pub fn engines(&self) -> local::EngineSet {
        self.engines.read().clone()
    }

    /// Engine `replica`, while the node fronts it.
    pub fn engine(&self, replica: u16) -> Option<Arc<local::LocalEngine>> {
        self.engines()
            .iter()
            .find(|e| e.replica == replica)
            .cloned()
    }

    /// The engine for what is not routed (model lists, passthrough endpoints, probes):
    /// the least busy of those taking requests, else the first. `None` only if the set
    /// were empty, which it never is (a config has at least one engine, and the last
    /// one cannot be removed); callers answer 503 then.
    pub fn preferred_engine(&self) -> Option<Arc<local::LocalEngine>> {
        let engines = self.engines();
        engines
            .iter()
            .filter(|e| e.takes_requests())
            .min_by_key(|e| e.adapter.inflight())
            .or_else(|| engines.first())
            .cloned()
    }

    /// Whether any engine takes requests now.
    pub fn any_engine_takes_requests(&self) -> bool {
        self.engines().iter().any(|e| e.takes_requests())
    }

    /// Requests in flight at this node's engines.
    pub fn engine_inflight(&self) -> u64 {
        self.engines().iter().map(|e| e.adapter.inflight()).sum()
    }

    /// Add an engine at run time (`POST /admin/engines`): it takes the next replica
    /// number, is gossiped as its own stream (draining until then), and takes
    /// requests once its first health check passes. Refused before the node started (its tasks need the
    /// node's runtime) and past [`gorgo_core::types::MAX_REPLICAS`] engines in a run.
    pub fn add_engine(
        self: &Arc<Self>,
        engine: config::EngineSection,
    ) -> Result<Arc<local::LocalEngine>, NodeError> {
        // One change of the engine set at a time (add, remove, reload).
        let mut next = self.next_replica.lock();
        // An engine on its way out is the node's state, not a mistake in the body: it
        // can come back once it has left.
        let url = config::normalize_engine_url(&engine.url);
        if let Some(e) = self
            .engines()
            .iter()
            .find(|e| e.is_removing() && config::normalize_engine_url(&e.config.url) == url)
        {
            return Err(NodeError::Conflict(format!(
                "engine {} at {} is being removed ({} requests in flight); add it again once it has left",
                e.replica,
                engine.url,
                e.adapter.inflight()
            )));
        }
        let added = self.prepare_engines(*next, std::slice::from_ref(&engine))?;
        self.install_engines(&mut next, &added)?;
        Ok(added[0].clone())
    }

    /// The engines `new` would be, numbered from replica `next`, each checked (with
    /// the engines the node fronts now and those of `new` before it) and built, but
    /// none in the set and none started: everything an addition can fail on, done
    /// before the set changes, so that a reload adds all of its engines or none.
    fn prepare_engines(
        &self,
        next: u16,
        new: &[config::EngineSection],
    ) -> Result<Vec<Arc<local::LocalEngine>>, NodeError> {
        if new.is_empty() {
            return Ok(Vec::new());
        }
        let Some(shutdown) = self.shutdown.get() else {
            return Err(NodeError::Config("the node has not started".into()));
        };
        // Checked as the config file's engines are, with the engines the node fronts
        // now (not the file's at start: an engine of the file removed since may come
        // back).
        let mut list: Vec<config::EngineSection> =
            self.engines().iter().map(|e| e.config.clone()).collect();
        for engine in new {
            list.push(engine.clone());
            let mut check = self.config.clone().into_inner();
            check.engine = None;
            check.engines = list.clone();
            check.validate_added_engine()?;
        }
        // The node's state, not the body: a 409, and only a restart lifts it.
        if usize::from(next) + new.len() > usize::from(gorgo_core::types::MAX_REPLICAS) {
            return Err(NodeError::Conflict(format!(
                "{next} engines were added in this run, the limit is {}: restart the node to add {} more",
                gorgo_core::types::MAX_REPLICAS,
                new.len()
            )));
        }
        new.iter()
            .zip(next..)
            .map(|(engine, replica)| {
                let e = local::LocalEngine::new(
                    &self.config,
                    engine,
                    replica,
                    shutdown.child_token(),
                    self.now_ms(),
                )?;
                Ok(Arc::new(e.awaiting_first_check()))
            })
            .collect()
    }

    /// Put engines built by [`prepare_engines`](Self::prepare_engines) in the set, in
    /// one change, and start them; `next` (held since they were prepared) moves past
    /// their replica numbers.
    fn install_engines(
        self: &Arc<Self>,
        next: &mut u16,
        added: &[Arc<local::LocalEngine>],
    ) -> Result<(), NodeError> {
        {
            let mut engines = self.engines.write();
            for a in added {
                let url = config::normalize_engine_url(&a.config.url);
                if engines
                    .iter()
                    .any(|e| config::normalize_engine_url(&e.config.url) == url)
                {
                    return Err(NodeError::invalid(
                        "url",
                        format!("the node already fronts {}", a.config.url),
                    ));
                }
            }
            let mut set = engines.as_ref().clone();
            set.extend(added.iter().cloned());
            *engines = Arc::new(set);
        }
        for a in added {
            *next += 1;
            self.peers.add_engine(a.replica);
            spawn_engine_tasks(self, a, &mut None);
            tracing::info!(replica = a.replica, url = %a.config.url, "engine added");
        }
        Ok(())
    }

    /// Remove engine `replica` (`DELETE /admin/engines/{replica}`): it drains (no new
    /// requests; peers see it draining) and leaves the set, and then its peers'
    /// views, once its requests are done ([`NodeState::engines_tick`]). False when no
    /// such engine; refused for the last engine in rotation (serving, a health check
    /// passed and its breaker not open, as `/readyz` counts it): a node left with
    /// drained engines, or with engines no health check has passed, serves nothing
    /// itself, and nothing would say why.
    pub fn remove_engine(&self, replica: u16) -> Result<bool, NodeError> {
        // One change of the engine set at a time: two removals counting the engines
        // that stay at once could each leave the other as the last, and remove both.
        let _changing = self.next_replica.lock();
        let engines = self.engines();
        let Some(e) = engines.iter().find(|e| e.replica == replica) else {
            return Ok(false);
        };
        if e.is_removing() {
            return Ok(true);
        }
        one_stays_in_rotation(&engines, &[replica], &[])?;
        e.start_removing();
        tracing::info!(replica, url = %e.config.url, "engine removal: draining");
        Ok(true)
    }

    /// Make the engine set follow a config's `[[engines]]` (the node binary's SIGHUP
    /// reload): entries whose `url` the node does not front are added, engines whose
    /// `url` the list no longer has are removed (drained first). An entry whose url
    /// stays keeps its engine as it runs (changed settings of it need a restart, and
    /// are named in the log). Returns the replicas added and removed. All or nothing:
    /// every addition and removal is checked before any is made (docs/node.md says a
    /// bad reload changes nothing), and an error changes nothing. The new engines
    /// count as staying in rotation before any health check of theirs: a list that
    /// replaces every engine is no removal of the last (the file says what the
    /// engines are; the API's additions, one at a time, are checked first).
    pub fn reload_engines(
        self: &Arc<Self>,
        wanted: &[config::EngineSection],
    ) -> Result<(Vec<u16>, Vec<u16>), NodeError> {
        // Held from the plan to the last change: the plan is checked against the set
        // it changes.
        let mut next = self.next_replica.lock();
        let current = self.engines();
        // By engine, however its URL is spelled here or there.
        let same =
            |a: &str, b: &str| config::normalize_engine_url(a) == config::normalize_engine_url(b);
        let mut new = Vec::new();
        for w in wanted {
            match current.iter().find(|e| same(&e.config.url, &w.url)) {
                None => new.push(w.clone()),
                // Still draining out (removed through the admin API): it cannot come
                // back before it has left. The rest of the list is applied.
                Some(e) if e.is_removing() => {
                    tracing::warn!(replica = e.replica, url = %w.url, "reload: this engine is still being removed; reload again once it has left to add it back");
                }
                Some(_) => {}
            }
        }
        let mut leaving = Vec::new();
        for e in current.iter().filter(|e| !e.is_removing()) {
            match wanted.iter().find(|w| same(&w.url, &e.config.url)) {
                None => leaving.push(e.clone()),
                // Settings other than the URL's spelling.
                Some(w)
                    if (config::EngineSection {
                        url: e.config.url.clone(),
                        ..w.clone()
                    }) != e.config =>
                {
                    tracing::warn!(replica = e.replica, url = %e.config.url, "reload: this engine's settings changed; restart the node to apply them");
                }
                Some(_) => {}
            }
        }
        let added = self.prepare_engines(*next, &new)?;
        let after: Vec<_> = current.iter().chain(&added).cloned().collect();
        let removed: Vec<u16> = leaving.iter().map(|e| e.replica).collect();
        let new: Vec<u16> = added.iter().map(|e| e.replica).collect();
        one_stays_in_rotation(&after, &removed, &new)?;
        // Nothing below fails but a race `install_engines` refuses before it changes
        // anything.
        self.install_engines(&mut next, &added)?;
        for e in &leaving {
            e.start_removing();
            tracing::info!(replica = e.replica, url = %e.config.url, "engine removal: draining");
        }
        Ok((added.iter().map(|e| e.replica).collect(), removed))
    }

    /// Once per gossip interval: follow each engine's KV capacity, keep its summary
    /// sample in step with the cluster, publish its stats, and let go of removed
    /// engines whose requests are done (their last stats say draining, then their
    /// gossip stream ends: peers drop them, summary and all).
    pub fn engines_tick(&self) {
        let live = self.peers.peers().iter().filter(|p| p.alive).count();
        let now = self.now_ms();
        let epoch = self.tuning.epoch();
        let mut gone = Vec::new();
        for e in self.engines().iter() {
            let capacity = e.adapter.kv_capacity_tokens();
            self.change_index(e.replica, &e.shadow, |shadow| {
                [
                    shadow.set_capacity(capacity),
                    shadow.follow_peers(live, now),
                ]
            });
            // Read once, before the stats: an engine that leaves at this tick must
            // have said draining in the stats it published last (peers keep them,
            // and would price a replica that is gone as idle). Read after them, a
            // removal landing in between let it leave with stats that said serving.
            let removing = e.is_removing();
            let mut stats = e.queue_stats(epoch);
            stats.draining |= removing;
            self.peers.publish_stats(stats);
            if removing && e.adapter.inflight() == 0 {
                // Its summary goes empty before it leaves: a peer of an earlier build,
                // which keeps the engine after its stream ends, holds no fingerprints
                // of it against its cap on a peer's.
                self.change_index(e.replica, &e.shadow, |shadow| [shadow.clear()]);
                gone.push(e.replica);
            }
        }
        if !gone.is_empty() {
            let mut engines = self.engines.write();
            let kept: Vec<_> = engines
                .iter()
                .filter(|e| {
                    let leaves = gone.contains(&e.replica);
                    if leaves {
                        e.stop.cancel();
                        self.metrics.kv_events.forget(e.replica);
                        tracing::info!(replica = e.replica, "engine removed");
                    }
                    !leaves
                })
                .cloned()
                .collect();
            *engines = Arc::new(kept);
            drop(engines);
            // Its stream ends after the draining stats above: peers drop the engine
            // (before, they listed it for the rest of the run).
            for &replica in &gone {
                self.peers.remove_engine(replica);
            }
        }
    }

    /// Change engine `replica`'s prefix `index` with `change` and hand the summary changes it
    /// returns to gossip, under the index's lock. Taken under it and handed over after
    /// it, two changes could reach the gossiped mirror in the other order: an older
    /// delta after a sample change set the mirror back to the old sample, and brought
    /// back fingerprints the newer one had removed.
    pub fn change_index<const N: usize>(
        &self,
        replica: u16,
        index: &Mutex<shadow::LocalCache>,
        change: impl FnOnce(&mut shadow::LocalCache) -> [Option<gorgo_core::summary::SummaryDelta>; N],
    ) {
        let mut cache = index.lock();
        for delta in change(&mut cache).into_iter().flatten() {
            self.peers.publish_summary(replica, &delta);
        }
    }

    /// A fresh request id.
    pub fn next_request_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The queue stats of each of this node's engines (the view of it, with its
    /// current fit) and the tuning epoch it routes with.
    pub fn local_stats(&self) -> Vec<QueueStats> {
        let epoch = self.tuning.epoch();
        self.engines()
            .iter()
            .map(|e| e.queue_stats(epoch))
            .collect()
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

    /// Let the forward ledger forget the peers the cluster has forgotten (down past
    /// its `remove_down_after`), so that it does not keep every peer id it ever heard
    /// of, with their pending forwards and forward bias
    /// (`gorgo_core::cost::ForwardLedger::retain_peers`). Runs every gossip interval.
    pub fn forget_departed_peers(&self) {
        let known: std::collections::HashSet<NodeId> =
            self.peers.peers().into_iter().map(|p| p.id).collect();
        self.router
            .ledger
            .lock()
            .retain_peers(|p| known.contains(p));
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
        if let Some(write) = fx.learned_write {
            // File work blocks: off the async workers where there are some. A failed
            // write logs itself and comes back in a later step's effects.
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn_blocking(move || write.write());
                }
                Err(_) => {
                    let _ = write.write();
                }
            }
        }
        *self.weights.write() = self.tuning.weights();
        self.metrics
            .tuning_epoch
            .set(metrics::gauge_value(self.tuning.epoch()));
        self.metrics
            .tuning_leader
            .set(self.tuning.is_leader() as i64);
    }

    /// Client requests in flight: those holding an ingress slot (from the moment the
    /// slot is taken, through routing, the engine's or a peer's wait for a head, to the
    /// body's end), and the overflow relays. What `gorgo_inflight_requests` shows and
    /// a drain waits on.
    pub fn client_requests_in_flight(&self) -> usize {
        let limits = &self.config.limits;
        (limits.max_concurrency - self.permits.available_permits())
            + (limits.max_forwards - self.overflow_permits.available_permits())
    }

    /// Update the gauges that are read at scrape time. The per-engine and per-peer
    /// families are cleared and refilled, so a removed engine's series and a
    /// forgotten peer's go with them; what they are refilled with is read first, and
    /// the rebuild runs under [`metrics::NodeMetrics::refilling`], so a scrape
    /// encoding at the same moment sees the families whole.
    pub fn refresh_gauges(&self) {
        let peers = self.peers.peers();
        let gossip = self.peers.gossip_counters();
        let engines = self.engines();
        let replicas: Vec<(metrics::ReplicaLabels, bool, u64)> = engines
            .iter()
            .map(|e| {
                let label = metrics::ReplicaLabels {
                    replica: e.replica.to_string(),
                };
                (label, e.takes_requests(), e.adapter.inflight())
            })
            .collect();
        let refilling = self.metrics.refilling();
        self.metrics
            .inflight
            .set(metrics::gauge_value(self.client_requests_in_flight() as u64));
        self.metrics
            .peers_alive
            .set(peers.iter().filter(|p| p.alive).count() as i64);
        self.metrics.replica_serving.clear();
        self.metrics.replica_inflight.clear();
        for (label, serving, inflight) in &replicas {
            self.metrics
                .replica_serving
                .get_or_create(label)
                .set(*serving as i64);
            self.metrics
                .replica_inflight
                .get_or_create(label)
                .set(metrics::gauge_value(*inflight));
        }
        self.metrics
            .engine_healthy
            .set(engines.iter().filter(|e| e.is_healthy()).count() as i64);
        self.metrics
            .engine_breaker
            .set(worst_breaker(engines.iter().map(|e| e.adapter.breaker())));
        self.metrics.observe_gossip(&gossip);
        // A peer the cluster has forgotten (down for a while) goes with its series.
        self.metrics.prefixes_age.clear();
        self.metrics.stats_age.clear();
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
            if let Some(age_ms) = p.freshest_stats_age_ms() {
                self.metrics
                    .stats_age
                    .get_or_create(&label)
                    .set(age_ms as f64 / 1000.0);
            }
        }
        drop(refilling);
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
    /// Bind the addresses in the config; an error names the field and the address
    /// (a port in use is a config problem the operator must find).
    pub async fn bind(config: &NodeConfig) -> Result<Self, NodeError> {
        let bind = |field: &'static str, addr: SocketAddr| async move {
            TcpListener::bind(addr).await.map_err(|e| {
                NodeError::Config(format!("invalid `{field}`: cannot listen on {addr}: {e}"))
            })
        };
        Ok(NodeListeners {
            http: bind("listen.http", config.listen.http).await?,
            admin: bind("listen.admin", config.listen.admin).await?,
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
    // Peers' forwards served here: forward permits held, less those of overflow
    // relays, which go to peers and, under load, never all end at once (they held the
    // drain to its deadline).
    let local_work = || {
        let forwards = limits.max_forwards - state.forward_permits.available_permits();
        let relays = limits.max_forwards - state.overflow_permits.available_permits();
        state.engine_inflight() as usize + forwards.saturating_sub(relays)
    };
    let clients = || state.client_requests_in_flight();
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

/// Refused (409) when removing the engines `leaving` would take the node's engines
/// out of rotation, the staying engines all drained or being removed, or all without
/// a passed health check while one leaving has: a node left so serves nothing itself,
/// and nothing would say why. In rotation: serving (not drained, not being removed),
/// and ready as `/readyz` counts it, a health check passed and the breaker not open;
/// `fresh` engines (a reload's new ones) count as ready before their first check. A
/// removal that leaves the node no less ready than it is is not refused: a node whose
/// engines never passed a check (it started before them) can still swap them.
fn one_stays_in_rotation(
    engines: &[Arc<local::LocalEngine>],
    leaving: &[u16],
    fresh: &[u16],
) -> Result<(), NodeError> {
    if leaving.is_empty() {
        return Ok(());
    }
    let serving = |o: &&Arc<local::LocalEngine>| o.status() == local::EngineStatus::Serving;
    let ready = |o: &&Arc<local::LocalEngine>| {
        serving(o) && (fresh.contains(&o.replica) || o.adapter.is_ready())
    };
    let (gone, staying): (Vec<_>, Vec<_>) =
        engines.iter().partition(|o| leaving.contains(&o.replica));
    if staying.iter().any(serving) && (staying.iter().any(ready) || !gone.iter().any(ready)) {
        return Ok(());
    }
    let named = |of: &dyn Fn(&&Arc<local::LocalEngine>) -> bool| -> String {
        let replicas: Vec<String> = staying
            .iter()
            .filter(|o| of(o))
            .map(|o| o.replica.to_string())
            .collect();
        replicas.join(", ")
    };
    let drained = named(&|o| !o.is_removing() && !serving(o));
    let unchecked = named(&|o| serving(o));
    Err(NodeError::Conflict(if !unchecked.is_empty() {
        format!(
            "the node's last engine that passed its health checks cannot be removed (not passed or failing now: {unchecked}; remove it once another has passed one)"
        )
    } else if drained.is_empty() {
        "the node's last engine cannot be removed".into()
    } else {
        format!(
            "the node's last engine in rotation cannot be removed (drained: {drained}; put one back with POST /admin/engines/R/serve first)"
        )
    }))
}

/// Start engine `e`'s tasks (health checks, scrapes, KV events) until the node's
/// shutdown or the engine's removal: in the node's task set at start, detached for an
/// engine added at run time (they end with the engine's `stop`, a child of shutdown).
fn spawn_engine_tasks(
    state: &Arc<NodeState>,
    e: &Arc<local::LocalEngine>,
    tasks: &mut Option<&mut JoinSet<()>>,
) {
    let Some(shutdown) = state.shutdown.get() else {
        return;
    };
    // Stops with the node or with the engine, whichever comes first.
    let stop = shutdown.child_token();
    let (engine_stop, both) = (e.stop.clone(), stop.clone());
    let sd = shutdown.clone();
    let watcher = async move {
        tokio::select! {
            _ = engine_stop.cancelled() => both.cancel(),
            _ = sd.cancelled() => {}
        }
    };
    let cfg = &e.config;
    let health_every = Duration::from_millis(cfg.health_interval_ms);
    let metrics_every =
        (cfg.metrics_interval_ms > 0).then(|| Duration::from_millis(cfg.metrics_interval_ms));
    let background = e
        .adapter
        .clone()
        .run_background(health_every, metrics_every, stop.clone());
    let events = e.kv_events.is_some().then(|| {
        let (state, e) = (state.clone(), e.clone());
        async move {
            if let Some(kv) = e.kv_events.as_ref() {
                let engine = kv_events::FollowedEngine {
                    replica: e.replica,
                    shadow: &e.shadow,
                };
                kv_events::run(state, engine, kv, stop).await;
            }
        }
    });
    match tasks {
        Some(set) => {
            set.spawn(watcher);
            set.spawn(background);
            if let Some(ev) = events {
                set.spawn(ev);
            }
        }
        None => {
            tokio::spawn(watcher);
            tokio::spawn(background);
            if let Some(ev) = events {
                tokio::spawn(ev);
            }
        }
    }
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

    let _ = state.shutdown.set(shutdown.clone());
    for e in state.engines().iter() {
        spawn_engine_tasks(&state, e, &mut Some(&mut tasks));
    }

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
                    st.engines_tick();
                    st.tuning_tick();
                    st.forget_departed_peers();
                }
            }
        }
    });

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

/// The breaker gauge of a node with several engines: the worst engine's state
/// ([`gorgo_core::health::BreakerState::severity`]), as its code; 0 with none.
fn worst_breaker(states: impl Iterator<Item = gorgo_core::health::BreakerState>) -> i64 {
    states.max_by_key(|s| s.severity()).map_or(0, |s| s.code())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The node's breaker gauge is the worst engine's state: one open engine beside a
    /// half-open one is open (1), not half-open (2, the larger code).
    #[test]
    fn the_breaker_gauge_is_the_worst_engines() {
        use gorgo_core::health::BreakerState::{Closed, HalfOpen, Open};
        let open = Open { until_ms: 5 };
        let half = HalfOpen { probing: false };
        assert_eq!(worst_breaker([half, open, Closed].into_iter()), 1);
        assert_eq!(worst_breaker([Closed, half].into_iter()), 2);
        assert_eq!(worst_breaker([Closed, Closed].into_iter()), 0);
        assert_eq!(worst_breaker(std::iter::empty()), 0);
    }

    /// A cluster view the test scripts: its peers and its gossip totals.
    #[derive(Debug, Default)]
    struct ScriptedPeers {
        peers: Mutex<Vec<PeerView>>,
        gossip: Mutex<peers::GossipCounters>,
    }

    impl PeerSource for ScriptedPeers {
        fn peers(&self) -> Vec<PeerView> {
            self.peers.lock().clone()
        }
        fn matched_tokens(&self, _: &NodeId, _: u16, _: &gorgo_core::HashChain) -> u64 {
            0
        }
        fn open_forward(
            &self,
            peer: &NodeId,
        ) -> futures::future::BoxFuture<
            'static,
            Result<(peers::ForwardSend, peers::ForwardRecv), NodeError>,
        > {
            let peer = peer.clone();
            Box::pin(async move { Err(NodeError::Cluster(format!("no stream to {peer}"))) })
        }
        fn peer_gone(&self, _: &NodeId) -> futures::future::BoxFuture<'static, ()> {
            Box::pin(std::future::pending())
        }
        fn publish_stats(&self, _: QueueStats) {}
        fn gossip_counters(&self) -> peers::GossipCounters {
            *self.gossip.lock()
        }
    }

    /// A live peer whose stats are 1.5 s old and prefix summary 2.5 s.
    fn peer(id: &str) -> PeerView {
        PeerView {
            id: NodeId::from(id),
            region: Some(id.to_owned()),
            alive: true,
            rtt_ms: 1.0,
            stats: None,
            engines: Vec::new(),
            stats_age_ms: Some(1500),
            summary_version: 1,
            summary_entries: 0,
            summary_age_ms: Some(2500),
        }
    }

    /// A node (not started) over `peers`.
    fn node(peers: Arc<ScriptedPeers>) -> Arc<NodeState> {
        let config = NodeConfig::from_toml_str(config::tests::MINIMAL).unwrap();
        NodeState::new(config, peers).unwrap()
    }

    /// A peer the cluster forgot (down past `forget_down`) leaves the per-peer age
    /// gauges: its series used to stay at its last value, looking fresh, and the label
    /// set grew with every peer ever seen.
    #[test]
    fn a_forgotten_peer_leaves_the_age_gauges() {
        let peers = Arc::new(ScriptedPeers::default());
        *peers.peers.lock() = vec![peer("b"), peer("c")];
        let state = node(peers.clone());
        state.refresh_gauges();
        let text = state.metrics.encode();
        assert!(
            text.contains(r#"gorgo_peer_stats_age_seconds{peer="b"} 1.5"#),
            "{text}"
        );
        *peers.peers.lock() = vec![peer("c")];
        state.refresh_gauges();
        let text = state.metrics.encode();
        assert!(!text.contains(r#"peer="b""#), "{text}");
        assert!(
            text.contains(r#"gorgo_peer_prefixes_age_seconds{peer="c"} 2.5"#),
            "{text}"
        );
    }

    /// A peer the cluster forgot leaves the forward ledger: its pending forwards and
    /// forward bias used to stay for good, for every peer id ever heard of.
    #[test]
    fn a_forgotten_peer_leaves_the_forward_ledger() {
        let peers = Arc::new(ScriptedPeers::default());
        *peers.peers.lock() = vec![peer("b"), peer("c")];
        let state = node(peers.clone());
        let (b, c) = (NodeId::from("b"), NodeId::from("c"));
        for p in [&b, &c] {
            let mut ledger = state.router.ledger.lock();
            ledger.record_forward(p, 0, 100, 100, 10);
            ledger.observe_forward_ttft(p, 0, 100.0, 1100.0, 10);
        }
        state.forget_departed_peers();
        assert_eq!(state.router.ledger.lock().pending(&b, 0), (1, 100));
        *peers.peers.lock() = vec![peer("c")];
        state.forget_departed_peers();
        let ledger = state.router.ledger.lock();
        assert_eq!(ledger.pending(&b, 0), (0, 0));
        assert_eq!(ledger.forward_bias_ms(&b, 0, 10), 0.0);
        assert_eq!(ledger.pending(&c, 0), (1, 100));
        assert!(ledger.forward_bias_ms(&c, 0, 10) > 0.0);
    }

    /// The cluster's running totals are exported as counters (`_total`, the unit
    /// before it), each following its total: scraped twice with nothing new, a
    /// counter does not count the total again. They were gauges without `_total`.
    #[test]
    fn cluster_totals_are_counters_that_follow_their_totals() {
        let peers = Arc::new(ScriptedPeers::default());
        let state = node(peers.clone());
        let set = |n: u64| {
            let mut g = peers.gossip.lock();
            g.bytes_sent = 10 * n;
            g.bytes_received = 20 * n;
            g.identity_conflicts = n;
            g.own_id_claimed = n;
            g.spurious_turn_undead_dropped = n;
            g.refused.spoofed = n;
            g.traffic.swim = (n, 2 * n);
            g.messages_sent.deltas = n;
        };
        for n in [1, 3, 3] {
            set(n);
            state.refresh_gauges();
        }
        let text = state.metrics.encode_prometheus_text();
        for (family, series, value) in [
            ("gorgo_gossip_sent_bytes_total", "", 30),
            ("gorgo_gossip_received_bytes_total", "", 60),
            ("gorgo_cluster_identity_conflicts_total", "", 3),
            ("gorgo_cluster_own_id_claimed_total", "", 3),
            ("gorgo_cluster_spurious_turn_undead_dropped_total", "", 3),
            ("gorgo_cluster_refused_total", r#"{what="spoofed"}"#, 3),
            ("gorgo_cluster_refused_total", r#"{what="malformed"}"#, 0),
            (
                "gorgo_cluster_bytes_total",
                r#"{traffic="swim",direction="received"}"#,
                6,
            ),
            ("gorgo_gossip_messages_sent_total", r#"{kind="delta"}"#, 3),
        ] {
            assert!(
                text.contains(&format!("# TYPE {family} counter\n")),
                "{family}: {text}"
            );
            assert!(
                text.contains(&format!("\n{family}{series} {value}\n")),
                "{family}{series}: {text}"
            );
        }
        assert!(
            text.contains("# TYPE gorgo_request_body_reading_bytes gauge\n"),
            "{text}"
        );
    }

    /// A scrape encoding while another refreshes the gauges sees the families that
    /// are cleared and refilled whole (it used to be able to encode between the clear
    /// and the refill and miss their series). A race: each round may catch it, none
    /// can fail when the rebuild and the encoding exclude each other.
    #[test]
    fn a_scrape_during_a_refresh_sees_every_series() {
        let peers = Arc::new(ScriptedPeers::default());
        *peers.peers.lock() = vec![peer("b")];
        let state = node(peers);
        state.refresh_gauges();
        std::thread::scope(|s| {
            let refresher = s.spawn(|| {
                for _ in 0..2000 {
                    state.refresh_gauges();
                }
            });
            while !refresher.is_finished() {
                let text = state.metrics.encode();
                for series in [
                    r#"gorgo_engine_replica_serving{replica="0"}"#,
                    r#"gorgo_engine_replica_inflight_requests{replica="0"}"#,
                    r#"gorgo_peer_stats_age_seconds{peer="b"}"#,
                    r#"gorgo_peer_prefixes_age_seconds{peer="b"}"#,
                ] {
                    assert!(text.contains(series), "{series} missing:\n{text}");
                }
            }
        });
    }
}
