"""The test tooling's server launcher: a start that loses its port to another process is retried
with new ports (the flaky "Address already in use" of a CI run), and nothing else is retried.
A small Python HTTP server stands in for SGLang (no SGLang needed)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kllm_plugins.testing.sglang_server import PORT_PLACEHOLDER, ServerStartError, SGLangServer

# fails like a server whose port was taken while `attempts` <= fail_first, then serves /health
_FAKE = r"""
import http.server, sys
from pathlib import Path
port, extra, count, fail_first = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
Path(str(count) + f".{n}").write_text(f"{port} {extra}")
if n <= fail_first:
    print("zmq.error.ZMQError: Address already in use (addr='tcp://*:1')", flush=True)
    sys.exit(1)
if fail_first < 0:
    print("some other start-up error", flush=True)
    sys.exit(1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _launcher(tmp: Path, fail_first: int, extra_args: list[str]) -> SGLangServer:
    """A launcher whose command is the fake, handed the launcher's current port and endpoint (both
    change on a retry) in place of "python -m sglang.launch_server"."""
    s = SGLangServer("unused", extra_args=extra_args, startup_timeout_s=30, log_path=str(tmp / "server.log"))
    (tmp / "fake.py").write_text(_FAKE)
    wrapper = tmp / "wrap.py"
    wrapper.write_text(
        "import subprocess, sys\n"
        "a = sys.argv[1:]\n"
        "port = a[a.index('--port') + 1]\n"
        "ep = next((x for x in a if x.startswith('tcp://')), '-')\n"
        f"sys.exit(subprocess.call([sys.executable, {str(tmp / 'fake.py')!r}, port, ep, "
        f"{str(tmp / 'count')!r}, '{fail_first}']))\n")
    s.args[:3] = [sys.executable, str(wrapper)]
    return s


@pytest.mark.parametrize("fail_first", [1, 2])
def test_a_start_that_lost_its_port_is_retried_with_new_ports(tmp_path: Path, fail_first: int) -> None:
    s = _launcher(tmp_path, fail_first, ["--kv-events-config", f"tcp://*:{PORT_PLACEHOLDER}"])
    assert not any(PORT_PLACEHOLDER in a for a in s.args)  # filled in at construction
    try:
        s.start()
        seen = [(tmp_path / f"count.{k}").read_text().split() for k in range(1, fail_first + 2)]
        assert int((tmp_path / "count").read_text()) == fail_first + 1
        assert seen[-1][0] == str(s.port) and s.base_url.endswith(f":{s.port}")
        assert len({p for p, _ in seen}) == len(seen)  # a new HTTP port per attempt
        assert all(ep.startswith("tcp://*:") and ep[len("tcp://*:"):].isdigit() for _, ep in seen)
        assert seen[-1][1] in s.args
    finally:
        s.stop()


def test_other_start_failures_and_the_last_port_clash_are_raised(tmp_path: Path) -> None:
    for fail_first, calls in ((-1, 1), (5, 3)):  # not a port clash: once; clashes beyond the retries: 1 + 2
        d = tmp_path / str(fail_first)
        d.mkdir()
        s = _launcher(d, fail_first, [])
        with pytest.raises(ServerStartError):
            s.start()
        assert int((d / "count").read_text()) == calls
