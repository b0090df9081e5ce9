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
use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

pub use aggregate::{aggregate, hit_ratio, PolicyResult, PredictionError};
pub use gorgo_core::LatencyStats;
pub use record::RequestRecord;
pub use sweep::{goodput_at_slo, LatencyFloor, Slo, Sweep, SweepPoint};
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
    pub fn write(&self, out_dir: &Path) -> Result<()> {
        fs::create_dir_all(out_dir).map_err(io(out_dir))?;

        let path = out_dir.join("results.json");
        let json =
            serde_json::to_string_pretty(&self.results).map_err(|source| ReportError::Json {
                what: "results",
                source,
            })?;
        fs::write(&path, json + "\n").map_err(io(&path))?;

        let path = out_dir.join("table.md");
        fs::write(&path, render_markdown(self)).map_err(io(&path))?;

        let path = out_dir.join("requests.csv");
        let file = fs::File::create(&path).map_err(io(&path))?;
        let mut csv = csv::Writer::from_writer(std::io::BufWriter::new(file));
        for r in &self.records {
            csv.serialize(record::CsvRow::from(r))?;
        }
        csv.flush().map_err(io(&path))?;

        let path = out_dir.join("ttft_cdf.svg");
        fs::write(&path, plot::ttft_cdf(self)?).map_err(io(&path))?;
        let path = out_dir.join("region_share.svg");
        fs::write(&path, plot::region_share(self)?).map_err(io(&path))?;

        if let Some(svg) = plot::tuning_trajectory(&self.tuning)? {
            let path = out_dir.join("tuning.svg");
            fs::write(&path, svg).map_err(io(&path))?;
        }
        if !self.tuning.is_empty() {
            let path = out_dir.join("tuning.jsonl");
            let mut out = std::io::BufWriter::new(fs::File::create(&path).map_err(io(&path))?);
            for line in &self.tuning {
                out.write_all(line.as_bytes()).map_err(io(&path))?;
                out.write_all(b"\n").map_err(io(&path))?;
            }
            out.flush().map_err(io(&path))?;
        }
        Ok(())
    }
}

impl Sweep {
    /// Write `sweep.json`, `sweep.md`, `sweep_ttft_p95.svg`, `sweep_e2e_p95.svg` and
    /// `sweep_cache_hit.svg` into `out_dir` (created if missing). (Here rather than in
    /// `sweep`, as [`Report::write`] is: the plots read the sweep, so the module that
    /// writes both sits above them.)
    pub fn write(&self, out_dir: &Path) -> Result<()> {
        fs::create_dir_all(out_dir).map_err(io(out_dir))?;
        let path = out_dir.join("sweep.json");
        let json = serde_json::to_string_pretty(self).map_err(|source| ReportError::Json {
            what: "sweep",
            source,
        })?;
        fs::write(&path, json + "\n").map_err(io(&path))?;
        let path = out_dir.join("sweep.md");
        fs::write(&path, sweep::render_sweep_markdown(self)).map_err(io(&path))?;
        for (file, svg) in plot::sweep_plots(self)? {
            let path = out_dir.join(file);
            fs::write(&path, svg).map_err(io(&path))?;
        }
        Ok(())
    }
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
