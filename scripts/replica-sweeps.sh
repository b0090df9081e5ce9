#!/usr/bin/env bash
# The four-engines-per-region sweeps behind docs/simulator.md ("Replicas: four engines
# per region"): five workloads (gen5, syn and mc; skew and azure since 2026-12-03), every
# policy, light load to saturation, node view.
# Time scales are a quarter of scripts/policy-sweeps.sh's (four times the engines).
# About 45 s on 2 cores. Usage: scripts/replica-sweeps.sh [OUT] [SEED]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/replicas}
SEED=${2:-0}
G=${GORGO:-target/release/gorgo}
[ -x "$G" ] || cargo build --release -q
mkdir -p "$OUT"
[ -f "$OUT/gen5.jsonl" ] || "$G" trace generate --seed 5 --duration-s 1800 --out "$OUT/gen5.jsonl" > /dev/null
# skew: as in scripts/policy-sweeps.sh.
[ -f "$OUT/skew.jsonl" ] || "$G" trace generate --seed 23 --duration-s 1800 --users 400 \
  --output-tokens 400 --region-weights 3,1,1 --out "$OUT/skew.jsonl" > /dev/null
P=gorgo,gorgo-ttft,gorgo-paper,least-load,least-request,prefix-cache,session-affinity,simple-session-affinity,cache-aware,round-robin,oracle
X="--replicas 4 --seed $SEED --max-context-tokens 32768"
"$G" sweep --trace "$OUT/gen5.jsonl" --policies $P $X --time-scales 1,0.5,0.3125,0.25,0.2,0.15 \
  --out "$OUT/gen5-s$SEED"
"$G" sweep --trace ../shared/data/traces/mooncake_synthetic_trace.jsonl --policies $P $X \
  --time-scales 2,1,0.75,0.5,0.375,0.3125,0.25 --ttft-slo-ms 10000 --out "$OUT/syn-s$SEED"
"$G" sweep --trace ../shared/data/traces/mooncake_conversation_trace.jsonl --policies $P $X \
  --time-scales 2,1,0.75,0.5,0.375 --ttft-slo-ms 10000 --out "$OUT/mc-s$SEED"
"$G" sweep --trace "$OUT/skew.jsonl" --policies $P $X --time-scales 1,0.5,0.375,0.25,0.1875 \
  --out "$OUT/skew-s$SEED"
"$G" sweep --trace ../shared/data/traces/AzureLLMInferenceTrace_conv_2023.csv --policies $P $X \
  --time-scales 0.25,0.125,0.0875,0.0625 --ttft-slo-ms 10000 --out "$OUT/azure-s$SEED"
