"""A pytest junit XML file as a small JSON summary (suite, commit, machine, date, each test's
outcome, time and the first lines of any failure) for benchmarks/results/gpu/. Where the XML is
missing (pytest stopped at the device call's limit), the per-test lines scripts/gpu/pytest_progress.py
wrote as tests finished (`<xml>.jsonl` beside it, or $KLLM_PROGRESS_JSONL) are summarized instead,
marked `"complete": false`."""
from __future__ import annotations

import json
import os
import sys
import time
import xml.etree.ElementTree as ET

RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def from_progress(path: str) -> list[dict]:
    """The progress lines, one entry per test (its worst phase)."""
    tests: dict[str, dict] = {}
    with open(path) as f:
        for raw in f:
            if not raw.strip():
                continue
            line = json.loads(raw)
            line.pop("when", None)
            old = tests.get(line["test"])
            if old is None or RANK[line["outcome"]] > RANK[old["outcome"]]:
                tests[line["test"]] = line
    return list(tests.values())


def main(xml_path: str, suite: str, out_path: str) -> int:
    import torch

    tests = []
    complete = os.path.exists(xml_path)
    progress = os.environ.get("KLLM_PROGRESS_JSONL") or xml_path + ".jsonl"
    if not complete and os.path.exists(progress):
        tests = from_progress(progress)
    if complete:
        for case in ET.parse(xml_path).getroot().iter("testcase"):
            outcome, detail = "passed", ""
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    detail = (node.get("message") or "") + "\n" + (node.text or "")
                    detail = detail.strip()[:1500]
                    break
            tests.append({"test": f"{case.get('classname', '')}::{case.get('name', '')}", "outcome": outcome,
                          "seconds": round(float(case.get("time", 0) or 0), 2), **({"detail": detail} if detail else {})})
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    summary = {"suite": suite, "commit": os.environ.get("KLLM_COMMIT", "unknown"),
               "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "complete": complete,
               "machine": {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                           "torch": torch.__version__},
               "command": f"bash scripts/gpu/run_suite.sh {suite}", "metrics": counts, "counts": counts, "tests": tests}
    with open(out_path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"{suite}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
