"""Starting several servers at once: `start_each` reports each one's error and stops none;
`start_all` stops every server and raises the first error when any failed."""
from __future__ import annotations

import pytest

from kllm_plugins.testing.sglang_server import start_all, start_each


class FakeServer:
    def __init__(self, fails: bool) -> None:
        self.fails, self.started, self.stopped = fails, False, False

    def start(self) -> None:
        if self.fails:
            raise RuntimeError("no start")
        self.started = True

    def stop(self) -> None:
        self.stopped = True


def test_start_each_reports_per_server_and_start_all_stops_everything() -> None:
    servers = [FakeServer(False), FakeServer(True), FakeServer(False)]
    errors = start_each(servers)  # type: ignore[arg-type]
    assert [e is None for e in errors] == [True, False, True] and "no start" in str(errors[1])
    assert all(s.started != s.fails for s in servers) and not any(s.stopped for s in servers)
    with pytest.raises(RuntimeError, match="no start"):
        start_all(servers)  # type: ignore[arg-type]
    assert all(s.stopped for s in servers)
