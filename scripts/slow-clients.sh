#!/usr/bin/env bash
# Slow and idle clients against one node (issue #18; docs/reliability.md).
#
# One `gorgo engine` emulator and one `gorgo node` in front of it; then SLOW
# connections that send a request head and a body byte every 5 s, and IDLE
# connections that send nothing (scripts/slow_clients.py, over several processes and
# many 127.x source addresses), held open for HOLD_S seconds. Meanwhile a well-behaved
# client sends GOOD requests one after another from 127.0.0.3, and the admin port's
# /readyz and /metrics are read. Passes when every good request and every admin call
# succeeded. Not part of CI (it needs ~25,000 sockets); the same mechanisms are
# tested at small scale in crates/gorgo-node/tests/node_limits.rs and node_fds.rs.
#
# Environment (defaults in brackets):
#   SLOW [5000]  IDLE [20000]  HOLD_S [60]  GOOD [100]
#   OUT [out/slow-clients/<UTC time>]  SKIP_BUILD [0]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SLOW=${SLOW:-5000}
IDLE=${IDLE:-20000}
HOLD_S=${HOLD_S:-60}
GOOD=${GOOD:-100}
OUT=${OUT:-$ROOT/out/slow-clients/$(date -u +%Y%m%dT%H%M%SZ)}
GORGO=${GORGO:-$ROOT/target/release/gorgo}
mkdir -p "$OUT"
[ "${SKIP_BUILD:-0}" = 1 ] || cargo build --release --quiet
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_ready() { # name url
  for _ in $(seq 1 300); do curl -fsS -o /dev/null "$2" 2>/dev/null && return 0; sleep 0.1; done
  echo "$1 did not become ready" >&2; exit 1
}
ENGINE_PORT=$(free_port); NODE_PORT=$(free_port); QUIC_PORT=$(free_port); ADMIN_PORT=$(free_port)
"$GORGO" certs --out "$OUT/certs" --nodes solo >/dev/null
"$GORGO" engine --listen "127.0.0.1:$ENGINE_PORT" --max-queue 100000 >"$OUT/engine.log" 2>&1 &
PIDS+=($!)
wait_ready engine "http://127.0.0.1:$ENGINE_PORT/health"
cat >"$OUT/node.toml" <<TOML
[node]
id = "solo"
region = "solo"
[listen]
http = "127.0.0.1:$NODE_PORT"
quic = "127.0.0.1:$QUIC_PORT"
admin = "127.0.0.1:$ADMIN_PORT"
[engine]
url = "http://127.0.0.1:$ENGINE_PORT"
kind = "sglang"
[tls]
ca = "$OUT/certs/ca.pem"
cert = "$OUT/certs/solo.pem"
key = "$OUT/certs/solo.key"
[admin]
token = "slow-clients-token"
TOML
RUST_LOG=warn "$GORGO" node --config "$OUT/node.toml" >"$OUT/node.log" 2>&1 &
NODE_PID=$!
PIDS+=($NODE_PID)
wait_ready node "http://127.0.0.1:$ADMIN_PORT/readyz"
echo "node pid $NODE_PID, descriptor limit $(grep 'open files' /proc/$NODE_PID/limits | awk '{print $4}')" | tee "$OUT/summary.txt"

# At most ~12,500 sockets per attacking process (each process's descriptor limit).
total=$((SLOW + IDLE)); procs=$(( (total + 12499) / 12500 )); octet=10
left_slow=$SLOW; left_idle=$IDLE
for i in $(seq 1 "$procs"); do
  s=$(( left_slow < 12500 ? left_slow : 12500 )); left_slow=$((left_slow - s))
  room=$((12500 - s)); d=$(( left_idle < room ? left_idle : room )); left_idle=$((left_idle - d))
  (ulimit -n "$(ulimit -Hn)"; exec python3 scripts/slow_clients.py "127.0.0.1:$NODE_PORT" "$s" "$d" "$octet") \
    >"$OUT/attack-$i.log" 2>&1 &
  PIDS+=($!)
  octet=$((octet + 1))
done
echo "attack: $SLOW slow + $IDLE idle connections in $procs processes; holding $HOLD_S s" | tee -a "$OUT/summary.txt"
sleep 15  # let the attackers reach their counts before measuring

ok=0; fail=0; admin_ok=0; admin_fail=0; : >"$OUT/good.tsv"
deadline=$((SECONDS + HOLD_S))
body='{"model":"gorgo-emulated","messages":[{"role":"user","content":"hello"}],"max_tokens":4}'
for i in $(seq 1 "$GOOD"); do
  r=$(curl -sS -o /dev/null -w '%{http_code} %{time_total}' --interface 127.0.0.3 --max-time 30 \
    -H 'content-type: application/json' -d "$body" "http://127.0.0.1:$NODE_PORT/v1/chat/completions" 2>&1 || true)
  echo "$r" >>"$OUT/good.tsv"
  case $r in 200\ *) ok=$((ok + 1)) ;; *) fail=$((fail + 1)) ;; esac
  if curl -fsS -o /dev/null --max-time 10 "http://127.0.0.1:$ADMIN_PORT/readyz"; then admin_ok=$((admin_ok + 1)); else admin_fail=$((admin_fail + 1)); fi
  [ $SECONDS -lt $deadline ] || break
  sleep $(python3 -c "print(max(0.0, ($deadline - $SECONDS) / max(1, $GOOD - $i)))")
done
curl -fsS "http://127.0.0.1:$ADMIN_PORT/metrics" | grep -E '^gorgo_connections' >"$OUT/connections.txt" || true
{
  echo "good requests: $ok ok, $fail failed"
  echo "admin /readyz: $admin_ok ok, $admin_fail failed"
  python3 - "$OUT/good.tsv" <<'PY'
import sys
t = sorted(float(l.split()[1]) for l in open(sys.argv[1]) if l.startswith("200 "))
if t:
    print(f"good request latency: p50 {t[len(t)//2]*1000:.0f} ms, max {t[-1]*1000:.0f} ms")
PY
  echo "node alive: $(kill -0 $NODE_PID 2>/dev/null && echo yes || echo NO), rss $(ps -o rss= -p $NODE_PID 2>/dev/null | awk '{printf "%.0f MiB", $1/1024}')"
  tail -n1 "$OUT"/attack-*.log
  cat "$OUT/connections.txt"
} | tee -a "$OUT/summary.txt"
[ "$fail" = 0 ] && [ "$admin_fail" = 0 ]
