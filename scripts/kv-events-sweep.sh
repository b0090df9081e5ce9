#!/usr/bin/env bash
# The measurement of docs/kv-events.md: per load point, `gorgo sim` with the nodes'
# prefix index on the shadow model and on the engines' KV events (`--kv-events`),
# the cache-estimate error and the routing result of each, on two workloads.
#
#     bash scripts/kv-events-sweep.sh [OUT]     # default out/kv-events
#
# GORGO_BIN (default target/release/gorgo), POLICIES (default gorgo,cache-aware).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/kv-events}
BIN=${GORGO_BIN:-target/release/gorgo}
POLICIES=${POLICIES:-gorgo,cache-aware}
TRACES=${TRACES:-../shared/data/traces}
mkdir -p "$OUT"
[ -f "$OUT/gen5.jsonl" ] || "$BIN" trace generate --seed 5 --duration-s 1800 --out "$OUT/gen5.jsonl" >/dev/null

run() { # workload trace loads...
  local w=$1 trace=$2
  shift 2
  for scale in "$@"; do
    for source in shadow events; do
      local flag=""
      [ "$source" = events ] && flag=--kv-events
      "$BIN" sim --trace "$trace" --policies "$POLICIES" --time-scale "$scale" \
        --max-context-tokens 32768 $flag --out "$OUT/$w-x$scale-$source" >/dev/null 2>&1
    done
  done
}
run gen5 "$OUT/gen5.jsonl" 4 3 2 1.5 1.25 1
run syn "$TRACES/mooncake_synthetic_trace.jsonl" 8 4 3 2 1.5 1.25 1

python3 - "$OUT" "$POLICIES" <<'EOF'
import json, os, re, sys
out, policies = sys.argv[1], sys.argv[2].split(",")
def load(d):
    sim = json.load(open(os.path.join(d, "sim.json")))
    res = json.load(open(os.path.join(d, "results.json")))["policies"]
    return {r["policy"]: (r["cache_estimate_error"], res[r["policy"]]) for r in sim["runs"]}
runs = {}
for name in os.listdir(out):
    m = re.fullmatch(r"(\w+)-x([\d.]+)-(shadow|events)", name)
    if m:
        runs[(m[1], float(m[2]), m[3])] = load(os.path.join(out, name))
for w in ["gen5", "syn"]:
    print(f"\n### {w}\n")
    print("| load | policy | cache-estimate error, mean tokens (% of prompt) shadow / events "
          "| p95 abs. error % shadow / events | p95 TTFT ms shadow / events | ratio | cache hit shadow / events |")
    print("|---|---|---|---|---|---:|---|")
    for scale in sorted({k[1] for k in runs if k[0] == w}, reverse=True):
        for p in policies:
            s, e = runs[(w, scale, "shadow")][p], runs[(w, scale, "events")][p]
            fmt = lambda c: f"{c['mean_tokens']:.1f} ({c['mean_pct']:.2f}%)"
            ratio = e[1]["ttft_ms"]["p95"] / s[1]["ttft_ms"]["p95"]
            print(f"| x{scale:g} | {p} | {fmt(s[0])} / {fmt(e[0])} "
                  f"| {s[0]['p95_pct']:.2f} / {e[0]['p95_pct']:.2f} "
                  f"| {s[1]['ttft_ms']['p95']:,.0f} / {e[1]['ttft_ms']['p95']:,.0f} | {ratio:.3f} "
                  f"| {s[1]['cache_hit_ratio']:.1%} / {e[1]['cache_hit_ratio']:.1%} |")
EOF
