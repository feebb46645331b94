"""Benchmark helper (not collected by pytest): the stated starvation bound's quantity, from a
recorded run. For every long request: TTFT / (solo TTFT of itself + solo TTFT of the older long
requests still waiting for their first token when it arrived + solo TTFT of the younger ones that
got theirs before it: at most `long_overtake_max` with fair_sched), with solo TTFT interpolated from
the run's calibration, arrivals rebuilt from the seeded trace. The bound says this stays <= K
(docs/fair_sched.md); "long TTFT / own solo" in the table also counts the wait behind older ones.

    python benchmarks/fair_sched/chain_bound.py issue
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from workload import MIXES, make_trace  # noqa: E402

RESULTS = os.path.join(os.path.dirname(HERE), "results")


def main() -> None:
    mix = sys.argv[1] if len(sys.argv) > 1 else "issue"
    with open(os.path.join(RESULTS, "fair_sched.json"), encoding="utf-8") as fh:
        res = json.load(fh)
    with open(os.path.join(RESULTS, f"fair_sched_{mix}_requests.json"), encoding="utf-8") as fh:
        reqs = json.load(fh)
    cal = res["mixes"][mix]["calibration"]
    lo, hi, tlo, thi = cal["long_lo_tokens"], cal["long_hi_tokens"], cal["long_lo_ttft_s"], cal["long_hi_ttft_s"]

    def solo(n: float) -> float:
        return max(tlo + (thi - tlo) / (hi - lo) * (n - lo), 1e-3)

    for r in res["runs"]:
        if r.get("mix") != mix:
            continue
        key = f"{r['policy']}@{r['load']}/s{r['seed']}"
        jobs = make_trace(MIXES[mix], r["requests"], r["rate_req_s"], r["seed"])
        longs = [(j.arrival_s, row[1], row[2]) for j, row in zip(jobs, reqs[key]) if row[0] == "long"]
        worst = max(t / (solo(n) + sum(solo(n2) for a2, n2, t2 in longs if a2 < a < a2 + t2)
                          + sum(solo(n2) for a2, n2, t2 in longs if a < a2 and a2 + t2 < a + t))
                    for a, n, t in longs)
        print(f"{key:32s} max TTFT / solo of (itself + older unfinished longs + younger ones served first) = {worst:.2f}; "
              f"max TTFT / own solo = {r['long_ttft_over_solo']['max']:.2f}")


if __name__ == "__main__":
    main()
