#!/usr/bin/env python3
"""Per load point of one or more `gorgo sweep` results: `gorgo` against the best baseline.

Usage: scripts/sweep_ratios.py [--policy gorgo] OUT/*/sweep.json

For each point: `gorgo`'s p95 TTFT over the best baseline's (best for that metric at that
load; baselines as gorgo-report's `is_baseline`: every policy but gorgo* and oracle), its
p95 E2E over the best baseline's E2E, its p95 TTFT over the oracle's, the cache hit
ratios of `gorgo` and of the TTFT-best baseline, and the cost model's prediction (median
absolute percentage error, Spearman), the p95 TTFT of the E2E-best baseline over `gorgo`'s
(what the baseline that wins E2E pays for it), and the baselines that beat `gorgo` on both
p95 TTFT and p95 E2E at that point (dominate it). Then, over all points, the geometric means
of the two ratios, how many points miss issue #15's bars (TTFT > 0.85x, E2E > 1.0x) and how
many some baseline dominates.

A percentile `sweep.json` holds as `null` is either censored (listed under the point's
`censored`: above every measured value, e.g. a live p95 with more than 5% failed) or
not measured. A censored value reads as +inf: its cells print `censored`, a ratio with
it prints `censored` and counts as a miss of the bars when it is `gorgo`'s; one not
measured prints `-` and leaves the point out. The geometric means are over the points
where both ratios are finite.
"""

import argparse
import json
import math


def is_baseline(p):
    return not p.startswith("gorgo") and p != "oracle"


def value(point, policy, metric, stat="p95"):
    """A percentile of one point: a float; +inf when censored; NaN when not measured."""
    v = point["policies"][policy][metric][stat]
    if v is not None:
        return float(v)
    marks = (point.get("censored") or {}).get(policy, [])
    return math.inf if f"{metric}.{stat}" in marks else math.nan


def ratio(a, b):
    """a / b; NaN when either is unmeasured, both censored, or b is 0."""
    if math.isnan(a) or math.isnan(b) or b == 0 or (math.isinf(a) and math.isinf(b)):
        return math.nan
    return a / b


def fmt(v, spec, censored=None):
    """`v` formatted; `-` when not measured, `censored` when it or `censored` is +inf."""
    if v is None or math.isnan(v):
        return "-"
    if math.isinf(v) or (censored is not None and any(math.isinf(c) for c in censored)):
        return "censored"
    return format(v, spec)


def best(point, names, metric):
    """The name with the lowest measured p95 of `metric` (censored ranks last), or None."""
    measured = [b for b in names if not math.isnan(value(point, b, metric))]
    return min(measured, key=lambda b: value(point, b, metric)) if measured else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="gorgo")
    ap.add_argument("sweeps", nargs="+")
    a = ap.parse_args()
    log_t = log_e = 0.0
    n = points = miss_t = miss_e = dominated_points = 0
    print(
        "| sweep | load | p95 TTFT ms | / best baseline | p95 E2E / best | / oracle | cache hit (best) "
        "| pred MAPE, rho | E2E best's p95 TTFT / gorgo's | dominated by |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for path in a.sweeps:
        with open(path) as f:
            d = json.load(f)
        name = path.rstrip("/").split("/")[-2] if "/" in path else path
        for p in sorted(d["points"], key=lambda p: -p["time_scale"]):
            ps = p["policies"]
            if a.policy not in ps:
                continue
            g = ps[a.policy]
            gt, ge = value(p, a.policy, "ttft_ms"), value(p, a.policy, "e2e_ms")
            base = [b for b in ps if is_baseline(b)]
            bt, be = best(p, base, "ttft_ms"), best(p, base, "e2e_ms")
            bt_t = value(p, bt, "ttft_ms") if bt else math.nan
            be_e = value(p, be, "e2e_ms") if be else math.nan
            be_t = value(p, be, "ttft_ms") if be else math.nan
            rt, re_ = ratio(gt, bt_t), ratio(ge, be_e)
            ot = value(p, "oracle", "ttft_ms") if "oracle" in ps else math.nan
            ro = ratio(gt, ot)
            pred = g.get("prediction") or {}
            e2e_best_ttft = ratio(be_t, gt)
            dominated_by = [
                b
                for b in base
                if value(p, b, "ttft_ms") < gt and value(p, b, "e2e_ms") < ge
            ]
            points += 1
            dominated_points += bool(dominated_by)
            # Both finite and positive: the geometric means are over these.
            if all(math.isfinite(r) and r > 0 for r in (rt, re_)):
                log_t += math.log(rt)
                log_e += math.log(re_)
                n += 1
            # A censored gorgo p95 (ratio +inf) misses; an unmeasured one (NaN) is not counted.
            miss_t += rt > 0.85
            miss_e += re_ > 1.0

            def pct(v):
                return "-" if v is None else f"{v:.0f}%"

            def hit(policy):
                h = ps[policy].get("cache_hit_ratio") if policy else None
                return "-" if h is None else f"{h * 100:.0f}%"

            print(
                f"| {name} | x{p['time_scale']:g} | {fmt(gt, '.0f')} | "
                f"{fmt(rt, '.3f', [gt, bt_t])} ({bt or '-'}) | "
                f"{fmt(re_, '.3f', [ge, be_e])} ({be or '-'}) | {fmt(ro, '.3f', [gt, ot])} | "
                f"{hit(a.policy)} ({hit(bt)}) | "
                f"{pct(pred.get('mape_median'))}, {fmt(pred.get('spearman'), '.2f')} | "
                f"{fmt(e2e_best_ttft, '.2f', [be_t, gt])} | {', '.join(dominated_by) or '-'} |"
            )
    if points:
        means = (
            f"geometric mean p95 TTFT / best baseline {math.exp(log_t / n):.3f}, "
            f"p95 E2E / best baseline {math.exp(log_e / n):.3f} (over {n} with both ratios measured)"
            if n
            else "no point with both ratios measured"
        )
        print(
            f"\n{points} points: {means}; TTFT above 0.85x at {miss_t}, "
            f"E2E above 1.0x at {miss_e}; dominated by a baseline at {dominated_points}"
        )


if __name__ == "__main__":
    main()
