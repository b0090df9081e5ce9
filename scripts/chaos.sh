#!/usr/bin/env bash
# The chaos soak (issue #18): a three-region cluster under a generated multi-turn
# workload while a seeded schedule of faults hits it, then a report of what clients saw.
#
#   bash scripts/chaos.sh                         # 10 minutes: every fault kind 3 times
#   CHAOS_DURATION_S=90 bash scripts/chaos.sh     # the short form: every kind once
#
# Steps: `gorgo trace generate` (the replay's workload, as long as the run), `gorgo up
# --detach` on configs/topologies/three-region.toml, a watcher of every node's
# /admin/state (scripts/chaos_report.py watch), `gorgo bench` in the background, and
# meanwhile the faults of `chaos_report.py schedule`, in order:
#   node_kill     gorgo restart --kill node-<region>   (SIGKILL, started again, ready)
#   node_restart  gorgo restart node-<region>          (SIGTERM: the node drains first)
#   engine_pause  SIGSTOP to the region's engine, SIGCONT after the hold (~10 s)
#   engine_kill   gorgo restart --kill engine-<region>, until it answers /health
#   partition     the region cut from every other through gorgo netem's control API
#                 (POST /partition?a=X&b=Y), healed after the hold (~10 s)
# Each fault is a line of faults.jsonl: {"kind", "target", "start_ms", "end_ms" (system
# clock), "ok", "detail"}. Last, `chaos_report.py report` writes chaos.md and
# chaos.json; the script exits non-zero when a fault could not be run, the bench
# failed, or a check of the report fails. The cluster is stopped on every exit
# (`gorgo down`; a paused engine is continued first).
#
# Knobs (environment):
#   CHAOS_DURATION_S  replay length and schedule span, s (default 600)
#   CHAOS_SEED        workload and schedule seed (default 1)
#   CHAOS_USERS       users of the generated workload (default 400 for 600 s and more,
#                     150 below: about 3.3 and 2.3 requests/s)
#   CHAOS_HOLD_S      how long a pause or a partition lasts, s (default 10; shorter
#                     when the slots are: at most half of one)
#   CHAOS_OUT         output dir (default out/chaos): trace.jsonl, bench/ (the bench's
#                     report, requests.csv), faults.jsonl, admin.jsonl, run/ (the
#                     cluster's logs), chaos.md, chaos.json
#   CHAOS_RECOVERY_TARGET_S  how soon after a fault's end the routing share must be back
#                     to normal, s (default 10)
#   CHAOS_IP_BASE     gorgo up --ip-base (default 40: away from up's default 10)
#   CHAOS_BASE_PORT   gorgo up --base-port (default 27100)
#   CHAOS_REPLICAS    gorgo up --replicas (default 1): engine faults hit each region's
#                     engine 0 (`engine-<region>`), the region's other engines serve on
#   GORGO_BIN         use this gorgo binary instead of building target/release/gorgo
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

DURATION=${CHAOS_DURATION_S:-600}
SEED=${CHAOS_SEED:-1}
USERS=${CHAOS_USERS:-$(( DURATION >= 600 ? 400 : 150 ))}
HOLD=${CHAOS_HOLD_S:-10}
OUT=${CHAOS_OUT:-out/chaos}
IP_BASE=${CHAOS_IP_BASE:-40}
BASE_PORT=${CHAOS_BASE_PORT:-27100}
RECOVERY_TARGET_S=${CHAOS_RECOVERY_TARGET_S:-10}
REPLICAS=${CHAOS_REPLICAS:-1}
TOPOLOGY=configs/topologies/three-region.toml
PY=python3
REPORT=$ROOT/scripts/chaos_report.py
# The full run asks every kind three times; a shorter one gets fewer rounds.
if [ "$DURATION" -ge 600 ]; then MIN_PER_KIND=3; else MIN_PER_KIND=1; fi

log() { printf '== %s\n' "$*"; }
die() { printf 'chaos: %s\n' "$*" >&2; exit 1; }
now_ms() { date +%s%3N; }
# A sleep that Ctrl-C or SIGTERM interrupts at once (bash runs a trap only after its
# foreground command ends, and the script waits up to a slot between faults).
pause() { sleep "$1" & wait $!; }

TARGET_DIR=${CARGO_TARGET_DIR:-target}
case $TARGET_DIR in /*) ;; *) TARGET_DIR=$ROOT/$TARGET_DIR ;; esac
GORGO=${GORGO_BIN:-$TARGET_DIR/release/gorgo}

# ---------------------------------------------------------------- cleanup
RUN=
WATCH_PID=
BENCH_PID=
PAUSED_PID=
stop_pid() {  # stop_pid PID: SIGTERM, up to 10 s to go, then SIGKILL
  kill "$1" 2>/dev/null || return 0
  for _ in $(seq 1 100); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}
cleanup() {
  local rc=$?
  # A stopped engine would sit on SIGTERM until `gorgo down` gives up on it.
  if [ -n "$PAUSED_PID" ]; then kill -CONT "$PAUSED_PID" 2>/dev/null || true; fi
  # An interrupted run has no report to write: the bench just stops (a background job
  # of a script ignores SIGINT, so it gets SIGTERM).
  if [ -n "$BENCH_PID" ]; then stop_pid "$BENCH_PID"; fi
  if [ -n "$WATCH_PID" ]; then stop_pid "$WATCH_PID"; fi
  if [ -n "$RUN" ] && [ -f "$RUN/pids.json" ]; then "$GORGO" down --run-dir "$RUN" >/dev/null 2>&1 || true; fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------- build, plan, workload
if [ -z "${GORGO_BIN:-}" ]; then
  log "cargo build --release --bin gorgo"
  cargo build --release --bin gorgo
fi
[ -x "$GORGO" ] || die "no gorgo binary at $GORGO"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -rf "$OUT/bench" "$OUT/faults.jsonl" "$OUT/admin.jsonl" "$OUT/chaos.md" "$OUT/chaos.json"
RUN=$OUT/run
FAULTS=$OUT/faults.jsonl
: > "$FAULTS"

PLAN=$("$GORGO" netem --topology "$TOPOLOGY" --ip-base "$IP_BASE" --base-port "$BASE_PORT" --plan)
CONTROL=http://$(printf '%s' "$PLAN" | $PY -c 'import json,sys; print(json.load(sys.stdin)["control_addr"])')
mapfile -t REGIONS < <(printf '%s' "$PLAN" | $PY -c 'import json,sys; [print(r["name"]) for r in json.load(sys.stdin)["regions"]]')
REGION_CSV=$(IFS=,; echo "${REGIONS[*]}")

log "workload: gorgo trace generate --seed $SEED --duration-s $DURATION --users $USERS"
"$GORGO" trace generate --seed "$SEED" --duration-s "$DURATION" --users "$USERS" \
  --out "$OUT/trace.jsonl" --stats > "$OUT/trace-stats.txt"
mapfile -t SCHEDULE < <($PY "$REPORT" schedule --seed "$SEED" --duration-s "$DURATION" \
  --hold-s "$HOLD" --regions "$REGION_CSV")

# ---------------------------------------------------------------- cluster, watcher, bench
log "gorgo up --detach (run dir $RUN, 127.0.0.$IP_BASE+, ports from $BASE_PORT)"
"$GORGO" up --detach --run-dir "$RUN" --topology "$TOPOLOGY" --ip-base "$IP_BASE" \
  --base-port "$BASE_PORT" --seed "$SEED" --replicas "$REPLICAS" > "$OUT/up.log" 2>&1 \
  || { cat "$OUT/up.log" >&2; die "gorgo up failed"; }

$PY "$REPORT" watch --cluster "$RUN/cluster.json" --out "$OUT/admin.jsonl" --interval-s 0.25 &
WATCH_PID=$!

log "gorgo bench for $DURATION s in the background (log: $OUT/bench.log)"
# Prompts cut to half the emulators' 32k context: the node's estimate of a prompt's
# length runs a little over the trace's, and a refused prompt is no fault's doing.
"$GORGO" bench --trace "$OUT/trace.jsonl" --cluster "$RUN" --out "$OUT/bench" --label chaos \
  --duration "$DURATION" --timeout-s 120 --max-context-tokens 16384 --no-progress \
  > "$OUT/bench.log" 2>&1 &
BENCH_PID=$!
T0=$(now_ms)

# ---------------------------------------------------------------- faults
pid_of() {  # pid_of NAME: the pid pids.json records for it now
  $PY -c 'import json,sys; print(next(p["pid"] for p in json.load(open(sys.argv[1]))["processes"] if p["name"] == sys.argv[2]))' \
    "$RUN/pids.json" "$1"
}
engine_url() {  # engine_url REGION
  $PY -c 'import json,sys; print(next(r["engine_url"] for r in json.load(open(sys.argv[1]))["regions"] if r["name"] == sys.argv[2]))' \
    "$RUN/cluster.json" "$1"
}
record() {  # record KIND TARGET START END OK DETAIL
  $PY -c 'import json,sys; k,t,s,e,ok,d = sys.argv[1:]; print(json.dumps({"kind": k, "target": t, "start_ms": int(s), "end_ms": int(e), "ok": ok == "true", "detail": d}))' \
    "$@" >> "$FAULTS"
}
link() {  # link partition|heal A B
  curl -sS --fail-with-body -m 5 -X POST "$CONTROL/$1?a=$2&b=$3" >> "$OUT/control.log" 2>&1 \
    && echo >> "$OUT/control.log"
}

RETRIED=
restart() {  # restart [--kill] NAME: gorgo restart, started once more if it died starting
  "$GORGO" restart --run-dir "$RUN" "$@" >> "$OUT/restart.log" 2>&1 && return 0
  # Seen after SIGKILL: the restarted node exits at once with "Address already in use"
  # (the killed process's sockets outlive the moment /proc reports it gone). It is dead
  # now, so a plain restart just starts it; the fault log says it took two tries.
  grep -q "exited while starting" <(tail -n 40 "$OUT/restart.log") || return 1
  RETRIED="$* died while starting ($(grep -m 1 -o 'Address already in use' "$RUN/logs/${*: -1}.log" || echo "see its log")); started again"
  sleep 1
  "$GORGO" restart --run-dir "$RUN" "${@: -1}" >> "$OUT/restart.log" 2>&1
}

run_fault() {  # run_fault KIND TARGET HOLD_S; sets FAILURE (why it could not run) and NOTE
  local kind=$1 target=$2 hold=$3 pid url other
  RETRIED= FAILURE= NOTE=
  case $kind in
    node_kill)
      restart --kill "node-$target" \
        || { FAILURE="gorgo restart --kill node-$target failed (restart.log)"; return; } ;;
    node_restart)
      restart "node-$target" \
        || { FAILURE="gorgo restart node-$target failed (restart.log)"; return; } ;;
    engine_pause)
      pid=$(pid_of "engine-$target") || { FAILURE="no engine-$target in pids.json"; return; }
      PAUSED_PID=$pid
      kill -STOP "$pid" || { PAUSED_PID=; FAILURE="SIGSTOP to $pid failed"; return; }
      pause "$hold"
      kill -CONT "$pid" || { FAILURE="SIGCONT to $pid failed"; return; }
      PAUSED_PID= ;;
    engine_kill)
      restart --kill "engine-$target" \
        || { FAILURE="gorgo restart --kill engine-$target failed (restart.log)"; return; }
      url=$(engine_url "$target")
      # `gorgo restart` waits until the engine answers `/health`; checked once more here:
      # the fault lasts until the engine answers.
      for _ in $(seq 1 100); do
        curl -sf -m 1 "$url/health" > /dev/null && break
        sleep 0.1
      done
      curl -sf -m 1 "$url/health" > /dev/null || { FAILURE="engine-$target not answering after restart"; return; } ;;
    partition)
      for other in "${REGIONS[@]}"; do
        [ "$other" = "$target" ] || link partition "$target" "$other" \
          || { FAILURE="partition $target-$other failed (control.log)"; return; }
      done
      pause "$hold"
      for other in "${REGIONS[@]}"; do
        [ "$other" = "$target" ] || link heal "$target" "$other" \
          || { FAILURE="heal $target-$other failed (control.log)"; return; }
      done ;;
    *) FAILURE="unknown fault kind $kind"; return ;;
  esac
  NOTE=$RETRIED
}

FAULTS_FAILED=0
for line in "${SCHEDULE[@]}"; do
  read -r AT_MS KIND TARGET HOLD_S < <(printf '%s' "$line" | $PY -c \
    'import json,sys; f=json.load(sys.stdin); print(round(f["at_s"] * 1000), f["kind"], f["target"], f["hold_s"] or 0)')
  # Scheduled from the bench's start; a fault that ran long delays the next one.
  WAIT_MS=$(( T0 + AT_MS - $(now_ms) ))
  if [ "$WAIT_MS" -gt 0 ]; then pause "$(( WAIT_MS / 1000 )).$(printf '%03d' $(( WAIT_MS % 1000 )))"; fi
  kill -0 "$BENCH_PID" 2>/dev/null || die "gorgo bench exited early (bench.log):
$(tail -20 "$OUT/bench.log")"
  START=$(now_ms)
  log "t+$(( (START - T0) / 1000 )) s: $KIND $TARGET"
  run_fault "$KIND" "$TARGET" "$HOLD_S"
  END=$(now_ms)
  if [ -z "$FAILURE" ]; then
    [ -z "$NOTE" ] || log "  note: $NOTE"
    record "$KIND" "$TARGET" "$START" "$END" true "$NOTE"
  else
    log "  failed: $FAILURE"
    record "$KIND" "$TARGET" "$START" "$END" false "$FAILURE"
    FAULTS_FAILED=$((FAULTS_FAILED + 1))
  fi
done

# ---------------------------------------------------------------- report
log "waiting for gorgo bench to finish"
BENCH_RC=0
wait "$BENCH_PID" || BENCH_RC=$?
BENCH_PID=
kill "$WATCH_PID" 2>/dev/null || true
wait "$WATCH_PID" 2>/dev/null || true
WATCH_PID=
tail -n 25 "$OUT/bench.log"
[ "$BENCH_RC" -eq 0 ] || die "gorgo bench failed ($BENCH_RC): see $OUT/bench.log"

REPORT_RC=0
$PY "$REPORT" report --bench "$OUT/bench" --faults "$FAULTS" --admin "$OUT/admin.jsonl" \
  --out "$OUT" --min-per-kind "$MIN_PER_KIND" --recovery-target-s "$RECOVERY_TARGET_S" || REPORT_RC=$?
log "report: $OUT/chaos.md, $OUT/chaos.json"
[ "$FAULTS_FAILED" -eq 0 ] || die "$FAULTS_FAILED faults could not be run (faults.jsonl)"
[ "$REPORT_RC" -eq 0 ] || die "checks failed (chaos.md)"
log "all checks passed"
