#!/usr/bin/env python3
"""The comparison report of scripts/real-engine-e2e.sh.

Usage: real_engine_report.py --out DIR --policies P1,P2 --regions R1,R2,R3 [--strict]

Reads what the script left in DIR: each policy's `gorgo bench` report
(bench-<policy>/results.json, requests.csv), each node's /admin/state at the end of its
run (bench-<policy>/admin-<region>.json) and each llama.cpp server's log
(llama/<policy>-<region>.log). Writes DIR/results.json (every policy's entry from its
own results.json, unchanged: the percentiles are gorgo's), DIR/table.md and
DIR/report.md (the table, the engines' own evidence of prefix-cache reuse, the nodes'
fitted t_p against what the engines took). With --strict, exits 1 unless gorgo's p95
TTFT is lower than round-robin's and least-request's.
"""
import argparse
import csv
import json
import re
import sys
from pathlib import Path

# llama-cpp-python (verbose) logs, per request: how much of the prompt matched the
# context it kept from the previous request, then llama.cpp's own timing of the prefill.
PREFIX_RE = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")
PROMPT_EVAL_RE = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
# With the RAM prompt cache: a saved state restored because it shares the longest prefix.
CACHE_HIT = "Llama._create_completion: cache hit"
# Prefills shorter than this are dominated by fixed costs, not per-token work.
MIN_TOKENS_FOR_RATE = 64


def engine_log_stats(path):
    """Per request: (prefix tokens reused, tokens prefilled, prefill ms); and how many
    saved states the RAM cache restored."""
    requests = []
    pending_hit = 0
    restores = 0
    for line in path.read_text(errors="replace").splitlines():
        if CACHE_HIT in line:
            restores += 1
            continue
        m = PREFIX_RE.search(line)
        if m:
            pending_hit = int(m.group(1))
            continue
        m = PROMPT_EVAL_RE.search(line)
        if m:
            requests.append((pending_hit, int(m.group(2)), float(m.group(1))))
            pending_hit = 0
    return requests, restores


def fmt_ms(x):
    return "-" if x is None else f"{x:,.0f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--policies", required=True)
    ap.add_argument("--regions", required=True)
    ap.add_argument("--strict", action="store_true")
    a = ap.parse_args()
    policies = [p for p in a.policies.split(",") if p]
    regions = [r for r in a.regions.split(",") if r]

    merged = {"config": {"command": "scripts/real-engine-e2e.sh", "runs": {}}, "policies": {}}
    for p in policies:
        res = json.loads((a.out / f"bench-{p}" / "results.json").read_text())
        merged["config"]["runs"][p] = res.get("config", {})
        for name, entry in res["policies"].items():
            merged["policies"][name] = entry
    (a.out / "results.json").write_text(json.dumps(merged, indent=2) + "\n")

    # How fast the machine let the engines prefill during each policy's run (the engines
    # share 2 cores with everything else): ms per prefilled model token, prefills of at
    # least MIN_TOKENS_FOR_RATE tokens, all regions.
    speed = {}
    for p in policies:
        big = []
        for r in regions:
            log = a.out / "llama" / f"{p}-{r}.log"
            if log.exists():
                big += [(n, t) for _, n, t in engine_log_stats(log)[0] if n >= MIN_TOKENS_FOR_RATE]
        speed[p] = sum(t for _, t in big) / sum(n for n, _ in big) if big else None

    # The table: every number straight from gorgo's results.json.
    head = ["policy", "requests", "failed", "TTFT p50", "TTFT p95", "TTFT p99", "E2E p95"]
    head += [f"share {r}" for r in regions] + ["forwarded", "engine ms/token"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in policies:
        e = merged["policies"].get(p)
        if e is None:
            continue
        share = e.get("region_share", {})
        cells = [p, str(e["requests"]), str(e["failed"])]
        cells += [fmt_ms(e["ttft_ms"][k]) for k in ("p50", "p95", "p99")]
        cells += [fmt_ms(e["e2e_ms"]["p95"])]
        cells += [f"{share.get(r, 0.0):.0%}" for r in regions]
        cells += [f"{e.get('forwarded_share', 0.0):.0%}"]
        cells += ["-" if speed.get(p) is None else f"{speed[p]:.3f}"]
        rows.append("| " + " | ".join(cells) + " |")
    table = "\n".join(rows) + (
        "\n\n(milliseconds; share: where requests were served; engine ms/token: the engines'"
        " own prefill time per model token during that run, i.e. how fast the shared machine was)\n"
    )
    (a.out / "table.md").write_text(table)

    # The engines' own evidence, and the nodes' fits against it.
    ev = ["| policy | region | requests | prompt tokens | reused from cache | cached states restored | prefill time (engine) |",
          "|---|---|---|---|---|---|---|"]
    fit = ["| policy | region | node t_p ms/token (fitted) | base ms | R^2 | samples | engine ms/token (llama.cpp, x tokens per node token) |",
           "|---|---|---|---|---|---|---|"]
    for p in policies:
        served_tokens = {}
        csv_path = a.out / f"bench-{p}" / "requests.csv"
        if csv_path.exists():
            with csv_path.open() as f:
                for row in csv.DictReader(f):
                    if row.get("ok", "true").lower() in ("true", "1") and row.get("served_by"):
                        served_tokens[row["served_by"]] = served_tokens.get(row["served_by"], 0) + int(float(row["input_tokens"]))
        for r in regions:
            log = a.out / "llama" / f"{p}-{r}.log"
            reqs, restores = engine_log_stats(log) if log.exists() else ([], 0)
            hit = sum(h for h, _, _ in reqs)
            evaluated = sum(n for _, n, _ in reqs)
            ms = sum(t for _, _, t in reqs)
            total = hit + evaluated
            ev.append(f"| {p} | {r} | {len(reqs)} | {total:,} | {hit / total if total else 0:.0%} | {restores} | {ms / 1000:,.1f} s |")
            big = [(n, t) for _, n, t in reqs if n >= MIN_TOKENS_FOR_RATE]
            per_llama_token = sum(t for _, t in big) / sum(n for n, _ in big) if big else None
            admin = a.out / f"bench-{p}" / f"admin-{r}.json"
            state = json.loads(admin.read_text()) if admin.exists() else {}
            # A node with the model's tokenizer counts the engine's tokens; one without
            # counts the trace's (4-byte) tokens unless it learned the ratio.
            if state.get("tokens", {}).get("counting") == "tokenizer":
                ratio = 1.0
            else:
                ratio = total / served_tokens[r] if served_tokens.get(r) else None
            engine_per_node_token = per_llama_token * ratio if per_llama_token and ratio else None
            f = state.get("fit", {})
            def num(x, spec):
                return "-" if x is None else format(x, spec)
            fit.append(
                f"| {p} | {r} | {num(f.get('t_p_ms'), '.3f')} | {num(f.get('base_ms'), '.0f')} | "
                f"{num(f.get('r_squared'), '.2f')} | {f.get('samples', '-')} | "
                + (f"{engine_per_node_token:.3f} ({per_llama_token:.3f} x {ratio:.2f})" if engine_per_node_token else "-")
                + " |"
            )
    report = "# GORGO on llama.cpp: comparison\n\n" + table
    report += "\n## The engines' own evidence of prefix-cache reuse (llama.cpp logs)\n\n" + "\n".join(ev) + "\n"
    report += "\n## Fitted t_p per region against the engine\n\n" + "\n".join(fit) + "\n"
    (a.out / "report.md").write_text(report)
    print(report)

    if a.strict:
        g = merged["policies"].get("gorgo")
        others = [merged["policies"].get(b) for b in ("round-robin", "least-request")]
        if g is None or any(o is None for o in others):
            print("strict: gorgo, round-robin and least-request must all have run", file=sys.stderr)
            return 1
        worse = [b for b, o in zip(("round-robin", "least-request"), others) if not g["ttft_ms"]["p95"] < o["ttft_ms"]["p95"]]
        if worse:
            print(f"strict: gorgo's p95 TTFT is not lower than {', '.join(worse)}'s", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
