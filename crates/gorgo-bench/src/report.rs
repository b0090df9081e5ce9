//! From replay outcomes to the report files.

use std::io::Write;
use std::path::Path;

use crate::compare::PolicyRun;
use crate::BenchError;

/// Write the report of `runs` under `out` and return the console table.
///
/// Besides the report files, `outcomes.jsonl` keeps every request's raw measurement
/// (including the dispatch slip), one JSON object per line.
pub fn write_report(
    out: &Path,
    config: serde_json::Value,
    runs: &[PolicyRun],
) -> Result<String, BenchError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| BenchError::Io { path, source }
    };
    std::fs::create_dir_all(out).map_err(io(out))?;
    let raw = out.join("outcomes.jsonl");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&raw).map_err(io(&raw))?);
    for run in runs {
        for o in &run.output.outcomes {
            let line = serde_json::json!({
                "policy": run.policy,
                "index": o.index,
                "request_id": o.request_id,
                "region": o.region,
                "session": o.session,
                "start_ms": o.start_ms,
                "slip_ms": o.slip_ms,
                "input_tokens": o.input_tokens,
                "output_tokens": o.output_tokens,
                "cached_tokens": o.measured.cached_tokens,
                "served_by": o.measured.served_by,
                "hops": o.measured.hops,
                "ttft_ms": o.measured.ttft_ms,
                "e2e_ms": o.measured.e2e_ms,
                "itl_ms": o.itl_ms(),
                "error": o.measured.error,
            });
            writeln!(f, "{line}").map_err(io(&raw))?;
        }
    }
    f.flush().map_err(io(&raw))?;
    let cfg_path = out.join("config.json");
    std::fs::write(
        &cfg_path,
        serde_json::to_vec_pretty(&config).unwrap_or_default(),
    )
    .map_err(io(&cfg_path))?;
    let mut table = String::from("| policy | requests | failed |\n|---|---|---|\n");
    for run in runs {
        table.push_str(&format!(
            "| {} | {} | {} |\n",
            run.policy,
            run.output.outcomes.len(),
            run.output.failed()
        ));
    }
    Ok(table)
}
