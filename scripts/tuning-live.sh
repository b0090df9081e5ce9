#!/usr/bin/env bash
# Online tuning live (docs/tuning.md, "Live run"): `gorgo up` three regions of emulated
# engines behind netem WAN relays, policy gorgo, tuning online with the default trial
# design, replaying WIN seconds of a generated multi-turn trace at time scale TS (30
# minutes of replay by default). Then, in the simulator on the same window: the grid of
# fixed weights (`gorgo tune-offline`), and the final live weights run as fixed weights,
# against the grid's best. About 40 minutes wall on 2 cores; keep the machine idle.
# Usage: scripts/tuning-live.sh [OUT]   (env: WIN=1800 TS=2 BASE_PORT=27100, and
# START=W_RTT,W_QUEUE to start the line from other weights, e.g. the bad start 2.0,0.05,
# TRIAL=switchback|sequential for another trial design, and WINDOW=REQUESTS and
# WINDOW_MS=MS for another trial window, e.g. WINDOW=256 WINDOW_MS=120000)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/tuning-live}
G=${GORGO:-target/release/gorgo}
WIN=${WIN:-900}
TS=${TS:-2}
PORT=${BASE_PORT:-27100}
[ -x "$G" ] || cargo build --release -q
mkdir -p "$OUT"
T="$OUT/gen5.jsonl"
[ -f "$T" ] || "$G" trace generate --seed 5 --duration-s 1800 --out "$T" > /dev/null
"$G" down --run-dir "$OUT/run" > /dev/null 2>&1 || true
"$G" up --topology configs/topologies/three-region.toml --policy gorgo --tuning online \
  ${START:+--tuning-start "$START"} ${TRIAL:+--tuning-trial "$TRIAL"} \
  ${WINDOW:+--tuning-window "$WINDOW"} ${WINDOW_MS:+--tuning-window-ms "$WINDOW_MS"} --run-dir "$OUT/run" --base-port "$PORT" --detach
trap '"$G" down --run-dir "$OUT/run" > /dev/null 2>&1 || true' EXIT
"$G" bench --trace "$T" --cluster "$OUT/run" --window "$WIN" --time-scale "$TS" \
  --max-context-tokens 32768 --label gorgo-online --no-progress --out "$OUT/live" \
  > "$OUT/live.log" 2>&1
# Every node's /admin/tuning at the end: the line's noise and why it ran no trial
# (`trial_hold`), which tuning.jsonl does not hold when nothing was decided.
python3 - "$OUT/run/cluster.json" > "$OUT/tuning-views.json" <<'VIEWS'
import json, sys, urllib.request
c = json.load(open(sys.argv[1]))
views = {}
for r in c["regions"]:
    req = urllib.request.Request(r["admin_url"] + "/admin/tuning",
                                 headers={"authorization": "Bearer " + c["admin_token"]})
    with urllib.request.urlopen(req, timeout=10) as resp:
        v = json.load(resp)
    views[r["name"]] = {k: v.get(k) for k in ("epoch", "leader", "phase", "weights", "candidate",
                                              "switchback_block_ms",
                                              "trial_hold", "noise_sd", "required_improvement",
                                              "start_fit")}
json.dump(views, sys.stdout, indent=1)
VIEWS
"$G" down --run-dir "$OUT/run" > /dev/null 2>&1 || true
trap - EXIT
"$G" tune-offline --trace "$T" --window-s "$WIN" --time-scale "$TS" \
  --max-context-tokens 32768 --no-progress --out "$OUT/grid" > "$OUT/grid.log" 2>&1
python3 - "$OUT" "$G" "$T" "$WIN" "$TS" "${START:-1.0,1.0}" <<'EOF'
import json, math, os, subprocess, sys
out, g, trace, win, ts, start = sys.argv[1:]
# No tuning.jsonl: the line decided nothing (no start-fit move, no trial: it settled).
path = f"{out}/live/tuning.jsonl"
lines = [json.loads(l) for l in open(path) if l.strip()] if os.path.exists(path) else []
lines.sort(key=lambda r: r["epoch"])
inc = lines[0]["incumbent"] if lines else dict(zip(("w_rtt", "w_queue"), map(float, start.split(","))))
for r in lines:
    inc = r["candidate"] if r["accepted"] else r["incumbent"]
# The start fit's move is not a trial: "the last third" counts trials only.
trials = [r for r in lines if r["verdict"] != "start-fit"]
late = [r for r in trials[len(trials) * 2 // 3:] if r["accepted"]]
noise = [r.get("noise_sd") for r in lines if r.get("noise_sd")]
# The leader's view at the end has the latest noise estimate (a trial record's is older,
# and a line that decided nothing has no record).
views = json.load(open(f"{out}/tuning-views.json"))
lead = next((views[v["leader"]] for v in views.values() if v.get("leader") in views), {})
sd = lead.get("noise_sd") or (noise[-1] if noise else None)
late_gain = [math.log(r["score_tail_ttft_ms"] / r["incumbent_tail_ttft_ms"])
             for r in late if r.get("score_tail_ttft_ms") and r.get("incumbent_tail_ttft_ms")]
subprocess.run([g, "sim", "--trace", trace, "--window-s", win, "--time-scale", ts,
                "--max-context-tokens", "32768", "--policies", "gorgo", "--weights",
                f"{inc['w_rtt']},{inc['w_queue']}", "--out", f"{out}/final-weights"],
               check=True, capture_output=True)
final = json.load(open(f"{out}/final-weights/results.json"))["policies"]["gorgo"]
grid = json.load(open(f"{out}/grid/grid.json"))
live = json.load(open(f"{out}/live/results.json"))["policies"]
live = next(iter(live.values())) if isinstance(live, dict) else live[0][1]
summary = {
    "start": start,
    "trials": len(trials),
    "accepted": sum(r["accepted"] for r in trials),
    "verdicts": {v: sum(r["verdict"] == v for r in lines) for v in sorted({r["verdict"] for r in lines})},
    "accepted_in_last_third": len(late),
    "late_accepted_log_gains": late_gain,
    "noise_sd": sd,
    "trial_hold_at_end": lead.get("trial_hold"),
    "required_improvement_at_end": lead.get("required_improvement"),
    "final_weights": inc,
    "final_weights_sim_p95_ttft_ms": final["ttft_ms"]["p95"],
    "final_weights_sim_p95_e2e_ms": final["e2e_ms"]["p95"],
    "grid_best": grid["best"],
    "grid_default": grid["default"],
    "final_over_grid_best": final["ttft_ms"]["p95"] / grid["best"]["p95_ttft_ms"],
    "live_p95_ttft_ms": live["ttft_ms"]["p95"],
    "live_p95_e2e_ms": live["e2e_ms"]["p95"],
    "live_requests": live["requests"],
    "live_failed": live["failed"],
}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps(summary, indent=1))
EOF
