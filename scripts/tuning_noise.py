#!/usr/bin/env python3
"""How much of a tuning trial's noise is prompt composition (docs/tuning.md, issue #16).

    python3 scripts/tuning_noise.py [--window N] OUT...   # OUT: `gorgo sim` report directories

An interleaved trial splits each window's requests in two arms by a hash of the request
and compares the arms' mean TTFT of their slowest 20% (gorgo_core::es::TAIL_QUANTILE).
With the same weights on both arms, the log ratio of the two is pure noise: the sd of
it over windows is what a decision has to see through. Part of that noise is only
which arm happened to get the long prompts. This takes each run's requests.csv
(one policy, fixed weights), splits every window of N requests (by start time) in two
by a hash of the request id, and prints the sd of the log ratio of the arms' tail
means, raw and after a regression adjustment (CUPED: subtract theta times the
difference of a covariate the weights cannot change, with theta the least-squares slope
over the run's windows, fitted in-sample, so an upper bound on the gain) on:

- mean-cov: the arms' mean full-prompt prefill, t_p x input tokens;
- tail-cov: the arms' mean prefill of their longest 20% of prompts;
- log-tail-cov: the log ratio of the same.

t_p is the run's engine profile's (configs/engines). Standard library only.
"""
import argparse
import csv
import hashlib
import json
import math
import statistics
import tomllib
from pathlib import Path

TAIL = 0.2


def tail_mean(xs):
    xs = sorted(xs)
    k = max(1, math.ceil(TAIL * len(xs)))
    return sum(xs[-k:]) / k


def arm(request_id):
    return int(hashlib.md5(request_id.encode()).hexdigest()[:8], 16) % 2


def residual_sd(d, x):
    mx, md = statistics.fmean(x), statistics.fmean(d)
    vx = sum((a - mx) ** 2 for a in x)
    if vx == 0:
        return statistics.pstdev(d)
    theta = sum((a - mx) * (b - md) for a, b in zip(x, d)) / vx
    return statistics.pstdev([b - theta * a for a, b in zip(x, d)])


def t_p_of(out):
    profile = json.load(open(out / "sim.json")).get("config", {}).get(
        "engine_profile", "paper-a100-mistral7b")
    path = Path(profile)
    if not path.exists():
        path = Path(__file__).resolve().parent.parent / "configs" / "engines" / f"{profile}.toml"
    return tomllib.loads(path.read_text())["t_p_ms_per_token"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("outs", nargs="+")
    a = ap.parse_args()
    print(f"| run | windows of {a.window} | raw sd | mean-cov | tail-cov | log-tail-cov |")
    print("|---|---:|---:|---:|---:|---:|")
    for out in map(Path, a.outs):
        t_p = t_p_of(out)
        rows = [r for r in csv.DictReader(open(out / "requests.csv")) if r["ok"] == "true"]
        rows.sort(key=lambda r: float(r["start_ms"]))
        d, x1, x2, x3 = [], [], [], []
        for i in range(0, len(rows) - a.window + 1, a.window):
            w = rows[i:i + a.window]
            arms = [[r for r in w if arm(r["request_id"]) == k] for k in (0, 1)]
            if min(len(s) for s in arms) < 8:
                continue
            ttft = [tail_mean([float(r["ttft_ms"]) for r in s]) for s in arms]
            cov = [[t_p * int(r["input_tokens"]) for r in s] for s in arms]
            scale = sum(ttft) / 2
            d.append(math.log(ttft[0] / ttft[1]))
            x1.append((statistics.fmean(cov[0]) - statistics.fmean(cov[1])) / scale)
            x2.append((tail_mean(cov[0]) - tail_mean(cov[1])) / scale)
            x3.append(math.log(tail_mean(cov[0]) / tail_mean(cov[1])))
        if len(d) < 3:
            print(f"| {out.name} | {len(d)} | too few windows | | | |")
            continue
        print(f"| {out.name} | {len(d)} | {statistics.pstdev(d):.3f} | {residual_sd(d, x1):.3f} "
              f"| {residual_sd(d, x2):.3f} | {residual_sd(d, x3):.3f} |")


if __name__ == "__main__":
    main()
