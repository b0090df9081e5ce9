//! Topology files: regions, client-to-region delay, and the one-way delay matrix
//! between regions with jitter, loss and rate.
//!
//! ```toml
//! [network]              # applies to every inter-region link
//! jitter_ms = 0.0
//! loss = 0.0             # fraction of UDP datagrams dropped, in [0, 1)
//! rate_mbps = 1000.0     # optional serialisation rate per link direction
//!
//! [[regions]]
//! name = "us-ashburn"
//! client_delay_ms = 3.0  # one way, client to this region's node
//!
//! [one_way_ms]           # from = { to = ms }; a missing reverse direction mirrors
//! us-ashburn = { eu-frankfurt = 45.0 }
//! ```

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::link::{LinkParams, DEFAULT_QUEUE_LIMIT_BYTES};
use crate::NetemError;

/// Largest delay, jitter or client delay accepted, in ms: anything above is a typo.
pub(crate) const MAX_DELAY_MS: f64 = 60_000.0;
/// Slowest link rate accepted, in Mbit/s (1 kbit/s).
pub(crate) const MIN_RATE_MBPS: f64 = 0.001;
/// Fastest link rate accepted, in Mbit/s (1 Tbit/s).
pub(crate) const MAX_RATE_MBPS: f64 = 1_000_000.0;
/// Most regions a topology may list (the loopback plan gives each one an address).
pub const MAX_REGIONS: usize = 64;
/// Longest region name: names become namespace and file names.
const MAX_NAME_LEN: usize = 40;
/// What the tc scripts append to a region's name for its clients' namespace.
const CLIENT_SUFFIX: &str = "-client";

/// One region of a topology.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Region {
    /// Region name, e.g. `us-ashburn`; used as the key everywhere.
    pub name: String,
    /// One-way delay between this region's clients and its node, in ms.
    pub client_delay_ms: f64,
    /// Jitter on the client link, in ms (uniform in +-jitter; TCP keeps order).
    #[serde(default)]
    pub client_jitter_ms: f64,
}

/// Link properties shared by every inter-region link.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNetwork {
    #[serde(default)]
    jitter_ms: f64,
    #[serde(default)]
    loss: f64,
    #[serde(default)]
    rate_mbps: Option<f64>,
    #[serde(default)]
    queue_limit_kib: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTopology {
    #[serde(default)]
    network: RawNetwork,
    regions: Vec<Region>,
    #[serde(default)]
    one_way_ms: BTreeMap<String, BTreeMap<String, f64>>,
}

/// A validated topology: why it exists is to be the single description of the
/// emulated WAN that relays, `gorgo up`, the simulator and the tc scripts share.
#[derive(Clone, Debug, PartialEq)]
pub struct Topology {
    /// Regions in file order; indices into `one_way_ms` follow this order.
    pub regions: Vec<Region>,
    /// `one_way_ms[a][b]`: one-way delay from region a to region b (0 on the diagonal).
    pub one_way_ms: Vec<Vec<f64>>,
    /// Jitter on every inter-region link, in ms (uniform in +-jitter).
    pub jitter_ms: f64,
    /// Fraction of UDP datagrams dropped on every inter-region link.
    pub loss: f64,
    /// Serialisation rate of each inter-region link direction, if limited.
    pub rate_mbps: Option<f64>,
    /// Byte budget of each queue of every link: one per TCP connection
    /// direction, per UDP link towards its target and per UDP session back
    /// ([`LinkParams::queue_limit_bytes`]); over it datagrams drop.
    pub queue_limit_bytes: usize,
}

/// Whether `value` is a finite number in `[lo, hi]`; the error names `field`.
/// Shared with the sphere generator, so it makes only what this loader reads.
pub(crate) fn check_range(field: &str, value: f64, lo: f64, hi: f64) -> Result<(), NetemError> {
    match out_of_range(value, lo, hi) {
        Some(reason) => Err(NetemError::invalid(field, reason)),
        None => Ok(()),
    }
}

/// Why `value` is not a finite number in `[lo, hi]`; `None` when it is. The
/// reason alone, for the loader and the control API to name their own field.
pub(crate) fn out_of_range(value: f64, lo: f64, hi: f64) -> Option<String> {
    (!value.is_finite() || value < lo || value > hi)
        .then(|| format!("must be a number in [{lo}, {hi}], got {value}"))
}

/// Why `loss` is not a fraction in `[0, 1)` (1 would drop everything: a
/// partition is the way to do that); `None` when it is.
pub(crate) fn bad_loss(loss: f64) -> Option<String> {
    (!(loss.is_finite() && (0.0..1.0).contains(&loss)))
        .then(|| format!("must be a fraction in [0, 1), got {loss}"))
}

impl Topology {
    /// Reads and validates a topology TOML file, read with a cap
    /// ([`gorgo_files::MAX_CONFIG_FILE_BYTES`]: `/dev/zero` is refused, not read).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, NetemError> {
        let path = path.as_ref();
        let text = gorgo_files::read_capped(path, gorgo_files::MAX_CONFIG_FILE_BYTES).map_err(
            |source| NetemError::Read {
                path: path.display().to_string(),
                source,
            },
        )?;
        Self::from_toml(&text)
    }

    /// Parses and validates topology TOML text.
    pub fn from_toml(text: &str) -> Result<Self, NetemError> {
        let raw: RawTopology = toml::from_str(text)?;
        Self::validate(raw)
    }

    fn validate(raw: RawTopology) -> Result<Self, NetemError> {
        if raw.regions.is_empty() {
            return Err(NetemError::invalid(
                "regions",
                "at least one region is needed",
            ));
        }
        if raw.regions.len() > MAX_REGIONS {
            return Err(NetemError::invalid(
                "regions",
                format!("at most {MAX_REGIONS} regions"),
            ));
        }
        let mut index = BTreeMap::new();
        for (i, region) in raw.regions.iter().enumerate() {
            let field = format!("regions[{i}].name");
            let name = &region.name;
            if name.is_empty()
                || name.len() > MAX_NAME_LEN
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            {
                return Err(NetemError::invalid(
                    field,
                    format!("`{name}`: use 1-{MAX_NAME_LEN} characters of a-z, 0-9 and -"),
                ));
            }
            if name == crate::CLIENTS {
                return Err(NetemError::invalid(
                    field,
                    format!("`{name}` is reserved: it names a region's clients in link names"),
                ));
            }
            // The tc scripts put region x's clients in namespace
            // `gorgo-x-client`: a region named `x-client` would collide with it.
            if name.ends_with(CLIENT_SUFFIX) {
                return Err(NetemError::invalid(
                    field,
                    format!(
                        "`{name}`: a name ending in `{CLIENT_SUFFIX}` is reserved for a region's clients"
                    ),
                ));
            }
            if index.insert(name.clone(), i).is_some() {
                return Err(NetemError::invalid(
                    field,
                    format!("duplicate region `{name}`"),
                ));
            }
            check_range(
                &format!("regions[{i}].client_delay_ms"),
                region.client_delay_ms,
                0.0,
                MAX_DELAY_MS,
            )?;
            check_range(
                &format!("regions[{i}].client_jitter_ms"),
                region.client_jitter_ms,
                0.0,
                MAX_DELAY_MS,
            )?;
        }
        check_range(
            "network.jitter_ms",
            raw.network.jitter_ms,
            0.0,
            MAX_DELAY_MS,
        )?;
        if let Some(reason) = bad_loss(raw.network.loss) {
            return Err(NetemError::invalid("network.loss", reason));
        }
        if let Some(rate) = raw.network.rate_mbps {
            check_range("network.rate_mbps", rate, MIN_RATE_MBPS, MAX_RATE_MBPS)?;
        }
        let queue_limit_bytes = match raw.network.queue_limit_kib {
            None => DEFAULT_QUEUE_LIMIT_BYTES,
            Some(kib) if (1..=4 * 1024 * 1024).contains(&kib) => kib as usize * 1024,
            Some(kib) => {
                return Err(NetemError::invalid(
                    "network.queue_limit_kib",
                    format!("must be in [1, 4194304], got {kib}"),
                ))
            }
        };

        let n = raw.regions.len();
        let mut given: Vec<Vec<Option<f64>>> = vec![vec![None; n]; n];
        for (from, row) in &raw.one_way_ms {
            let a = *index.get(from).ok_or_else(|| {
                NetemError::invalid(
                    format!("one_way_ms.{from}"),
                    format!("`{from}` is not a listed region"),
                )
            })?;
            for (to, &ms) in row {
                let field = format!("one_way_ms.{from}.{to}");
                let b = *index.get(to).ok_or_else(|| {
                    NetemError::invalid(&field, format!("`{to}` is not a listed region"))
                })?;
                if a == b {
                    return Err(NetemError::invalid(
                        field,
                        "a region has no link to itself (use client_delay_ms)",
                    ));
                }
                check_range(&field, ms, 0.0, MAX_DELAY_MS)?;
                given[a][b] = Some(ms);
            }
        }
        let mut one_way_ms = vec![vec![0.0; n]; n];
        for a in 0..n {
            for b in 0..n {
                if a == b {
                    continue;
                }
                one_way_ms[a][b] = match (given[a][b], given[b][a]) {
                    (Some(ms), _) | (None, Some(ms)) => ms,
                    (None, None) => {
                        let (x, y) = (&raw.regions[a].name, &raw.regions[b].name);
                        return Err(NetemError::invalid(
                            format!("one_way_ms.{x}.{y}"),
                            format!("missing: give {x} -> {y} or {y} -> {x}"),
                        ));
                    }
                };
            }
        }
        Ok(Topology {
            regions: raw.regions,
            one_way_ms,
            jitter_ms: raw.network.jitter_ms,
            loss: raw.network.loss,
            rate_mbps: raw.network.rate_mbps,
            queue_limit_bytes,
        })
    }

    /// Index of a region by name.
    pub fn region_index(&self, name: &str) -> Result<usize, NetemError> {
        self.regions
            .iter()
            .position(|r| r.name == name)
            .ok_or_else(|| NetemError::UnknownRegion(name.to_owned()))
    }

    /// Round-trip time between two regions in ms (0 from a region to itself).
    pub fn rtt_ms(&self, a: &str, b: &str) -> Result<f64, NetemError> {
        let (a, b) = (self.region_index(a)?, self.region_index(b)?);
        Ok(self.one_way_ms[a][b] + self.one_way_ms[b][a])
    }

    /// Parameters of the one-way inter-region link from region index `a` to `b`.
    ///
    /// Panics if an index is out of range (indices come from this topology).
    pub fn link(&self, a: usize, b: usize) -> LinkParams {
        LinkParams {
            delay: ms(self.one_way_ms[a][b]),
            jitter: ms(self.jitter_ms),
            loss: self.loss,
            rate_bps: self.rate_mbps.map(mbps_to_bps),
            queue_limit_bytes: self.queue_limit_bytes,
        }
    }

    /// Parameters of the link between region `i`'s clients and its node (each direction).
    pub fn client_link(&self, i: usize) -> LinkParams {
        LinkParams {
            delay: ms(self.regions[i].client_delay_ms),
            jitter: ms(self.regions[i].client_jitter_ms),
            loss: 0.0,
            rate_bps: None,
            queue_limit_bytes: self.queue_limit_bytes,
        }
    }
}

/// A delay in ms (validated: finite, not negative) as a `Duration`.
pub(crate) fn ms(v: f64) -> Duration {
    Duration::from_secs_f64(v / 1000.0)
}

/// A rate in Mbit/s (validated) in bits per second, as `LinkParams` takes it.
pub(crate) fn mbps_to_bps(mbps: f64) -> u64 {
    (mbps * 1e6) as u64
}

impl std::str::FromStr for Topology {
    type Err = NetemError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::from_toml(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: &str = r#"
        [network]
        jitter_ms = 1.5
        loss = 0.01
        [[regions]]
        name = "a"
        client_delay_ms = 2
        [[regions]]
        name = "b"
        client_delay_ms = 3
        [[regions]]
        name = "c"
        client_delay_ms = 4
        [one_way_ms]
        a = { b = 10, c = 20 }
        b = { c = 30, a = 12 }
    "#;

    #[test]
    fn parses_and_mirrors_missing_directions() {
        let t: Topology = SMALL.parse().unwrap();
        assert_eq!(t.one_way_ms[0][1], 10.0);
        assert_eq!(t.one_way_ms[1][0], 12.0);
        assert_eq!(t.one_way_ms[2][0], 20.0);
        assert_eq!(t.one_way_ms[2][1], 30.0);
        assert_eq!(t.rtt_ms("a", "b").unwrap(), 22.0);
        assert_eq!(t.rtt_ms("c", "c").unwrap(), 0.0);
        assert_eq!(t.link(0, 2).delay, Duration::from_millis(20));
        assert_eq!(t.link(0, 2).loss, 0.01);
        assert_eq!(t.client_link(2).delay, Duration::from_millis(4));
        assert!(matches!(
            t.rtt_ms("a", "z"),
            Err(NetemError::UnknownRegion(_))
        ));
    }

    fn err(text: &str) -> String {
        Topology::from_toml(text).unwrap_err().to_string()
    }

    /// A topology file is read with a cap: a valid one padded one byte over it, or
    /// `/dev/zero` (which says it is empty), is refused naming the file and the cap.
    #[test]
    fn a_topology_file_over_the_cap_is_refused() {
        let cap = gorgo_files::MAX_CONFIG_FILE_BYTES;
        let dir = tempfile::tempdir().unwrap();
        let ok = dir.path().join("ok.toml");
        std::fs::write(&ok, SMALL).unwrap();
        Topology::from_file(&ok).unwrap();
        let big = dir.path().join("big.toml");
        let padding = " ".repeat(cap as usize + 1 - SMALL.len());
        std::fs::write(&big, format!("{SMALL}{padding}")).unwrap();
        let zero = Path::new("/dev/zero");
        for path in [big.as_path(), zero].into_iter().filter(|p| p.exists()) {
            let e = Topology::from_file(path).unwrap_err();
            assert!(matches!(e, NetemError::Read { .. }), "{e:?}");
            let e = e.to_string();
            assert!(
                e.contains(&path.display().to_string())
                    && e.contains(&format!("larger than {cap} bytes")),
                "{e}"
            );
        }
    }

    #[test]
    fn errors_name_the_field() {
        let missing = SMALL.replace("b = { c = 30, a = 12 }", "b = { a = 12 }");
        assert!(
            err(&missing).contains("one_way_ms.b.c"),
            "{}",
            err(&missing)
        );
        let unknown = SMALL.replace("loss = 0.01", "los = 0.01");
        assert!(err(&unknown).contains("los"), "{}", err(&unknown));
        let bad_loss = SMALL.replace("loss = 0.01", "loss = 1.5");
        assert!(err(&bad_loss).contains("network.loss"));
        let self_link = SMALL.replace("a = { b = 10, c = 20 }", "a = { a = 1, b = 10, c = 20 }");
        assert!(err(&self_link).contains("one_way_ms.a.a"));
        let stranger = SMALL.replace("a = { b = 10, c = 20 }", "a = { b = 10, c = 20, z = 1 }");
        assert!(err(&stranger).contains("one_way_ms.a.z"));
        let negative = SMALL.replace("client_delay_ms = 3", "client_delay_ms = -3");
        assert!(err(&negative).contains("regions[1].client_delay_ms"));
        let dup = SMALL.replace("name = \"c\"", "name = \"a\"");
        assert!(err(&dup).contains("regions[2].name"));
        let reserved = SMALL.replace("name = \"c\"", "name = \"clients\"");
        assert!(
            err(&reserved).contains("regions[2].name"),
            "{}",
            err(&reserved)
        );
        assert!(err("regions = []").contains("regions"));
    }

    /// `x-client` is region x's client namespace in the tc scripts, so no
    /// region may take that name.
    #[test]
    fn a_region_name_cannot_be_a_client_namespace() {
        let text = r#"
            [[regions]]
            name = "a"
            client_delay_ms = 1
            [[regions]]
            name = "a-client"
            client_delay_ms = 1
            [one_way_ms]
            a = { a-client = 5 }
        "#;
        assert!(err(text).contains("regions[1].name"), "{}", err(text));
    }

    fn repo_topology(name: &str) -> Topology {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/topologies/");
        Topology::from_file(format!("{path}{name}")).unwrap()
    }

    #[test]
    fn shipped_topologies_match_the_design() {
        let t = repo_topology("three-region.toml");
        let rtt = |a, b| t.rtt_ms(a, b).unwrap();
        assert!((rtt("us-ashburn", "eu-frankfurt") - 90.0).abs() <= 5.0);
        assert!((rtt("us-ashburn", "ap-seoul") - 180.0).abs() <= 10.0);
        assert!((rtt("eu-frankfurt", "ap-seoul") - 250.0).abs() <= 10.0);
        for r in &t.regions {
            assert!((2.0..=10.0).contains(&r.client_delay_ms), "{}", r.name);
        }
        let t = repo_topology("five-region.toml");
        assert_eq!(t.regions.len(), 5);
        assert_eq!(t.rtt_ms("us-west", "me-israel").unwrap(), 281.0);
        let t = repo_topology("lan.toml");
        for a in 0..t.regions.len() {
            assert_eq!(t.regions[a].client_delay_ms, 1.0);
            for b in 0..t.regions.len() {
                if a != b {
                    assert_eq!(t.one_way_ms[a][b], 1.0);
                }
            }
        }
    }
}
