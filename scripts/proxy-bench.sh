#!/usr/bin/env bash
# Node overhead vs SGLang's router (docs/benchmarks.md, "Node overhead vs SGLang router").
#
# For each engine in ENGINES, one engine, one single `gorgo node` (no peers) and
# SGLang's router (sglang-router 0.3.2, cache_aware) in front of that same engine.
# The same requests go three ways (direct, node, sglang), interleaved:
#   1. sequential, one request at a time (scripts/proxy_bench_latency.py): TTFT and
#      E2E per request, non-streaming and streaming; added latency = proxy - direct;
#   2. at concurrency with wrk (requests/s and latency), non-streaming and streaming,
#      the three targets in turn for several rounds (`gorgo` engine only: the Python
#      engine would be the bottleneck).
# Engines: `gorgo` is `gorgo engine` with near-zero costs (whole output ready at its
# first timer tick, about 1 ms; SSE chunks written back to back); `python` is
# scripts/proxy_bench_engine.py, which answers at once with no timer at all (the most
# stable direct latency, so the cleanest proxy - direct).
# Not part of CI. Needs: a release build, python3 (venv), wrk (apt-get install wrk).
#
# Environment (defaults in brackets):
#   GORGO_BENCH_VENV  venv with sglang-router [~/.cache/gorgo/bench-venv], made if missing
#   OUT               result directory [out/proxy-bench/<UTC time>]
#   ENGINES [gorgo,python]
#   REQUESTS [2000]  WARMUP [30]  MAX_TOKENS [16]: sequential run (per target and mode)
#   WRK_CONNECTIONS [32]  WRK_THREADS [1]  WRK_DURATION [5s]  WRK_ROUNDS [3]: wrk runs
#   NODE_POLICY [gorgo]: the node's routing policy (single node: always local)
#   NICE [-10 as root, else 0]: nice level of every process of the benchmark (engine,
#     node, router, clients alike), so that other jobs on a shared machine disturb the
#     tails less
#   SKIP_BUILD [0]: 1 uses target/release/gorgo as it is
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

VENV=${GORGO_BENCH_VENV:-$HOME/.cache/gorgo/bench-venv}
OUT=${OUT:-$ROOT/out/proxy-bench/$(date -u +%Y%m%dT%H%M%SZ)}
ENGINES=${ENGINES:-gorgo,python}
REQUESTS=${REQUESTS:-2000}
WARMUP=${WARMUP:-30}
MAX_TOKENS=${MAX_TOKENS:-16}
WRK_CONNECTIONS=${WRK_CONNECTIONS:-32}
WRK_THREADS=${WRK_THREADS:-1}
WRK_DURATION=${WRK_DURATION:-5s}
WRK_ROUNDS=${WRK_ROUNDS:-3}
NODE_POLICY=${NODE_POLICY:-gorgo}
if [ "$(id -u)" = 0 ]; then NICE=${NICE:--10}; else NICE=${NICE:-0}; fi
RUN=(nice -n "$NICE")

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  echo "== cargo build --release --bin gorgo"
  cargo build --release --bin gorgo
fi
command -v wrk >/dev/null || { echo "wrk missing: apt-get install wrk" >&2; exit 1; }
if ! "$VENV/bin/python" -c 'import sglang_router' 2>/dev/null; then
  echo "== installing sglang-router==0.3.2 into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q sglang-router==0.3.2
fi

mkdir -p "$OUT"
WORK=$(mktemp -d)
PIDS=()
stop_all() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  PIDS=()
}
cleanup() {
  stop_all
  rm -rf "$WORK"
}
trap cleanup EXIT
trap "exit 130" INT TERM

# Others may rebuild target/release while this runs: use a copy.
cp "$ROOT/target/release/gorgo" "$WORK/gorgo"
GORGO=$WORK/gorgo
"$GORGO" certs --out "$WORK/certs" --nodes bench >/dev/null

# `gorgo engine` profile whose own latency is tiny: near-zero prefill and decode
# costs, so a request's whole output is ready at the emulator's first timer tick.
cat >"$WORK/engine.toml" <<EOF
name = "proxy-bench"
description = "near-zero costs: the engine is not the bottleneck"
model = "bench"
request_overhead_ms = 0.0
prefill_base_ms = 0.001
t_p_ms_per_token = 0.0
decode_base_ms = 0.001
per_seq_ms = 0.0
per_ctx_token_ms = 0.0
max_total_tokens = 100000000
chunked_prefill_size = 1000000
max_running_requests = 4096
context_length = 1000000
EOF

# wrk: one POST body per mode.
PROMPT=$(python3 -c 'print(("route cache prefix region token queue " * 40)[:1000])')
for mode in nonstream stream; do
  stream=false
  [ "$mode" = stream ] && stream=true
  printf '{"model":"bench","messages":[{"role":"user","content":"%s"}],"max_tokens":%d,"stream":%s}' \
    "$PROMPT" "$MAX_TOKENS" "$stream" >"$WORK/body-$mode.json"
done
cat >"$WORK/post.lua" <<'EOF'
local f = assert(io.open(os.getenv("BODY_FILE"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"
EOF

wait_ready() { # name url
  for _ in $(seq 1 300); do
    if curl -fsS -o /dev/null "$2" 2>/dev/null; then return 0; fi
    sleep 0.2 # waiting for a process to start, not synchronising a test
  done
  echo "$1 not ready at $2; see $OUT/*.log" >&2
  exit 1
}

free_ports() { # five free loopback ports: engine, node http, node quic (udp), admin, router
  # Below the kernel's ephemeral range, so that no outgoing connection (of this
  # benchmark or of anything else on the machine) takes one before we bind it.
  python3 - <<'EOF'
import random, socket
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
kinds = (socket.SOCK_STREAM,) * 2 + (socket.SOCK_DGRAM,) + (socket.SOCK_STREAM,) * 2
ports = []
while len(ports) < len(kinds):
    port = random.randrange(max(1024, low - 12000), low)
    if port in ports:
        continue
    s = socket.socket(socket.AF_INET, kinds[len(ports)])
    try:
        s.bind(("127.0.0.1", port))
        ports.append(port)
    except OSError:
        pass
    finally:
        s.close()
print(" ".join(map(str, ports)))
EOF
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse --short HEAD)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //') x $(nproc)"
  echo "nice: $NICE"
  echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "sglang-router: $("$VENV/bin/pip" show sglang-router 2>/dev/null | grep ^Version)"
} | tee "$OUT/machine.txt"

run_suite() { # engine kind: gorgo | python
  local kind=$1 dir="$OUT/$1"
  mkdir -p "$dir"
  local ENGINE_PORT NODE_PORT QUIC_PORT ADMIN_PORT ROUTER_PORT
  read -r ENGINE_PORT NODE_PORT QUIC_PORT ADMIN_PORT ROUTER_PORT < <(free_ports)
  local engine_kind=sglang metrics_ms=250
  echo "== [$kind] engine :$ENGINE_PORT, node :$NODE_PORT, sglang router :$ROUTER_PORT"
  case $kind in
    gorgo)
      RUST_LOG=warn "${RUN[@]}" "$GORGO" engine --profile "$WORK/engine.toml" \
        --listen "127.0.0.1:$ENGINE_PORT" --max-queue 100000 >"$dir/engine.log" 2>&1 &
      ;;
    python)
      # No /metrics: the node reads none (kind openai, no scraping).
      engine_kind=openai metrics_ms=0
      "${RUN[@]}" python3 scripts/proxy_bench_engine.py --listen "127.0.0.1:$ENGINE_PORT" \
        >"$dir/engine.log" 2>&1 &
      ;;
    *) echo "unknown engine $kind" >&2; exit 1 ;;
  esac
  PIDS+=($!)
  wait_ready engine "http://127.0.0.1:$ENGINE_PORT/health"

  cat >"$WORK/node.toml" <<EOF
[node]
id = "bench"
region = "bench"

[listen]
http = "127.0.0.1:$NODE_PORT"
quic = "127.0.0.1:$QUIC_PORT"
admin = "127.0.0.1:$ADMIN_PORT"

[engine]
url = "http://127.0.0.1:$ENGINE_PORT"
kind = "$engine_kind"
metrics_interval_ms = $metrics_ms

[tls]
ca = "certs/ca.pem"
cert = "certs/bench.pem"
key = "certs/bench.key"

[routing]
policy = "$NODE_POLICY"

[admin]
token = "proxy-bench-token"
EOF
  cp "$WORK/node.toml" "$dir/node.toml"
  RUST_LOG=warn "${RUN[@]}" "$GORGO" node --config "$WORK/node.toml" >"$dir/node.log" 2>&1 &
  PIDS+=($!)
  "${RUN[@]}" "$VENV/bin/python" -m sglang_router.launch_router \
    --worker-urls "http://127.0.0.1:$ENGINE_PORT" --policy cache_aware \
    --host 127.0.0.1 --port "$ROUTER_PORT" --log-level warn >"$dir/router.log" 2>&1 &
  PIDS+=($!)
  wait_ready node "http://127.0.0.1:$ADMIN_PORT/readyz"
  wait_ready router "http://127.0.0.1:$ROUTER_PORT/health"
  # The router answers /health before its worker check passes: wait for a completion.
  for _ in $(seq 1 150); do
    if curl -fsS -o /dev/null -H 'content-type: application/json' \
      -d '{"model":"bench","messages":[{"role":"user","content":"hi"}],"max_tokens":2}' \
      "http://127.0.0.1:$ROUTER_PORT/v1/chat/completions" 2>/dev/null; then break; fi
    sleep 0.2
  done

  local targets=(direct="127.0.0.1:$ENGINE_PORT" node="127.0.0.1:$NODE_PORT"
    sglang="127.0.0.1:$ROUTER_PORT")
  echo "== [$kind] sequential latency: $REQUESTS requests per target and mode, interleaved"
  "${RUN[@]}" python3 scripts/proxy_bench_latency.py \
    --target "${targets[0]}" --target "${targets[1]}" --target "${targets[2]}" \
    --requests "$REQUESTS" --warmup "$WARMUP" --max-tokens "$MAX_TOKENS" \
    --out "$dir/latency.json" | tee "$dir/latency.txt"

  if [ "$kind" = gorgo ] && [ "$WRK_ROUNDS" -gt 0 ]; then
    echo "== [$kind] throughput: wrk -t$WRK_THREADS -c$WRK_CONNECTIONS -d$WRK_DURATION --latency, $WRK_ROUNDS rounds"
    : >"$dir/wrk.tsv"
    for round in $(seq 1 "$WRK_ROUNDS"); do
      for mode in nonstream stream; do
        for target in "${targets[@]}"; do
          local name=${target%%=*} addr=${target#*=}
          local log="$dir/wrk-$mode-$name-$round.txt"
          BODY_FILE="$WORK/body-$mode.json" "${RUN[@]}" wrk -t"$WRK_THREADS" \
            -c"$WRK_CONNECTIONS" -d"$WRK_DURATION" --latency -s "$WORK/post.lua" \
            "http://$addr/v1/chat/completions" >"$log" 2>&1
          python3 - "$log" "$mode" "$name" "$round" >>"$dir/wrk.tsv" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
def ms(v):
    n, unit = re.match(r"([\d.]+)(us|ms|s)", v).groups()
    return float(n) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]
rps = re.search(r"Requests/sec:\s+([\d.]+)", text).group(1)
p50 = ms(re.search(r"^\s+50%\s+(\S+)", text, re.M).group(1))
p99 = ms(re.search(r"^\s+99%\s+(\S+)", text, re.M).group(1))
bad = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
errs = re.search(r"Socket errors: (.*)", text)
print("\t".join([sys.argv[2], sys.argv[3], sys.argv[4], rps, f"{p50:.3f}", f"{p99:.3f}",
                 bad.group(1) if bad else "0", errs.group(1) if errs else "-"]))
EOF
          tail -n1 "$dir/wrk.tsv"
        done
      done
    done
    python3 - "$dir/wrk.tsv" <<'EOF' | tee "$dir/throughput.txt"
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
print("\nthroughput (wrk, median over rounds)")
print(f"{'mode':<10} {'target':<8} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'non-2xx':>8}  req/s by round")
for mode in ("nonstream", "stream"):
    for name in ("direct", "node", "sglang"):
        sel = [r for r in rows if r[0] == mode and r[1] == name]
        if not sel:
            continue
        rps = [float(r[3]) for r in sel]
        print(f"{mode:<10} {name:<8} {statistics.median(rps):>9.0f} "
              f"{statistics.median(float(r[4]) for r in sel):>8.2f} "
              f"{statistics.median(float(r[5]) for r in sel):>8.2f} "
              f"{sum(int(r[6]) for r in sel):>8}  {' '.join(f'{x:.0f}' for x in rps)}")
EOF
  fi
  stop_all
}

IFS=, read -r -a engine_list <<<"$ENGINES"
for kind in "${engine_list[@]}"; do
  run_suite "$kind"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/machine.txt"
echo "== results in $OUT"
