#!/usr/bin/env bash
# GuideLLM, the standard LLM-serving load generator, replaying a Mooncake trace through
# a GORGO node, with its backend validation on (it checks `GET /health` and
# `/v1/models`, which every node answers as SGLang and vLLM do), and `gorgo bench`
# replaying the same trace window on a fresh cluster, side by side.
#
#   bash scripts/guidellm.sh                     # venv, tokenizer, 2 fresh clusters, table
#   GORGO_GUIDELLM_TARGET=http://127.0.0.10:7100 bash scripts/guidellm.sh   # a node you run
#
# GuideLLM pulls torch (a ~6 GB virtualenv), so this is a script, not a CI test; the
# `/health` contract it needs is tested in CI (crates/gorgo-node/tests/node_routes.rs).
#
# Steps: a virtualenv with guidellm 0.8.1 (reused when it works); an offline tokenizer
# for GuideLLM to size prompts with (scripts/guidellm_tokenizer.py: byte-level BPE
# trained on the text GuideLLM generates, ~4 bytes per token, the emulator's and the
# nodes' count); the trace's first requests whose prompts fit the emulator's context;
# `gorgo up` -> `guidellm run --profile kind=replay --data kind=mooncake` -> `gorgo
# down`; `gorgo up` -> `gorgo bench` -> `gorgo down`; the table (side-by-side.md).
# Every process started here is stopped on exit, success or not.
#
# Knobs (environment):
#   GORGO_GUIDELLM_VENV       virtualenv (default ~/.cache/gorgo/guidellm-venv)
#   GORGO_GUIDELLM_OUT        output dir (default out/guidellm)
#   GORGO_GUIDELLM_TRACE      Mooncake JSONL (default ../shared/data/traces/mooncake_conversation_trace.jsonl)
#   GORGO_GUIDELLM_REQUESTS   requests replayed (default 120)
#   GORGO_GUIDELLM_MAX_INPUT  skip rows with more prompt tokens (default 8000)
#   GORGO_GUIDELLM_TARGET     a running node's client URL: GuideLLM only, no cluster started
#   GORGO_BIN                 gorgo binary (default target/release/gorgo, built if missing)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${GORGO_GUIDELLM_VENV:-$HOME/.cache/gorgo/guidellm-venv}
OUT=${GORGO_GUIDELLM_OUT:-out/guidellm}
TRACE=${GORGO_GUIDELLM_TRACE:-../shared/data/traces/mooncake_conversation_trace.jsonl}
REQUESTS=${GORGO_GUIDELLM_REQUESTS:-120}
MAX_INPUT=${GORGO_GUIDELLM_MAX_INPUT:-8000}
TARGET=${GORGO_GUIDELLM_TARGET:-}
GORGO=${GORGO_BIN:-target/release/gorgo}
BASE_PORT=19500   # this script's clusters: away from gorgo up's default 7100
IP_BASE=70
RUN="$OUT/run"
mkdir -p "$OUT"

if ! "$VENV/bin/guidellm" --version 2>/dev/null | grep -q "0.8.1"; then
  echo "== virtualenv $VENV with guidellm 0.8.1 (pulls torch: a few minutes)"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "guidellm==0.8.1"
fi
if [ ! -f "$OUT/tokenizer/tokenizer.json" ]; then
  echo "== offline tokenizer"
  "$VENV/bin/python" scripts/guidellm_tokenizer.py "$OUT/tokenizer"
fi
echo "== trace window: the first $REQUESTS requests of $TRACE with at most $MAX_INPUT prompt tokens"
python3 - "$TRACE" "$OUT/trace.jsonl" "$REQUESTS" "$MAX_INPUT" <<'PY'
import json, sys
src, dst, n, max_input = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
kept = 0
with open(src) as f, open(dst, "w") as out:
    for line in f:
        if kept == n:
            break
        row = json.loads(line)
        if row["input_length"] <= max_input:
            out.write(line)
            kept += 1
print(f"   {kept} requests over {row['timestamp'] / 1000:.0f} s of trace")
PY

if [ -z "$TARGET" ] && [ ! -x "$GORGO" ]; then
  echo "== cargo build --release"
  cargo build --release --quiet --bin gorgo
fi
# This script's own cluster (none when GORGO_GUIDELLM_TARGET names a node): stopped
# however the script ends, from before it is started.
OWN_CLUSTER=0
if [ -z "$TARGET" ]; then OWN_CLUSTER=1; fi
cleanup() {
  if [ "$OWN_CLUSTER" = "1" ]; then "$GORGO" down --run-dir "$RUN" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
up() {
  "$GORGO" down --run-dir "$RUN" >/dev/null 2>&1 || true
  "$GORGO" up --run-dir "$RUN" --base-port "$BASE_PORT" --ip-base "$IP_BASE" --detach >"$OUT/up-$1.log" 2>&1
}

if [ "$OWN_CLUSTER" = "1" ]; then
  up guidellm
  TARGET=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['regions'][0]['client_url'])" "$RUN/cluster.json")
fi
echo "== guidellm replay through $TARGET"
# Mooncake timestamps are milliseconds; GuideLLM's replay reads seconds.
"$VENV/bin/guidellm" run \
  --backend "kind=openai_http,target=$TARGET" \
  --profile kind=replay \
  --data "kind=mooncake,source.kind=json_file,source.path=$OUT/trace.jsonl,time_scale=0.001" \
  --tokenizer "kind=huggingface_auto,model=$OUT/tokenizer" \
  --output "kind=json,path=$OUT/guidellm.json" --output kind=console \
  --disable-progress 2>&1 | tee "$OUT/guidellm.log" | grep -E "backend validated|^\|" || true
[ -f "$OUT/guidellm.json" ] || { echo "guidellm wrote no result; see $OUT/guidellm.log" >&2; exit 1; }

if [ "$OWN_CLUSTER" = "1" ]; then
  "$GORGO" down --run-dir "$RUN" >/dev/null 2>&1 || true
  echo "== gorgo bench, same trace window, fresh cluster (all regions' clients)"
  up bench
  "$GORGO" bench --trace "$OUT/trace.jsonl" --cluster "$RUN" --label gorgo \
    --out "$OUT/bench" --no-progress >"$OUT/bench.log" 2>&1
  "$GORGO" down --run-dir "$RUN" >/dev/null 2>&1 || true
fi

python3 - "$OUT" <<'PY'
import csv, json, os, statistics, sys
out = sys.argv[1]
g = json.load(open(os.path.join(out, "guidellm.json")))["benchmarks"][0]["metrics"]
rows = []
def pct(m, p):
    return m["successful"]["percentiles"][p]
rows.append(("GuideLLM 0.8.1 (one node's client)",
             g["request_totals"]["successful"], g["request_totals"]["errored"],
             pct(g["time_to_first_token_ms"], "p50"), pct(g["time_to_first_token_ms"], "p95"),
             pct(g["request_latency"], "p50") * 1000, pct(g["request_latency"], "p95") * 1000,
             g["prompt_token_count"]["successful"]["median"]))
bench = os.path.join(out, "bench", "results.json")
if os.path.exists(bench):
    b = json.load(open(bench))["policies"]["gorgo"]
    rows.append(("gorgo bench (each region's clients)", b["requests"] - b["failed"], b["failed"],
                 b["ttft_ms"]["p50"], b["ttft_ms"]["p95"], b["e2e_ms"]["p50"], b["e2e_ms"]["p95"],
                 statistics.median(int(r["input_tokens"]) for r in csv.DictReader(
                     open(os.path.join(out, "bench", "requests.csv"))) if r["ok"] == "true")))
lines = ["| client | ok | failed | TTFT p50 ms | TTFT p95 ms | E2E p50 ms | E2E p95 ms | prompt tokens p50 |",
         "|---|---|---|---|---|---|---|---|"]
for r in rows:
    lines.append(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.0f} | {r[4]:.0f} | {r[5]:.0f} | {r[6]:.0f} | {r[7]:.0f} |")
table = "\n".join(lines)
open(os.path.join(out, "side-by-side.md"), "w").write(table + "\n")
print(table)
PY
