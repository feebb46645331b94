"""What the slow L3 medium did in a bench_tiers.py run (not collected by pytest; no new measurement):
per setup, trace, step and repeat, the medium's calls and seconds charged in that cell (deltas of the
per-process counters, both servers summed), and for kv_tiers what its cost model had learned at the
end of the cell (L3 bandwidth and latency per page, break-even length, prefill speed, prefetches
admitted / refused, "L3 slower than recomputing" warnings).

    python benchmarks/kv_tiers/medium_report.py /tmp/kvt6/partial.json
"""
from __future__ import annotations

import argparse
import json
from typing import Any


def _totals(snap: list[dict[str, Any]] | None) -> dict[int, dict[str, dict[str, float]]]:
    return {int(p["pid"]): p["counts"] for p in (snap or [])}


def medium_delta(before: list[dict[str, Any]] | None, after: list[dict[str, Any]] | None) -> dict[str, dict[str, float]]:
    """Calls / bytes / seconds per kind charged between two snapshots (all processes summed)."""
    b, a = _totals(before), _totals(after)
    out: dict[str, dict[str, float]] = {}
    for pid, counts in a.items():
        for kind, c in counts.items():
            prev = b.get(pid, {}).get(kind, {"calls": 0, "bytes": 0, "seconds": 0.0})
            o = out.setdefault(kind, {"calls": 0, "bytes": 0, "seconds": 0.0})
            for k in o:
                o[k] += c[k] - prev[k]
    return out


def cell_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    cells = doc["cells"]
    rows = []
    order = {"serial": -1.0}
    # cells of one lifetime are cumulative: deltas in the order they were measured (repeat, trace order, step)
    traces = list(dict.fromkeys(c["trace"] for c in cells))
    key = lambda c: (c["setup"], c["repeat"], traces.index(c["trace"]), order.get(c["step"], c["step"]))  # noqa: E731
    prev: dict[tuple[str, int], Any] = {}
    for c in sorted(cells, key=key):
        life = (c["setup"], c["repeat"])
        after = c.get("medium_after")
        d = medium_delta(prev.get(life), after) if after is not None else {}
        if after is not None:
            prev[life] = after
        kv = c.get("kv_tiers_after") or []
        rows.append({"setup": c["setup"], "trace": c["trace"], "step": c["step"], "repeat": c["repeat"],
                     "hit": c["hit_rate"], "ttft": c["ttft_s"], "medium": d,
                     "kv_tiers": [{k: s.get(k) for k in ("l3_bandwidth_bytes_per_s", "l3_latency_s", "l3_min_fetch_tokens",
                                                         "l3_prefetch_overhead_s", "prefill_tokens_per_s", "prefetch_admitted",
                                                         "prefetch_refused", "prefetch_explored", "l2_explored",
                                                         "prefetch_wait", "l3_slower_than_recompute_logs", "store_hits")}
                                  for s in kv]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="a bench_tiers.py --partial file")
    args = ap.parse_args()
    doc = json.load(open(args.path))
    for r in cell_rows(doc):
        med = ", ".join(f"{k} {int(v['calls'])} calls {v['seconds']:.2f} s" for k, v in sorted(r["medium"].items()))
        print(f"{r['setup']:8} rep {r['repeat']} {r['trace'][:9]:9} {str(r['step']):6} hit l3 {r['hit']['l3']:.3f} "
              f"total {r['hit']['total']:.3f} TTFT mean {r['ttft']['mean']:.3f} p50 {r['ttft']['p50']:.3f} | medium: {med}")
        for i, s in enumerate(r["kv_tiers"]):
            bw = s.get("l3_bandwidth_bytes_per_s")
            print(f"    kv_tiers server {i}: L3 {bw / 1e6 if bw else float('nan'):.2f} MB/s + "
                  f"{(s.get('l3_latency_s') or 0) * 1e3:.1f} ms, overhead {s.get('l3_prefetch_overhead_s') or 0:.3f} s, "
                  f"break-even {s.get('l3_min_fetch_tokens')} tokens, prefill {s.get('prefill_tokens_per_s') or 0:.0f} tok/s, "
                  f"prefetch admitted {s.get('prefetch_admitted')} refused {s.get('prefetch_refused')} "
                  f"explored {s.get('prefetch_explored') or 0} (L2 {s.get('l2_explored') or 0}), waits "
                  f"{(s.get('prefetch_wait') or {}).get('calls', 0)} = {(s.get('prefetch_wait') or {}).get('seconds', 0.0):.2f} s, "
                  f"slower-than-recompute warnings {s.get('l3_slower_than_recompute_logs')}, store hits {s.get('store_hits')}")


if __name__ == "__main__":
    main()
