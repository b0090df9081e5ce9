#!/usr/bin/env python3
"""The Python half of scripts/chaos.sh (the chaos soak of issue #18): the fault
schedule, a watcher of the nodes' admin state, and the report.

    chaos_report.py schedule --seed S --duration-s D --hold-s H --regions a,b,c
    chaos_report.py watch --cluster RUN/cluster.json --out admin.jsonl [--interval-s 0.5]
    chaos_report.py report --bench BENCH_DIR --faults faults.jsonl --admin admin.jsonl
                           --out DIR [--min-per-kind N] [--tolerance 0.1] [--window-s 5]

schedule prints one JSON object per fault ({"at_s", "kind", "target", "hold_s"}, at_s
from the start of the replay), seeded: every kind once per round in a shuffled order,
each kind's targets a seeded permutation of the regions (so three rounds hit every
region with every kind once).

watch polls every node's /admin/state and appends one line per poll: {"t_ms" (the
system clock when the poll was sent), "region", "up" (the node answered), "engine_healthy",
"alive": {peer region: alive}, "stats_version": {peer region: version of the stats it
holds}}, until SIGTERM.

report reads the bench's requests.csv and results.json (config.started_unix_ms puts
each request's send time on the system clock the fault log uses), the fault log and the
watcher's log, and writes DIR/chaos.json and DIR/chaos.md: per fault, the requests that
failed before their first byte (no 2xx response head; allowed: sent to the faulted
node's own address while it was down; every other one counts against the run), the
requests cut mid-stream (after the head) and whether each got an SSE error event, the
time until the fault was seen (the peers' /admin/state for node faults and partitions,
the node's own engine health for engine faults), when the faulted region's routing
share dropped, and when it was back to normal. The share is taken over a window of
--window-s 1-s bins (by send time, failed requests included) and compared with the
share the same requests would have given had each been routed as requests from its
home region were away from every fault (so a burst of one region's sessions is not
taken for a routing change); "back" is the first window from the fault's end whose
deviation is within the tolerance: --tolerance or twice the spread (standard
deviation) of the deviation over windows away from every fault, whichever is larger
(a band narrower than the noise of a few requests a second would call a healthy region
unrecovered). Exits 1 when a check fails (the list is in chaos.json and chaos.md).
"""
import argparse
import csv
import json
import math
import random
import signal
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

KINDS = ["node_kill", "node_restart", "engine_pause", "engine_kill", "partition"]
# Faults that take the target's node down: requests sent to its own address in the
# window may fail before their first token (nothing can answer them).
NODE_DOWN = {"node_kill", "node_restart"}
# Faults held for a while (the others are a restart, over when it is).
HELD = {"engine_pause", "partition"}
# Failures up to this long after a fault's end are still put down to it (a stream
# that stalled across the fault and timed out after it).
ATTRIBUTION_GRACE_MS = 15_000
# Bins this close to a fault are not "normal" when the normal routing share is taken.
QUIET_BEFORE_MS = 2_000
QUIET_AFTER_MS = 10_000
# The replay's first seconds (empty caches, first gossip) are not normal either.
WARMUP_MS = 5_000
# A share window with fewer completed requests than this says nothing.
MIN_WINDOW_REQUESTS = 5
# Detection is looked for up to this long after a fault's end.
DETECT_GRACE_MS = 10_000


# ---------------------------------------------------------------- schedule

def schedule(seed, duration_s, hold_s, regions):
    """The seeded fault list: a warm-up of min(30 s, duration / 4.5) (the report's
    normal routing comes from it and the quiet gaps between faults) and a tail of
    min(30 s, duration / 18), rounds of one fault of each kind in slots of at least
    30 s (at least one round), each fault starting in the first fifth of its slot, held
    min(hold, slot / 2) but at least 3 s."""
    rng = random.Random(seed)
    warmup, tail = min(30.0, duration_s / 4.5), min(30.0, duration_s / 18.0)
    avail = duration_s - warmup - tail
    rounds = max(1, int(avail // (len(KINDS) * 30.0)))
    slot = avail / (rounds * len(KINDS))
    hold = min(hold_s, max(3.0, slot / 2))
    targets = {}
    for kind in KINDS:
        order = list(regions)
        rng.shuffle(order)
        targets[kind] = order
    faults = []
    t = warmup
    for r in range(rounds):
        kinds = list(KINDS)
        rng.shuffle(kinds)
        for kind in kinds:
            at = t + rng.uniform(0, slot / 5)
            faults.append({
                "at_s": round(at, 3),
                "kind": kind,
                "target": targets[kind][r % len(regions)],
                # Only a pause and a partition are held; restarts take what they take.
                "hold_s": round(hold, 3) if kind in HELD else None,
            })
            t += slot
    return faults


# ---------------------------------------------------------------- watch

def watch(cluster_path, out_path, interval_s):
    cluster = json.loads(Path(cluster_path).read_text())
    token = cluster.get("admin_token") or ""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    lock = threading.Lock()
    out = open(out_path, "a", buffering=1)

    def poll(region, url):
        while not stop.is_set():
            sent = time.time()
            line = {"t_ms": round(sent * 1000), "region": region, "up": False,
                    "engine_healthy": None, "alive": {}, "stats_version": {}}
            try:
                req = urllib.request.Request(url + "/admin/state",
                                             headers={"Authorization": f"Bearer {token}"})
                with urllib.request.urlopen(req, timeout=1.0) as resp:
                    state = json.load(resp)
                line["up"] = True
                line["engine_healthy"] = (state.get("engine") or {}).get("healthy")
                peers = state.get("peers") or []
                line["alive"] = {p.get("region") or p.get("id"): bool(p.get("alive")) for p in peers}
                line["stats_version"] = {p.get("region") or p.get("id"): (p.get("stats") or {}).get("version")
                                         for p in peers}
            except Exception:
                pass
            with lock:
                out.write(json.dumps(line) + "\n")
            stop.wait(max(0.0, interval_s - (time.time() - sent)))

    threads = [threading.Thread(target=poll, args=(r["name"], r["admin_url"].rstrip("/")),
                                daemon=True)
               for r in cluster["regions"] if r.get("admin_url")]
    for t in threads:
        t.start()
    while not stop.is_set():
        stop.wait(1.0)
    for t in threads:
        t.join(timeout=2.0)
    out.close()


# ---------------------------------------------------------------- report

def fnum(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def read_requests(bench_dir):
    results = json.loads((bench_dir / "results.json").read_text())
    started = results["config"].get("started_unix_ms")
    if not started:
        sys.exit(f"{bench_dir}/results.json has no config.started_unix_ms: "
                 "a gorgo bench older than the chaos soak wrote it")
    base = next(iter(started.values()))
    rows = []
    with open(bench_dir / "requests.csv", newline="") as f:
        for r in csv.DictReader(f):
            send = base + fnum(r["start_ms"])
            e2e = fnum(r["e2e_ms"])
            rows.append({
                "id": r["request_id"],
                "region": r["region"],
                "served_by": r["served_by"] or None,
                "ok": r["ok"].lower() == "true",
                "error": r["error"] or "",
                "send_ms": send,
                "end_ms": send + (e2e if math.isfinite(e2e) else 0.0),
                # The stream began (2xx head): a failure after it is a cut mid-stream.
                "started": math.isfinite(fnum(r.get("first_byte_ms"))),
            })
    return base, rows


def read_jsonl(path):
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def got_sse_error(row):
    """The bench records an SSE `error` object in the stream as `error event: ...`
    (crates/gorgo-bench/src/client.rs)."""
    return row["error"].startswith("error event")


def attribute(rows, faults):
    """Each failed request to the fault whose window ([start, end + grace]) its life
    overlaps, the latest such fault that had started before it failed; else None."""
    out = {}
    for i, r in enumerate(rows):
        if r["ok"]:
            continue
        best = None
        for k, f in enumerate(faults):
            if r["send_ms"] <= f["end_ms"] + ATTRIBUTION_GRACE_MS and r["end_ms"] >= f["start_ms"]:
                if f["start_ms"] <= r["end_ms"] and (best is None or f["start_ms"] > faults[best]["start_ms"]):
                    best = k
        out[i] = best
    return out


def allowed_before_first_byte(row, fault):
    """A failure before the first byte that the fault explains by itself: the request
    went to the faulted node's own address while it was down. After SIGKILL that
    includes requests already waiting at the node (their connection died with it); a
    graceful restart drains, so only requests sent during the restart qualify."""
    if fault is None or fault["kind"] not in NODE_DOWN or row["region"] != fault["target"]:
        return False
    if fault["kind"] == "node_kill":
        return row["send_ms"] <= fault["end_ms"] and row["end_ms"] >= fault["start_ms"]
    return fault["start_ms"] <= row["send_ms"] <= fault["end_ms"]


def sse_expected(row, fault):
    """Whether a stream cut mid-way should have ended with an SSE error event: always,
    except for the clients of a node killed with SIGKILL (their own connection died)."""
    return not (fault is not None and fault["kind"] == "node_kill" and row["region"] == fault["target"])


class Shares:
    """Routing share by send time, in 1-s bins: of the requests sent in a window (failed
    ones included), the fraction a region served, against the fraction it would have
    served had each request been routed as requests from its home region were when
    nothing was wrong. The difference (the deviation) takes the workload's mix of home
    regions out: a burst of one region's sessions moves the share, not the deviation."""

    def __init__(self, rows, base_ms, faults, regions):
        self.base = base_ms
        self.faults = faults
        self.n_bins = int(max((r["send_ms"] for r in rows), default=base_ms) - base_ms) // 1000 + 1
        zeros = lambda: [0] * self.n_bins  # noqa: E731
        self.sent = zeros()
        self.sent_from = {h: zeros() for h in regions}
        self.served = {r: zeros() for r in regions}
        pair = {}  # (home, served) -> quiet requests
        home_total = {h: 0 for h in regions}
        for r in rows:
            b = self.bin_of(r["send_ms"])
            if not 0 <= b < self.n_bins:
                continue
            self.sent[b] += 1
            self.sent_from.setdefault(r["region"], zeros())[b] += 1
            served = r["served_by"] if r["ok"] else None
            if served:
                self.served.setdefault(served, zeros())[b] += 1
            if self.quiet(b):
                home_total[r["region"]] = home_total.get(r["region"], 0) + 1
                pair[(r["region"], served)] = pair.get((r["region"], served), 0) + 1
        # p(served by s | home h) when nothing was wrong.
        self.routing = {(h, s): n / home_total[h] for (h, s), n in pair.items() if home_total[h]}
        self.quiet_requests = sum(home_total.values())

    def bin_of(self, t_ms):
        return int((t_ms - self.base) // 1000)

    def quiet(self, b):
        """Whether bin b is after the warm-up and away from every fault."""
        t0 = self.base + b * 1000
        return t0 >= self.base + WARMUP_MS and not any(
            t0 + 1000 > f["start_ms"] - QUIET_BEFORE_MS and t0 < f["end_ms"] + QUIET_AFTER_MS
            for f in self.faults)

    def window(self, region, first_bin, n_bins):
        """(share, deviation from the expected share) of `region` over the bins from
        `first_bin`; None with too few requests."""
        lo, hi = max(0, first_bin), min(self.n_bins, first_bin + n_bins)
        total = sum(self.sent[lo:hi])
        if total < MIN_WINDOW_REQUESTS:
            return None
        share = sum(self.served.get(region, [0] * self.n_bins)[lo:hi]) / total
        expected = sum(sum(series[lo:hi]) * self.routing.get((h, region), 0.0)
                       for h, series in self.sent_from.items()) / total
        return share, share - expected

    def normal(self, region, win):
        """The region's share over quiet bins, and the spread (standard deviation) of the
        deviation over windows of `win` quiet bins (None with fewer than ten windows)."""
        quiet = [b for b in range(self.n_bins) if self.quiet(b)]
        total = sum(self.sent[b] for b in quiet)
        served = sum(self.served.get(region, [0] * self.n_bins)[b] for b in quiet)
        qs = set(quiet)
        devs = [w[1] for b in quiet if all(b + i in qs for i in range(win))
                for w in [self.window(region, b, win)] if w is not None]
        spread = statistics.pstdev(devs) if len(devs) >= 10 else None
        return (served / total if total else None), spread


def detect_ms(fault, admin, regions):
    """When the fault was first seen in /admin/state: for node faults and partitions,
    the first poll by which every other node had reported the target not alive, or
    (a node restarted faster than failure detection) back as a new generation: its
    stats version below the last one seen before the fault, since a restarted node
    counts from the start again; for engine faults, the target's node reporting its
    engine unhealthy."""
    start, limit = fault["start_ms"], fault["end_ms"] + DETECT_GRACE_MS
    polls = [a for a in admin if start <= a["t_ms"] <= limit]
    before = {}
    for a in admin:
        if a["t_ms"] < start and a["up"]:
            v = (a.get("stats_version") or {}).get(fault["target"])
            if v is not None:
                before[a["region"]] = v
    if fault["kind"].startswith("engine_"):
        for a in polls:
            if a["region"] == fault["target"] and a["up"] and a["engine_healthy"] is False:
                return a["t_ms"] - start
        return None
    seen = set()
    others = {r for r in regions if r != fault["target"]}
    for a in polls:
        if a["region"] not in others or not a["up"]:
            continue
        v = (a.get("stats_version") or {}).get(fault["target"])
        renewed = fault["kind"] in NODE_DOWN and v is not None and v < before.get(a["region"], -1)
        if renewed or not a["alive"].get(fault["target"], False):
            seen.add(a["region"])
            if seen == others:
                return a["t_ms"] - start
    return None


def report(args):
    bench = Path(args.bench)
    base, rows = read_requests(bench)
    faults = read_jsonl(args.faults)
    admin = read_jsonl(args.admin)
    regions = sorted({r["region"] for r in rows} | {f["target"] for f in faults})
    shares = Shares(rows, base, faults, regions)
    win = int(args.window_s)
    normal = {r: shares.normal(r, win) for r in regions}
    tolerance = {r: max(args.tolerance, 2 * spread) if spread is not None else args.tolerance
                 for r, (_, spread) in normal.items()}
    owner = attribute(rows, faults)

    per_fault = []
    for k, f in enumerate(faults):
        mine = [rows[i] for i, fk in owner.items() if fk == k]
        before = [r for r in mine if not r["started"]]
        allowed = [r for r in before if allowed_before_first_byte(r, f)]
        other = [r for r in before if not allowed_before_first_byte(r, f)]
        cut = [r for r in mine if r["started"]]
        cut_sse = [r for r in cut if got_sse_error(r)]
        cut_missing = [r for r in cut if not got_sse_error(r) and sse_expected(r, f)]
        norm, _ = normal.get(f["target"], (None, None))
        tol = tolerance.get(f["target"], args.tolerance)
        next_start = faults[k + 1]["start_ms"] if k + 1 < len(faults) else math.inf
        drop = recovered = None
        if norm is not None:
            b0, b_end = shares.bin_of(f["start_ms"]), shares.bin_of(f["end_ms"])
            for b in range(b0, b_end + DETECT_GRACE_MS // 1000 + 1):
                w = shares.window(f["target"], b, win)
                if w is not None and w[1] < -tol:
                    drop = round(max(0.0, (base + b * 1000 - f["start_ms"]) / 1000), 1)
                    break
            # The first share window starting at or after the end that is back within
            # the tolerance, before the next fault starts.
            b = b_end + (1 if base + b_end * 1000 < f["end_ms"] else 0)
            while base + b * 1000 < min(next_start, base + shares.n_bins * 1000):
                w = shares.window(f["target"], b, win)
                if w is not None and abs(w[1]) <= tol:
                    recovered = round((base + b * 1000 - f["end_ms"]) / 1000, 1)
                    break
                b += 1
        det = detect_ms(f, admin, regions)
        per_fault.append({
            "kind": f["kind"],
            "target": f["target"],
            "start_s": round((f["start_ms"] - base) / 1000, 1),
            "held_s": round((f["end_ms"] - f["start_ms"]) / 1000, 1),
            "executed": bool(f.get("ok", True)),
            "detail": f.get("detail", ""),
            "failed_before_first_byte_allowed": len(allowed),
            "failed_before_first_byte_other": len(other),
            "other_errors": sorted({r["error"][:160] for r in other}),
            "cut_mid_stream": len(cut),
            "cut_with_sse_error": len(cut_sse),
            "cut_without_expected_sse_error": len(cut_missing),
            "cut_errors": sorted({r["error"][:160] for r in cut}),
            "detect_s": None if det is None else round(det / 1000, 2),
            "share_drop_s": drop,
            "normal_share": None if norm is None else round(norm, 3),
            "tolerance": round(tol, 3),
            "recovered_s": recovered,
            # How long the share had to come back before the next fault (or the end).
            "room_s": round((min(next_start, base + shares.n_bins * 1000) - f["end_ms"]) / 1000, 1),
        })

    unattributed = [rows[i] for i, fk in owner.items() if fk is None]
    # Not back in time; a fault followed by the next one (or the end) before a whole
    # target plus one window had passed is unmeasured, not late (the short form's slots).
    late = [p for p in per_fault
            if (p["recovered_s"] is None and p["room_s"] >= args.recovery_target_s + win)
            or (p["recovered_s"] is not None and p["recovered_s"] > args.recovery_target_s)]
    unmeasured = [p for p in per_fault if p["recovered_s"] is None and p not in late]
    counts = {kind: sum(1 for f in faults if f["kind"] == kind) for kind in KINDS}
    checks = [
        ("every fault ran", all(p["executed"] for p in per_fault),
         ", ".join(f"{p['kind']} {p['target']}: {p['detail']}" for p in per_fault if not p["executed"])),
        (f"every kind at least {args.min_per_kind} times", all(c >= args.min_per_kind for c in counts.values()),
         ", ".join(f"{k} {c}" for k, c in counts.items())),
        ("no failure before the first byte except at a downed node's own address",
         sum(p["failed_before_first_byte_other"] for p in per_fault)
         + sum(1 for r in unattributed if not r["started"]) == 0, ""),
        ("every stream cut mid-way got an SSE error event (where a live node could send one)",
         sum(p["cut_without_expected_sse_error"] for p in per_fault)
         + sum(1 for r in unattributed if r["started"]) == 0, ""),
        (f"routing share back to normal within {args.recovery_target_s:g} s of every fault's end",
         not late, ", ".join(f"{p['kind']} {p['target']} at {p['start_s']} s: "
                             f"{'not back' if p['recovered_s'] is None else str(p['recovered_s']) + ' s'}"
                             for p in late)),
    ]
    summary = {
        "requests": len(rows),
        "ok": sum(r["ok"] for r in rows),
        "failed": sum(not r["ok"] for r in rows),
        "unattributed_failures": len(unattributed),
        "unattributed_errors": sorted({r["error"][:160] for r in unattributed}),
        "normal_share": {r: (None if v is None else round(v, 3)) for r, (v, _) in normal.items()},
        "normal_requests": shares.quiet_requests,
        "tolerance": {r: round(t, 3) for r, t in tolerance.items()},
        "window_s": win,
        "faults_by_kind": counts,
        "recovery_unmeasured": [f"{p['kind']} {p['target']} at {p['start_s']} s ({p['room_s']} s to the next)"
                                for p in unmeasured],
    }
    result = {
        "summary": summary,
        "faults": per_fault,
        "checks": [{"check": c, "pass": ok, "detail": d} for c, ok, d in checks],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chaos.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "chaos.md").write_text(render(result))
    print(render(result))
    return 0 if all(ok for _, ok, _ in checks) else 1


def cell(v, unit=""):
    return "-" if v is None else f"{v:g}{unit}"


def render(result):
    s = result["summary"]
    lines = [
        f"requests {s['requests']}, ok {s['ok']}, failed {s['failed']} "
        f"(not during any fault: {s['unattributed_failures']}); normal share "
        + ", ".join(f"{r} {cell(v)} (+-{s['tolerance'][r]:g})" for r, v in s["normal_share"].items())
        + f"; share window {s['window_s']} s",
        "",
        "| # | fault | target | start s | held s | failed before 1st byte: allowed / other "
        "| cut mid-stream (SSE error) | detected s | share dropped s | share back s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, p in enumerate(result["faults"], 1):
        lines.append(
            f"| {i} | {p['kind']}{'' if p['executed'] else ' (FAILED TO RUN)'} | {p['target']} "
            f"| {p['start_s']:g} | {p['held_s']:g} "
            f"| {p['failed_before_first_byte_allowed']} / {p['failed_before_first_byte_other']} "
            f"| {p['cut_mid_stream']} ({p['cut_with_sse_error']}) "
            f"| {cell(p['detect_s'])} | {cell(p['share_drop_s'])} | {cell(p['recovered_s'])} |")
    notes = [f"{i}. {p['kind']} {p['target']}: {p['detail']}"
             for i, p in enumerate(result["faults"], 1) if p["detail"]]
    if notes:
        lines += ["", "Notes: " + "; ".join(notes)]
    if s["recovery_unmeasured"]:
        lines += ["", "Share recovery not measurable (the next fault came first): "
                  + "; ".join(s["recovery_unmeasured"])]
    lines += ["", "| check | result |", "|---|---|"]
    for c in result["checks"]:
        lines.append(f"| {c['check']} | {'pass' if c['pass'] else 'FAIL'}"
                     f"{': ' + c['detail'] if c['detail'] and not c['pass'] else ''} |")
    errors = sorted({e for p in result["faults"] for e in p["other_errors"] + p["cut_errors"]}
                    | set(s["unattributed_errors"]))
    if errors:
        lines += ["", "Errors seen (first 160 characters, distinct):", ""]
        lines += [f"- `{e}`" for e in errors[:30]]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("schedule")
    sp.add_argument("--seed", type=int, required=True)
    sp.add_argument("--duration-s", type=float, required=True)
    sp.add_argument("--hold-s", type=float, default=10.0)
    sp.add_argument("--regions", required=True)
    wp = sub.add_parser("watch")
    wp.add_argument("--cluster", required=True)
    wp.add_argument("--out", required=True)
    wp.add_argument("--interval-s", type=float, default=0.5)
    rp = sub.add_parser("report")
    rp.add_argument("--bench", required=True, help="gorgo bench's output dir")
    rp.add_argument("--faults", required=True)
    rp.add_argument("--admin", required=True)
    rp.add_argument("--out", required=True)
    rp.add_argument("--min-per-kind", type=int, default=1)
    rp.add_argument("--tolerance", type=float, default=0.1,
                    help="how far (absolute share) from normal still counts as back")
    rp.add_argument("--window-s", type=float, default=5, help="share window, 1-s bins")
    rp.add_argument("--recovery-target-s", type=float, default=10)
    a = ap.parse_args()
    if a.cmd == "schedule":
        regions = [r for r in a.regions.split(",") if r]
        for f in schedule(a.seed, a.duration_s, a.hold_s, regions):
            print(json.dumps(f))
        return 0
    if a.cmd == "watch":
        watch(a.cluster, a.out, a.interval_s)
        return 0
    return report(a)


if __name__ == "__main__":
    sys.exit(main())
