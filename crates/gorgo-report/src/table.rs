//! The paper-style comparison table, as Markdown (`table.md`) and for the console.

use crate::Report;

/// `v / per` with `decimals` places; `-` for a value nothing measured (NaN). The one
/// missing-value format of the report's tables (`table.md`, `sweep.md`).
pub(crate) fn num(v: f64, per: f64, decimals: usize) -> String {
    if v.is_nan() {
        "-".into()
    } else {
        format!("{:.*}", decimals, v / per)
    }
}

/// Header and rows of the table: one row per policy.
fn cells(report: &Report) -> (Vec<String>, Vec<Vec<String>>) {
    let mut regions: Vec<&str> = report
        .results
        .policies
        .iter()
        .flat_map(|(_, r)| r.region_share.keys().map(String::as_str))
        .collect();
    regions.sort_unstable();
    regions.dedup();

    let mut header: Vec<String> = [
        "policy",
        "requests",
        "failed",
        "req/s",
        "TTFT p50 ms",
        "TTFT p95 ms",
        "TTFT p99 ms",
        "E2E p50 s",
        "E2E p95 s",
        "E2E p99 s",
        "ITL p50 ms",
        "forwarded",
        "cache hit",
        "pred median APE",
        "pred rho",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    header.extend(regions.iter().map(|r| format!("share {r}")));

    let rows = report
        .results
        .policies
        .iter()
        .map(|(name, r)| {
            let mut row = vec![
                name.clone(),
                r.requests.to_string(),
                r.failed.to_string(),
                format!("{:.2}", r.throughput_rps),
                num(r.ttft_ms.p50, 1.0, 0),
                num(r.ttft_ms.p95, 1.0, 0),
                num(r.ttft_ms.p99, 1.0, 0),
                num(r.e2e_ms.p50, 1000.0, 2),
                num(r.e2e_ms.p95, 1000.0, 2),
                num(r.e2e_ms.p99, 1000.0, 2),
                num(r.itl_ms.p50, 1.0, 1),
                format!("{:.1}%", r.forwarded_share * 100.0),
                r.cache_hit_ratio
                    .map_or("-".into(), |h| format!("{:.1}%", h * 100.0)),
                r.prediction
                    .map_or("-".into(), |p| format!("{:.0}%", p.mape_median)),
                r.prediction
                    .and_then(|p| p.spearman)
                    .map_or("-".into(), |s| format!("{s:.2}")),
            ];
            row.extend(regions.iter().map(|reg| {
                format!(
                    "{:.1}%",
                    r.region_share.get(*reg).copied().unwrap_or(0.0) * 100.0
                )
            }));
            row
        })
        .collect();
    (header, rows)
}

/// Header and rows of the per-region cache-hit table, `None` when no policy has a
/// per-region figure.
fn hit_cells(report: &Report) -> Option<(Vec<String>, Vec<Vec<String>>)> {
    let mut regions: Vec<&str> = report
        .results
        .policies
        .iter()
        .flat_map(|(_, r)| r.cache_hit_ratio_by_region.keys().map(String::as_str))
        .collect();
    regions.sort_unstable();
    regions.dedup();
    if regions.is_empty() {
        return None;
    }
    let mut header = vec!["policy".to_string()];
    header.extend(regions.iter().map(|r| format!("cache hit {r}")));
    let rows = report
        .results
        .policies
        .iter()
        .map(|(name, r)| {
            let mut row = vec![name.clone()];
            row.extend(regions.iter().map(|reg| {
                r.cache_hit_ratio_by_region
                    .get(*reg)
                    .map_or("-".into(), |h| format!("{:.1}%", h * 100.0))
            }));
            row
        })
        .collect();
    Some((header, rows))
}

/// The table as Markdown: what `table.md` holds (then the per-region cache hits).
pub fn render_markdown(report: &Report) -> String {
    let (header, rows) = cells(report);
    let mut out = markdown(&header, &rows);
    if let Some((header, rows)) = hit_cells(report) {
        out.push_str("\nCache hit ratio by serving region:\n\n");
        out.push_str(&markdown(&header, &rows));
    }
    out
}

/// The table with aligned columns for a terminal (then the per-region cache hits).
pub fn render_table(report: &Report) -> String {
    let (header, rows) = cells(report);
    let mut out = aligned(&header, &rows);
    if let Some((header, rows)) = hit_cells(report) {
        out.push('\n');
        out.push_str(&aligned(&header, &rows));
    }
    out
}

/// A Markdown table: the first column left-aligned, the others (numbers) right.
pub fn markdown(header: &[String], rows: &[Vec<String>]) -> String {
    let mut out = format!("| {} |\n", header.join(" | "));
    out.push('|');
    for (i, _) in header.iter().enumerate() {
        // Numbers right-aligned, the policy name left.
        out.push_str(if i == 0 { " --- |" } else { " ---: |" });
    }
    out.push('\n');
    for row in rows {
        out.push_str(&format!("| {} |\n", row.join(" | ")));
    }
    out
}

/// A table with aligned columns for a terminal: the first column left-aligned, the
/// others right.
pub fn aligned(header: &[String], rows: &[Vec<String>]) -> String {
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            rows.iter()
                .map(|r| r[i].len())
                .chain([header[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |row: &[String]| {
        let parts: Vec<String> = row
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (c, w))| {
                if i == 0 {
                    format!("{c:<w$}")
                } else {
                    format!("{c:>w$}")
                }
            })
            .collect();
        parts.join("  ").trim_end().to_owned() + "\n"
    };
    let mut out = line(header);
    for row in rows {
        out.push_str(&line(row));
    }
    out
}
