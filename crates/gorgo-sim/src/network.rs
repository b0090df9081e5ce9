//! The simulated network: client-to-region delays and the inter-region delay matrix.
//!
//! A plain value so the simulator does not depend on the relays of `gorgo-netem`; the
//! CLI converts a topology file into it.

use serde::{Deserialize, Serialize};

use crate::{invalid, Result};

/// Most regions the simulator handles (region indices are bytes in per-request rows).
pub const MAX_REGIONS: usize = 64;

/// One region as seen from its clients.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionNet {
    /// Region name (also the node id of its router).
    pub name: String,
    /// One-way delay between a client of this region and its node, ms.
    pub client_delay_ms: f64,
    /// Uniform jitter in `[-j, +j]` on that delay, ms.
    #[serde(default)]
    pub client_jitter_ms: f64,
}

/// Regions and the one-way delays between them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Network {
    /// The regions, in a fixed order (indices below refer to it).
    pub regions: Vec<RegionNet>,
    /// `one_way_ms[a][b]`: one-way delay from region `a` to region `b`, ms.
    pub one_way_ms: Vec<Vec<f64>>,
    /// Uniform jitter in `[-j, +j]` on every inter-region message, ms.
    #[serde(default)]
    pub jitter_ms: f64,
    /// Inter-region link rate, Mbit/s (`None`: unlimited): response transfer time.
    #[serde(default)]
    pub rate_mbps: Option<f64>,
}

impl Network {
    /// Check sizes and values; errors name the field.
    pub fn validate(&self) -> Result<()> {
        let n = self.regions.len();
        if n == 0 || n > MAX_REGIONS {
            return Err(invalid(
                "regions",
                format!("need 1 to {MAX_REGIONS} regions, got {n}"),
            ));
        }
        for (i, r) in self.regions.iter().enumerate() {
            if r.name.is_empty() {
                return Err(invalid("regions.name", "empty region name"));
            }
            if self.regions[..i].iter().any(|o| o.name == r.name) {
                return Err(invalid("regions.name", format!("`{}` twice", r.name)));
            }
            if !(r.client_delay_ms.is_finite() && r.client_delay_ms >= 0.0) {
                return Err(invalid("regions.client_delay_ms", "must be >= 0"));
            }
            if !(r.client_jitter_ms.is_finite() && r.client_jitter_ms >= 0.0) {
                return Err(invalid("regions.client_jitter_ms", "must be >= 0"));
            }
        }
        if self.one_way_ms.len() != n || self.one_way_ms.iter().any(|row| row.len() != n) {
            return Err(invalid("one_way_ms", format!("must be {n} x {n}")));
        }
        if self
            .one_way_ms
            .iter()
            .flatten()
            .any(|d| !(d.is_finite() && *d >= 0.0))
        {
            return Err(invalid("one_way_ms", "delays must be finite and >= 0"));
        }
        if !(self.jitter_ms.is_finite() && self.jitter_ms >= 0.0) {
            return Err(invalid("jitter_ms", "must be >= 0"));
        }
        if let Some(r) = self.rate_mbps {
            if !(r.is_finite() && r > 0.0) {
                return Err(invalid("rate_mbps", "must be > 0"));
            }
        }
        Ok(())
    }

    /// Region names in order.
    pub fn names(&self) -> Vec<String> {
        self.regions.iter().map(|r| r.name.clone()).collect()
    }

    /// Round-trip time between two regions without jitter, ms (what a node's RTT EWMA
    /// converges to).
    pub fn rtt_ms(&self, a: usize, b: usize) -> f64 {
        if a == b {
            0.0
        } else {
            self.one_way_ms[a][b] + self.one_way_ms[b][a]
        }
    }

    /// A network of `n` regions with the same one-way delay between every pair and the
    /// same client delay: for tests and quick experiments.
    pub fn uniform(n: usize, one_way_ms: f64, client_delay_ms: f64) -> Self {
        Network {
            regions: (0..n)
                .map(|i| RegionNet {
                    name: format!("r{i}"),
                    client_delay_ms,
                    client_jitter_ms: 0.0,
                })
                .collect(),
            one_way_ms: (0..n)
                .map(|a| {
                    (0..n)
                        .map(|b| if a == b { 0.0 } else { one_way_ms })
                        .collect()
                })
                .collect(),
            jitter_ms: 0.0,
            rate_mbps: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_validates_and_rtt_is_symmetric() {
        let n = Network::uniform(3, 40.0, 2.0);
        n.validate().unwrap();
        assert_eq!(n.rtt_ms(0, 1), 80.0);
        assert_eq!(n.rtt_ms(2, 2), 0.0);
    }

    #[test]
    fn bad_matrix_names_the_field() {
        let mut n = Network::uniform(2, 40.0, 2.0);
        n.one_way_ms[0].pop();
        let e = n.validate().unwrap_err().to_string();
        assert!(e.contains("one_way_ms"), "{e}");
        let mut n = Network::uniform(2, 40.0, 2.0);
        n.one_way_ms[1][0] = f64::NAN;
        assert!(n.validate().is_err());
        let mut n = Network::uniform(2, 40.0, 2.0);
        n.regions[1].name = "r0".into();
        assert!(n.validate().unwrap_err().to_string().contains("twice"));
    }
}
