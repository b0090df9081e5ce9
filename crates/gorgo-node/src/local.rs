//! The engines a node fronts: one [`LocalEngine`] per replica (docs/design.md,
//! "Replicas"), each a routing candidate of its own with its adapter (health, breaker,
//! accounting and fit), its prefix index and its KV-event stream.
//!
//! The set changes at run time (`/admin/engines`): an engine added takes the next
//! replica number (numbers are never reused within a run, so peers never confuse a new
//! engine's summary and stats with a removed one's); an engine removed drains first
//! (no new requests, its stats say `draining` so peers stop counting on it), and is
//! dropped from the set once its requests are done.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use gorgo_core::QueueStats;
use parking_lot::Mutex;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::config::{EngineSection, ValidatedConfig};
use crate::engine::EngineAdapter;
use crate::error::NodeError;
use crate::kv_events::KvEvents;
use crate::shadow::LocalCache;

/// Where an engine is in its life on the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineStatus {
    /// Takes new requests (while healthy).
    Serving,
    /// Takes no new requests; what is in flight finishes (`weight` 0, or removal).
    Draining,
}

/// One engine of this node.
pub struct LocalEngine {
    /// Which of the node's engines: its name in gossip and decisions.
    pub replica: u16,
    /// Its config entry.
    pub config: EngineSection,
    /// Health, breaker, accounting and fit of the engine, and its HTTP client.
    pub adapter: Arc<EngineAdapter>,
    /// Model of the engine's prefix cache.
    pub shadow: Mutex<LocalCache>,
    /// The engine's KV events, when `kv_events` is set: the index follows them while
    /// the stream is healthy.
    pub kv_events: Option<KvEvents>,
    /// Cancelled when the engine leaves the node: its health checks, scrapes and
    /// event stream stop.
    pub stop: CancellationToken,
    /// [`EngineStatus`] as a number, or [`REMOVING`]: one atomic, so that putting an
    /// engine back in rotation cannot undo a removal that raced with it (a check of a
    /// separate flag, then a store, left an engine serving and removing at once).
    status: AtomicU8,
    /// Added at run time: it takes requests only once a health check has passed. An
    /// engine of the config at start is routable at once (the node has no other),
    /// but one added to a running node was idle and unqueued, the cheapest candidate
    /// of all, and drew requests to an address nothing had checked yet.
    awaits_first_check: bool,
}

/// [`LocalEngine::status`]'s value once removal was asked for: draining, and dropped
/// from the set once idle.
const REMOVING: u8 = u8::MAX;

impl std::fmt::Debug for LocalEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalEngine")
            .field("replica", &self.replica)
            .field("url", &self.config.url)
            .finish_non_exhaustive()
    }
}

impl LocalEngine {
    /// Engine `replica` from its config entry; its tasks stop with `stop`.
    pub fn new(
        node: &ValidatedConfig,
        engine: &EngineSection,
        replica: u16,
        stop: CancellationToken,
        now_ms: u64,
    ) -> Result<Self, NodeError> {
        let adapter = Arc::new(EngineAdapter::new(engine, replica, &node.limits)?);
        let capacity = adapter.kv_capacity_tokens();
        let status = if engine.weight > 0.0 {
            EngineStatus::Serving
        } else {
            EngineStatus::Draining
        };
        Ok(LocalEngine {
            replica,
            shadow: Mutex::new(LocalCache::new(capacity, node.cluster.summary_sample)),
            kv_events: KvEvents::from_config(node, engine, now_ms)?,
            config: engine.clone(),
            adapter,
            stop,
            status: AtomicU8::new(status as u8),
            awaits_first_check: false,
        })
    }

    /// This engine, added to a running node: it takes requests only once a health
    /// check has passed.
    pub fn awaiting_first_check(mut self) -> Self {
        self.awaits_first_check = true;
        self
    }

    /// Where the engine is in its life.
    pub fn status(&self) -> EngineStatus {
        match self.status.load(Ordering::Relaxed) {
            0 => EngineStatus::Serving,
            _ => EngineStatus::Draining,
        }
    }

    /// Take no new requests (what is in flight finishes).
    pub fn start_draining(&self) {
        // A removal stays a removal.
        let _ = self.status.compare_exchange(
            EngineStatus::Serving as u8,
            EngineStatus::Draining as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// Back in rotation after [`start_draining`](Self::start_draining); false (and
    /// nothing done) for an engine being removed.
    pub fn start_serving(&self) -> bool {
        match self.status.compare_exchange(
            EngineStatus::Draining as u8,
            EngineStatus::Serving as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => true,
            Err(now) => now == EngineStatus::Serving as u8,
        }
    }

    /// Drain, then leave the node once idle.
    pub fn start_removing(&self) {
        self.status.store(REMOVING, Ordering::Release);
    }

    /// Whether removal was asked for.
    pub fn is_removing(&self) -> bool {
        self.status.load(Ordering::Acquire) == REMOVING
    }

    /// Whether the engine takes new requests now: serving and healthy.
    pub fn takes_requests(&self) -> bool {
        self.status() == EngineStatus::Serving && self.is_healthy()
    }

    /// Whether routing may count on the engine's health now: its breaker lets
    /// requests through and, added at run time, a health check has passed (until
    /// then it is not healthy, whatever its untried breaker says).
    pub fn is_healthy(&self) -> bool {
        if self.awaits_first_check {
            self.adapter.is_ready()
        } else {
            self.adapter.is_healthy()
        }
    }

    /// Its queue stats as gossiped: the view of the engine with the fit, marked
    /// draining while it takes no new requests (drained, or down: its breaker open),
    /// so that peers stop counting on it at its next stats, as they do for a node
    /// that drains.
    pub fn queue_stats(&self, epoch: u64) -> QueueStats {
        let mut s = self.adapter.queue_stats(epoch);
        s.draining = !self.takes_requests();
        s
    }

    /// What `/admin/engines` and `/admin/state` show of it.
    pub fn view(&self, now_ms: u64) -> serde_json::Value {
        let a = &self.adapter;
        let fit = a.fit();
        let shadow = self.shadow.lock();
        serde_json::json!({
            "replica": self.replica,
            "url": self.config.url,
            "kind": a.kind().to_string(),
            "weight": self.config.weight,
            "status": self.status(),
            "removing": self.is_removing(),
            "healthy": self.is_healthy(),
            "health_checked": a.health_checked(),
            "breaker": a.breaker(),
            "max_context_tokens": a.max_context_tokens(),
            "max_running_requests": a.max_running_requests().map(|l| l.0),
            "max_running_requests_source": a.max_running_requests().map(|l| l.1),
            "inflight": a.inflight(),
            "accounting": a.counters(),
            "kv_capacity_tokens": a.kv_capacity_tokens(),
            "scraped": a.scraped(),
            "fit": {
                "t_p_ms": fit.t_p_ms(),
                "base_ms": fit.base_ms(),
                "r_squared": fit.r_squared(),
                "samples": fit.samples(),
            },
            "shadow_index_blocks": shadow.len(),
            "shadow_index_tokens": shadow.used_tokens(),
            "prefix_index_source": shadow.source(),
            "kv_events": self.kv_events.as_ref().map(|kv| kv.view(now_ms)),
        })
    }
}

/// The node's engines, in replica order: a snapshot readers take without holding a
/// lock (an engine added or removed makes a new set).
pub type EngineSet = Arc<Vec<Arc<LocalEngine>>>;
