//! From replay outcomes to `gorgo-report`'s records and report files.
//!
//! Live runs can fail requests the simulator never fails (timeouts, transport errors,
//! overload answers), and a timeout is by construction the slowest kind of request.
//! So the TTFT and E2E percentiles of a live report are taken over *every* request a
//! policy sent, a request that failed before measuring the metric ranking above
//! every measured one (it is right-censored: it would have taken longer than the
//! run let it). When a percentile's rank falls among those requests (for p95: more
//! than 5% of them), the true value lies beyond what was measured: the percentile is
//! reported as *censored* (`config.censored`), with a lower bound as its value, and
//! `scripts/fidelity_report.py` does not score it.

use std::path::Path;

use gorgo_core::{percentile, LatencyStats};
use gorgo_report::{render_table, Report, RequestRecord};
use serde::Serialize;

use crate::compare::{Comparison, PolicyFailure, PolicyRun};
use crate::replay::RequestOutcome;
use crate::BenchError;

/// One outcome as a report record under `policy`.
///
/// TTFT is kept whenever it was measured, even when the request failed later (a
/// stream cut or timed out after its first token): it is defined by the first token,
/// not by completion. A failed request without one has a NaN TTFT. Its
/// `first_byte_ms` tells a stream cut mid-way from a request that never started.
/// When a successful response carries no `x-gorgo-served-by` (an engine or proxy that
/// is not a GORGO node), it counts as served in its home region. `start_ms` is the
/// origin of the request's times (its scheduled send time in open loop).
pub fn to_record(policy: &str, o: &RequestOutcome) -> RequestRecord {
    let ok = o.ok();
    let served_by = o
        .measured
        .served_by
        .clone()
        .or_else(|| ok.then(|| o.region.clone()));
    let hops = o.measured.hops.unwrap_or_else(|| {
        // Without the header, a different serving region still means one forward.
        u32::from(served_by.as_ref().is_some_and(|s| *s != o.region))
    });
    RequestRecord {
        policy: policy.to_owned(),
        request_id: o.request_id.clone(),
        region: o.region.clone(),
        served_by,
        hops,
        ttft_ms: o.measured.ttft_ms.unwrap_or(f64::NAN),
        e2e_ms: o.measured.e2e_ms.unwrap_or(f64::NAN),
        // NaN, not `None`, when there is none: `RequestRecord::itl` would otherwise
        // derive one for a failed request from its kept TTFT and its failure time.
        itl_ms: Some(o.itl_ms().unwrap_or(f64::NAN)),
        input_tokens: o.input_tokens,
        output_tokens: o.output_tokens,
        cached_tokens: o.measured.cached_tokens,
        predicted_ttft_ms: o.measured.predicted_ttft_ms,
        // No node knows it live.
        cached_anywhere_tokens: None,
        start_ms: o.start_ms,
        first_byte_ms: o.measured.first_byte_ms,
        retries: o.measured.connect_retries,
        ok,
        error: o.measured.error.clone(),
    }
}

/// What one request tells about one latency metric (TTFT or E2E).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Observation {
    /// The metric was measured, ms.
    Measured(f64),
    /// It was not (the request failed first); it would have taken at least this
    /// long, ms: the time the request failed (0 when unknown).
    AtLeast(f64),
}

impl Observation {
    /// TTFT of `o`: measured whenever a first token arrived, failed or not.
    pub fn ttft(o: &RequestOutcome) -> Observation {
        match o.measured.ttft_ms {
            Some(v) if v.is_finite() => Observation::Measured(v),
            _ => Observation::AtLeast(o.measured.e2e_ms.unwrap_or(0.0)),
        }
    }

    /// E2E of `o`: measured only when it completed (a failed request's E2E is when it
    /// failed, a lower bound of when it would have completed).
    pub fn e2e(o: &RequestOutcome) -> Observation {
        match o.measured.e2e_ms {
            Some(v) if o.ok() && v.is_finite() => Observation::Measured(v),
            e => Observation::AtLeast(e.unwrap_or(0.0)),
        }
    }
}

/// One metric's statistics over every request of a policy, with censoring explicit:
/// what replaces `gorgo-report`'s TTFT and E2E statistics (over completed requests
/// only, so biased low exactly when requests time out) in a live report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CensoredStats {
    /// p50/p95/p99: nearest rank (`gorgo_core::percentile`) over every request, the
    /// unmeasured ones ranked above every measured one. A censored percentile holds
    /// the same percentile of the per-request lower bounds (measured value, else the
    /// time the request failed): the true value is at least that. The mean is over
    /// the measured requests. All NaN (null in results.json) when nothing was
    /// measured, so a policy whose requests all failed never reads as 0 ms.
    #[serde(skip)]
    pub stats: LatencyStats,
    /// Requests that measured the metric.
    pub measured: u64,
    /// Requests that failed before measuring it.
    pub unmeasured: u64,
    /// The percentiles (`"p50"`, `"p95"`, `"p99"`) whose rank falls among the
    /// unmeasured requests: the p-th is censored when more than `100 - p` percent of
    /// the requests are unmeasured.
    pub censored: Vec<&'static str>,
}

/// The percentiles reported, with their `results.json` names.
const PERCENTILES: [(&str, f64); 3] = [("p50", 50.0), ("p95", 95.0), ("p99", 99.0)];

/// [`CensoredStats`] of one metric from every request's [`Observation`].
pub fn censored_stats(obs: &[Observation]) -> CensoredStats {
    let mut measured: Vec<f64> = Vec::with_capacity(obs.len());
    // Every request, the unmeasured ones as +inf: where each percentile's rank falls.
    let mut ranked: Vec<f64> = Vec::with_capacity(obs.len());
    // Every request's lower bound: what a censored percentile is at least.
    let mut bounds: Vec<f64> = Vec::with_capacity(obs.len());
    for o in obs {
        match *o {
            Observation::Measured(v) if v.is_finite() => {
                measured.push(v);
                ranked.push(v);
                bounds.push(v);
            }
            Observation::Measured(_) => {
                ranked.push(f64::INFINITY);
                bounds.push(0.0);
            }
            Observation::AtLeast(v) => {
                ranked.push(f64::INFINITY);
                bounds.push(if v.is_finite() { v.max(0.0) } else { 0.0 });
            }
        }
    }
    let unmeasured = (obs.len() - measured.len()) as u64;
    let mut out = CensoredStats {
        stats: LatencyStats {
            p50: f64::NAN,
            p95: f64::NAN,
            p99: f64::NAN,
            mean: f64::NAN,
        },
        measured: measured.len() as u64,
        unmeasured,
        censored: Vec::new(),
    };
    if measured.is_empty() {
        if !obs.is_empty() {
            out.censored = PERCENTILES.iter().map(|(name, _)| *name).collect();
        }
        return out;
    }
    ranked.sort_by(f64::total_cmp);
    bounds.sort_by(f64::total_cmp);
    let mut values = [f64::NAN; 3];
    for (slot, (name, p)) in values.iter_mut().zip(PERCENTILES) {
        let v = percentile(&ranked, p).unwrap_or(f64::NAN);
        *slot = if v.is_finite() {
            v
        } else {
            out.censored.push(name);
            percentile(&bounds, p).unwrap_or(f64::NAN)
        };
    }
    out.stats = LatencyStats {
        p50: values[0],
        p95: values[1],
        p99: values[2],
        mean: measured.iter().sum::<f64>() / measured.len() as f64,
    };
    out
}

/// The stats of `values` (ms) with their maximum added, as JSON: the slip summary.
fn slip_summary(values: &[f64]) -> serde_json::Value {
    let mut v = values.to_vec();
    let stats = gorgo_core::summarize(&mut v);
    let max = values
        .iter()
        .copied()
        .filter(|x| x.is_finite())
        .fold(0.0, f64::max);
    serde_json::json!({
        "p50": stats.p50,
        "p95": stats.p95,
        "p99": stats.p99,
        "mean": stats.mean,
        "max": max,
    })
}

/// The message of the error event a node ends a stream with when its
/// `limits.request_timeout_ms` runs out after the response began
/// (crates/gorgo-node/src/ingress.rs, `Tracked::poll_next`).
const NODE_TIMEOUT_EVENT: &str = "request timed out";

/// Whether a request failed by a timeout: the client's own (`--timeout-s`: reqwest's
/// error, described as `timeout: ...`), or the node's, which a client running past
/// the node's `request_timeout_ms` (600 s by default) only ever sees: a 504 before the
/// response began (`ServeError::Timeout`, crates/gorgo-node/src/api.rs, the engine's
/// first-byte timeout included), or the error event that ends a stream mid-way.
fn is_timeout(error: &str) -> bool {
    error.starts_with("timeout")
        || error.starts_with("HTTP 504")
        || error.strip_prefix(crate::client::ERROR_EVENT) == Some(NODE_TIMEOUT_EVENT)
}

/// Per-policy failure counts for `config.failures`: how many requests failed, their
/// share, how many of them timed out (the client's timeouts and the node's: see
/// [`is_timeout`]), and the retries (each one waited a backoff that is inside its
/// request's latency).
fn failure_summary(outcomes: &[RequestOutcome]) -> serde_json::Value {
    let requests = outcomes.len();
    let failed = outcomes.iter().filter(|o| !o.ok()).count();
    let timeouts = outcomes
        .iter()
        .filter(|o| o.measured.error.as_deref().is_some_and(is_timeout))
        .count();
    let retries: u64 = outcomes
        .iter()
        .map(|o| u64::from(o.measured.connect_retries))
        .sum();
    let retried = outcomes
        .iter()
        .filter(|o| o.measured.connect_retries > 0)
        .count();
    serde_json::json!({
        "requests": requests,
        "failed": failed,
        "failed_share": if requests == 0 { 0.0 } else { failed as f64 / requests as f64 },
        "timeouts": timeouts,
        "retried_requests": retried,
        "retries": retries,
    })
}

/// Write `results.json`, `table.md`, `requests.csv`, the plots and (when a cluster
/// tuned its weights) `tuning.jsonl` of `runs` under `out`, and return the console
/// table.
///
/// Besides `gorgo-report`'s content: each policy's TTFT and E2E statistics are taken
/// over every request it sent, censoring explicit (see the module doc and
/// [`censored_stats`]); ITL is null when no request measured one. The config gets, per
/// policy, `"slip_ms"` (how late requests went out against their schedule:
/// p50/p95/p99/mean/max, ms), `"failures"` (failed count and share, timeouts,
/// retries), `"censored"` (`{"ttft_ms": [...], "e2e_ms": [...]}`: the censored
/// percentiles, with how many requests measured each metric), `"started_unix_ms"` (each
/// replay's start on the system clock) and `"sim_comparable"` (false when any replay
/// ran closed loop or capped in flight, which the simulator does not model);
/// `"cancelled"` lists the policies whose replay was interrupted. `requests.csv` gets
/// a last column `slip_ms`.
pub fn write_report(
    out: &Path,
    config: serde_json::Value,
    runs: &[PolicyRun],
) -> Result<String, BenchError> {
    write_runs(out, config, runs, &[], &[])
}

/// [`write_report`] of a comparison: its runs, and in `config.cancelled`, after the
/// policies whose replay was interrupted, those the interrupt (or a failure before
/// them) kept from running (in `config.policies` if the caller lists them there,
/// absent from `policies`), and in `config.failed` the policies that failed with their
/// errors (`[{"policy", "error"}]`), so a comparison cut short never reads as complete.
pub fn write_comparison_report(
    out: &Path,
    config: serde_json::Value,
    comparison: &Comparison,
) -> Result<String, BenchError> {
    write_runs(
        out,
        config,
        &comparison.runs,
        &comparison.not_run,
        &comparison.failed,
    )
}

/// [`write_report`], `not_run` (policies that never ran) added to `"cancelled"` and
/// `failed` written as `"failed"`.
fn write_runs(
    out: &Path,
    mut config: serde_json::Value,
    runs: &[PolicyRun],
    not_run: &[String],
    failed: &[PolicyFailure],
) -> Result<String, BenchError> {
    let mut slip = serde_json::Map::new();
    let mut started = serde_json::Map::new();
    let mut failures = serde_json::Map::new();
    let mut censored = serde_json::Map::new();
    let mut cancelled = Vec::new();
    let mut records = Vec::new();
    let mut slips = Vec::new();
    let mut latency = Vec::new();
    for run in runs {
        let outcomes = &run.output.outcomes;
        let run_slips: Vec<f64> = outcomes.iter().map(|o| o.slip_ms).collect();
        slip.insert(run.policy.clone(), slip_summary(&run_slips));
        slips.extend(run_slips);
        started.insert(run.policy.clone(), run.output.started_unix_ms.into());
        failures.insert(run.policy.clone(), failure_summary(outcomes));
        let ttft = censored_stats(&outcomes.iter().map(Observation::ttft).collect::<Vec<_>>());
        let e2e = censored_stats(&outcomes.iter().map(Observation::e2e).collect::<Vec<_>>());
        censored.insert(
            run.policy.clone(),
            serde_json::json!({"ttft_ms": &ttft, "e2e_ms": &e2e}),
        );
        let has_itl = outcomes.iter().any(|o| o.itl_ms().is_some());
        latency.push((run.policy.clone(), ttft, e2e, has_itl));
        if run.output.cancelled {
            cancelled.push(run.policy.clone());
        }
        records.extend(outcomes.iter().map(|o| to_record(&run.policy, o)));
    }
    cancelled.extend(not_run.iter().cloned());
    if let Some(obj) = config.as_object_mut() {
        obj.insert("slip_ms".into(), serde_json::Value::Object(slip));
        obj.insert("failures".into(), serde_json::Value::Object(failures));
        obj.insert("censored".into(), serde_json::Value::Object(censored));
        obj.insert("started_unix_ms".into(), serde_json::Value::Object(started));
        obj.insert(
            "sim_comparable".into(),
            runs.iter().all(|r| r.output.sim_comparable).into(),
        );
        if !cancelled.is_empty() {
            obj.insert("cancelled".into(), cancelled.into());
        }
        if !failed.is_empty() {
            let failed = failed
                .iter()
                .map(|f| serde_json::json!({"policy": f.policy, "error": f.error}))
                .collect::<Vec<_>>();
            obj.insert("failed".into(), failed.into());
        }
    }
    let tuning: Vec<&serde_json::Value> = runs.iter().flat_map(|r| &r.tuning).collect();
    let mut report = Report::from_records(&config, records)
        .and_then(|r| r.with_tuning(&tuning))
        .map_err(report_err(out))?;
    for (policy, ttft, e2e, has_itl) in &latency {
        if let Some(r) = report.results.policy_mut(policy) {
            r.ttft_ms = ttft.stats;
            r.e2e_ms = e2e.stats;
            if !has_itl {
                r.itl_ms = nan_stats();
            }
        }
    }
    report.write(out).map_err(report_err(out))?;
    let path = out.join("requests.csv");
    let csv = std::fs::read_to_string(&path).map_err(|source| BenchError::Io {
        path: path.clone(),
        source,
    })?;
    let values: Vec<String> = slips.iter().map(|v| format!("{v:.3}")).collect();
    let csv = append_csv_column(&csv, "slip_ms", &values).map_err(|reason| BenchError::Report {
        path: path.clone(),
        reason,
    })?;
    gorgo_files::write_atomic(&path, csv.as_bytes()).map_err(|source| BenchError::Io {
        path: path.clone(),
        source,
    })?;
    let note = censoring_note(&latency);
    if !note.is_empty() {
        let path = out.join("table.md");
        let mut table = std::fs::read_to_string(&path).map_err(|source| BenchError::Io {
            path: path.clone(),
            source,
        })?;
        table.push('\n');
        table.push_str(&note);
        gorgo_files::write_atomic(&path, table.as_bytes())
            .map_err(|source| BenchError::Io { path, source })?;
    }
    Ok(render_table(&report) + &note)
}

/// Statistics of a metric nothing measured: null in results.json, never 0 ms.
fn nan_stats() -> LatencyStats {
    LatencyStats {
        p50: f64::NAN,
        p95: f64::NAN,
        p99: f64::NAN,
        mean: f64::NAN,
    }
}

/// The lines under the table naming each censored percentile (empty when none is).
fn censoring_note(latency: &[(String, CensoredStats, CensoredStats, bool)]) -> String {
    let mut lines = Vec::new();
    for (policy, ttft, e2e, _) in latency {
        let mut parts = Vec::new();
        for (metric, s) in [("TTFT", ttft), ("E2E", e2e)] {
            if !s.censored.is_empty() {
                parts.push(format!(
                    "{metric} {} ({} of {} requests unmeasured)",
                    s.censored.join("/"),
                    s.unmeasured,
                    s.measured + s.unmeasured
                ));
            }
        }
        if !parts.is_empty() {
            lines.push(format!("- {policy}: {}", parts.join("; ")));
        }
    }
    if lines.is_empty() {
        return String::new();
    }
    format!(
        "Censored percentiles: too many requests failed before measuring them (failures rank \
         above every measured request), so the true value lies beyond the one shown, a lower \
         bound (null when nothing was measured):\n{}\n",
        lines.join("\n")
    )
}

/// `csv` (a CSV file with a header and one record per value, as the `csv` crate
/// writes it: quoted fields may hold line breaks) with one more column, `name`, whose
/// fields are `values` (plain numbers, no quoting needed). An empty file stays empty.
fn append_csv_column(csv: &str, name: &str, values: &[String]) -> Result<String, String> {
    if csv.is_empty() {
        return if values.is_empty() {
            Ok(String::new())
        } else {
            Err(format!("empty file, {} values to add", values.len()))
        };
    }
    let mut out = String::with_capacity(csv.len() + values.len() * 10 + name.len() + 1);
    let mut fields = std::iter::once(name).chain(values.iter().map(String::as_str));
    let mut in_quotes = false;
    let mut rest = csv;
    while let Some(i) = rest.find(|c| c == '"' || (c == '\n' && !in_quotes)) {
        // A `"` toggles quoting (an escaped `""` toggles twice); a line break outside
        // quotes ends a record.
        let (before, after) = rest.split_at(i);
        let c = after.as_bytes()[0];
        if c == b'"' {
            in_quotes = !in_quotes;
            out.push_str(before);
            out.push('"');
        } else {
            let field = fields
                .next()
                .ok_or_else(|| "more records than values".to_owned())?;
            let before = before.strip_suffix('\r').unwrap_or(before);
            out.push_str(before);
            out.push(',');
            out.push_str(field);
            out.push('\n');
        }
        rest = &after[1..];
    }
    if !rest.is_empty() || in_quotes {
        return Err("the last record has no line end".into());
    }
    if fields.next().is_some() {
        return Err("fewer records than values".into());
    }
    Ok(out)
}

fn report_err(out: &Path) -> impl Fn(gorgo_report::ReportError) -> BenchError + '_ {
    move |e| BenchError::Report {
        path: out.to_path_buf(),
        reason: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::Measured;

    fn outcome(served_by: Option<&str>, hops: Option<u32>, error: Option<&str>) -> RequestOutcome {
        RequestOutcome {
            index: 0,
            request_id: "r0".into(),
            region: "us".into(),
            session: None,
            start_ms: 5.0,
            slip_ms: 1.0,
            input_tokens: 10,
            output_tokens: 3,
            measured: Measured {
                ttft_ms: Some(10.0),
                e2e_ms: Some(30.0),
                served_by: served_by.map(str::to_owned),
                hops,
                error: error.map(str::to_owned),
                ..Measured::default()
            },
        }
    }

    #[test]
    fn records_carry_region_hops_and_itl() {
        let r = to_record("p", &outcome(Some("eu"), Some(1), None));
        assert_eq!(
            (r.served_by.as_deref(), r.hops, r.ok),
            (Some("eu"), 1, true)
        );
        assert_eq!(r.itl_ms, Some(10.0));
        // No headers: served at home, no forward.
        let r = to_record("p", &outcome(None, None, None));
        assert_eq!((r.served_by.as_deref(), r.hops), (Some("us"), 0));
        // Served elsewhere without a hops header: one forward.
        assert_eq!(to_record("p", &outcome(Some("eu"), None, None)).hops, 1);
        // Failed before a first token: NaN TTFT, no serving region, the error kept,
        // no stream begun.
        let mut refused = outcome(None, None, Some("HTTP 503"));
        refused.measured.ttft_ms = None;
        let r = to_record("p", &refused);
        assert!(!r.ok && r.ttft_ms.is_nan() && r.served_by.is_none());
        assert_eq!(r.error.as_deref(), Some("HTTP 503"));
        assert_eq!(r.first_byte_ms, None);
        // Cut mid-stream: the head's time stays.
        let mut cut = outcome(Some("eu"), Some(1), Some("body: reset"));
        cut.measured.first_byte_ms = Some(4.0);
        assert_eq!(to_record("p", &cut).first_byte_ms, Some(4.0));
        // ... and its first token, measured before the cut, stays its TTFT.
        assert_eq!(to_record("p", &cut).ttft_ms, 10.0);
    }

    fn measured(v: impl IntoIterator<Item = f64>) -> Vec<Observation> {
        v.into_iter().map(Observation::Measured).collect()
    }

    #[test]
    fn failures_rank_above_every_measured_request() {
        // 96 measured (1..=96 ms) and 4 that failed at 300 ms: p95 is the 95th of all
        // 100 (95 ms), not the 95th percentile of the survivors (92 ms); p99 falls
        // among the failures: censored, at least 300 ms.
        let mut obs = measured((1..=96).map(f64::from));
        obs.extend([Observation::AtLeast(300.0); 4]);
        let s = censored_stats(&obs);
        assert_eq!((s.measured, s.unmeasured), (96, 4));
        assert_eq!((s.stats.p50, s.stats.p95, s.stats.p99), (50.0, 95.0, 300.0));
        assert_eq!(s.censored, vec!["p99"]);
        assert_eq!(s.stats.mean, 48.5);
        // Exactly 5% unmeasured: p95 is still a measured request.
        let mut obs = measured((1..=95).map(f64::from));
        obs.extend([Observation::AtLeast(300.0); 5]);
        let s = censored_stats(&obs);
        assert_eq!((s.stats.p95, s.censored.clone()), (95.0, vec!["p99"]));
        // More than 5%: p95 is censored.
        let mut obs = measured((1..=94).map(f64::from));
        obs.extend([Observation::AtLeast(300.0); 6]);
        let s = censored_stats(&obs);
        assert_eq!(s.censored, vec!["p95", "p99"]);
        assert_eq!(s.stats.p95, 300.0);
        // The lower bound is each request's own: failures early in the run bound
        // nothing above their failure time.
        let mut obs = measured([10.0, 20.0]);
        obs.extend([Observation::AtLeast(1.0), Observation::AtLeast(f64::NAN)]);
        let s = censored_stats(&obs);
        assert_eq!(s.censored, vec!["p95", "p99"]);
        assert_eq!((s.stats.p50, s.stats.p95), (20.0, 20.0));
    }

    #[test]
    fn nothing_measured_is_null_not_zero() {
        let s = censored_stats(&[Observation::AtLeast(3.0), Observation::AtLeast(5.0)]);
        assert!(s.stats.p50.is_nan() && s.stats.p95.is_nan() && s.stats.mean.is_nan());
        assert_eq!(s.censored, vec!["p50", "p95", "p99"]);
        assert_eq!((s.measured, s.unmeasured), (0, 2));
        // No request at all: nothing to censor either.
        let s = censored_stats(&[]);
        assert!(s.stats.p95.is_nan() && s.censored.is_empty());
        // A NaN measurement counts as unmeasured.
        let s = censored_stats(&[Observation::Measured(f64::NAN), Observation::Measured(2.0)]);
        assert_eq!((s.measured, s.unmeasured, s.stats.p50), (1, 1, 2.0));
    }

    #[test]
    fn observations_keep_a_first_token_of_a_failed_request() {
        let mut cut = outcome(None, None, Some("timeout: body"));
        cut.measured.e2e_ms = Some(300.0);
        assert_eq!(Observation::ttft(&cut), Observation::Measured(10.0));
        assert_eq!(Observation::e2e(&cut), Observation::AtLeast(300.0));
        cut.measured.ttft_ms = None;
        assert_eq!(Observation::ttft(&cut), Observation::AtLeast(300.0));
        let ok = outcome(None, None, None);
        assert_eq!(Observation::e2e(&ok), Observation::Measured(30.0));
    }

    /// A node's timeouts count as timeouts too: past its `request_timeout_ms` it answers
    /// 504 before the stream began, or ends the stream with the error event
    /// "request timed out" (the exact bodies and events a node sends).
    #[test]
    fn the_nodes_timeouts_are_counted_with_the_clients() {
        let errors = [
            "timeout: error sending request",
            r#"HTTP 504: {"error":{"message":"request timed out","type":"server_error","param":null,"code":"timeout"}}"#,
            r#"HTTP 504: {"error":{"message":"engine did not answer in time","type":"server_error","param":null,"code":"timeout"}}"#,
            "error event: request timed out",
            // Not timeouts: an engine failure, another error event, a cancelled request.
            r#"HTTP 502: {"error":{"message":"engine failed","type":"server_error","param":null,"code":"engine_failed"}}"#,
            "error event: upstream closed",
            "cancelled: stopped before it completed",
        ];
        let outcomes: Vec<RequestOutcome> = errors
            .iter()
            .map(|e| outcome(None, None, Some(e)))
            .collect();
        let f = failure_summary(&outcomes);
        assert_eq!(f["failed"], 7);
        assert_eq!(f["timeouts"], 4, "{f}");
    }

    #[test]
    fn a_column_is_added_to_every_record() {
        let csv = "a,b\n1,\"x\ny, \"\"z\"\"\"\n2,\n";
        assert_eq!(
            append_csv_column(csv, "slip_ms", &["0.5".into(), "7".into()]).unwrap(),
            "a,b,slip_ms\n1,\"x\ny, \"\"z\"\"\",0.5\n2,,7\n"
        );
        assert!(append_csv_column(csv, "s", &["1".into()]).is_err());
        assert!(append_csv_column(csv, "s", &["1".into(), "2".into(), "3".into()]).is_err());
        assert!(append_csv_column("a\n1", "s", &["1".into()]).is_err());
        assert_eq!(append_csv_column("", "s", &[]).unwrap(), "");
    }

    fn run(policy: &str, outcomes: Vec<RequestOutcome>) -> PolicyRun {
        PolicyRun {
            policy: policy.into(),
            regions: vec!["us".into()],
            output: crate::replay::ReplayOutput {
                outcomes,
                wall: std::time::Duration::from_secs(1),
                started_unix_ms: 0.0,
                cancelled: false,
                sim_comparable: true,
            },
            tuning: Vec::new(),
        }
    }

    #[test]
    fn the_report_counts_failures_censoring_and_slip() {
        // "good": 20 requests, slip i ms, one of them failed after its first token
        // with an error that needs quoting in CSV. "dead": all refused.
        let good: Vec<RequestOutcome> = (0..20)
            .map(|i| {
                let mut o = outcome(None, None, None);
                o.index = i;
                o.request_id = format!("r{i}");
                o.slip_ms = i as f64;
                o.measured.ttft_ms = Some(10.0 + i as f64);
                if i == 7 {
                    o.measured.error = Some("timeout: a, \"b\"\nline two".into());
                    o.measured.e2e_ms = Some(500.0);
                    o.measured.connect_retries = 2;
                }
                o
            })
            .collect();
        let dead: Vec<RequestOutcome> = (0..3)
            .map(|i| {
                let mut o = outcome(None, None, Some("HTTP 503: busy"));
                o.index = i;
                o.measured.ttft_ms = None;
                o.measured.e2e_ms = Some(2.0);
                o
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let table = write_report(
            dir.path(),
            serde_json::json!({"trace": "t"}),
            &[run("good", good), run("dead", dead)],
        )
        .unwrap();
        let results: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join("results.json")).unwrap(),
        )
        .unwrap();
        let (cfg, pol) = (&results["config"], &results["policies"]);
        // The failed request's TTFT (17 ms) is in the percentiles: max is 29.
        assert_eq!(pol["good"]["ttft_ms"]["p99"], 29.0);
        assert_eq!(pol["good"]["failed"], 1);
        // E2E: 1 of 20 unmeasured (5%): p95 measured, p99 censored at 500 ms.
        assert_eq!(pol["good"]["e2e_ms"]["p99"], 500.0);
        assert_eq!(
            cfg["censored"]["good"]["e2e_ms"]["censored"],
            serde_json::json!(["p99"])
        );
        assert_eq!(
            cfg["censored"]["good"]["ttft_ms"]["censored"],
            serde_json::json!([])
        );
        assert_eq!(cfg["failures"]["good"]["failed_share"], 0.05);
        assert_eq!(cfg["failures"]["good"]["timeouts"], 1);
        assert_eq!(cfg["failures"]["good"]["retries"], 2);
        assert_eq!(cfg["failures"]["good"]["retried_requests"], 1);
        assert_eq!(cfg["slip_ms"]["good"]["max"], 19.0);
        assert_eq!(cfg["slip_ms"]["good"]["p50"], 9.0);
        assert_eq!(cfg["sim_comparable"], true);
        // All failed: nulls, never 0 ms, every percentile censored.
        for metric in ["ttft_ms", "e2e_ms", "itl_ms"] {
            assert!(pol["dead"][metric]["p95"].is_null(), "{metric}");
        }
        assert_eq!(cfg["failures"]["dead"]["failed_share"], 1.0);
        assert_eq!(
            cfg["censored"]["dead"]["ttft_ms"]["censored"],
            serde_json::json!(["p50", "p95", "p99"])
        );
        assert!(table.contains("- dead: TTFT p50/p95/p99"), "{table}");
        let md = std::fs::read_to_string(dir.path().join("table.md")).unwrap();
        assert!(md.contains("Censored percentiles") && md.contains("- good: E2E p99"));
        // requests.csv: one slip per record, in record order, past a quoted error.
        let csv = std::fs::read_to_string(dir.path().join("requests.csv")).unwrap();
        let header = csv.lines().next().unwrap();
        assert!(header.ends_with(",slip_ms"), "{header}");
        let records: Vec<&str> = csv.split_inclusive('\n').collect();
        assert_eq!(records.len(), 1 + 20 + 1 + 3, "{csv}");
        let after_quote = &csv[csv.find("line two\"").unwrap()..];
        let rest_of_record = &after_quote[..after_quote.find('\n').unwrap()];
        assert!(rest_of_record.ends_with(",7.000"), "{rest_of_record}");
        assert!(records.last().unwrap().ends_with(",1.000\n"));
    }
}
