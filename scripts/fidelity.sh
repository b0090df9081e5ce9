#!/usr/bin/env bash
# Issue #13's fidelity check in one command: for each window (three workloads at two
# loads), the live `gorgo compare` (real nodes, emulated engines, netem WAN delays, all
# clusters at once) against the default `gorgo sim` (each node's own view) of the same
# window, time scale and context clamp; then scripts/fidelity_report.py writes
# OUT/fidelity.md (every cell's difference, the 15% count, the rankings; also against
# the median of five simulation seeds and against --live-chains).
# About 40 minutes wall on 2 cores for the six windows (80 with REPEAT=1); run it on an idle machine (the
# live clusters time on the real clock).
# Usage: [WINDOWS="gen5-x2 mc-x4"] [POLICIES=a,b,...] [REPEAT=1] scripts/fidelity.sh [OUT]
#   REPEAT=1 runs each live window a second time (OUT/<window>/live2), so the report can
#   say how much two live runs of the same window differ.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/fidelity}
G=${GORGO:-target/release/gorgo}
[ -x "$G" ] || cargo build --release -q
mkdir -p "$OUT"
[ -f "$OUT/gen5.jsonl" ] || "$G" trace generate --seed 5 --duration-s 1800 --out "$OUT/gen5.jsonl" > /dev/null
WINDOWS=${WINDOWS:-gen5-x2 gen5-x1.5 mc-x4 mc-x2 syn-x4 syn-x2}
P=${POLICIES:-gorgo,least-load,least-request,prefix-cache,session-affinity,simple-session-affinity}
# Whether the run in directory $1 is done: its results.json parses and was not cut
# short. An interrupted `gorgo compare` (Ctrl-C, SIGTERM) still writes results.json,
# with config.cancelled naming the policies it did not finish: that run is done again.
finished() {
  python3 -c 'import json, sys
config = json.load(open(sys.argv[1])).get("config") or {}
sys.exit(1 if config.get("cancelled") else 0)' "$1/results.json" 2>/dev/null
}
run() {
  local name=$1 trace=$2 win=$3 ts=$4 dir="$OUT/$1"
  case " $WINDOWS " in *" $name "*) ;; *) return ;; esac
  mkdir -p "$dir"
  echo "$trace $win $ts" > "$dir/window.txt"
  local sim=("$G" sim --trace "$trace" --window-s "$win" --time-scale "$ts" --max-context-tokens 32768 --policies "$P,oracle")
  "${sim[@]}" --out "$dir/sim" > "$dir/sim.log" 2>&1
  # A p95 over a few hundred requests moves with the seed (tie-breaks, gossip phases),
  # in the simulation as live: seeds 1-4 give the simulation's spread, and
  # --live-chains hashes prompts as the live nodes do (it decides simple-session-affinity's
  # user-to-region map). Each takes under a second.
  for s in 1 2 3 4; do
    finished "$dir/sim-seed$s" || "${sim[@]}" --seed $s --out "$dir/sim-seed$s" > /dev/null 2>&1
  done
  finished "$dir/sim-live-chains" || "${sim[@]}" --live-chains --out "$dir/sim-live-chains" > /dev/null 2>&1
  # A window already replayed live is kept (so REPEAT=1 on a finished OUT adds live2
  # only); one whose replay was interrupted is replayed again.
  local runs=(live)
  [ "${REPEAT:-0}" = "1" ] && runs+=(live2)
  for r in "${runs[@]}"; do
    finished "$dir/$r" || "$G" compare --trace "$trace" --window "$win" --time-scale "$ts" \
      --max-context-tokens 32768 --policies "$P" --base-port 47100 --no-progress --out "$dir/$r" > "$dir/$r.log" 2>&1
  done
  echo "$(date -u +%H:%M:%S) done $name"
}
SYN=../shared/data/traces/mooncake_synthetic_trace.jsonl
MC=../shared/data/traces/mooncake_conversation_trace.jsonl
run gen5-x2 "$OUT/gen5.jsonl" 150 2
run gen5-x1.5 "$OUT/gen5.jsonl" 240 1.5
run mc-x4 "$MC" 120 4
run mc-x2 "$MC" 120 2
run syn-x4 "$SYN" 120 4
run syn-x2 "$SYN" 120 2
python3 scripts/fidelity_report.py "$OUT" > "$OUT/fidelity.md" && echo "report: $OUT/fidelity.md"
