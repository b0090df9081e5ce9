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
"""

import argparse
import json
import math


def is_baseline(p):
    return not p.startswith("gorgo") and p != "oracle"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="gorgo")
    ap.add_argument("sweeps", nargs="+")
    a = ap.parse_args()
    log_t = log_e = 0.0
    n = miss_t = miss_e = dominated_points = 0
    print(
        "| sweep | load | p95 TTFT ms | / best baseline | p95 E2E / best | / oracle | cache hit (best) "
        "| pred MAPE, rho | E2E best's p95 TTFT / gorgo's | dominated by |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for path in a.sweeps:
        d = json.load(open(path))
        name = path.rstrip("/").split("/")[-2]
        for p in sorted(d["points"], key=lambda p: -p["time_scale"]):
            ps = p["policies"]
            if a.policy not in ps:
                continue
            g = ps[a.policy]
            base = [b for b in ps if is_baseline(b)]
            bt = min(base, key=lambda b: ps[b]["ttft_ms"]["p95"])
            be = min(base, key=lambda b: ps[b]["e2e_ms"]["p95"])
            rt = g["ttft_ms"]["p95"] / ps[bt]["ttft_ms"]["p95"]
            re_ = g["e2e_ms"]["p95"] / ps[be]["e2e_ms"]["p95"]
            ro = g["ttft_ms"]["p95"] / ps["oracle"]["ttft_ms"]["p95"] if "oracle" in ps else float("nan")
            pred = g.get("prediction") or {}
            e2e_best_ttft = ps[be]["ttft_ms"]["p95"] / g["ttft_ms"]["p95"]
            dominated_by = [
                b
                for b in base
                if ps[b]["ttft_ms"]["p95"] < g["ttft_ms"]["p95"] and ps[b]["e2e_ms"]["p95"] < g["e2e_ms"]["p95"]
            ]
            dominated_points += bool(dominated_by)
            log_t += math.log(rt)
            log_e += math.log(re_)
            n += 1
            miss_t += rt > 0.85
            miss_e += re_ > 1.0
            print(
                f"| {name} | x{p['time_scale']:g} | {g['ttft_ms']['p95']:.0f} | {rt:.3f} ({bt}) | "
                f"{re_:.3f} ({be}) | {ro:.3f} | {g['cache_hit_ratio'] * 100:.0f}% ({ps[bt]['cache_hit_ratio'] * 100:.0f}%) | "
                f"{pred.get('mape_median', float('nan')):.0f}%, {pred.get('spearman', float('nan')):.2f} | "
                f"{e2e_best_ttft:.2f} | {', '.join(dominated_by) or '-'} |"
            )
    if n:
        print(
            f"\n{n} points: geometric mean p95 TTFT / best baseline {math.exp(log_t / n):.3f}, "
            f"p95 E2E / best baseline {math.exp(log_e / n):.3f}; TTFT above 0.85x at {miss_t}, "
            f"E2E above 1.0x at {miss_e}; dominated by a baseline at {dominated_points}"
        )


if __name__ == "__main__":
    main()
