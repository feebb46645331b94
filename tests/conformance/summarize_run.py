"""Summarize one run of the conformance suite (pytest's --junitxml) as the small JSON summary in
benchmarks/results/conformance/: passed / failed / skipped / xfailed per kit per setup.

    KLLM_CONFORMANCE=full .venv/bin/python -m pytest tests/conformance --junitxml=run.xml
    .venv/bin/python tests/conformance/summarize_run.py run.xml --command "..." --commit SHA \\
        --machine "..." --wall-s N [--notes notes.json] > benchmarks/results/conformance/full_run.json
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from datetime import datetime, timezone
from typing import Any


def kit_and_setup(module: str, name: str) -> tuple[str, str]:
    """(kit, setup) of one test, from its module and parametrized name."""
    base, _, param = name.partition("[")
    param = param.rstrip("]")
    if module == "test_server_kits":
        if base == "test_kit":
            setup, _, case = param.partition("-")
            return f"server_kits.{case.split('.')[0]}", setup
        if base == "test_every_plugin_is_held_or_listed":
            return "profiles_listing", "none"
        return {"test_radix_cache_server_kit_tree": "server_kits.radix_cache_server_kit",
                "test_cache_hit_kit_multiturn": "server_kits.cache_hit_kit"}[base], param
    if module == "test_openai_sdk":
        return "openai_sdk", param.rsplit("-", 1)[1]
    if module == "test_schemathesis":
        if base == "test_every_plugin_server_no_5xx_no_hang":
            return f"schemathesis.{param}", "all"
        return f"schemathesis.{param}", "router_stock"
    if module == "test_bench_serving":
        dataset, target = param.rsplit("-", 1)
        return f"bench_serving.{dataset}", "all" if target == "direct" else "router_all"
    if module == "test_unified_radix_cache_kits":
        core = "rust_treecore" if "rust" in base else "python_treecore"
        return "unified_radix_cache", core
    return module, "none"


def outcome(case: ET.Element) -> tuple[str, str]:
    for tag in ("failure", "error"):
        el = case.find(tag)
        if el is not None:
            return "failed", (el.get("message") or "")[:300]
    el = case.find("skipped")
    if el is not None:
        if el.get("type") == "pytest.xfail":
            return "xfailed", (el.get("message") or "")[:300]
        return "skipped", (el.get("message") or "")[:200]
    return "passed", ""


def summarize(xml_path: str) -> dict[str, Any]:
    root = ET.parse(xml_path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None
    per: dict[str, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(
        lambda: {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0}))
    totals = {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0}
    failures, xfails = [], defaultdict(list)
    for case in suite.iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        name = case.get("name", "")
        kit, setup = kit_and_setup(module, name)
        what, msg = outcome(case)
        per[setup][kit][what] += 1
        totals[what] += 1
        if what == "failed":
            failures.append({"test": f"{module}::{name}", "message": msg})
        elif what == "xfailed":
            xfails[re.sub(r"\s+", " ", msg)].append(f"{module}::{name}")
    return {
        "totals": totals,
        "pytest_time_s": round(float(suite.get("time", 0.0)), 1),
        "per_setup": {s: dict(k) for s, k in per.items()},
        "failures": failures,
        "xfailed_by_reason": {reason: len(tests) for reason, tests in xfails.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("xml")
    ap.add_argument("--command", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--machine", required=True)
    ap.add_argument("--date", default=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    ap.add_argument("--wall-s", type=float, required=True)
    ap.add_argument("--notes", help="a JSON file of notes (what each failure is, and why)")
    args = ap.parse_args(argv)
    metrics = summarize(args.xml)
    metrics["wall_s"] = args.wall_s
    out = {"command": args.command, "commit": args.commit, "machine": args.machine, "date": args.date,
           "metrics": metrics}
    if args.notes:
        with open(args.notes) as f:
            out["notes"] = json.load(f)
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
