//! The byte budget of request bodies being read (`limits.max_body_bytes_in_flight`).
//!
//! Every body a client or a peer sends is capped (`limits.max_body_bytes`) and timed
//! (`limits.body_timeout_ms`), and the slots bound what the node holds once a body is
//! read, but bodies still arriving are taken before any slot: without a budget they
//! were bounded only by the connection caps (16,384 connections of 8 MiB each). A
//! client's body takes its share as its bytes arrive (announcing a length costs a
//! client nothing, so it earns nothing); a peer's forward, from an authenticated peer,
//! its announced length before its buffer is made. One that does not fit is answered
//! 503 before more of it is read.

use std::sync::Arc;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Granularity of the budget: permits are units of this many bytes (a semaphore
/// acquires at most `u32::MAX` permits at once).
const UNIT_BYTES: usize = 4096;

/// The node-wide budget (one per node, shared by the client ingress and the forwards
/// peers send).
#[derive(Debug)]
pub struct BodyBudget {
    units: Arc<Semaphore>,
    /// Bytes held by bodies being read, as `gorgo_request_body_bytes_reading`.
    held: Gauge,
}

/// The budget would be exceeded: the body is refused (503) before more is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetExhausted;

impl BodyBudget {
    /// A budget of `bytes` (rounded up to whole units), reported through `held`.
    pub fn new(bytes: usize, held: Gauge) -> Self {
        BodyBudget {
            units: Arc::new(Semaphore::new(bytes.div_ceil(UNIT_BYTES))),
            held,
        }
    }

    /// A lease holding nothing yet, for one body.
    pub fn lease(&self) -> BodyLease {
        BodyLease {
            units: self.units.clone(),
            held: self.held.clone(),
            permit: None,
        }
    }
}

/// What one body being read holds of the budget; given back when dropped.
#[derive(Debug)]
pub struct BodyLease {
    units: Arc<Semaphore>,
    held: Gauge,
    permit: Option<OwnedSemaphorePermit>,
}

impl BodyLease {
    /// Hold enough for `bytes` of this body in all (never shrinks): the body has read,
    /// or announced, that many.
    pub fn cover(&mut self, bytes: usize) -> Result<(), BudgetExhausted> {
        let have = self.permit.as_ref().map_or(0, |p| p.num_permits());
        let want = bytes.div_ceil(UNIT_BYTES);
        if want <= have {
            return Ok(());
        }
        let more = u32::try_from(want - have).map_err(|_| BudgetExhausted)?;
        let extra = self
            .units
            .clone()
            .try_acquire_many_owned(more)
            .map_err(|_| BudgetExhausted)?;
        self.held.inc_by(((want - have) * UNIT_BYTES) as i64);
        match &mut self.permit {
            Some(p) => p.merge(extra),
            None => self.permit = Some(extra),
        }
        Ok(())
    }
}

impl Drop for BodyLease {
    fn drop(&mut self) {
        if let Some(p) = &self.permit {
            self.held.dec_by((p.num_permits() * UNIT_BYTES) as i64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_share_the_budget_and_give_it_back() {
        let gauge = Gauge::default();
        let budget = BodyBudget::new(10 * UNIT_BYTES, gauge.clone());
        let mut a = budget.lease();
        a.cover(1).unwrap();
        a.cover(6 * UNIT_BYTES).unwrap();
        a.cover(3 * UNIT_BYTES).unwrap(); // never shrinks
        assert_eq!(gauge.get(), (6 * UNIT_BYTES) as i64);
        let mut b = budget.lease();
        assert_eq!(b.cover(5 * UNIT_BYTES), Err(BudgetExhausted));
        b.cover(4 * UNIT_BYTES).unwrap();
        assert_eq!(gauge.get(), (10 * UNIT_BYTES) as i64);
        drop(a);
        assert_eq!(gauge.get(), (4 * UNIT_BYTES) as i64);
        b.cover(10 * UNIT_BYTES).unwrap();
        drop(b);
        assert_eq!(gauge.get(), 0);
        assert_eq!(budget.lease().cover(usize::MAX), Err(BudgetExhausted));
    }
}
