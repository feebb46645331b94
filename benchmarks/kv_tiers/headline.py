"""Write benchmarks/results/kv_tiers/headline.json, the plugin's headline summary, from bench_tiers results.

The issue asks for one file with every setup's hit rate, TTFT and throughput at the SLO. The grids
that measure them are separate runs (the reuse traces at long contexts, the no-reuse control), each
recorded under its own name by bench_tiers.py (`benchmarks/results/kv_tiers/<name>.json`); this reads
their runs and records, per trace and setup, the medians with min/max over repeats and the ratios of
medians against L1 only and HiCache, each source named with the command that produced it:

    python benchmarks/kv_tiers/headline.py long unique
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kllm_plugins.bench.record import load_summary, result_path, write_summary  # noqa: E402

SETUPS = ("l1_only", "hicache", "kv_tiers")
FIGURES = (("ttft_mean_s", "ttft_mean_s"), ("ttft_p50_s", "ttft_p50_s"), ("ttft_p99_s", "ttft_p99_s"),
           ("throughput_at_slo_req_s", "throughput_at_slo_req_s"))


def _figure(run: dict, key: str) -> dict:
    s = run.get("spread", {}).get(key)
    if s:
        return {"median": s["median"], "min": s["min"], "max": s["max"]}
    flat = {"ttft_mean_s": ("ttft_s", "mean"), "ttft_p50_s": ("ttft_s", "p50"), "ttft_p99_s": ("ttft_s", "p99")}
    if key in flat:
        v = run[flat[key][0]][flat[key][1]]
    else:
        v = run[key]
    return {"median": v, "min": v, "max": v}


def merge(names: list[str], root: Path | None = None) -> dict:
    traces: dict[str, dict] = {}
    sources = []
    for name in names:
        path = result_path("kv_tiers", name, root)
        if not path.is_file():
            raise SystemExit(f"headline: no results file {path}")
        data = load_summary(path)
        kept = [r for r in data.get("runs", []) if r["setup"] in SETUPS]
        if not kept:
            raise SystemExit(f"headline: {path} has no run of {', '.join(SETUPS)}")
        sources.append({"results": f"benchmarks/results/kv_tiers/{name}.json", "command": data["command"],
                        "commit": data.get("commit", "unknown"), "date": data.get("date", "unknown")})
        for r in kept:
            row = {"hit_rate": r["hit_rate"]["total"], "repeats": r.get("repeats", 1), "source": name}
            row.update({out: _figure(r, key) for out, key in FIGURES})
            row["trace"] = r["trace"]
            traces.setdefault(f"{name}.{r['trace'].split()[0]}", {})[r["setup"]] = row
    for setups in traces.values():
        for base in ("l1_only", "hicache"):
            if base not in setups or "kv_tiers" not in setups:
                continue
            ours, ref = setups["kv_tiers"], setups[base]
            ours.setdefault("ratios", {})[f"vs_{base}"] = {
                out: (ours[out]["median"] / ref[out]["median"] if ref[out]["median"] else None) for out, _ in FIGURES}
    return {"sources": sources, "traces": traces}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="+", help="results names under benchmarks/results/kv_tiers (without .json)")
    ap.add_argument("--out", default=str(result_path("kv_tiers", "headline")))
    args = ap.parse_args(argv)
    merged = merge(args.names)
    first = merged["sources"][0]
    summary = {
        "command": " ".join(["python", "benchmarks/kv_tiers/headline.py", *map(shlex.quote, args.names)]),
        "commit": first["commit"], "machine": load_summary(result_path("kv_tiers", args.names[0])).get(
            "machine", "CPU, 2 cores (see the sources)"),
        "date": max(s["date"] for s in merged["sources"]),
        "metrics": merged["traces"], "sources": merged["sources"],
        "notes": "TTFT and throughput at the SLO: median over repeats with min/max; ratios are ratios of medians "
                 "(kv_tiers over the baseline).",
    }
    write_summary(args.out, summary)
    for trace, setups in merged["traces"].items():
        for setup, r in setups.items():
            print(f"{setup:9} {trace[:44]:44} hit {r['hit_rate']:.3f} TTFT mean {r['ttft_mean_s']['median']:.3f} "
                  f"req/s at SLO {r['throughput_at_slo_req_s']['median']:.2f}")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
