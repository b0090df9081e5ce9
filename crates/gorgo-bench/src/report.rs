//! From replay outcomes to `gorgo-report`'s records and report files.

use std::path::Path;

use gorgo_report::{render_table, Report, RequestRecord};

use crate::compare::PolicyRun;
use crate::replay::RequestOutcome;
use crate::BenchError;

/// One outcome as a report record under `policy`.
///
/// A failed request has a NaN TTFT (the report keeps it out of the statistics); its
/// `first_byte_ms` tells a stream cut mid-way from a request that never started.
/// When a successful response carries no `x-gorgo-served-by` (an engine or proxy that
/// is not a GORGO node), it counts as served in its home region.
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
        ttft_ms: if ok {
            o.measured.ttft_ms.unwrap_or(f64::NAN)
        } else {
            f64::NAN
        },
        e2e_ms: o.measured.e2e_ms.unwrap_or(f64::NAN),
        itl_ms: o.itl_ms(),
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

/// Write `results.json`, `table.md`, `requests.csv`, the plots and (when a cluster
/// tuned its weights) `tuning.jsonl` of `runs` under `out`, and return the console
/// table. The dispatch slip of each policy (p50/p95/
/// p99/mean, ms) is added to the config under `"slip_ms"`, each replay's start on
/// the system clock under `"started_unix_ms"`; `"cancelled"` lists the
/// policies whose replay was interrupted.
pub fn write_report(
    out: &Path,
    mut config: serde_json::Value,
    runs: &[PolicyRun],
) -> Result<String, BenchError> {
    let mut slip = serde_json::Map::new();
    let mut started = serde_json::Map::new();
    let mut cancelled = Vec::new();
    let mut records = Vec::new();
    for run in runs {
        let mut slips: Vec<f64> = run.output.outcomes.iter().map(|o| o.slip_ms).collect();
        let stats = gorgo_core::summarize(&mut slips);
        slip.insert(
            run.policy.clone(),
            serde_json::to_value(stats).unwrap_or_default(),
        );
        started.insert(run.policy.clone(), run.output.started_unix_ms.into());
        if run.output.cancelled {
            cancelled.push(run.policy.clone());
        }
        records.extend(
            run.output
                .outcomes
                .iter()
                .map(|o| to_record(&run.policy, o)),
        );
    }
    if let Some(obj) = config.as_object_mut() {
        obj.insert("slip_ms".into(), serde_json::Value::Object(slip));
        obj.insert("started_unix_ms".into(), serde_json::Value::Object(started));
        if !cancelled.is_empty() {
            obj.insert("cancelled".into(), cancelled.into());
        }
    }
    let tuning: Vec<&serde_json::Value> = runs.iter().flat_map(|r| &r.tuning).collect();
    let report = Report::from_records(&config, records)
        .and_then(|r| r.with_tuning(&tuning))
        .map_err(report_err(out))?;
    report.write(out).map_err(report_err(out))?;
    Ok(render_table(&report))
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
        // Failed: NaN TTFT, no serving region, the error kept, no stream begun.
        let r = to_record("p", &outcome(None, None, Some("HTTP 503")));
        assert!(!r.ok && r.ttft_ms.is_nan() && r.served_by.is_none());
        assert_eq!(r.error.as_deref(), Some("HTTP 503"));
        assert_eq!(r.first_byte_ms, None);
        // Cut mid-stream: the head's time stays.
        let mut cut = outcome(Some("eu"), Some(1), Some("body: reset"));
        cut.measured.first_byte_ms = Some(4.0);
        assert_eq!(to_record("p", &cut).first_byte_ms, Some(4.0));
    }
}
