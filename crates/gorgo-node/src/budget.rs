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

/// The node-wide budget (one per node, shared by the client ingress and the forwards
/// peers send).
#[derive(Debug)]
pub struct BodyBudget {
    /// One permit per byte: a body holds what it has sent, not a rounded share (in
    /// 4 KiB units, 1-byte bodies held 4,096 times their bytes, and one client's h2c
    /// streams took a GiB budget for about 256 KB sent).
    bytes: Arc<Semaphore>,
    /// Bytes held by bodies being read, as `gorgo_request_body_reading_bytes`.
    held: Gauge,
}

/// The budget would be exceeded: the body is refused (503) before more is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetExhausted;

impl BodyBudget {
    /// A budget of `bytes`, reported through `held`.
    pub fn new(bytes: usize, held: Gauge) -> Self {
        BodyBudget {
            bytes: Arc::new(Semaphore::new(bytes.min(Semaphore::MAX_PERMITS))),
            held,
        }
    }

    /// A lease holding nothing yet, for one body.
    pub fn lease(&self) -> BodyLease {
        BodyLease {
            bytes: self.bytes.clone(),
            held: self.held.clone(),
            permit: None,
        }
    }
}

/// What one body being read holds of the budget; given back when dropped.
#[derive(Debug)]
pub struct BodyLease {
    bytes: Arc<Semaphore>,
    held: Gauge,
    permit: Option<OwnedSemaphorePermit>,
}

impl BodyLease {
    /// Hold enough for `bytes` of this body in all (never shrinks): the body has read,
    /// or announced, that many.
    pub fn cover(&mut self, bytes: usize) -> Result<(), BudgetExhausted> {
        let have = self.permit.as_ref().map_or(0, |p| p.num_permits());
        if bytes <= have {
            return Ok(());
        }
        // A semaphore acquires at most `u32::MAX` permits at once: 4 GiB, beyond any
        // body cap.
        let more = u32::try_from(bytes - have).map_err(|_| BudgetExhausted)?;
        let extra = self
            .bytes
            .clone()
            .try_acquire_many_owned(more)
            .map_err(|_| BudgetExhausted)?;
        self.held.inc_by((bytes - have) as i64);
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
            self.held.dec_by(p.num_permits() as i64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNIT_BYTES: usize = 4096;

    /// A body holds the bytes it has sent: a byte each for bodies that sent one.
    #[test]
    fn a_byte_sent_holds_a_byte() {
        let budget = BodyBudget::new(UNIT_BYTES, Gauge::default());
        let leases: Vec<BodyLease> = (0..UNIT_BYTES)
            .map(|_| {
                let mut l = budget.lease();
                l.cover(1).unwrap();
                l
            })
            .collect();
        assert_eq!(budget.lease().cover(1), Err(BudgetExhausted));
        drop(leases);
        budget.lease().cover(UNIT_BYTES).unwrap();
    }

    #[test]
    fn bodies_share_the_budget_and_give_it_back() {
        let gauge = Gauge::default();
        let budget = BodyBudget::new(10 * UNIT_BYTES, gauge.clone());
        let mut a = budget.lease();
        a.cover(1).unwrap();
        assert_eq!(gauge.get(), 1);
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
