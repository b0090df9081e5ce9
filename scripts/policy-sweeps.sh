#!/usr/bin/env bash
# The load sweeps behind docs/policy.md: five workloads, every policy, light load to
# saturation, in the simulator's default (node-view) mode. About 1 minute on 2 cores.
# Usage: scripts/policy-sweeps.sh [OUT]   (default out/policy)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/policy}
G=${GORGO:-target/release/gorgo}
# Extra flags for every sweep (e.g. "--refuse-forwards false"), from the environment.
# Without --region-seed the Mooncake traces' users go to regions as `gorgo bench` sends
# them, not as --region-seed 0 does: runs compared across builds pass both flags,
# SWEEP_FLAGS="--seed S --region-seed S".
X=${SWEEP_FLAGS:-}
[ -x "$G" ] || cargo build --release -q
mkdir -p "$OUT"
[ -f "$OUT/gen5.jsonl" ] || "$G" trace generate --seed 5 --duration-s 1800 --out "$OUT/gen5.jsonl" > /dev/null
# skew: another generated multi-turn trace, unlike gen5 in seed, users, output length
# (400 tokens) and a 3:1:1 regional skew; added after the rule was changed, to check it
# on a workload it was not developed on.
[ -f "$OUT/skew.jsonl" ] || "$G" trace generate --seed 23 --duration-s 1800 --users 400 \
  --output-tokens 400 --region-weights 3,1,1 --out "$OUT/skew.jsonl" > /dev/null
P=gorgo,gorgo-ttft,gorgo-paper,least-load,least-request,prefix-cache,session-affinity,simple-session-affinity,cache-aware,round-robin,oracle
"$G" sweep --trace "$OUT/gen5.jsonl" --policies $P --time-scales 4,3,2,1.5,1.25,1 \
  --max-context-tokens 32768 $X --out "$OUT/gen5"
"$G" sweep --trace ../shared/data/traces/mooncake_synthetic_trace.jsonl --policies $P \
  --time-scales 8,4,3,2,1.5,1.25,1 --max-context-tokens 32768 $X --ttft-slo-ms 10000 --out "$OUT/syn"
"$G" sweep --trace ../shared/data/traces/mooncake_conversation_trace.jsonl --policies $P \
  --time-scales 8,6,4,3,2,1.5 --max-context-tokens 32768 $X --ttft-slo-ms 10000 --out "$OUT/mc"
"$G" sweep --trace "$OUT/skew.jsonl" --policies $P --time-scales 4,2,1.5,1,0.75 \
  --max-context-tokens 32768 $X --out "$OUT/skew"
# azure: Azure's 2023 conversation trace, no prefix information (no cache reuse at all).
"$G" sweep --trace ../shared/data/traces/AzureLLMInferenceTrace_conv_2023.csv --policies $P \
  --time-scales 1,0.5,0.35,0.25 --max-context-tokens 32768 $X --ttft-slo-ms 10000 --out "$OUT/azure"
