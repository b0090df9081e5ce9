//! SVG plots: the TTFT CDF per policy and the per-region request share over time.

use std::error::Error;

use plotters::prelude::*;

use crate::{Report, ReportError, Result};

/// Most points drawn per line: keeps SVGs small for long runs without changing shape.
const MAX_POINTS: usize = 2000;
/// Time bins of the region-share plot.
const SHARE_BINS: usize = 30;

type DrawResult = std::result::Result<(), Box<dyn Error>>;

fn plot_error(file: &'static str) -> impl Fn(Box<dyn Error>) -> ReportError {
    move |e| ReportError::Plot {
        file,
        reason: e.to_string(),
    }
}

fn color(i: usize) -> RGBColor {
    // A small qualitative palette (Okabe-Ito), readable in print and for colour-blind
    // readers.
    const COLORS: [RGBColor; 8] = [
        RGBColor(0, 114, 178),
        RGBColor(213, 94, 0),
        RGBColor(0, 158, 115),
        RGBColor(204, 121, 167),
        RGBColor(230, 159, 0),
        RGBColor(86, 180, 233),
        RGBColor(0, 0, 0),
        RGBColor(240, 228, 66),
    ];
    COLORS[i % COLORS.len()]
}

/// `ttft_cdf.svg`: the empirical CDF of TTFT of completed requests, one line per
/// policy, log x axis.
pub(crate) fn ttft_cdf(report: &Report) -> Result<String> {
    let mut svg = String::new();
    draw_ttft_cdf(report, &mut svg).map_err(plot_error("ttft_cdf.svg"))?;
    Ok(svg)
}

fn draw_ttft_cdf(report: &Report, svg: &mut String) -> DrawResult {
    let series: Vec<(&str, Vec<f64>)> = report
        .results
        .policies
        .iter()
        .map(|(policy, _)| {
            let mut v: Vec<f64> = report
                .records
                .iter()
                .filter(|r| r.ok && &r.policy == policy && r.ttft_ms.is_finite())
                .map(|r| r.ttft_ms.max(0.1))
                .collect();
            v.sort_by(f64::total_cmp);
            (policy.as_str(), v)
        })
        .collect();
    let lo = series
        .iter()
        .filter_map(|(_, v)| v.first())
        .copied()
        .fold(f64::INFINITY, f64::min);
    let hi = series
        .iter()
        .filter_map(|(_, v)| v.last())
        .copied()
        .fold(0.0, f64::max);
    let (lo, hi) = if lo.is_finite() && hi > lo {
        (lo * 0.9, hi * 1.1)
    } else {
        (1.0, 10_000.0)
    };

    let root = SVGBackend::with_string(svg, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("TTFT CDF", ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..1f64)?;
    chart
        .configure_mesh()
        .x_desc("TTFT (ms, log scale)")
        .y_desc("fraction of requests")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .draw()?;
    for (i, (policy, v)) in series.iter().enumerate() {
        if v.is_empty() {
            continue;
        }
        let n = v.len();
        let step = n.div_ceil(MAX_POINTS).max(1);
        let points = (0..n)
            .filter(|k| k % step == 0 || *k == n - 1)
            .map(|k| (v[k], (k + 1) as f64 / n as f64));
        let c = color(i);
        chart
            .draw_series(LineSeries::new(points, c.stroke_width(2)))?
            .label(*policy)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// `region_share.svg`: for each policy a panel with, per region, the share of completed
/// requests it served in each time bin.
pub(crate) fn region_share(report: &Report) -> Result<String> {
    let mut svg = String::new();
    draw_region_share(report, &mut svg).map_err(plot_error("region_share.svg"))?;
    Ok(svg)
}

fn draw_region_share(report: &Report, svg: &mut String) -> DrawResult {
    let mut regions: Vec<&str> = report
        .records
        .iter()
        .filter_map(|r| r.served_by.as_deref())
        .collect();
    regions.sort_unstable();
    regions.dedup();
    let end_s = report
        .records
        .iter()
        .map(|r| r.start_ms / 1000.0)
        .filter(|t| t.is_finite())
        .fold(0.0, f64::max)
        .max(1.0);
    let bin_s = end_s / SHARE_BINS as f64;
    let policies = &report.results.policies;

    let panels = policies.len().max(1);
    let root = SVGBackend::with_string(svg, (900, 60 + 240 * panels as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(
        "Request share per serving region over time",
        ("sans-serif", 22),
    )?;
    let areas = root.split_evenly((panels, 1));
    for ((policy, _), area) in policies.iter().zip(areas) {
        // served[bin][region], completed[bin]
        let mut served = vec![vec![0u64; regions.len()]; SHARE_BINS];
        let mut completed = vec![0u64; SHARE_BINS];
        for r in report
            .records
            .iter()
            .filter(|r| r.ok && &r.policy == policy)
        {
            let Some(reg) = r.served_by.as_deref() else {
                continue;
            };
            if !r.start_ms.is_finite() {
                continue;
            }
            let bin = ((r.start_ms / 1000.0 / bin_s).max(0.0) as usize).min(SHARE_BINS - 1);
            completed[bin] += 1;
            if let Ok(k) = regions.binary_search(&reg) {
                served[bin][k] += 1;
            }
        }
        let mut chart = ChartBuilder::on(&area)
            .caption(policy.as_str(), ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(50)
            .build_cartesian_2d(0f64..end_s, 0f64..1f64)?;
        chart
            .configure_mesh()
            .x_desc("time (s)")
            .y_desc("share")
            .draw()?;
        for (k, region) in regions.iter().enumerate() {
            let points: Vec<(f64, f64)> = (0..SHARE_BINS)
                .filter(|&b| completed[b] > 0)
                .map(|b| {
                    (
                        (b as f64 + 0.5) * bin_s,
                        served[b][k] as f64 / completed[b] as f64,
                    )
                })
                .collect();
            let c = color(k);
            chart
                .draw_series(LineSeries::new(points, c.stroke_width(2)))?
                .label(*region)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
        }
        if !regions.is_empty() {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()?;
        }
    }
    root.present()?;
    Ok(())
}
