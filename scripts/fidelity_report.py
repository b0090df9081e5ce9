#!/usr/bin/env python3
"""The report of scripts/fidelity.sh: live `gorgo compare` against the default `gorgo sim`.

Usage: scripts/fidelity_report.py OUT   (markdown on stdout)

For each window directory under OUT (with `live/results.json` and `sim/results.json`):
every policy's TTFT p50, TTFT p95 and E2E p95, live and simulated, with the simulated
cell's difference from live; how many cells are within 15% (issue #13's bar); the
rankings by p95 TTFT on both sides; each pair of policies the two sides order
differently, with how far apart the pair is live; and the load criterion of the issue
(the best baseline's live p95 TTFT over its p50). When the window was replayed twice
(`live2/`, `REPEAT=1`), the same comparison between the two live runs: how much live
differs from itself.

A live cell is *censored* when more of that policy's requests failed before measuring
the metric than the percentile leaves above it (for a p95: more than 5%; a timeout is
the slowest kind of request): `gorgo compare` lists those in `config.censored`, and its
value is only a lower bound. Censored cells (and cells without a value: every request
failed) are shown as such and never scored, nor ranked.

A live run that was interrupted (`config.cancelled` in its results.json: Ctrl-C or
SIGTERM to `gorgo compare`; its report covers only what finished) is flagged in its
window's section and in the summary: scripts/fidelity.sh replays it again when rerun.
"""

import json
import os
import statistics
import sys

TOLERANCE = 0.15
ORDER = ["gen5-x2", "gen5-x1.5", "mc-x4", "mc-x2", "syn-x4", "syn-x2"]


CELLS = ["TTFT p50", "TTFT p95", "E2E p95"]
# (metric, percentile) of each cell, as `config.censored` names them.
CELL_KEYS = [("ttft_ms", "p50"), ("ttft_ms", "p95"), ("e2e_ms", "p95")]


def load_full(path):
    """The policies of a results.json, and per policy the set of its censored cells
    (indices into CELLS): those `config.censored` lists, and those without a value."""
    with open(path) as f:
        res = json.load(f)
    policies = dict(res["policies"].items())
    listed = (res.get("config") or {}).get("censored") or {}
    censored = {}
    for p, r in policies.items():
        marks = listed.get(p) or {}
        censored[p] = {
            k
            for k, (metric, pct) in enumerate(CELL_KEYS)
            if pct in (marks.get(metric) or {}).get("censored", []) or r[metric][pct] is None
        }
    return policies, censored, res.get("config") or {}


def load(path):
    return load_full(path)[0]


def interrupted(config, label):
    """A bold line naming the policies whose replay was cut short, or None."""
    cancelled = config.get("cancelled") or []
    if not cancelled:
        return None
    return (
        f"**the {label} run was interrupted (cancelled: {', '.join(cancelled)}): its cells "
        "cover only the requests that finished; rerun scripts/fidelity.sh to replay it**"
    )


def cells(r):
    e2e = r["e2e_ms"]["p95"]
    return (r["ttft_ms"]["p50"], r["ttft_ms"]["p95"], None if e2e is None else e2e / 1000.0)


def seed_median(runs):
    """Per policy, the median over simulation seeds of each metric (same shape as a
    results entry, for the fields the report reads) and each cell's range."""
    out, ranges = {}, {}
    for p in runs[0]:
        if not all(p in r for r in runs):
            continue
        vals = [cells(r[p]) for r in runs]
        med = [statistics.median(v[k] for v in vals) for k in range(3)]
        ranges[p] = [(min(v[k] for v in vals), max(v[k] for v in vals)) for k in range(3)]
        out[p] = {"ttft_ms": {"p50": med[0], "p95": med[1]}, "e2e_ms": {"p95": med[2] * 1000.0}}
    return out, ranges


def ranking(results, policies, censored=None):
    """Policies by p95 TTFT; those whose p95 is censored cannot be placed and follow,
    marked."""
    censored = censored or {}
    ranked = [p for p in policies if 1 not in censored.get(p, set())]
    out = sorted(ranked, key=lambda p: results[p]["ttft_ms"]["p95"])
    return out + [f"{p} (censored)" for p in policies if p not in ranked]


def discordant(ref, other, policies, skip=frozenset()):
    """Pairs ordered differently by p95 TTFT, with their gap in `ref` (larger / smaller);
    pairs with a policy in `skip` (a censored p95) are left out."""
    out = []
    for i, a in enumerate(policies):
        for b in policies[i + 1:]:
            if a in skip or b in skip:
                continue
            ra, rb = ref[a]["ttft_ms"]["p95"], ref[b]["ttft_ms"]["p95"]
            oa, ob = other[a]["ttft_ms"]["p95"], other[b]["ttft_ms"]["p95"]
            if (ra - rb) * (oa - ob) < 0:
                out.append((a, b, max(ra, rb) / min(ra, rb) - 1.0))
    return out


def compare(name, ref, other, ref_label, other_label, ref_cens=None, other_cens=None):
    """The table of `other` against `ref`. `*_cens`: each side's censored cells per
    policy (see load_full); such a cell is shown, not scored."""
    ref_cens, other_cens = ref_cens or {}, other_cens or {}
    policies = [p for p in ref if p in other]
    lines = [
        f"| policy | {ref_label} TTFT p50 | p95 | E2E p95 s | {other_label} TTFT p50 | p95 | E2E p95 s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    within = total = censored = 0
    worst = (0.0, "")
    fmt = lambda k, v: "-" if v is None else (f"{v:.0f}" if k < 2 else f"{v:.1f}")
    for p in policies:
        rc, oc = cells(ref[p]), cells(other[p])
        rcs, ocs = ref_cens.get(p, set()), other_cens.get(p, set())
        row = f"| {p} |" + "".join(
            f" {fmt(k, v)}{' (censored)' if k in rcs else ''} |" for k, v in enumerate(rc)
        )
        for k, (r, o) in enumerate(zip(rc, oc)):
            if k in rcs or k in ocs or r is None or o is None:
                # A lower bound (or nothing): not a value to score.
                censored += 1
                row += f" {fmt(k, o)}{' (censored)' if k in ocs else ''}, not scored |"
                continue
            d = o / r - 1.0 if r > 0 else float("inf")
            total += 1
            ok = abs(d) <= TOLERANCE
            within += ok
            if abs(d) > abs(worst[0]):
                worst = (d, f"{p} {CELLS[k]}")
            cell = f"{fmt(k, o)} ({d * 100:+.0f}%)"
            row += f" {cell if ok else '**' + cell + '**'} |"
        lines.append(row)
    r_ref, r_other = ranking(ref, policies, ref_cens), ranking(other, policies, other_cens)
    lines.append("")
    not_scored = f", {censored} censored cells not scored" if censored else ""
    lines.append(
        f"within 15%: {within}/{total}{not_scored} "
        f"(largest difference: {worst[1]} {worst[0] * 100:+.0f}%)"
    )
    lines.append(f"rank p95 {ref_label}: {' < '.join(r_ref)}")
    lines.append(f"rank p95 {other_label}: {' < '.join(r_other)}")
    skip = {p for p in policies if 1 in ref_cens.get(p, set()) | other_cens.get(p, set())}
    pairs = discordant(ref, other, policies, skip)
    if pairs:
        desc = ", ".join(f"{a} / {b} ({g * 100:.0f}% apart {ref_label})" for a, b, g in pairs)
        lines.append(f"pairs ordered differently: {len(pairs)}: {desc}")
    else:
        lines.append("pairs ordered differently: none (same ranking)")
    score = f"{within}/{total}" + (f" ({censored} censored)" if censored else "")
    # The same ranking: over the policies whose p95 neither side censors.
    kept = [p for p in policies if p not in skip]
    same = ranking(ref, kept) == ranking(other, kept)
    return lines, score, same, pairs


def main():
    out = sys.argv[1]
    found = [d for d in os.listdir(out) if os.path.isfile(os.path.join(out, d, "live", "results.json"))]
    windows = [w for w in ORDER if w in found] + sorted(w for w in found if w not in ORDER)
    print("# Fidelity: live `gorgo compare` against the default `gorgo sim`\n")
    print("TTFT in ms, E2E in s; a simulated cell gives its difference from live, in bold when")
    print("beyond 15%. A live cell marked censored (more of the policy's requests failed")
    print("before measuring it than the percentile leaves above it) is a lower bound: not")
    print("scored, nor ranked. Generated by scripts/fidelity_report.py.\n")
    summary = []
    for w in windows:
        d = os.path.join(out, w)
        live, live_cens, live_cfg = load_full(os.path.join(d, "live", "results.json"))
        sim = load(os.path.join(d, "sim", "results.json"))
        sim_only = {p: r for p, r in sim.items() if p in live}
        print(f"## {w}\n")
        cut = interrupted(live_cfg, "live")
        if cut:
            print(cut + "\n")
        spec = os.path.join(d, "window.txt")
        if os.path.exists(spec):
            trace, win, ts = open(spec).read().split()
            print(f"`{os.path.basename(trace)}`, first {win} s, time scale {ts}.\n")
        requests = max(r["requests"] for r in live.values())
        failed = sum(r["failed"] for r in live.values())
        # Baselines as gorgo-report's `is_baseline` (and scripts/sweep_ratios.py), with
        # an uncensored p50 and p95.
        baselines = [
            p for p in live
            if not p.startswith("gorgo") and p != "oracle" and not {0, 1} & live_cens[p]
        ]
        best = min(baselines, key=lambda p: live[p]["ttft_ms"]["p95"]) if baselines else None
        def section(title, other, label, tail="", other_cens=None):
            """Print one comparison against live; its two summary cells."""
            if title:
                print(title + "\n")
            lines, score, same, pairs = compare(
                w, live, other, "live", label, live_cens, other_cens
            )
            print("\n".join(lines) + tail)
            return [score, "yes" if same else f"no ({len(pairs)} pairs)"]

        row = [w + (" (live interrupted)" if cut else "")] + section("", sim_only, "sim")
        if best:
            b = live[best]["ttft_ms"]
            print(f"load: best baseline live ({best}) p95 / p50 = {b['p95'] / b['p50']:.1f}")
        print(f"requests per policy live: {requests}, failed live (all policies): {failed}")
        per_policy = ", ".join(
            f"{p} {r['failed']} ({r['failed'] / r['requests'] * 100:.1f}%)"
            for p, r in live.items()
            if r["failed"] and r["requests"]
        )
        if per_policy:
            print(f"failed live per policy: {per_policy}")
        if live_cfg.get("sim_comparable") is False:
            print("**the live run was closed loop or capped in flight: the simulator models neither**")
        print()
        seeds = [os.path.join(d, f"sim-seed{k}", "results.json") for k in range(1, 5)]
        if all(os.path.exists(x) for x in seeds):
            runs = [sim_only] + [{p: r for p, r in load(x).items() if p in live} for x in seeds]
            med, ranges = seed_median(runs)
            row += section("Against the median of five simulation seeds (0-4):", med, "sim median")
            scored = [
                (c, lo, hi)
                for p in med
                for k, (c, (lo, hi)) in enumerate(zip(cells(live[p]), ranges[p]))
                if k not in live_cens[p] and c is not None
            ]
            inside = sum(lo <= c <= hi for c, lo, hi in scored)
            print(f"live cells inside the five seeds' range: {inside}/{len(scored)}\n")
        else:
            row += ["-", "-"]
        others = [
            ("sim-live-chains", "Against `--live-chains` (prompts hashed as the live nodes hash them):", "sim live-chains"),
            ("live2", "Live against itself (the same window replayed a second time):", "live again"),
        ]
        for sub, title, label in others:
            path = os.path.join(d, sub, "results.json")
            if os.path.exists(path):
                pols, cens, cfg = load_full(path)
                cut = interrupted(cfg, label)
                if cut:
                    print(cut + "\n")
                    row[0] += f" ({label} interrupted)"
                other = {p: r for p, r in pols.items() if p in live}
                row += section(title, other, label, "\n", cens)
            else:
                row += ["-", "-"]
        summary.append(row)
    print("## Summary\n")
    print(
        "| window | sim (seed 0): cells within 15% of live | same p95 ranking "
        "| median of 5 seeds: within 15% | same ranking | live-chains: within 15% | same ranking "
        "| live again: within 15% | same ranking |"
    )
    print("|---|---:|---|---:|---|---:|---|---:|---|")
    for row in summary:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
