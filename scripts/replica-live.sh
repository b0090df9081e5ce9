#!/usr/bin/env bash
# The live check of docs/simulator.md "Replicas: four engines per region": three
# regions with four engine emulators each (`gorgo compare --replicas 4`: real nodes
# fronting `[[engines]]`, netem WAN delays) against the default (node-view)
# `gorgo sim --replicas 4` on the same window, time scale and context clamp.
# About 6 minutes wall on 2 cores.
# Usage: [POLICIES=gorgo,cache-aware] [TS=0.5] [WINDOW=240] scripts/replica-live.sh [OUT]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/replica-live}
G=${GORGO:-target/release/gorgo}
[ -x "$G" ] || cargo build --release -q
P=${POLICIES:-gorgo,cache-aware}
TS=${TS:-0.5}
W=${WINDOW:-240}
mkdir -p "$OUT"
[ -f "$OUT/gen5.jsonl" ] || "$G" trace generate --seed 5 --duration-s 1800 --out "$OUT/gen5.jsonl" > /dev/null
"$G" sim --trace "$OUT/gen5.jsonl" --window-s "$W" --time-scale "$TS" --max-context-tokens 32768 \
  --replicas 4 --policies "$P" --out "$OUT/sim" > "$OUT/sim.log" 2>&1
"$G" compare --trace "$OUT/gen5.jsonl" --window "$W" --time-scale "$TS" --max-context-tokens 32768 \
  --replicas 4 --policies "$P" --base-port 47100 --no-progress --out "$OUT/live" > "$OUT/live.log" 2>&1
echo "sim:"; grep -A6 "policy" "$OUT/sim.log" | head -12
echo "live:"; grep -A6 "policy" "$OUT/live.log" | head -12
