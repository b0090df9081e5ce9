#!/usr/bin/env bash
# GORGO on real inference engines: one llama.cpp server (llama-cpp-python) per region of
# configs/topologies/three-region.toml, on loopback, with a small random-weight model.
#
#   bash scripts/real-engine-e2e.sh            # everything: venv, model, check, 4 policies, report
#
# llama-cpp-python's server takes its model lock for /v1/models too, so a health check
# there waits behind a long prefill; the nodes check /docs (a static page) instead.
#
# Steps: a Python venv with llama-cpp-python (reused when it works), a tiny GGUF model
# (../shared/tools/tiny_gguf.py), a release build of gorgo, a generated multi-turn session
# workload, then for each policy: fresh llama servers, `gorgo up --engine-url ...
# --engine-kind openai --detach`, `gorgo bench`, the nodes' /admin/state, `gorgo down`,
# servers stopped. First one server is calibrated (cold prefill cost: the nodes' seeds).
# Before the first replay the official `openai` client is checked
# through a node against the engine it fronts (streaming and not). Last, the comparison
# report (results.json, table.md, evidence of the engines' own prefix caching).
# Every process started here is stopped on exit, success or not.
#
# Knobs (environment):
#   GORGO_LLAMA_VENV     venv with llama-cpp-python (default ~/.cache/gorgo/llama-venv)
#   GORGO_REAL_OUT       output dir (default out/real-engine)
#   GORGO_REAL_POLICIES  comma-separated (default gorgo,round-robin,least-request,session-affinity)
#   GORGO_REAL_SEED      workload seed (default 1)
#   GORGO_REAL_USERS     users in the workload (default 24)
#   GORGO_REAL_SECONDS   trace window in seconds, one policy's replay (default 210)
#   GORGO_REAL_THREADS   llama.cpp threads per server (default 1)
#   GORGO_REAL_CACHE_MB  each server's RAM prompt cache, MiB (default 128; 0: one context only)
#   GORGO_REAL_KV_TOKENS the nodes' assumed engine cache, node tokens (default from the above)
#   GORGO_REAL_MAX_RUNNING the nodes' engine.max_running_requests (default 1: llama-cpp-python's
#                        server runs one request at a time; 0 leaves it unset)
#   GORGO_REAL_TOKENIZER 1 (default): the nodes count the model's tokens with its tokenizer;
#                        0: they estimate them from bytes and learn the ratio from the engine
#   GORGO_BIN            use this gorgo binary instead of building target/release/gorgo
#   GORGO_REAL_STRICT=1  exit non-zero unless gorgo's p95 TTFT beats round-robin's and least-request's
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

VENV=${GORGO_LLAMA_VENV:-$HOME/.cache/gorgo/llama-venv}
OUT=${GORGO_REAL_OUT:-out/real-engine}
POLICIES=${GORGO_REAL_POLICIES:-gorgo,round-robin,least-request,session-affinity}
SEED=${GORGO_REAL_SEED:-1}
USERS=${GORGO_REAL_USERS:-24}
SECONDS_WINDOW=${GORGO_REAL_SECONDS:-210}
THREADS=${GORGO_REAL_THREADS:-1}
# llama-cpp-python's server runs one request at a time: the nodes are told, so that
# their queue estimate counts the decode of every request ahead (docs/policy.md, "A
# serial engine's queue").
MAX_RUNNING=${GORGO_REAL_MAX_RUNNING:-1}
MAX_RUNNING_ARGS=()
[ "$MAX_RUNNING" -gt 0 ] && MAX_RUNNING_ARGS=(--engine-max-running "$MAX_RUNNING")
TOPOLOGY=configs/topologies/three-region.toml
TOOLS=../shared/tools
LLAMA_PORT0=18410   # llama servers: 18410, 18411, ... (127.0.0.1)
BASE_PORT=19100     # gorgo up's port block, away from the default 7100 and compare's 17100
N_CTX=8192
# The engines' prefix cache. A plain llama.cpp server keeps one context: the last prompt
# it ran; any other prompt in between evicts it, and with tens of sessions interleaving
# on each server no policy gets reuse (docs/real-engine.md). llama-cpp-python's RAM
# prompt cache (--cache) keeps the states of recent prompts, LRU within CACHE_MB, and
# restores the longest matching prefix: a real multi-prefix cache like vLLM's or SGLang's.
CACHE_MB=${GORGO_REAL_CACHE_MB:-128}
# What each node assumes its engine caches, in the node's tokens: the model's, which the
# node learns to count from the engine's usage.prompt_tokens (docs/node.md, "Tokens";
# before issue #17 part 3 they were 4 bytes each, ~3.4 model tokens). A saved state takes
# ~4 KiB per model token (4 layers x 256 x K,V x f16), and each state is a full copy of
# its prompt, shared prefixes included (hence ~0.6 of the raw figure): 128 MiB ~ 19,000
# tokens. With one context, about one of the longest prompts.
if [ "$CACHE_MB" -gt 0 ]; then
  KV_NODE_TOKENS=${GORGO_REAL_KV_TOKENS:-$((CACHE_MB * 150))}
  CACHE_ARGS=(--cache True --cache_type ram --cache_size $((CACHE_MB * 1048576)))
else
  KV_NODE_TOKENS=${GORGO_REAL_KV_TOKENS:-3400}
  CACHE_ARGS=()
fi

log() { printf '== %s\n' "$*"; }
die() { printf 'real-engine-e2e: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------- cleanup
LLAMA_PIDS=()
RUN_DIRS=()
TARGET_DIR=${CARGO_TARGET_DIR:-target}
case $TARGET_DIR in /*) ;; *) TARGET_DIR=$ROOT/$TARGET_DIR ;; esac
GORGO=${GORGO_BIN:-$TARGET_DIR/release/gorgo}
stop_llama() {
  local pid
  for pid in "${LLAMA_PIDS[@]:-}"; do
    [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
  done
  for pid in "${LLAMA_PIDS[@]:-}"; do
    [ -n "$pid" ] || continue
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  LLAMA_PIDS=()
}
cleanup() {
  local rc=$?
  local d
  for d in "${RUN_DIRS[@]:-}"; do
    if [ -n "$d" ] && [ -f "$d/pids.json" ]; then "$GORGO" down --run-dir "$d" >/dev/null 2>&1 || true; fi
  done
  stop_llama
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------- venv
if "$VENV/bin/python" -c 'import llama_cpp.server, gguf, numpy' 2>/dev/null; then
  log "reusing the venv at $VENV"
else
  log "creating the venv at $VENV (llama-cpp-python builds llama.cpp from source: ~8 min on 2 cores)"
  python3 -m venv "$VENV"
  CMAKE_ARGS="-DGGML_NATIVE=OFF" "$VENV/bin/pip" install gguf numpy "llama-cpp-python[server]==0.3.36"
fi
PY=$VENV/bin/python
# The openai client for the check: the venv's, else the system's, else install it.
if "$PY" -c 'import openai' 2>/dev/null; then
  CLIENT_PY=$PY
elif python3 -c 'import openai' 2>/dev/null; then
  CLIENT_PY=python3
else
  "$VENV/bin/pip" install openai
  CLIENT_PY=$PY
fi

# ---------------------------------------------------------------- build, model, workload
if [ -z "${GORGO_BIN:-}" ]; then
  log "cargo build --release --bin gorgo"
  cargo build --release --bin gorgo
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
[ -f "$TOOLS/tiny_gguf.py" ] || die "$TOOLS/tiny_gguf.py not found (the shared tools live beside the repo)"
MODEL=$OUT/tiny.gguf
"$PY" "$TOOLS/tiny_gguf.py" "$MODEL" --ctx "$N_CTX" --seed 0
# The nodes count the model's own tokens (docs/node.md, "Tokens"), the units of the
# calibration's t_p and of KV_NODE_TOKENS. Without the tokenizer a node learns the
# ratio from the engine's usage.prompt_tokens, but llama-cpp-python 0.3.36 sends no
# usage in streams and `gorgo bench` streams every request, so the learner never gets a
# sample, the node counts 4-byte tokens (~3.5 model tokens each), and a t_p seeded per
# model token is 3.5x too low for it (docs/real-engine.md, run 4).
TOKENIZER_ARGS=()
if [ "${GORGO_REAL_TOKENIZER:-1}" = 1 ]; then
  "$PY" scripts/gguf_tokenizer.py "$MODEL" "$OUT/tokenizer" > /dev/null
  TOKENIZER_ARGS=(--tokenizer "$OUT/tokenizer/tokenizer.json"
    --chat-template "$ROOT/configs/templates/llama-cpp-python-chatml.jinja" --chat-add-special-tokens)
fi

mapfile -t REGIONS < <("$PY" - "$TOPOLOGY" <<'EOF'
import sys, tomllib
for r in tomllib.load(open(sys.argv[1], "rb"))["regions"]:
    print(r["name"])
EOF
)
[ "${#REGIONS[@]}" -gt 0 ] || die "no regions in $TOPOLOGY"
REGION_CSV=$(IFS=,; echo "${REGIONS[*]}")

# Multi-turn sessions whose context grows turn by turn (so prefix reuse matters), prompts
# of ~100-900 node tokens (a few hundred to ~3,000 llama tokens), short answers.
cat > "$OUT/workload.toml" <<EOF
duration_s = $SECONDS_WINDOW.0
users = $USERS
requests_per_user = 60.0
single_turn_sessions = 0.2
multi_turn_mean_turns = 5.0
think_time_median_s = 8.0
system_prompt_median_tokens = 120.0
system_prompt_sigma = 0.5
shared_prompts = 4
shared_prompt_tokens = 64
shared_prompt_users = 0.5
first_message_median_tokens = 150.0
first_message_sigma = 0.6
followup_message_median_tokens = 50.0
followup_message_sigma = 0.6
output_tokens = 16
answer_context_median_tokens = 40.0
answer_context_sigma = 0.0
tokens_per_block = 16
max_input_tokens = 900
diurnal_amplitude = 0.0
EOF
log "gorgo trace generate (seed $SEED)"
"$GORGO" trace generate --config "$OUT/workload.toml" --seed "$SEED" --out "$OUT/trace.jsonl" --stats \
  | tee "$OUT/trace-stats.txt"

# ---------------------------------------------------------------- engines
# start_llama TAG: one server per region, logs in $OUT/llama/<TAG>-<region>.log.
ENGINE_URLS=""
start_llama() {
  local tag=$1 i=0 region port
  mkdir -p "$OUT/llama"
  ENGINE_URLS=""
  for region in "${REGIONS[@]}"; do
    port=$((LLAMA_PORT0 + i))
    if curl -s -o /dev/null "http://127.0.0.1:$port/v1/models"; then
      die "port $port is already serving something; stop it first"
    fi
    # --interrupt_requests False: by default a new request aborts the stream in progress;
    # a router's engine must queue them instead.
    "$PY" -m llama_cpp.server --model "$MODEL" --model_alias tiny --host 127.0.0.1 --port "$port" \
      --n_ctx "$N_CTX" --chat_format chatml --n_threads "$THREADS" --n_threads_batch "$THREADS" \
      --interrupt_requests False "${CACHE_ARGS[@]}" \
      >"$OUT/llama/$tag-$region.log" 2>&1 &
    LLAMA_PIDS+=($!)
    ENGINE_URLS+="${ENGINE_URLS:+,}$region=http://127.0.0.1:$port"
    i=$((i + 1))
  done
  i=0
  for region in "${REGIONS[@]}"; do
    port=$((LLAMA_PORT0 + i))
    local ok=0
    for _ in $(seq 1 600); do
      if curl -sf -o /dev/null "http://127.0.0.1:$port/v1/models"; then ok=1; break; fi
      kill -0 "${LLAMA_PIDS[$i]}" 2>/dev/null || break
      sleep 0.2
    done
    [ "$ok" = 1 ] || { tail -20 "$OUT/llama/$tag-$region.log" >&2; die "llama server for $region did not start"; }
    i=$((i + 1))
  done
}

# up POLICY RUN_DIR: the cluster on the running llama servers.
up() {
  RUN_DIRS+=("$2")
  "$GORGO" up --topology "$TOPOLOGY" --policy "$1" --run-dir "$2" --base-port "$BASE_PORT" \
    --engine-url "$ENGINE_URLS" --engine-kind openai --engine-kv-tokens "$KV_NODE_TOKENS" \
    --engine-health-path /docs --engine-t-p-ms "$T_P_MS" --engine-base-ms "$BASE_MS" \
    --engine-decode-step-ms "$DECODE_MS" ${TOKENIZER_ARGS[@]+"${TOKENIZER_ARGS[@]}"} \
    ${MAX_RUNNING_ARGS[@]+"${MAX_RUNNING_ARGS[@]}"} \
    --allow-policy-header --detach \
    >"$2.up.log" 2>&1 || { cat "$2.up.log" >&2; die "gorgo up failed for $1"; }
}

# json_get FILE KEY...: one value of a JSON file (numeric keys index lists).
json_get() {
  "$PY" -c 'import json, sys
d = json.load(open(sys.argv[1]))
for k in sys.argv[2:]:
    d = d[int(k)] if isinstance(d, list) else d[k]
print(d)' "$@"
}

# ---------------------------------------------------------------- calibration
# The nodes' prefill fit is seeded from the engine, as an operator would: cold prompts
# across the workload's range on one server (the others idle), TTFT = base + t_p x tokens.
log "calibrating the engine (cold prompts, node token counts)"
start_llama check
"$PY" scripts/real_engine_calibrate.py "http://127.0.0.1:$LLAMA_PORT0" | tee "$OUT/calibration.json"
T_P_MS=$(json_get "$OUT/calibration.json" t_p_ms)
BASE_MS=$(json_get "$OUT/calibration.json" base_ms)
DECODE_MS=$(json_get "$OUT/calibration.json" decode_step_ms)

# ---------------------------------------------------------------- openai client check
log "openai client through a node to llama.cpp (streaming and not)"
up local-only "$OUT/run-check"
NODE_URL=$(json_get "$OUT/run-check/cluster.json" regions 0 client_url)
ENGINE_URL=$(json_get "$OUT/run-check/cluster.json" regions 0 engine_url)
"$CLIENT_PY" scripts/real_engine_openai_check.py "$NODE_URL" "$ENGINE_URL" | tee "$OUT/openai-check.txt"
"$GORGO" down --run-dir "$OUT/run-check" >/dev/null
stop_llama

# ---------------------------------------------------------------- one run per policy
IFS=, read -r -a POLICY_LIST <<<"$POLICIES"
for policy in "${POLICY_LIST[@]}"; do
  log "policy $policy: fresh llama servers, gorgo up, gorgo bench"
  start_llama "$policy"
  run_dir=$OUT/run-$policy
  up "$policy" "$run_dir"
  "$GORGO" bench --trace "$OUT/trace.jsonl" --cluster "$run_dir" --label "$policy" \
    --out "$OUT/bench-$policy" --model tiny --max-context-tokens 2000 --timeout-s 180 --no-progress \
    | tee "$OUT/bench-$policy.txt"
  # What each node learned: fitted t_p, in-flight accounting, shadow index, peers.
  token=$(json_get "$run_dir/cluster.json" admin_token)
  for i in "${!REGIONS[@]}"; do
    admin=$(json_get "$run_dir/cluster.json" regions "$i" admin_url)
    curl -sf -H "authorization: Bearer $token" "$admin/admin/state" >"$OUT/bench-$policy/admin-${REGIONS[$i]}.json" \
      || echo "could not read $admin/admin/state" >&2
    curl -sf -H "authorization: Bearer $token" "$admin/admin/decisions?limit=1000" \
      >"$OUT/bench-$policy/decisions-${REGIONS[$i]}.json" || echo "could not read $admin/admin/decisions" >&2
  done
  "$GORGO" down --run-dir "$run_dir"
  stop_llama
done

# ---------------------------------------------------------------- report
log "report"
strict=()
[ "${GORGO_REAL_STRICT:-0}" = 1 ] && strict=(--strict)
"$PY" scripts/real_engine_report.py --out "$OUT" --policies "$POLICIES" --regions "$REGION_CSV" "${strict[@]}"
log "done: $OUT/report.md"
