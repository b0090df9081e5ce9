//! The paper-style comparison table, as Markdown (`table.md`) and for the console.

use crate::Report;

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
                format!("{:.0}", r.ttft_ms.p50),
                format!("{:.0}", r.ttft_ms.p95),
                format!("{:.0}", r.ttft_ms.p99),
                format!("{:.2}", r.e2e_ms.p50 / 1000.0),
                format!("{:.2}", r.e2e_ms.p95 / 1000.0),
                format!("{:.2}", r.e2e_ms.p99 / 1000.0),
                format!("{:.1}", r.itl_ms.p50),
                format!("{:.1}%", r.forwarded_share * 100.0),
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

/// The table as Markdown: what `table.md` holds.
pub fn render_markdown(report: &Report) -> String {
    let (header, rows) = cells(report);
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

/// The table with aligned columns for a terminal.
pub fn render_table(report: &Report) -> String {
    let (header, rows) = cells(report);
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
    let mut out = line(&header);
    for row in &rows {
        out.push_str(&line(row));
    }
    out
}
