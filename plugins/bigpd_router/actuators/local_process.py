"""Layer: actuator (no SGLang import; it runs SGLang as a child process). Local-process actuator.

Starts `python -m sglang.launch_server` on a free port of this machine for each instance the
controller adds, in its own process group so stopping it takes its scheduler and detokenizer
children too, and stops it (SIGTERM, then SIGKILL after a grace period) when removed.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from kllm_plugins.plugins.bigpd_router.core.registry import Role

log = logging.getLogger("kllm.bigpd_router.local_process")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class LocalProcessActuator:
    model_path: str
    common_args: Sequence[str] = ()
    """Arguments for every instance (e.g. --max-total-tokens 4096 --sleep-on-idle)."""
    role_args: Mapping[Role, Sequence[str]] = field(default_factory=dict)
    """Extra arguments per role (e.g. --disaggregation-mode prefill)."""
    env: Mapping[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    log_dir: str | None = None
    stop_grace_s: float = 10.0
    python: str = sys.executable
    module: str = "sglang.launch_server"
    """The server module run with `python -m` (tests put the router's fake backend here)."""
    role_switch: bool = False
    """Start PD instances with --enable-pd-role-switch (and a bootstrap port each), so `switch` can
    flip an idle one between prefill and decode."""
    decode_graph_memory_gb: float | None = 0.0
    """Sent with a switch to decode (SGLang's decode_cuda_graph_memory_gb: the free device memory
    required before it captures decode CUDA graphs; SGLang refuses a flip to decode of an instance
    without captured graphs unless it is given). 0 checks nothing, which is right on CPU (no
    graphs); on GPUs give a measured footprint. None: not sent."""
    switch_retry_s: float = 0.5
    """Wait between tries of a role switch that SGLang refused because the instance was not idle."""
    stamp_log: bool = False
    """With log_dir: prefix every line of an instance's log with the wall-clock time it was read
    (time.time(), ms), so a start-up can be broken down below SGLang's one-second log stamps."""
    started_at: dict[str, float] = field(default_factory=dict)
    """URL -> time.time() just before the process was spawned."""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    bootstrap_ports: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def command(self, role: Role, port: int, bootstrap_port: int | None) -> list[str]:
        cmd = [self.python, "-m", self.module, "--model-path", self.model_path,
               "--host", self.host, "--port", str(port), *self.common_args, *self.role_args.get(role, ())]
        if bootstrap_port is not None:
            cmd += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        if self.role_switch and role is not Role.PLAIN:
            cmd.append("--enable-pd-role-switch")
        return cmd

    def add(self, role: Role) -> str:
        port = free_port(self.host)
        boot = free_port(self.host) if role is Role.PREFILL or (self.role_switch and role is Role.DECODE) else None
        cmd = self.command(role, port, boot)
        url = f"http://{self.host}:{port}"
        out: Any = subprocess.DEVNULL
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"sglang-{role.value}-{port}.log"), "wb")  # noqa: SIM115
        spawned = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if self.stamp_log and self.log_dir else out,
                                stderr=subprocess.STDOUT, env={**os.environ, **self.env}, start_new_session=True)
        if self.stamp_log and self.log_dir:
            threading.Thread(target=_stamp_lines, args=(proc, out), daemon=True).start()
        elif out is not subprocess.DEVNULL:
            out.close()  # the child holds its own descriptor
        with self._lock:
            self.procs[url] = proc
            self.started_at[url] = spawned
            if boot is not None:
                self.bootstrap_ports[url] = boot
        log.info("started instance role=%s url=%s pid=%d cmd=%s", role.value, url, proc.pid,
                 shlex.join(cmd[:6]) + " ...")
        return url

    def remove(self, url: str, role: Role | None = None) -> None:
        with self._lock:
            proc = self.procs.pop(url, None)
            self.bootstrap_ports.pop(url, None)
            self.started_at.pop(url, None)
        if proc is None:
            return
        _stop_group(proc, self.stop_grace_s)
        log.info("stopped instance url=%s rc=%s", url, proc.returncode)

    def switch(self, url: str, old: Role, new: Role, timeout_s: float = 60.0) -> bool:
        """Flip an idle instance's PD role through SGLang's POST /pd_role_switch."""
        if not self.role_switch or old is Role.PLAIN or new is Role.PLAIN:
            return False
        body: dict[str, object] = {"new_role": new.value}
        if new is Role.DECODE and self.decode_graph_memory_gb is not None:
            body["decode_cuda_graph_memory_gb"] = self.decode_graph_memory_gb
        req = urllib.request.Request(url + "/pd_role_switch", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        deadline = time.monotonic() + timeout_s
        tries = 0
        while True:
            tries += 1
            try:
                with urllib.request.urlopen(req, timeout=max(deadline - time.monotonic(), 1.0)) as r:
                    ok = r.status == 200
                break
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")
                # The router's drain covers only the requests it sent: a health check or the tail of
                # a finished stream can still be in the scheduler, and SGLang then refuses the flip
                # (nothing torn down, safe to retry) until it is idle.
                if exc.code == 400 and "not idle" in detail and time.monotonic() + self.switch_retry_s < deadline:
                    time.sleep(self.switch_retry_s)
                    continue
                log.warning("role switch of %s refused after %d tries: %s %s", url, tries, exc.code, detail[:200])
                return False
            except OSError as exc:
                log.warning("role switch of %s failed: %s", url, exc)
                return False
        log.info("switched instance url=%s %s->%s ok=%s tries=%d", url, old.value, new.value, ok, tries)
        return ok

    def alive(self, url: str) -> bool:
        proc = self.procs.get(url)
        return proc is not None and proc.poll() is None

    def wait_ready(self, url: str, timeout_s: float = 120.0) -> None:
        """Block until GET /health answers 200 (raises TimeoutError, or RuntimeError if it died)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive(url):
                raise RuntimeError(f"instance {url} exited during start-up")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"instance {url} not healthy after {timeout_s}s")

    def stop_all(self) -> None:
        for url in list(self.procs):
            self.remove(url)


def _stamp_lines(proc: subprocess.Popen[bytes], out: Any) -> None:
    assert proc.stdout is not None
    with out:
        for line in proc.stdout:
            out.write(b"%.3f " % time.time() + line)
            out.flush()


def _stop_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
    else:
        # the leader is gone; make sure no child of the group survived it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
