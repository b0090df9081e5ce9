//! SVG plots: TTFT and E2E CDFs per policy, the per-region request share over time
//! (stacked), a load sweep's p95 latencies and cache hit ratio against offered load,
//! and a tuning run's trajectory (weights and scores over trials).

use std::error::Error;

use plotters::coord::combinators::BindKeyPoints;
use plotters::prelude::*;

use crate::sweep::Sweep;
use crate::{PolicyResult, Report, ReportError, Result};

/// Most points drawn per line: keeps SVGs small for long runs without changing shape.
const MAX_POINTS: usize = 2000;
/// Sweep latency plots stop at this many times the SLO (higher values sit on the top
/// edge).
const CLIP_X_SLO: f64 = 50.0;
/// Time bins of the region-share plot.
const SHARE_BINS: usize = 30;

type DrawResult = std::result::Result<(), Box<dyn Error>>;

fn plot_error(file: &'static str) -> impl Fn(Box<dyn Error>) -> ReportError {
    move |e| ReportError::Plot {
        file,
        reason: e.to_string(),
    }
}

/// The `i`-th series colour. No two indices share one: a plot with more series than
/// the palette (a 32-region topology's bands) must still tell them apart.
fn color(i: usize) -> RGBColor {
    // A qualitative palette: Okabe-Ito's eight (readable in print and for colour-blind
    // readers), then four of Paul Tol's, so the dozen policies of `--policies all`
    // never share a colour.
    const COLORS: [RGBColor; 12] = [
        RGBColor(0, 114, 178),
        RGBColor(213, 94, 0),
        RGBColor(0, 158, 115),
        RGBColor(204, 121, 167),
        RGBColor(230, 159, 0),
        RGBColor(86, 180, 233),
        RGBColor(0, 0, 0),
        RGBColor(240, 228, 66),
        RGBColor(136, 34, 85),
        RGBColor(17, 119, 51),
        RGBColor(153, 153, 51),
        RGBColor(102, 51, 153),
    ];
    if let Some(c) = COLORS.get(i) {
        return *c;
    }
    // Past the palette: hues stepped by the golden ratio of a turn (each new one falls
    // in the widest gap left) at three lightnesses in turn, so neighbours differ in both.
    let k = i - COLORS.len();
    let hue = (k as f64 * 0.618_033_988_749_895).fract();
    let lightness = [0.35, 0.5, 0.65][k % 3];
    let (r, g, b) = HSLColor(hue, 0.75, lightness).rgb();
    RGBColor(r, g, b)
}

/// Width of `text` in a sans-serif font of `px` pixels, estimated (the SVG is laid out
/// here, not by the viewer): plotters writes a font of `px` as `font-size` px / 1.24,
/// and 0.6 em a character is above the average of Latin text, so half of `px` a
/// character keeps labels placed by it from overlapping.
fn text_width(text: &str, px: u32) -> i32 {
    (text.chars().count() as f64 * f64::from(px) * 0.5).ceil() as i32
}

/// Tick positions on a log axis from `lo` to `hi`: 1, 2 and 5 times each power of ten
/// (fewer per decade on wide ranges), so sub-second latencies get labels too.
pub(crate) fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    if !(lo.is_finite() && hi.is_finite() && lo > 0.0 && hi > lo) {
        return Vec::new();
    }
    let decades = (hi / lo).log10();
    let mantissas: &[f64] = if decades > 5.0 {
        &[1.0]
    } else if decades > 3.0 {
        &[1.0, 3.0]
    } else {
        &[1.0, 2.0, 5.0]
    };
    let mut out = Vec::new();
    let mut p = 10f64.powf(lo.log10().floor());
    while p <= hi {
        for m in mantissas {
            let v = m * p;
            if v >= lo && v <= hi {
                out.push(v);
            }
        }
        p *= 10.0;
    }
    out
}

/// A latency in ms as a short label: `50 ms`, `200 ms`, `1.5 s`, `20 s`.
pub(crate) fn fmt_ms(v: f64) -> String {
    if v < 1.0 {
        format!("{v:.2} ms")
    } else if v < 1000.0 {
        format!("{v:.0} ms")
    } else {
        let s = format!("{:.1}", v / 1000.0);
        format!("{} s", s.trim_end_matches(".0"))
    }
}

/// `(lo, hi)` of a log axis covering every value, padded; a default when empty.
fn log_bounds<'a>(values: impl Iterator<Item = &'a f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite() && **v > 0.0)
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
            (lo.min(*v), hi.max(*v))
        });
    if lo.is_finite() && hi > lo {
        (lo * 0.8, hi * 1.25)
    } else if lo.is_finite() {
        (lo * 0.5, lo * 2.0)
    } else {
        (1.0, 10_000.0)
    }
}

/// `ttft_cdf.svg`: the empirical CDFs of TTFT (left) and E2E latency (right), one line
/// per policy, log x axes. The y axis is the share of *all* the policy's requests: a
/// failed request has no latency and never arrives, so a policy with failures tops
/// out below 1 (its table p95 may be censored while its completed requests look fast).
pub(crate) fn ttft_cdf(report: &Report) -> Result<String> {
    let mut svg = String::new();
    draw_latency_cdfs(report, &mut svg).map_err(plot_error("ttft_cdf.svg"))?;
    Ok(svg)
}

/// One CDF line: the policy, the latencies its requests measured (sorted, finite) and
/// how many requests it sent in all (the denominator of the y axis).
type CdfSeries<'a> = (&'a str, Vec<f64>, usize);

/// A request's TTFT, when it measured one: a stream cut after its first token has
/// one, as in the live report's percentiles (the simulator fails requests only before).
fn measured_ttft(r: &crate::RequestRecord) -> Option<f64> {
    Some(r.ttft_ms).filter(|v| v.is_finite())
}

/// A completed request's E2E (a failed one's is when it failed).
fn completed_e2e(r: &crate::RequestRecord) -> Option<f64> {
    r.ok.then_some(r.e2e_ms)
}

/// Every policy's [`CdfSeries`] of the latency `pick` reads.
fn cdf_series(
    report: &Report,
    pick: fn(&crate::RequestRecord) -> Option<f64>,
) -> Vec<CdfSeries<'_>> {
    report
        .results
        .policies
        .iter()
        .map(|(policy, _)| {
            let records = || report.records.iter().filter(|r| &r.policy == policy);
            let mut v: Vec<f64> = records()
                .filter_map(pick)
                .filter(|v| v.is_finite())
                .map(|v| v.max(0.1))
                .collect();
            v.sort_by(f64::total_cmp);
            (policy.as_str(), v, records().count())
        })
        .collect()
}

/// The points of one CDF line: the k-th smallest latency at `k / total` (`total`
/// counts failed requests, so the line ends at the completed share), at most
/// [`MAX_POINTS`] of them, the last always kept.
fn cdf_points(sorted: &[f64], total: usize) -> Vec<(f64, f64)> {
    let n = sorted.len();
    let step = n.div_ceil(MAX_POINTS).max(1);
    (0..n)
        .filter(|k| k % step == 0 || *k == n - 1)
        .map(|k| (sorted[k], (k + 1) as f64 / total.max(n) as f64))
        .collect()
}

fn draw_latency_cdfs(report: &Report, svg: &mut String) -> DrawResult {
    let series = |pick| cdf_series(report, pick);
    let root = SVGBackend::with_string(svg, (1400, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(700);
    draw_cdf(
        &left,
        "TTFT CDF",
        "TTFT (log scale)",
        &series(measured_ttft),
    )?;
    draw_cdf(
        &right,
        "E2E CDF",
        "end-to-end latency (log scale)",
        &series(completed_e2e),
    )?;
    root.present()?;
    Ok(())
}

fn draw_cdf<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    x_desc: &str,
    series: &[CdfSeries<'_>],
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let (lo, hi) = log_bounds(series.iter().flat_map(|(_, v, _)| v.iter()));
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d(
            (lo..hi).log_scale().with_key_points(log_ticks(lo, hi)),
            0f64..1f64,
        )?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc("share of all requests (failed ones never arrive)")
        .x_label_formatter(&|v| fmt_ms(*v))
        .draw()?;
    let empty = series.iter().all(|(_, v, _)| v.is_empty());
    if empty {
        // A run past `--max-rows` keeps sketches, not requests: say so, not a blank.
        area.draw(&Text::new(
            "no per-request latencies in this report (none completed, or the run kept \
             no rows): see table.md",
            (80, 250),
            ("sans-serif", 15).into_font(),
        ))?;
    }
    for (i, (policy, v, total)) in series.iter().enumerate() {
        if v.is_empty() {
            continue;
        }
        let points = cdf_points(v, *total);
        let c = color(i);
        if let [only] = points[..] {
            // One request is one point, which a line does not show.
            chart.draw_series(std::iter::once(Circle::new(only, 4, c.filled())))?;
        }
        chart
            .draw_series(LineSeries::new(points, c.stroke_width(2)))?
            .label(*policy)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    if !empty {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    Ok(())
}

/// `region_share.svg`: for each policy a panel of stacked areas: per time bin, the
/// share of completed requests each region served (the bands add up to 1).
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
    let (places, legend_h) = flow_legend(&regions, SHARE_WIDTH);
    let height = 54 + legend_h as u32 + 200 * panels as u32;
    let root = SVGBackend::with_string(svg, (SHARE_WIDTH as u32, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(
        "Share of completed requests per serving region over time (stacked)",
        ("sans-serif", 22),
    )?;
    // One legend for every panel, in stacking order (bottom band first), wrapped into
    // as many rows as the regions need.
    let (legend, root) = root.split_vertically(legend_h);
    for (k, (region, &(x, y))) in regions.iter().zip(&places).enumerate() {
        legend.draw(&Rectangle::new(
            [(x, y), (x + LEGEND_SWATCH, y + 16)],
            color(k).mix(0.85).filled(),
        ))?;
        legend.draw(&Text::new(
            region.to_string(),
            (x + LEGEND_SWATCH + 6, y + 1),
            ("sans-serif", LEGEND_FONT).into_font(),
        ))?;
    }
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
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(0f64..end_s, 0f64..1f64)?;
        chart
            .configure_mesh()
            .x_desc("time (s)")
            .y_desc("share")
            .y_labels(5)
            .x_label_formatter(&|v| format!("{v:.0}"))
            .disable_x_mesh()
            .draw()?;
        // Bins with completions, each drawn as a step over its whole width.
        let bins: Vec<usize> = (0..SHARE_BINS).filter(|&b| completed[b] > 0).collect();
        let cumulative = |b: usize, upto: usize| -> f64 {
            served[b][..upto].iter().sum::<u64>() as f64 / completed[b] as f64
        };
        for k in 0..regions.len() {
            let mut upper = Vec::with_capacity(bins.len() * 2);
            let mut lower = Vec::with_capacity(bins.len() * 2);
            for &b in &bins {
                let (x0, x1) = (b as f64 * bin_s, (b + 1) as f64 * bin_s);
                let (lo, hi) = (cumulative(b, k), cumulative(b, k + 1));
                upper.extend([(x0, hi), (x1, hi)]);
                lower.extend([(x0, lo), (x1, lo)]);
            }
            lower.reverse();
            upper.extend(lower);
            chart.draw_series(std::iter::once(Polygon::new(
                upper,
                color(k).mix(0.85).filled(),
            )))?;
        }
    }
    root.present()?;
    Ok(())
}

/// Width of a sweep plot's chart, px (its legend column comes after).
const SWEEP_PLOT_WIDTH: i32 = 780;
/// Width of the region-share plot, px.
const SHARE_WIDTH: i32 = 900;
/// Legend label font size, px.
const LEGEND_FONT: u32 = 15;
/// Width of a legend's colour swatch, px.
const LEGEND_SWATCH: i32 = 18;

/// Where each entry of a legend of `labels` goes on a canvas `width` wide: left to
/// right, a new row before an entry would pass the right margin. Returns each entry's
/// top-left corner (its swatch; the label follows it) and the legend's height. An
/// entry wider than a row gets a row to itself.
fn flow_legend(labels: &[&str], width: i32) -> (Vec<(i32, i32)>, i32) {
    const MARGIN: i32 = 20;
    const ROW: i32 = 24;
    let (mut x, mut y) = (MARGIN, 8);
    let mut places = Vec::with_capacity(labels.len());
    for label in labels {
        let w = LEGEND_SWATCH + 6 + text_width(label, LEGEND_FONT);
        if x > MARGIN && x + w > width - MARGIN {
            x = MARGIN;
            y += ROW;
        }
        places.push((x, y));
        x += w + 24;
    }
    (places, y + ROW + 4)
}

/// One plot of a sweep: what it shows and how.
struct SweepPlot {
    file: &'static str,
    title: &'static str,
    y_desc: &'static str,
    pick: fn(&PolicyResult) -> Option<f64>,
    log: bool,
}

/// The three plots of a load sweep, `(file name, SVG)`: p95 TTFT, p95 E2E and cache
/// hit ratio against offered load, one line per policy.
pub(crate) fn sweep_plots(sweep: &Sweep) -> Result<Vec<(&'static str, String)>> {
    let plots = [
        SweepPlot {
            file: "sweep_ttft_p95.svg",
            title: "p95 TTFT vs offered load",
            y_desc: "p95 TTFT (log scale)",
            pick: |r| Some(r.ttft_ms.p95),
            log: true,
        },
        SweepPlot {
            file: "sweep_e2e_p95.svg",
            title: "p95 E2E latency vs offered load",
            y_desc: "p95 E2E (log scale)",
            pick: |r| Some(r.e2e_ms.p95),
            log: true,
        },
        SweepPlot {
            file: "sweep_cache_hit.svg",
            title: "Cache hit ratio vs offered load",
            y_desc: "cached / prompt tokens (%)",
            pick: |r| r.cache_hit_ratio.map(|h| h * 100.0),
            log: false,
        },
    ];
    let mut out = Vec::new();
    for plot in &plots {
        let slo = match plot.file {
            "sweep_ttft_p95.svg" => Some(sweep.slo.ttft_p95_ms),
            "sweep_e2e_p95.svg" => sweep.slo.e2e_p95_ms,
            _ => None,
        };
        // The floor no policy can beat (the cache's: the most any can hit), so a reader
        // sees how much room the best line leaves.
        let floor = sweep.floor.as_ref().and_then(|f| match plot.file {
            "sweep_ttft_p95.svg" => Some(("floor (no policy can beat)", f.ttft_ms.p95)),
            "sweep_e2e_p95.svg" => Some(("floor (no policy can beat)", f.e2e_ms.p95)),
            _ => f
                .cache_hit_ratio
                .map(|h| ("bound (unbounded shared cache)", h * 100.0)),
        });
        let mut svg = String::new();
        draw_sweep(sweep, &mut svg, plot, slo, floor).map_err(plot_error(plot.file))?;
        out.push((plot.file, svg));
    }
    Ok(out)
}

fn draw_sweep(
    sweep: &Sweep,
    svg: &mut String,
    plot: &SweepPlot,
    slo: Option<f64>,
    floor: Option<(&str, f64)>,
) -> DrawResult {
    let SweepPlot {
        title,
        y_desc,
        pick,
        log,
        ..
    } = *plot;
    let floor = floor.filter(|(_, v)| v.is_finite() && (!log || *v > 0.0));
    let mut refs: Vec<RefLine> = Vec::new();
    if let Some(s) = slo {
        refs.push(RefLine {
            label: format!("SLO {}", fmt_ms(s)),
            value: s,
            color: SLO_GREY,
            dash: 8,
            gap: 5,
        });
    }
    if let Some((label, f)) = floor {
        refs.push(RefLine {
            label: label.to_owned(),
            value: f,
            color: FLOOR_GREY,
            dash: 2,
            gap: 4,
        });
    }
    // +inf is censored (above every measured value, e.g. a live p95 with too many
    // failures): on a latency plot it stays, drawn at the top edge with its own marker,
    // as the worst points must not look like missing ones. NaN (nothing measured) goes.
    let lines: Vec<(String, Vec<(f64, f64)>)> = sweep
        .policies()
        .into_iter()
        .map(|p| {
            let pts = sweep
                .curve(&p)
                .into_iter()
                .filter_map(|(x, r)| {
                    pick(r)
                        .filter(|v| v.is_finite() || (log && *v == f64::INFINITY))
                        .map(|v| (x, v))
                })
                .map(|(x, v)| (x, if log { v.max(0.1) } else { v }))
                .collect();
            (p, pts)
        })
        .collect();
    let any_censored = lines
        .iter()
        .any(|(_, pts)| pts.iter().any(|p| p.1 == f64::INFINITY));
    let xs = sweep.points.iter().map(|p| p.offered_rps);
    let (x_lo, x_hi) = xs.fold((f64::INFINITY, 0.0f64), |(a, b), x| (a.min(x), b.max(x)));
    let (x_lo, x_hi) = if x_lo.is_finite() && x_hi > x_lo {
        let pad = (x_hi - x_lo) * 0.05;
        ((x_lo - pad).max(0.0), x_hi + pad)
    } else if x_lo.is_finite() {
        (x_lo * 0.5, x_lo * 1.5 + 1e-3)
    } else {
        (0.0, 1.0)
    };
    // The legend gets its own column so it never hides a line, as wide as its longest
    // label needs.
    let censored_label = "censored: above the top edge";
    let longest = refs
        .iter()
        .map(|r| r.label.as_str())
        .chain(lines.iter().map(|(p, _)| p.as_str()))
        .chain(any_censored.then_some(censored_label))
        .map(|l| text_width(l, LEGEND_FONT))
        .max()
        .unwrap_or(0);
    let legend_w = (40 + longest + 10).max(220);
    let root = SVGBackend::with_string(svg, (SWEEP_PLOT_WIDTH as u32 + legend_w as u32, 560))
        .into_drawing_area();
    root.fill(&WHITE)?;
    let (plot_area, legend) = root.split_horizontally(SWEEP_PLOT_WIDTH);
    // Reference lines first (dashed), then one entry per policy (a line and a marker),
    // then the censored marker when a point is censored.
    let rows = refs.len() + lines.len();
    if any_censored {
        let y = 60 + 24 * rows as i32;
        legend.draw(&TriangleMarker::new((21, y), 6, BLACK.filled()))?;
        legend.draw(&Text::new(
            censored_label,
            (40, y - 8),
            ("sans-serif", LEGEND_FONT).into_font(),
        ))?;
    }
    for k in 0..rows {
        let y = 60 + 24 * k as i32;
        let (label, c) = match refs.get(k) {
            Some(r) => (r.label.clone(), r.color),
            None => (lines[k - refs.len()].0.clone(), color(k - refs.len())),
        };
        if let Some(r) = refs.get(k) {
            let (dash, gap) = (r.dash as i32, r.gap as i32);
            let mut x = 10;
            while x < 32 {
                let end = (x + dash).min(32);
                legend.draw(&PathElement::new(vec![(x, y), (end, y)], c.stroke_width(3)))?;
                x = end + gap;
            }
        } else {
            legend.draw(&PathElement::new(vec![(10, y), (32, y)], c.stroke_width(3)))?;
            legend.draw(&Circle::new((21, y), 4, c.filled()))?;
        }
        legend.draw(&Text::new(
            label,
            (40, y - 8),
            ("sans-serif", LEGEND_FONT).into_font(),
        ))?;
    }
    let mut builder = ChartBuilder::on(&plot_area);
    builder
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(65);
    let values = lines.iter().flat_map(|(_, v)| v.iter().map(|p| &p.1));
    if log {
        let (lo, hi) = log_bounds(values.chain(refs.iter().map(|r| &r.value)));
        // A saturated policy's latencies run to hours; past CLIP_X_SLO times the SLO
        // they are drawn at the top edge so the lines near the SLO stay readable.
        let hi = slo.map_or(hi, |s| hi.min(s * CLIP_X_SLO).max(lo * 2.0));
        // Censored points (+inf) land on the top edge too, marked as such.
        let clipped: Vec<PlotLine> = lines
            .iter()
            .map(|(p, pts)| {
                (
                    p.clone(),
                    pts.iter()
                        .map(|&(x, y)| (x, y.min(hi), y == f64::INFINITY))
                        .collect(),
                )
            })
            .collect();
        let mut chart = builder.build_cartesian_2d(
            x_lo..x_hi,
            (lo..hi).log_scale().with_key_points(log_ticks(lo, hi)),
        )?;
        let desc = if slo.is_some() {
            format!("{y_desc}; clipped at {}", fmt_ms(hi))
        } else {
            y_desc.to_owned()
        };
        chart
            .configure_mesh()
            .x_desc("offered load (requests/s)")
            .y_desc(desc)
            .y_label_formatter(&|v| fmt_ms(*v))
            .max_light_lines(2)
            .draw()?;
        draw_lines(&mut chart, &clipped, &refs, (x_lo, x_hi))?;
    } else {
        // Ratios are often a few percent: scale to the data, not to 100%.
        let top = values
            .chain(refs.iter().map(|r| &r.value))
            .fold(0.0f64, |m, v| m.max(*v));
        let top = (top * 1.25).clamp(5.0, 100.0);
        let mut chart = builder.build_cartesian_2d(x_lo..x_hi, 0f64..top)?;
        chart
            .configure_mesh()
            .x_desc("offered load (requests/s)")
            .y_desc(y_desc)
            .y_label_formatter(&|v| format!("{v:.0}"))
            .max_light_lines(2)
            .draw()?;
        let lines: Vec<PlotLine> = lines
            .into_iter()
            .map(|(p, pts)| (p, pts.into_iter().map(|(x, y)| (x, y, false)).collect()))
            .collect();
        draw_lines(&mut chart, &lines, &refs, (x_lo, x_hi))?;
    }
    root.present()?;
    Ok(())
}

/// A weight pair as `tuning.jsonl` writes it.
#[derive(Debug, Clone, Copy, serde::Deserialize)]
struct WeightsLine {
    w_rtt: f64,
    w_queue: f64,
}

/// One decided trial as `tuning.jsonl` has it (the fields the plot reads).
#[derive(serde::Deserialize)]
struct TrialLine {
    #[serde(default)]
    policy: Option<String>,
    epoch: u64,
    candidate: WeightsLine,
    incumbent: WeightsLine,
    score_p95_ttft_ms: Option<f64>,
    incumbent_p95_ttft_ms: Option<f64>,
    accepted: bool,
}

/// The trajectory of a tuning run (`tuning.svg`): above, the incumbent's `w_rtt` and
/// `w_queue` after each trial (lines) and each candidate (dots); below, the p95 TTFT
/// of candidate and incumbent in each trial. Only the first policy of the lines is
/// drawn (a simulation tunes each weighted policy on its own line); `None` without
/// trials.
pub(crate) fn tuning_trajectory(lines: &[String]) -> Result<Option<String>> {
    let trials: Vec<TrialLine> = lines
        .iter()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let Some(first) = trials.first().map(|t| t.policy.clone()) else {
        return Ok(None);
    };
    let mut trials: Vec<TrialLine> = trials.into_iter().filter(|t| t.policy == first).collect();
    trials.sort_by_key(|t| t.epoch);
    let mut svg = String::new();
    draw_tuning(&trials, first.as_deref(), &mut svg).map_err(plot_error("tuning.svg"))?;
    Ok(Some(svg))
}

fn draw_tuning(trials: &[TrialLine], policy: Option<&str>, svg: &mut String) -> DrawResult {
    let x_hi = trials.len().max(2) as f64;
    let after = |t: &TrialLine| if t.accepted { t.candidate } else { t.incumbent };
    let mut rtt = vec![(0.0, trials[0].incumbent.w_rtt)];
    let mut queue = vec![(0.0, trials[0].incumbent.w_queue)];
    for (i, t) in trials.iter().enumerate() {
        let w = after(t);
        rtt.push(((i + 1) as f64, w.w_rtt));
        queue.push(((i + 1) as f64, w.w_queue));
    }
    let root = SVGBackend::with_string(svg, (1000, 720)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(380);
    let title = match policy {
        Some(p) => format!("Tuning trajectory of {p}: weights after each trial"),
        None => "Tuning trajectory: weights after each trial".to_owned(),
    };
    let w_all = trials.iter().flat_map(|t| {
        [
            t.candidate.w_rtt,
            t.candidate.w_queue,
            t.incumbent.w_rtt,
            t.incumbent.w_queue,
        ]
    });
    let (w_lo, w_hi) = log_bounds(w_all.collect::<Vec<_>>().iter());
    let mut chart = ChartBuilder::on(&top)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(35)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..x_hi, (w_lo..w_hi).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("trial")
        .y_desc("weight (log scale)")
        .y_label_formatter(&|v| format!("{v:.2}"))
        .max_light_lines(2)
        .draw()?;
    for (k, (name, pts, pick)) in [
        (
            "w_rtt",
            &rtt,
            (|w: WeightsLine| w.w_rtt) as fn(WeightsLine) -> f64,
        ),
        ("w_queue", &queue, |w: WeightsLine| w.w_queue),
    ]
    .into_iter()
    .enumerate()
    {
        let c = color(k);
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))?
            .label(format!("{name} (incumbent)"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(trials.iter().enumerate().map(|(i, t)| {
                let style = if t.accepted {
                    c.filled()
                } else {
                    c.mix(0.35).filled()
                };
                Circle::new(((i + 1) as f64, pick(t.candidate)), 3, style)
            }))?
            .label(format!("{name} of each candidate (solid: accepted)"))
            .legend(move |(x, y)| Circle::new((x + 10, y), 3, c.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    let pick = |f: fn(&TrialLine) -> Option<f64>| -> Vec<(f64, f64)> {
        trials
            .iter()
            .enumerate()
            .filter_map(|(i, t)| {
                f(t).filter(|v| v.is_finite() && *v > 0.0)
                    .map(|v| ((i + 1) as f64, v))
            })
            .collect()
    };
    let cand = pick(|t| t.score_p95_ttft_ms);
    let inc = pick(|t| t.incumbent_p95_ttft_ms);
    let (lo, hi) = log_bounds(cand.iter().chain(&inc).map(|p| &p.1));
    let mut chart = ChartBuilder::on(&bottom)
        .caption("p95 TTFT in each trial", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(
            0f64..x_hi,
            (lo..hi).log_scale().with_key_points(log_ticks(lo, hi)),
        )?;
    chart
        .configure_mesh()
        .x_desc("trial")
        .y_desc("p95 TTFT (log scale)")
        .y_label_formatter(&|v| fmt_ms(*v))
        .max_light_lines(2)
        .draw()?;
    for (k, (name, pts)) in [("incumbent", inc), ("candidate", cand)]
        .into_iter()
        .enumerate()
    {
        let c = color(k + 2);
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// The SLO's dashed line.
const SLO_GREY: RGBColor = RGBColor(120, 120, 120);
/// The latency floor's dotted line (a dark grey, since the palette has black).
const FLOOR_GREY: RGBColor = RGBColor(70, 70, 70);

/// A horizontal reference line (the SLO, the floor) and its legend entry.
struct RefLine {
    label: String,
    value: f64,
    color: RGBColor,
    /// Dash and gap lengths, px.
    dash: u32,
    gap: u32,
}

/// One policy's line on a sweep plot: its name and `(load, value, censored)` points.
type PlotLine = (String, Vec<(f64, f64, bool)>);

/// The policies' lines over horizontal dashed reference lines: a circle on each
/// point, an upward triangle on a censored one (the `bool`, drawn at the top edge).
fn draw_lines<'a, DB, Y>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<plotters::coord::types::RangedCoordf64, Y>>,
    lines: &[PlotLine],
    refs: &[RefLine],
    (x_lo, x_hi): (f64, f64),
) -> DrawResult
where
    DB: DrawingBackend + 'a,
    DB::ErrorType: 'static,
    Y: Ranged<ValueType = f64>,
{
    for r in refs {
        chart.draw_series(DashedLineSeries::new(
            vec![(x_lo, r.value), (x_hi, r.value)],
            r.dash,
            r.gap,
            r.color.stroke_width(2),
        ))?;
    }
    for (i, (_, pts)) in lines.iter().enumerate() {
        let c = color(i);
        chart.draw_series(LineSeries::new(
            pts.iter().map(|&(x, y, _)| (x, y)),
            c.stroke_width(2),
        ))?;
        chart.draw_series(
            pts.iter()
                .filter(|p| !p.2)
                .map(|&(x, y, _)| Circle::new((x, y), 4, c.filled())),
        )?;
        chart.draw_series(
            pts.iter()
                .filter(|p| p.2)
                .map(|&(x, y, _)| TriangleMarker::new((x, y), 7, c.filled())),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_ticks_label_sub_second_latencies() {
        assert_eq!(
            log_ticks(40.0, 3000.0),
            vec![50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0]
        );
        assert_eq!(log_ticks(1.0, 1e7).len(), 8);
        assert!(log_ticks(0.0, 10.0).is_empty());
        assert_eq!(fmt_ms(200.0), "200 ms");
        assert_eq!(fmt_ms(2000.0), "2 s");
        assert_eq!(fmt_ms(1500.0), "1.5 s");
    }

    fn rec(policy: &str, served: &str, start_ms: f64, ok: bool) -> crate::RequestRecord {
        crate::RequestRecord {
            policy: policy.into(),
            request_id: format!("r{start_ms}"),
            region: served.into(),
            served_by: ok.then(|| served.into()),
            hops: 0,
            ttft_ms: 100.0 + start_ms,
            e2e_ms: 1000.0 + start_ms,
            itl_ms: None,
            input_tokens: 100,
            output_tokens: 10,
            cached_tokens: None,
            predicted_ttft_ms: None,
            cached_anywhere_tokens: None,
            start_ms,
            first_byte_ms: None,
            retries: 0,
            ok,
            error: None,
        }
    }

    /// The `<name .../>` (or `<name ...>text`) tags of an SVG, as written.
    fn tags<'a>(svg: &'a str, name: &str) -> Vec<&'a str> {
        let open = format!("<{name} ");
        svg.match_indices(&open)
            .map(|(i, _)| {
                let rest = &svg[i..];
                let end = rest.find("</").or_else(|| rest.find("/>")).unwrap();
                &rest[..end]
            })
            .collect()
    }

    /// The value of attribute `name` of a tag from [`tags`].
    fn attr<'a>(tag: &'a str, name: &str) -> &'a str {
        let key = format!(" {name}=\"");
        let start = tag.find(&key).unwrap_or_else(|| panic!("{name} in {tag}")) + key.len();
        &tag[start..start + tag[start..].find('"').unwrap()]
    }

    fn num_attr(tag: &str, name: &str) -> f64 {
        attr(tag, name).parse().unwrap()
    }

    fn hex(c: RGBColor) -> String {
        format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
    }

    /// Past four regions the old legend ran off the canvas and stacked entries at its
    /// edge, and past twelve the bands reused colours: every region's entry is now on
    /// the canvas in a place of its own, with a colour of its own.
    #[test]
    fn region_legend_fits_and_its_colours_differ() {
        for n in [8usize, 32] {
            let regions: Vec<String> = (0..n).map(|i| format!("region-{i:02}")).collect();
            let records = regions
                .iter()
                .enumerate()
                .map(|(i, r)| rec("gorgo", r, i as f64 * 100.0, true))
                .collect();
            let report = Report::from_records(&(), records).unwrap();
            let svg = region_share(&report).unwrap();
            let labels: Vec<(i32, i32, &str)> = tags(&svg, "text")
                .into_iter()
                .filter_map(|t| {
                    let text = t[t.find('>')? + 1..].trim();
                    text.starts_with("region-")
                        .then(|| (num_attr(t, "x") as i32, num_attr(t, "y") as i32, text))
                })
                .collect();
            assert_eq!(labels.len(), n, "{n} regions");
            let mut places: Vec<(i32, i32)> = labels.iter().map(|l| (l.0, l.1)).collect();
            places.sort_unstable();
            places.dedup();
            assert_eq!(places.len(), n, "{n} regions: entries overlap");
            for (x, _, text) in &labels {
                assert!(
                    x + text_width(text, LEGEND_FONT) <= SHARE_WIDTH,
                    "{n} regions: {text} at {x} runs past the canvas"
                );
            }
            // The swatches: one per region, no two alike.
            let mut fills: Vec<&str> = tags(&svg, "rect")
                .into_iter()
                .filter(|t| attr(t, "width") == LEGEND_SWATCH.to_string())
                .map(|t| attr(t, "fill"))
                .collect();
            assert_eq!(fills.len(), n, "{n} regions");
            fills.sort_unstable();
            fills.dedup();
            assert_eq!(fills.len(), n, "{n} regions: colours repeat");
        }
        let mut colors: Vec<String> = (0..64).map(|i| hex(color(i))).collect();
        colors.sort_unstable();
        colors.dedup();
        assert_eq!(colors.len(), 64);
    }

    /// A censored live p95 (+inf) is drawn on the top edge with a triangle, not dropped
    /// as if it were missing: least-load gets a circle at its first load and a
    /// triangle, above it, at its second.
    #[test]
    fn censored_points_sit_on_the_top_edge_with_their_own_marker() {
        use crate::sweep::{Slo, SweepPoint};
        let result = |p95: f64| {
            let mut r = crate::PolicyResult::from_records(std::iter::empty());
            r.ttft_ms = crate::LatencyStats {
                p50: 100.0,
                p95,
                p99: p95,
                mean: 100.0,
            };
            r
        };
        let point = |load: f64, ll: f64| SweepPoint {
            time_scale: 1.0 / load,
            offered_rps: load,
            policies: vec![
                ("gorgo".into(), result(500.0 * load)),
                ("least-load".into(), result(ll)),
            ],
        };
        let sweep = Sweep::new(
            serde_json::json!({}),
            1.0,
            Slo {
                ttft_p95_ms: 2000.0,
                e2e_p95_ms: None,
            },
            vec![point(1.0, 600.0), point(2.0, f64::INFINITY)],
        );
        let plots = sweep_plots(&sweep).unwrap();
        let svg = &plots
            .iter()
            .find(|p| p.0 == "sweep_ttft_p95.svg")
            .unwrap()
            .1;
        let fill = hex(color(1));
        let circles: Vec<f64> = tags(svg, "circle")
            .into_iter()
            .filter(|t| attr(t, "fill") == fill && num_attr(t, "cx") < SWEEP_PLOT_WIDTH as f64)
            .map(|t| num_attr(t, "cy"))
            .collect();
        let triangles: Vec<f64> = tags(svg, "polygon")
            .into_iter()
            .filter(|t| attr(t, "fill") == fill)
            .map(|t| {
                attr(t, "points")
                    .split(' ')
                    .filter_map(|p| p.split_once(',')?.1.parse::<f64>().ok())
                    .fold(f64::INFINITY, f64::min)
            })
            .collect();
        assert_eq!(circles.len(), 1, "{svg}");
        assert_eq!(triangles.len(), 1, "{svg}");
        assert!(triangles[0] < circles[0], "{triangles:?} {circles:?}");
        assert!(svg.contains("censored: above the top edge"));
    }

    /// The CDF's y is the share of every request sent: with half the requests failed
    /// the line ends at 0.5, not 1.
    #[test]
    fn the_cdf_is_a_share_of_every_request() {
        let records = (0..10)
            .map(|i| rec("gorgo", "us", i as f64 * 10.0, i % 2 == 0))
            .collect();
        let report = Report::from_records(&(), records).unwrap();
        let series = cdf_series(&report, completed_e2e);
        let (_, v, total) = &series[0];
        assert_eq!((v.len(), *total), (5, 10));
        let points = cdf_points(v, *total);
        assert_eq!(points.last().unwrap().1, 0.5);
        assert_eq!(points[0].1, 0.1);
        // A failed request that measured its TTFT (cut after its first token) is in
        // the TTFT line, as in the table's percentiles; one failed before is not.
        let mut records: Vec<_> = (0..10)
            .map(|i| rec("gorgo", "us", i as f64 * 10.0, i % 2 == 0))
            .collect();
        records[1].ttft_ms = f64::NAN;
        let report = Report::from_records(&(), records).unwrap();
        let (_, v, total) = &cdf_series(&report, measured_ttft)[0];
        assert_eq!((v.len(), *total), (9, 10));
        // A report without rows says so on the plot.
        let empty = Report::from_records(&(), Vec::new()).unwrap();
        assert!(ttft_cdf(&empty)
            .unwrap()
            .contains("no per-request latencies"));
    }
}
