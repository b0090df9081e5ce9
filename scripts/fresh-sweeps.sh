#!/usr/bin/env bash
# Load sweeps on three generated workloads the routing rule was not developed on
# (configs/workloads/*.toml: agent-like sessions, pasted documents, shared application
# prompts), every policy, light load to saturation, in the simulator's default
# (node-view) mode: a check of the rule away from the traces it was tuned on
# (docs/policy.md, "Fresh workloads"). About 20 seconds on 2 cores.
# Usage: scripts/fresh-sweeps.sh [OUT]   (default out/fresh)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/fresh}
G=${GORGO:-target/release/gorgo}
X=${SWEEP_FLAGS:-}
[ -x "$G" ] || cargo build --release -q
mkdir -p "$OUT"
P=gorgo,gorgo-ttft,least-load,least-request,prefix-cache,session-affinity,simple-session-affinity,cache-aware,round-robin,oracle
for w in agentic documents shared-apps; do
  [ -f "$OUT/$w.jsonl" ] || "$G" trace generate --config "configs/workloads/$w.toml" --out "$OUT/$w.jsonl" > /dev/null 2>&1
  "$G" sweep --trace "$OUT/$w.jsonl" --policies $P --time-scales 4,2,1.5,1,0.75,0.5 \
    --max-context-tokens 32768 --no-progress $X --out "$OUT/$w" > "$OUT/$w.log"
done
python3 scripts/sweep_ratios.py "$OUT"/*/sweep.json
