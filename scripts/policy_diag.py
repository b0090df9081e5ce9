#!/usr/bin/env python3
"""Per-request diagnostics of a `gorgo sim` (or `gorgo compare`) requests.csv, used in
docs/policy.md: the cost model's prediction error split into local and forwarded
requests, and herding in bursts (the largest share of a burst that went to one region).

Usage: scripts/policy_diag.py out/sim/requests.csv [--burst-ms 50] [--min-burst 6]
"""
import argparse
import collections
import csv
import statistics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--burst-ms", type=float, default=50.0)
    ap.add_argument("--min-burst", type=int, default=6)
    a = ap.parse_args()
    rows = [r for r in csv.DictReader(open(a.csv)) if r["ok"] == "true"]
    for pol in sorted({r["policy"] for r in rows}):
        rs = sorted((r for r in rows if r["policy"] == pol), key=lambda r: float(r["start_ms"]))
        ttft = sorted(float(r["ttft_ms"]) for r in rs)
        p95 = ttft[int(0.95 * len(ttft))]
        line = f"{pol}: n {len(rs)}, p95 TTFT {p95:.0f} ms"
        pred = [r for r in rs if r["predicted_ttft_ms"]]
        if pred:
            def err(r):
                return (float(r["predicted_ttft_ms"]) - float(r["ttft_ms"])) / float(r["ttft_ms"])
            for hops in ("0", "1"):
                e = [err(r) for r in pred if r["hops"] == hops]
                if e:
                    kind = "local" if hops == "0" else "forwarded"
                    line += f"; {kind} n {len(e)} median signed error {statistics.median(e):+.1%}"
        bursts, cur = [], []
        for r in rs:
            if cur and float(r["start_ms"]) - float(cur[0]["start_ms"]) > a.burst_ms:
                bursts.append(cur)
                cur = []
            cur.append(r)
        bursts.append(cur)
        big = [b for b in bursts if len(b) >= a.min_burst]
        if big:
            share = statistics.mean(
                max(collections.Counter(r["served_by"] for r in b).values()) / len(b) for b in big
            )
            line += f"; {len(big)} bursts, largest region share {share:.2f}"
        tail = [r for r in rs if float(r["ttft_ms"]) >= p95]
        line += f"; forwarded share of the p95 tail {sum(r['hops'] != '0' for r in tail) / len(tail):.2f}"
        print(line)


if __name__ == "__main__":
    main()
