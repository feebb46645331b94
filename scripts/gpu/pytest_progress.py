"""A pytest plugin (`-p pytest_progress`, with scripts/gpu on PYTHONPATH) that appends one JSON line
per finished test to $KLLM_PROGRESS_JSONL as it finishes, so a run stopped at the device call's
limit still brings back every outcome so far (pytest writes its junit XML only at the end).
scripts/gpu/summarize_junit.py reads these lines when the XML is missing."""
from __future__ import annotations

import json
import os
from typing import Any


def pytest_runtest_logreport(report: Any) -> None:
    path = os.environ.get("KLLM_PROGRESS_JSONL")
    if not path:
        return
    # one line per test: its call, or the setup/teardown phase that failed or skipped it
    if report.when != "call" and report.outcome == "passed":
        return
    outcome = {"passed": "passed", "failed": "failed" if report.when == "call" else "error",
               "skipped": "skipped"}[report.outcome]
    detail = ""
    if report.outcome != "passed":
        detail = str(report.longrepr)[:1500] if report.longrepr is not None else ""
    test = report.nodeid.replace("/", ".").replace(".py::", "::")
    line = {"test": test, "outcome": outcome, "when": report.when, "seconds": round(report.duration, 2)}
    if detail:
        line["detail"] = detail
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
