"""A pytest junit XML file as a small JSON summary (suite, commit, machine, each test's outcome,
time and the first lines of any failure) for benchmarks/results/gpu/."""
from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET


def main(xml_path: str, suite: str, out_path: str) -> int:
    import torch

    tests = []
    if os.path.exists(xml_path):
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
               "machine": {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                           "torch": torch.__version__},
               "command": f"bash scripts/gpu/run_suite.sh {suite}", "counts": counts, "tests": tests}
    with open(out_path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"{suite}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
