#!/usr/bin/env bash
# docs/kv-events.md's live check: per source (shadow model, KV events), a three-region
# `gorgo up` of emulators, `gorgo bench` over the first 120 s of gen5 at x1, then each
# node's gorgo_cache_estimate_error_ratio and KV-event counters.
#
#     bash scripts/kv-events-live.sh [OUT]    # default out/kv-live; about 5 minutes
#
# Needs out/kv-events/gen5.jsonl (scripts/kv-events-sweep.sh makes it).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/kv-live}
BIN=${GORGO_BIN:-target/release/gorgo}
RUN=""
# However the script ends (an error, Ctrl-C), the cluster of the source being run is
# stopped.
stop() {
  if [ -n "$RUN" ]; then "$BIN" down --run-dir "$RUN/run" >/dev/null 2>&1 || true; fi
}
trap stop EXIT
for source in shadow events; do
  flag=""
  [ "$source" = events ] && flag=--kv-events
  RUN=$OUT/$source
  # A cluster an interrupted earlier run left behind is stopped before its pids.json
  # goes with the run dir (`gorgo up` would then find its addresses taken).
  "$BIN" down --run-dir "$RUN/run" >/dev/null 2>&1 || true
  rm -rf "$RUN"
  mkdir -p "$RUN"
  "$BIN" up --run-dir "$RUN/run" --detach --ip-base 180 --base-port 48600 $flag >"$RUN/up.log" 2>&1
  "$BIN" bench --trace out/kv-events/gen5.jsonl --cluster "$RUN/run/cluster.json" --window 120 \
    --time-scale 1 --max-context-tokens 32768 --no-progress --out "$RUN/bench" >"$RUN/bench.log" 2>&1 || true
  for ip in 180 181 182; do
    curl -s "http://127.0.0.$ip:48604/metrics" |
      grep -E "^gorgo_cache_estimate_error_ratio_(sum|count)|^gorgo_kv_event_(source_events|batches_total|resyncs_total|gaps_total|replays_total) " \
        >"$RUN/metrics-$ip.txt" || true
  done
  "$BIN" down --run-dir "$RUN/run" >/dev/null 2>&1 || true
done
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
for source in ["shadow", "events"]:
    total = count = 0.0
    for name in os.listdir(os.path.join(out, source)):
        if name.startswith("metrics-"):
            for line in open(os.path.join(out, source, name)):
                key, value = line.split()
                if key.endswith("_sum"):
                    total += float(value)
                elif key.endswith("_count"):
                    count += float(value)
    r = next(iter(json.load(open(os.path.join(out, source, "bench", "results.json")))["policies"].values()))
    print(f"{source}: {r['requests']} requests, {r['failed']} failed, cache-estimate error "
          f"{total / max(count, 1):.2%} of the prompt (mean of {count:.0f}), TTFT p50 "
          f"{r['ttft_ms']['p50']:.0f} ms p95 {r['ttft_ms']['p95']:.0f} ms, cache hit {r['cache_hit_ratio']:.1%}")
PY
