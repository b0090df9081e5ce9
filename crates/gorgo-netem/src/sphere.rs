//! Generated topologies: N regions at random points on the Earth's surface, for
//! simulations at scales no measured latency table covers.
//!
//! Why: the shipped topologies have 3 and 5 regions from public latency tables; the
//! simulator's scale questions (gossip bytes per node at 32 regions) need more, with
//! delays that obey the same geometry. The one-way delay between two regions is the
//! great-circle distance at two thirds of the speed of light (light in fibre) plus a
//! fixed 5 ms (routing, switching, the last mile). Deterministic from the seed.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::topology::{check_range, Region, Topology, MAX_DELAY_MS, MAX_REGIONS};
use crate::{NetemError, DEFAULT_QUEUE_LIMIT_BYTES};

/// Mean Earth radius, km.
pub const EARTH_RADIUS_KM: f64 = 6_371.0;
/// Light in fibre: two thirds of c, in km per ms.
pub const FIBRE_KM_PER_MS: f64 = 299_792.458 / 1_000.0 * 2.0 / 3.0;
/// Fixed part of every one-way delay, ms.
pub const FIXED_DELAY_MS: f64 = 5.0;

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct SphereSpec {
    /// Number of regions (2 to [`MAX_REGIONS`]).
    pub regions: usize,
    /// Seed of the region positions.
    pub seed: u64,
    /// One-way client-to-node delay of every region, ms, in [0, 60000] (as
    /// the topology loader accepts).
    pub client_delay_ms: f64,
}

/// A generated region: its place, for the file's comments.
#[derive(Debug, Clone, PartialEq)]
pub struct Placed {
    /// Latitude, degrees.
    pub lat_deg: f64,
    /// Longitude, degrees.
    pub lon_deg: f64,
}

/// Regions placed uniformly on the sphere (named `r00`, `r01`, ...), their one-way
/// delays rounded to 0.1 ms.
pub fn generate(spec: &SphereSpec) -> Result<(Topology, Vec<Placed>), NetemError> {
    if !(2..=MAX_REGIONS).contains(&spec.regions) {
        return Err(NetemError::invalid(
            "regions",
            format!("must be in [2, {MAX_REGIONS}], got {}", spec.regions),
        ));
    }
    // The loader's own range: what is generated must load back.
    check_range("client_delay_ms", spec.client_delay_ms, 0.0, MAX_DELAY_MS)?;
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
    let placed: Vec<Placed> = (0..spec.regions)
        .map(|_| {
            // Uniform on the sphere: z uniform in [-1, 1], longitude uniform.
            let z: f64 = rng.random_range(-1.0..1.0);
            let lon: f64 = rng.random_range(-180.0..180.0);
            Placed {
                lat_deg: z.asin().to_degrees(),
                lon_deg: lon,
            }
        })
        .collect();
    let n = spec.regions;
    let mut one_way_ms = vec![vec![0.0; n]; n];
    for a in 0..n {
        for b in 0..n {
            if a != b {
                let ms = great_circle_km(&placed[a], &placed[b]) / FIBRE_KM_PER_MS + FIXED_DELAY_MS;
                one_way_ms[a][b] = (ms * 10.0).round() / 10.0;
            }
        }
    }
    let width = (n - 1).to_string().len().max(2);
    let regions = (0..n)
        .map(|i| Region {
            name: format!("r{i:0width$}"),
            client_delay_ms: spec.client_delay_ms,
            client_jitter_ms: 0.0,
        })
        .collect();
    Ok((
        Topology {
            regions,
            one_way_ms,
            jitter_ms: 0.0,
            loss: 0.0,
            rate_mbps: None,
            queue_limit_bytes: DEFAULT_QUEUE_LIMIT_BYTES,
        },
        placed,
    ))
}

/// Great-circle distance, km (haversine).
pub fn great_circle_km(a: &Placed, b: &Placed) -> f64 {
    let (la, lb) = (a.lat_deg.to_radians(), b.lat_deg.to_radians());
    let dlat = lb - la;
    let dlon = (b.lon_deg - a.lon_deg).to_radians();
    let h = (dlat / 2.0).sin().powi(2) + la.cos() * lb.cos() * (dlon / 2.0).sin().powi(2);
    2.0 * EARTH_RADIUS_KM * h.sqrt().min(1.0).asin()
}

/// The topology file of a generated topology ([`Topology::from_toml`] reads it back
/// to the same topology), with a header saying how it was made.
pub fn to_toml(spec: &SphereSpec, topology: &Topology, placed: &[Placed]) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# Generated: {} regions uniformly on a sphere (seed {}).\n\
         # One-way delay = great-circle distance at 2/3 c + {FIXED_DELAY_MS} ms, rounded to 0.1 ms.\n\
         # Regenerate: gorgo topology --regions {} --seed {} --client-delay-ms {} --out FILE\n",
        spec.regions, spec.seed, spec.regions, spec.seed, spec.client_delay_ms
    );
    let _ = writeln!(s, "[network]\njitter_ms = 0.0\nloss = 0.0\n");
    for (r, p) in topology.regions.iter().zip(placed) {
        let _ = writeln!(
            s,
            "[[regions]]\nname = \"{}\"  # lat {:.1}, lon {:.1}\nclient_delay_ms = {:?}\n",
            r.name, p.lat_deg, p.lon_deg, r.client_delay_ms
        );
    }
    let _ = writeln!(s, "[one_way_ms]");
    let n = topology.regions.len();
    for a in 0..n.saturating_sub(1) {
        let row: Vec<String> = (a + 1..n)
            .map(|b| {
                format!(
                    "{} = {:?}",
                    topology.regions[b].name, topology.one_way_ms[a][b]
                )
            })
            .collect();
        let _ = writeln!(s, "{} = {{ {} }}", topology.regions[a].name, row.join(", "));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_bounded_and_round_trips() {
        let spec = SphereSpec {
            regions: 32,
            seed: 7,
            client_delay_ms: 5.0,
        };
        let (t, placed) = generate(&spec).unwrap();
        assert_eq!(generate(&spec).unwrap().0, t, "same seed, same topology");
        assert_ne!(
            generate(&SphereSpec {
                seed: 8,
                ..spec.clone()
            })
            .unwrap()
            .0,
            t
        );
        let max = std::f64::consts::PI * EARTH_RADIUS_KM / FIBRE_KM_PER_MS + FIXED_DELAY_MS;
        for a in 0..32 {
            for b in 0..32 {
                let d = t.one_way_ms[a][b];
                assert_eq!(d, t.one_way_ms[b][a], "symmetric");
                if a != b {
                    assert!((FIXED_DELAY_MS..=max + 0.1).contains(&d), "{d}");
                }
            }
        }
        let back = Topology::from_toml(&to_toml(&spec, &t, &placed)).unwrap();
        assert_eq!(back, t);
    }

    #[test]
    fn distances_of_known_points() {
        let p = |lat, lon| Placed {
            lat_deg: lat,
            lon_deg: lon,
        };
        // Antipodes: half the circumference, ~100 ms of fibre.
        let d = great_circle_km(&p(0.0, 0.0), &p(0.0, 180.0));
        assert!((d - std::f64::consts::PI * EARTH_RADIUS_KM).abs() < 1e-6);
        assert!((d / FIBRE_KM_PER_MS - 100.1).abs() < 0.1);
        assert_eq!(great_circle_km(&p(10.0, 20.0), &p(10.0, 20.0)), 0.0);
        assert!(generate(&SphereSpec {
            regions: 1,
            seed: 0,
            client_delay_ms: 1.0
        })
        .is_err());
    }

    /// A client delay the topology loader would refuse is refused here too.
    #[test]
    fn client_delay_out_of_the_loaders_range_is_refused() {
        for client_delay_ms in [1e6, -1.0, f64::NAN] {
            let err = generate(&SphereSpec {
                regions: 2,
                seed: 0,
                client_delay_ms,
            })
            .unwrap_err()
            .to_string();
            assert!(err.contains("client_delay_ms"), "{err}");
        }
    }
}
