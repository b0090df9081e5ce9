#!/usr/bin/env bash
# A rolling restart of every node of a `gorgo up` cluster under load (issue #18;
# docs/reliability.md): while `gorgo bench` replays a generated multi-turn trace,
# each node in turn is restarted gracefully (`gorgo restart`: SIGTERM drains it,
# then it starts again and joins), GAP_S seconds apart. Passes when no request failed
# for any reason but its prompt being over the engine's context (the trace's own).
# The bench client retries requests nothing answered (refused or reset connections),
# as OpenAI's SDK does: the restarting node's address is closed for about a second.
#
# Environment (defaults in brackets):
#   DURATION_S [120]: trace window  GAP_S [20]: between restarts  TIME_SCALE [1]
#   TOPOLOGY [configs/topologies/three-region.toml]  BASE_PORT [42000]
#   OUT [out/rolling-restart/<UTC time>]  SKIP_BUILD [0]  GORGO [target/release/gorgo]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DURATION_S=${DURATION_S:-120}
GAP_S=${GAP_S:-20}
TIME_SCALE=${TIME_SCALE:-1}
TOPOLOGY=${TOPOLOGY:-configs/topologies/three-region.toml}
BASE_PORT=${BASE_PORT:-42000}
OUT=${OUT:-$ROOT/out/rolling-restart/$(date -u +%Y%m%dT%H%M%SZ)}
GORGO=${GORGO:-$ROOT/target/release/gorgo}
mkdir -p "$OUT"
[ "${SKIP_BUILD:-0}" = 1 ] || cargo build --release --quiet
RUN="$OUT/run"
cleanup() { "$GORGO" down --run-dir "$RUN" >/dev/null 2>&1 || true; }
trap cleanup EXIT

"$GORGO" trace generate --seed 7 --duration-s "$DURATION_S" --out "$OUT/trace.jsonl" >/dev/null
"$GORGO" up --topology "$TOPOLOGY" --run-dir "$RUN" --base-port "$BASE_PORT" --detach >"$OUT/up.log" 2>&1 \
  || { cat "$OUT/up.log" >&2; exit 1; }
"$GORGO" bench --trace "$OUT/trace.jsonl" --cluster "$RUN" --time-scale "$TIME_SCALE" \
  --out "$OUT/bench" >"$OUT/bench.log" 2>&1 &
BENCH=$!
regions=$(python3 -c 'import json,sys; print(" ".join(r["name"] for r in json.load(open(sys.argv[1]))["regions"]))' "$RUN/cluster.json")
sleep "$GAP_S"
: >"$OUT/restarts.tsv"
for r in $regions; do
  t0=$(date +%s%3N)
  "$GORGO" restart --run-dir "$RUN" "$r" >>"$OUT/restart.log" 2>&1
  t1=$(date +%s%3N)
  printf '%s\t%s\t%s\n' "$r" "$t0" "$t1" | tee -a "$OUT/restarts.tsv"
  sleep "$GAP_S"
done
wait "$BENCH"
python3 - "$OUT/bench/requests.csv" "$OUT/restarts.tsv" <<'PY' | tee "$OUT/summary.txt"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
errors = [r["error"] for r in rows if r["error"]]
# Prompts over the engine's context fail with or without restarts: the trace's own.
context = [e for e in errors if "context_length_exceeded" in e]
other = [e for e in errors if "context_length_exceeded" not in e]
print(f"requests {len(rows)}, failed {len(errors)}: {len(context)} over the context "
      f"(the trace's, not the restarts'), {len(other)} others")
for e in other[:10]:
    print("  ", e[:160])
for line in open(sys.argv[2]):
    region, t0, t1 = line.split()
    print(f"restart {region}: {int(t1) - int(t0)} ms from SIGTERM to ready")
sys.exit(0 if not other else 1)
PY
