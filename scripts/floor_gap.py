#!/usr/bin/env python3
"""Where each policy's tail sits above the latency floor, taken apart per request.

    python3 scripts/floor_gap.py OUT        # OUT: a `gorgo sim` report directory

`gorgo sim` writes requests.csv (what each request got) and floor.csv (what it could
have got at best: alone on the fastest engine, an unbounded cache shared by every
engine, no network; crates/gorgo-sim/src/floor.rs). For the slowest 5% of each
policy's requests (TTFT at or above its p95) this prints the mean TTFT, the mean floor,
and the excess split in two:

- placement: the prefill of prompt tokens some engine of the cluster held when the
  client's node decided and the serving engine did not (t_p of the run's engine
  profile x the tokens; requests.csv's cached_anywhere_tokens, which only the
  simulator knows): a choice of engine could have saved it then;
- not cached anywhere: the prefill of tokens the unbounded shared cache would have held
  and no engine did when the request arrived (evicted everywhere, or still being
  computed): only earlier choices (where prefixes were put, what got evicted) or more
  KV could have saved it;
- queue + network: the rest: waiting behind other work, sharing the batch, the
  client's link and forwards.

It also gives the share of those requests that were forwarded, the p95 over the
floor's p95, and the share of the cluster's KV cache spent on copies of blocks another
engine also held (sampled every 10 s by the simulator, sim.json's counters): what
copies crowd out of the cache feeds the "not cached anywhere" term. Standard library
only.
"""
import csv
import json
import math
import sys
import tomllib
from pathlib import Path


def nearest_rank(sorted_values, p):
    """The percentile convention of the reports (gorgo_core::sketch::percentile)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), math.ceil(round(p / 100 * len(sorted_values), 9))))
    return sorted_values[rank - 1]


def main(out: Path) -> None:
    sim = json.loads((out / "sim.json").read_text())
    config = sim["config"]
    copies = {}
    for run in sim["runs"]:
        c = run["counters"]
        if c.get("kv_cached_tokens_sampled"):
            copies[run["policy"]] = 1 - c["kv_unique_tokens_sampled"] / c["kv_cached_tokens_sampled"]
    profile = config.get("engine_profile", "paper-a100-mistral7b")
    path = Path(profile)
    if not path.exists():
        path = Path(__file__).resolve().parent.parent / "configs" / "engines" / f"{profile}.toml"
    t_p = tomllib.loads(path.read_text())["t_p_ms_per_token"]
    floors = {}
    with open(out / "floor.csv", newline="") as f:
        for row in csv.DictReader(f):
            floors[row["request_id"]] = row
    # The floor of what an engine can serve, as the policies' p95 counts (the column
    # is absent in floor.csv files written before it existed: every row then counts).
    floor_p95 = nearest_rank(sorted(float(r["ttft_floor_ms"]) for r in floors.values()
                                    if r.get("servable", "true") == "true"), 95)
    by_policy = {}
    with open(out / "requests.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row["ok"] == "true":
                by_policy.setdefault(row["policy"], []).append(row)
    print(f"floor p95 TTFT {floor_p95:.0f} ms (t_p {t_p} ms/token, profile {profile})\n")
    print("| policy | p95 TTFT ms | p95 / floor p95 | tail requests | tail mean TTFT ms | "
          "tail mean floor ms | excess: placement ms | excess: not cached anywhere ms | "
          "excess: queue + network ms | tail forwarded | KV on copies |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for policy, rows in by_policy.items():
        ttfts = sorted(float(r["ttft_ms"]) for r in rows)
        p95 = nearest_rank(ttfts, 95)
        tail = [r for r in rows if float(r["ttft_ms"]) >= p95]
        n = len(tail)
        mean_ttft = sum(float(r["ttft_ms"]) for r in tail) / n
        mean_floor = sum(float(floors[r["request_id"]]["ttft_floor_ms"]) for r in tail) / n
        placement = nowhere = 0.0
        for r in tail:
            bound = int(floors[r["request_id"]]["cached_floor_tokens"])
            # Past what the floor prices as cached (earlier arrivals' blocks) a request
            # may find blocks a burst-mate computed while it waited: its floor prefills
            # those, and the wait is queueing.
            cached = min(bound, int(r["cached_tokens"] or 0))
            anywhere = min(bound, max(cached, int(r.get("cached_anywhere_tokens") or 0)))
            placement += t_p * (anywhere - cached)
            nowhere += t_p * max(0, bound - anywhere)
        placement, nowhere = placement / n, nowhere / n
        rest = mean_ttft - mean_floor - placement - nowhere
        forwarded = sum(1 for r in tail if r["served_by"] != r["region"]) / n
        copy_cell = f"{copies[policy]:.0%}" if policy in copies else "-"
        print(f"| {policy} | {p95:.0f} | {p95 / floor_p95:.2f} | {n} | {mean_ttft:.0f} | "
              f"{mean_floor:.0f} | {placement:.0f} | {nowhere:.0f} | {rest:.0f} | {forwarded:.0%} | "
              f"{copy_cell} |")

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
