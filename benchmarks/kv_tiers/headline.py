"""Write benchmarks/results/kv_tiers.json, the issue's headline file, from named bench_tiers results.

The issue asks for one file with every setup's hit rate, TTFT and throughput at the SLO. The grids
that measure them are separate runs (the reuse traces at long contexts, the no-reuse control), each
recorded under its own name by bench_tiers.py; this copies their runs, unchanged and each with the
command that produced it, into kv_tiers.json:

    python benchmarks/kv_tiers/headline.py kv_tiers_long16 kv_tiers_unique_r4
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
SETUPS = ("l1_only", "hicache", "kv_tiers")


def merge(names: list[str]) -> dict[str, object]:
    runs, sources = [], []
    for name in names:
        path = RESULTS / f"{name}.json"
        if not path.is_file():
            raise SystemExit(f"headline: no results file {path}")
        data = json.loads(path.read_text())
        kept = [dict(r, command=r.get("command") or data["command"]) for r in data["runs"] if r["setup"] in SETUPS]
        if not kept:
            raise SystemExit(f"headline: {path} has no run of {', '.join(SETUPS)}")
        runs.extend(kept)
        sources.append({"results": f"benchmarks/results/{name}.json", "command": data["command"]})
    return {"command": " ".join(["python", "benchmarks/kv_tiers/headline.py", *map(shlex.quote, names)]),
            "sources": sources, "runs": runs}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="+", help="results names under benchmarks/results (without .json)")
    ap.add_argument("--out", default=str(RESULTS / "kv_tiers.json"))
    args = ap.parse_args(argv)
    out = merge(args.names)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for r in out["runs"]:
        print(f"{r['setup']:9} {r['trace'][:44]:44} hit {r['hit_rate']['total']:.3f} "
              f"TTFT mean {r['ttft_s']['mean']:.3f} req/s at SLO {r['throughput_at_slo_req_s']:.2f}")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
