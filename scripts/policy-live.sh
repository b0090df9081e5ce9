#!/usr/bin/env bash
# The live check of docs/policy.md: `gorgo compare` (real nodes, emulated engines, netem
# WAN delays) against the default (node-view) `gorgo sim` on the same window, time scale
# and context clamp, for gorgo and the best baselines; two workloads at two loads, and
# the Mooncake conversation trace (round-robin is its best baseline) at two more.
# About 25 minutes wall on 2 cores for the first four windows, 16 for the mc pair.
# Usage: [WINDOWS="gen5-x2 mc-x3"] [POLICIES=gorgo,...] scripts/policy-live.sh [OUT]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/policy-live}
G=${GORGO:-target/release/gorgo}
[ -x "$G" ] || cargo build --release -q
mkdir -p "$OUT"
[ -f "$OUT/gen5.jsonl" ] || "$G" trace generate --seed 5 --duration-s 1800 --out "$OUT/gen5.jsonl" > /dev/null
WINDOWS=${WINDOWS:-gen5-x2 gen5-x1.5 syn-x2 syn-x4 mc-x3 mc-x2}
run() {
  local name=$1 trace=$2 win=$3 ts=$4 P=${POLICIES:-$5} dir="$OUT/$1"
  case " $WINDOWS " in *" $name "*) ;; *) return ;; esac
  mkdir -p "$dir"
  "$G" sim --trace "$trace" --window-s "$win" --time-scale "$ts" --max-context-tokens 32768 \
    --policies $P,oracle --out "$dir/sim" > "$dir/sim.log" 2>&1
  "$G" compare --trace "$trace" --window "$win" --time-scale "$ts" --max-context-tokens 32768 \
    --policies $P --base-port 47100 --no-progress --out "$dir/live" > "$dir/live.log" 2>&1
  echo "done $name"
}
SYN=../shared/data/traces/mooncake_synthetic_trace.jsonl
MC=../shared/data/traces/mooncake_conversation_trace.jsonl
BEST=gorgo,prefix-cache,cache-aware
run gen5-x2 "$OUT/gen5.jsonl" 150 2 $BEST
run gen5-x1.5 "$OUT/gen5.jsonl" 240 1.5 $BEST
run syn-x2 "$SYN" 120 2 $BEST
run syn-x4 "$SYN" 120 4 $BEST
run mc-x3 "$MC" 80 3 gorgo,round-robin
run mc-x2 "$MC" 120 2 gorgo,round-robin
