//! Benchmark and simulation reports: the results.json schema, the Markdown table,
//! requests.csv and SVG plots.
//!
//! `gorgo bench`, `gorgo compare` and `gorgo sim` all produce [`RequestRecord`]s; this
//! crate turns them into the one report format of docs/design.md (Interfaces), so live runs
//! and simulations compare cell by cell.
//!
//! ```no_run
//! # use gorgo_report::{Report, RequestRecord};
//! # fn records() -> Vec<RequestRecord> { Vec::new() }
//! let report = Report::from_records(&serde_json::json!({"trace": "t.jsonl"}), records())?;
//! report.write(std::path::Path::new("out"))?;
//! print!("{}", gorgo_report::render_table(&report));
//! # Ok::<(), gorgo_report::ReportError>(())
//! ```
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

mod aggregate;
mod plot;
mod record;
pub mod sweep;
mod table;

use std::fs;
use std::path::Path;

use serde::{Deserialize, Serialize};

pub use aggregate::{aggregate, hit_ratio, PolicyResult, PredictionError};
pub use gorgo_core::LatencyStats;
pub use record::RequestRecord;
pub use sweep::{
    goodput_at_slo, goodput_with_bound, slo_p95, Bound, Goodput, LatencyFloor, Slo, Sweep,
    SweepPoint,
};
pub use table::{aligned, markdown, render_markdown, render_table};

/// The one error type of `gorgo-report`.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Writing a report file failed.
    #[error("write {path}: {source}")]
    Io {
        /// The file being written.
        path: String,
        /// What went wrong.
        source: std::io::Error,
    },
    /// A config or tuning record that does not serialise to JSON.
    #[error("serialise {what}: {source}")]
    Json {
        /// What was being serialised.
        what: &'static str,
        /// What went wrong.
        source: serde_json::Error,
    },
    /// Writing requests.csv failed.
    #[error("requests.csv: {0}")]
    Csv(#[from] csv::Error),
    /// Drawing a plot failed.
    #[error("plot {file}: {reason}")]
    Plot {
        /// The SVG file.
        file: &'static str,
        /// The plotting library's message.
        reason: String,
    },
}

/// Convenience alias for this crate's results.
pub type Result<T, E = ReportError> = std::result::Result<T, E>;

/// The content of `results.json`: the run's configuration and one aggregate per policy,
/// in the order the policies first appear in the records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Results {
    /// Whatever describes the run (trace, topology, flags): free-form JSON.
    pub config: serde_json::Value,
    /// Aggregates by policy name.
    #[serde(with = "ordered_map")]
    pub policies: Vec<(String, PolicyResult)>,
}

impl Results {
    /// The aggregate of `policy`, if it ran.
    pub fn policy(&self, policy: &str) -> Option<&PolicyResult> {
        self.policies
            .iter()
            .find(|(p, _)| p == policy)
            .map(|(_, r)| r)
    }

    /// The aggregate of `policy` to add to (e.g. what only a simulation counts).
    pub fn policy_mut(&mut self, policy: &str) -> Option<&mut PolicyResult> {
        self.policies
            .iter_mut()
            .find(|(p, _)| p == policy)
            .map(|(_, r)| r)
    }
}

/// A whole report: aggregates, the per-request records behind them and, when the run
/// tuned weights, one record per tuning epoch.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// What goes to `results.json`.
    pub results: Results,
    /// Every request, for `requests.csv` and the plots.
    pub records: Vec<RequestRecord>,
    /// Tuning epochs for `tuning.jsonl`, each already serialised to one line of JSON
    /// (so the records' field order survives); empty: no file.
    pub tuning: Vec<String>,
}

impl Report {
    /// Aggregate `records` per policy; `config` is stored verbatim under `"config"`.
    pub fn from_records<C: Serialize + ?Sized>(
        config: &C,
        records: Vec<RequestRecord>,
    ) -> Result<Self> {
        let config = serde_json::to_value(config).map_err(|source| ReportError::Json {
            what: "config",
            source,
        })?;
        let policies = aggregate(&records);
        Ok(Report {
            results: Results { config, policies },
            records,
            tuning: Vec::new(),
        })
    }

    /// Attach tuning records (one per epoch; docs/design.md's `tuning.jsonl` fields), of any
    /// serialisable type so this crate does not depend on the tuner.
    pub fn with_tuning<T: Serialize>(mut self, epochs: &[T]) -> Result<Self> {
        self.tuning = epochs
            .iter()
            .map(serde_json::to_string)
            .collect::<std::result::Result<_, _>>()
            .map_err(|source| ReportError::Json {
                what: "tuning record",
                source,
            })?;
        Ok(self)
    }

    /// Write `results.json`, `table.md`, `requests.csv`, `ttft_cdf.svg` (TTFT and E2E
    /// CDFs side by side), `region_share.svg` (stacked per policy) and, with tuning records,
    /// `tuning.jsonl` and `tuning.svg` (the trajectory) into `out_dir`
    /// (created if missing).
    ///
    /// Every file is rendered first and replaced atomically ([`gorgo_files::write_atomic`]'s temporary
    /// file and rename), `results.json` last: a plot that fails to draw or a file that
    /// cannot be written leaves the previous `results.json`, and no file half written.
    /// A `tuning.jsonl` or `tuning.svg` this report does not produce (a rerun without
    /// tuning in the same directory) is removed, so it is not read as this run's.
    pub fn write(&self, out_dir: &Path) -> Result<()> {
        let json =
            serde_json::to_string_pretty(&self.results).map_err(|source| ReportError::Json {
                what: "results",
                source,
            })?;
        let mut files: Vec<(&str, Vec<u8>)> = vec![
            ("table.md", render_markdown(self).into_bytes()),
            ("requests.csv", record::csv(&self.records)?),
            ("ttft_cdf.svg", plot::ttft_cdf(self)?.into_bytes()),
            ("region_share.svg", plot::region_share(self)?.into_bytes()),
        ];
        let mut stale = Vec::new();
        match plot::tuning_trajectory(&self.tuning)? {
            Some(svg) => files.push(("tuning.svg", svg.into_bytes())),
            None => stale.push("tuning.svg"),
        }
        if self.tuning.is_empty() {
            stale.push("tuning.jsonl");
        } else {
            let mut lines = Vec::new();
            for line in &self.tuning {
                lines.extend_from_slice(line.as_bytes());
                lines.push(b'\n');
            }
            files.push(("tuning.jsonl", lines));
        }
        replace_files(out_dir, files, &stale, ("results.json", json + "\n"))
    }
}

impl Sweep {
    /// Write `sweep.json`, `sweep.md`, `sweep_ttft_p95.svg`, `sweep_e2e_p95.svg` and
    /// `sweep_cache_hit.svg` into `out_dir` (created if missing), each replaced
    /// atomically and `sweep.json` last, as [`Report::write`] does. (Here rather than in
    /// `sweep`, as [`Report::write`] is: the plots read the sweep, so the module that
    /// writes both sits above them.)
    pub fn write(&self, out_dir: &Path) -> Result<()> {
        let json = serde_json::to_string_pretty(self).map_err(|source| ReportError::Json {
            what: "sweep",
            source,
        })?;
        let mut files: Vec<(&str, Vec<u8>)> =
            vec![("sweep.md", sweep::render_sweep_markdown(self).into_bytes())];
        for (file, svg) in plot::sweep_plots(self)? {
            files.push((file, svg.into_bytes()));
        }
        replace_files(out_dir, files, &[], ("sweep.json", json + "\n"))
    }
}

/// Replace `files` in `out_dir` (created if missing), remove `stale` ones, then replace
/// `last`, the file readers take as the run's (results.json, sweep.json). Every file is
/// staged before any is replaced, so an error while writing changes nothing; one while
/// renaming (a directory in the way) stops before `last`, which keeps its old content.
fn replace_files(
    out_dir: &Path,
    files: Vec<(&str, Vec<u8>)>,
    stale: &[&str],
    last: (&str, String),
) -> Result<()> {
    fs::create_dir_all(out_dir).map_err(io(out_dir))?;
    let stage = |(name, bytes): (&str, &[u8])| {
        let path = out_dir.join(name);
        gorgo_files::stage(&path, bytes).map_err(io(&path))
    };
    let staged = files
        .iter()
        .map(|(name, bytes)| stage((name, bytes)))
        .collect::<Result<Vec<_>>>()?;
    let last = stage((last.0, last.1.as_bytes()))?;
    for file in staged {
        let path = file.path().to_path_buf();
        file.commit().map_err(io(&path))?;
    }
    for name in stale {
        let path = out_dir.join(name);
        gorgo_files::remove_stale(&path).map_err(io(&path))?;
    }
    let path = last.path().to_path_buf();
    last.commit().map_err(io(&path))
}

/// The error of a failed read or write of `path`, for `map_err`.
fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ReportError {
    let path = path.display().to_string();
    move |source| ReportError::Io { path, source }
}

/// A `Vec<(String, V)>` as a JSON object whose keys keep the vector's order (JSON
/// objects of `serde_json::Value` would sort them).
mod ordered_map {
    use serde::de::{Deserializer, MapAccess, Visitor};
    use serde::ser::{SerializeMap, Serializer};
    use serde::{Deserialize, Serialize};

    pub fn serialize<S: Serializer, V: Serialize>(
        v: &[(String, V)],
        s: S,
    ) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(v.len()))?;
        for (k, val) in v {
            map.serialize_entry(k, val)?;
        }
        map.end()
    }

    pub fn deserialize<'de, D: Deserializer<'de>, V: Deserialize<'de>>(
        d: D,
    ) -> Result<Vec<(String, V)>, D::Error> {
        struct Ordered<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for Ordered<V> {
            type Value = Vec<(String, V)>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a map of policy results")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    out.push(entry);
                }
                Ok(out)
            }
        }
        d.deserialize_map(Ordered(std::marker::PhantomData))
    }
}
