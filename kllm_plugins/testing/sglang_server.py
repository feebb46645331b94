"""Layer: test and demo tooling (no SGLang import). Launch a real `sglang.launch_server`.

`SGLangServer` starts the server in its own process group on a free loopback port, waits for
/health, and on exit stops the whole group (SGLang spawns scheduler and detokenizer children).
The log goes to a file; `log_tail()` and `grep_log()` read it without printing the huge
server_args line.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Mapping, Sequence


PORT_PLACEHOLDER = "{free_port}"
"""In an extra argument, replaced by a free port at each start attempt (e.g. a KV-event endpoint)."""

PD_CPU_ENV = {"MOONCAKE_PROTOCOL": "tcp", "MC_FORCE_TCP": "1",
              "KLLM_EXTRA_PLUGINS": "kllm_plugins.plugins.bigpd_router.hookimpls"}
"""Environment of a server of a prefill/decode pair on a CPU: Mooncake over TCP, and the
bigpd_router plugin's shim that makes its transfer work without CUDA (with `pd_cpu_args`)."""


def pd_cpu_args(role: str) -> list[str]:
    """SGLang arguments of a server in `role` ("prefill" or "decode") of a prefill/decode pair on a
    CPU: Mooncake transfer, no overlap scheduling (a prefill server's records torch.cuda events when
    a cached prefix is sent early), a bootstrap port, and on decode the cpu_tensor retraction backup
    (the default host_pool pins memory through CUDA)."""
    out = ["--disaggregation-transfer-backend", "mooncake", "--disable-overlap-schedule",
           "--disaggregation-mode", role, "--disaggregation-bootstrap-port", PORT_PLACEHOLDER]
    return out + (["--disaggregation-decode-retraction-backup", "cpu_tensor"] if role == "decode" else [])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fill_ports(template: str) -> str:
    out = template
    while PORT_PLACEHOLDER in out:
        out = out.replace(PORT_PLACEHOLDER, str(free_port()), 1)
    return out


def flush_cache(base_url: str, timeout_s: float = 60.0, retry_s: float = 0.5) -> None:
    """SGLang's /flush_cache (L1 and L2); it answers 400 while requests or storage operations are
    in flight, so retry every `retry_s` until `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}/flush_cache", data=b"", timeout=60):
                return
        except urllib.error.HTTPError as exc:
            if exc.code != 400 or time.monotonic() > deadline:
                raise
            time.sleep(retry_s)


class ServerStartError(RuntimeError):
    pass


class SGLangServer:
    """Context manager: a real SGLang server on the kllm CPU platform (by default)."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        plugins: Sequence[str] = (),
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cpu_platform: bool = True,
        strict: bool = True,
        max_total_tokens: int = 8192,
        startup_timeout_s: float = 180.0,
        log_path: str | None = None,
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(model_path),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-total-tokens", str(max_total_tokens),
            "--sleep-on-idle",
        ]
        if plugins:
            self.args += ["--enable-plugin", ",".join(plugins)]
        # a port picked free can be taken by another process before the server binds it (SGLang also
        # picks ports of its own): a start that fails on "Address already in use" is retried with new
        # ports, for the HTTP port and for every "{free_port}" in the extra arguments
        self._templated: dict[str, str] = {}  # an argument as filled in -> its template
        for a in extra_args:
            if PORT_PLACEHOLDER in a:
                filled = _fill_ports(a)
                self._templated[filled] = a
                a = filled
            self.args.append(a)
        self.port_retries = 2
        self.env = dict(os.environ)
        self.env.pop("SGLANG_USE_CPU_ENGINE", None)
        if cpu_platform:
            self.env["SGLANG_PLATFORM"] = "kllm_cpu"
        if strict:
            self.env["KLLM_STRICT"] = "1"
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.env["KLLM_RUN_DIR"] = tempfile.mkdtemp(prefix="kllm-run-")
        self.env.update(env or {})
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="sglang-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> "SGLangServer":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        for attempt in range(self.port_retries + 1):
            try:
                self._start_once()
                return
            except ServerStartError:
                if attempt == self.port_retries or not self._bind_failed():
                    raise
                self.stop()
                self._repick_ports()

    def _repick_ports(self) -> None:
        old = str(self.port)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        i = self.args.index("--port")
        assert self.args[i + 1] == old
        self.args[i + 1] = str(self.port)
        for k, a in enumerate(self.args):
            if a in self._templated:
                template = self._templated.pop(a)
                self.args[k] = _fill_ports(template)
                self._templated[self.args[k]] = template

    def _start_once(self) -> None:
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"sglang.launch_server exited with {self.proc.returncode}:\n{self.log_tail(40)}"
                )
            # uvicorn that cannot bind logs it and lingers in its shutdown; and what holds the port
            # may be a non-HTTP listener (another server's scheduler socket) that never answers
            if self._bind_failed():
                raise ServerStartError(f"HTTP port {self.port} taken:\n{self.log_tail(10)}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(f"server not healthy within {self.startup_timeout_s}s:\n{self.log_tail(40)}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is not None:  # exited: children it left in its group go too
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        else:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        self.proc = None

    # -- reading the log ---------------------------------------------------------------
    def log_text(self) -> str:
        text = self.log_path.read_text(errors="replace")
        return "\n".join(line if len(line) < 2000 else line[:200] + " …[cut]" for line in text.splitlines())

    def log_tail(self, n: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def _bind_failed(self) -> bool:
        return bool(self.grep_log(r"(?i)address already in use"))

    def grep_log(self, pattern: str) -> list[str]:
        rx = re.compile(pattern)
        return [line for line in self.log_text().splitlines() if rx.search(line)]

    # -- HTTP helpers ------------------------------------------------------------------
    def get_json(self, path: str, timeout: float = 30) -> Any:
        with urllib.request.urlopen(f"{self.base_url}{path}", timeout=timeout) as r:
            return json.loads(r.read())

    def post_json(self, path: str, body: Mapping[str, Any], timeout: float = 120) -> Any:
        req = urllib.request.Request(
            f"{self.base_url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def generate(self, text: str | None = None, input_ids: list[int] | None = None, max_new_tokens: int = 8, **params: Any) -> Any:
        body: dict[str, Any] = {"sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **params}}
        if input_ids is not None:
            body["input_ids"] = input_ids
        else:
            body["text"] = text
        return self.post_json("/generate", body)


def start_each(servers: Sequence[SGLangServer]) -> list[BaseException | None]:
    """Start servers concurrently (start-up is mostly imports, which overlap well); never raises:
    each server's error, or None where it started (a failed one is left to the caller to stop)."""
    errors: list[BaseException | None] = [None] * len(servers)

    def start(i: int) -> None:
        try:
            servers[i].start()
        except BaseException as exc:  # noqa: BLE001 - returned to the caller
            errors[i] = exc

    threads = [threading.Thread(target=start, args=(i,)) for i in range(len(servers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def start_all(servers: Sequence[SGLangServer]) -> None:
    """Start servers concurrently. If any fails, all are stopped and the first error is raised."""
    errors = [e for e in start_each(servers) if e is not None]
    if errors:
        for server in servers:
            server.stop()
        raise errors[0]
