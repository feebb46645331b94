"""Layer: actuator (no SGLang import; it talks HTTP to SGLang servers). A warm standby pool.

`StandbyActuator` wraps a process actuator (`LocalProcessActuator`) and keeps, per pool, a few
instances started and warmed up but not registered with the router (`core/standby_pool.py`
holds the book-keeping and the choices). On a scale-up (`add`) it promotes a ready standby: the
URL goes back to the controller, which registers it; the router's control loop checks it at once, so it takes traffic well under a second after the decision. A warming
standby that will be ready sooner than a cold start is handed over instead; with neither, `add`
logs why and starts a process cold. On a scale-down (`remove`, after the drain) the instance goes
back to the pool if the pool is short and the memory budget allows, else it is stopped. A filler
thread keeps the pool at its size. Optionally (`release_memory`) a ready standby releases its
memory through SGLang's `/release_memory_occupation` and resumes it when promoted; on the CPU
platform SGLang's memory saver does nothing (torch_memory_saver hooks CUDA allocations), so
this is off by default and measured in `bench_time_to_serve.py`.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from kllm_plugins.plugins.bigpd_router.actuators.local_process import LocalProcessActuator
from kllm_plugins.plugins.bigpd_router.core.registry import Role
from kllm_plugins.plugins.bigpd_router.core.standby_pool import Choice, StandbyEmpty, StandbyPool, State

log = logging.getLogger("kllm.bigpd_router.standby_actuator")


def process_group_memory_bytes(pgid: int) -> int:
    """Proportional set size (PSS; shared pages split between sharers) of every process in group
    `pgid`, from /proc; resident set size where smaps_rollup cannot be read. 0 if none is found."""
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.getpgid(int(name)) != pgid:
                continue
            with open(f"/proc/{name}/smaps_rollup", encoding="ascii") as fh:
                for line in fh:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError):
            try:
                with open(f"/proc/{name}/statm", encoding="ascii") as fh:
                    total += int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError, IndexError):
                continue
    return total


def http_json(url: str, body: dict[str, Any] | None = None, timeout_s: float = 5.0) -> tuple[int, Any]:
    """GET (no body) or POST JSON; (status, parsed body or text). Raises OSError on no answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw or b"null")
    except ValueError:
        return status, raw.decode(errors="replace")


@dataclass
class StandbyActuator:
    base: LocalProcessActuator
    pool: StandbyPool
    warm_request: bool = True
    """Send one 1-token /generate to a standby after its first good health check, before it is
    called ready (SGLang warms itself up too; this also runs the path a routed request takes)."""
    release_memory: bool = False
    """Release a ready standby's memory (SGLang /release_memory_occupation) and resume it when
    promoted. Only saves memory where SGLang's memory saver works (CUDA with torch_memory_saver)."""
    ready_timeout_s: float = 600.0
    """A standby not ready after this long is stopped."""
    poll_s: float = 0.25
    choices: dict[str, Choice] = field(default_factory=dict)
    """URL -> how it was added (the last few)."""
    _warm_refused: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _wake: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "StandbyActuator":
        """Start the filler thread (idempotent)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._fill_loop, name="kllm-standby-fill", daemon=True)
            self._thread.start()
        return self

    def stop_all(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for m in list(self.pool.members.values()):
            self.pool.drop(m.url)
        self.base.stop_all()

    def wait_filled(self, timeout_s: float = 600.0) -> bool:
        """Block until every pool has its size of ready standbys (True) or timeout (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(len(self.pool.of(r, State.READY)) >= n for r, n in self.pool.policy.size.items()):
                return True
            time.sleep(0.2)
        return False

    # ------------------------------------------------------------------ Actuator
    def add(self, role: Role) -> str:
        """One instance for `role`: a promoted standby, a warming one, or a cold start (see module doc)."""
        try:
            return self.promote(role)
        except StandbyEmpty as exc:
            self.pool.cold_fallbacks += 1
            log.warning("standby pool: %s; starting a %s instance cold", exc, role.value)
            url = self.base.add(role)
            self.choices[url] = Choice("cold", None, self.pool.times.cold_s(role), str(exc))
            return url
        finally:
            self._wake.set()  # refill

    def promote(self, role: Role) -> str:
        """Hand out the standby the measured times favour; StandbyEmpty says why there is none."""
        while True:
            choice = self.pool.choose(role)
            if choice.kind == "cold" or choice.url is None:
                raise StandbyEmpty(choice.reason)
            t0 = time.monotonic()
            m = self.pool.take(choice.url)
            if choice.kind == "promote" and not self._live(m.url):
                log.warning("standby %s is not running (or did not resume); stopping it", m.url)
                self.base.remove(m.url)
                continue
            if choice.kind == "promote":
                self.pool.times.observe_promote(role, time.monotonic() - t0)
            self.choices[m.url] = choice
            while len(self.choices) > 64:
                self.choices.pop(next(iter(self.choices)))
            log.info("scale-up by standby url=%s role=%s how=%s (%s)", m.url, role.value, choice.kind, choice.reason)
            return m.url

    def remove(self, url: str, role: Role | None = None) -> None:
        """A drained instance: back into the pool when it is short (and memory allows), else stopped."""
        if role is not None and self.base.alive(url):
            proc = self.base.procs.get(url)
            mem = process_group_memory_bytes(proc.pid) if proc is not None else 0
            if self.pool.accept_return(url, role, mem):
                try:  # a returned instance starts clean: its prefix cache belonged to the old traffic
                    http_json(url + "/flush_cache", {}, timeout_s=10)
                except OSError:
                    pass
                if self.release_memory:
                    self._release(url)
                return
        self.pool.drop(url)
        self.base.remove(url, role)

    def standby_seconds(self, now: float | None = None) -> float:
        return self.pool.standby_seconds(now)

    def snapshot(self) -> dict[str, Any]:
        return self.pool.snapshot()

    # ------------------------------------------------------------------ internals
    def _live(self, url: str) -> bool:
        """Can the standby be handed out? Its process must be running (and its memory resumed).
        No health check here: SGLang's /health generates a token on an idle server, which costs up
        to seconds on a loaded CPU, and the router checks the instance right after the scale step
        anyway (a late answer leaves it STARTING until a health round passes, not stopped)."""
        if self.release_memory:
            try:
                status, _ = http_json(url + "/resume_memory_occupation", {}, timeout_s=60)
            except OSError:
                return False
            if status != 200:
                return False
        return self.base.alive(url)

    def _release(self, url: str) -> None:
        try:
            status, body = http_json(url + "/release_memory_occupation", {}, timeout_s=60)
        except OSError as exc:
            log.warning("release_memory_occupation of %s failed: %s", url, exc)
            return
        if status != 200:
            log.warning("release_memory_occupation of %s answered %s: %s", url, status, str(body)[:200])

    def _check_warming(self, url: str, started_at: float) -> None:
        if not self.base.alive(url):
            log.warning("standby %s exited during start-up", url)
            self.pool.drop(url)
            self.base.remove(url)
            return
        if time.monotonic() - started_at > self.ready_timeout_s:
            log.warning("standby %s not ready after %.0fs; stopping it", url, self.ready_timeout_s)
            self.pool.drop(url)
            self.base.remove(url)
            return
        try:
            status, _ = http_json(url + "/health", timeout_s=2)
            if status != 200:
                return
            if self.warm_request and not self._warm_up(url):
                return
        except OSError:
            return
        proc = self.base.procs.get(url)
        if url not in self.pool.members:
            return  # handed out (a "wait" promotion) meanwhile
        mem = process_group_memory_bytes(proc.pid) if proc is not None else 0
        if not self.pool.mark_ready(url, mem):
            self.base.remove(url)
        elif self.release_memory:
            self._release(url)

    def _warm_up(self, url: str) -> bool:
        """One 1-token /generate: text, or token ids where the server refuses text (started with
        --skip-tokenizer-init, as SGLang answers it: 400). A refusal is logged once per standby
        (a standby that never warms up would otherwise wait silently for its ready timeout)."""
        sampling = {"max_new_tokens": 1, "temperature": 0}
        status, body = http_json(url + "/generate", {"text": "warm up", "sampling_params": sampling}, timeout_s=120)
        if status == 400:
            status, body = http_json(url + "/generate", {"input_ids": [0], "sampling_params": sampling}, timeout_s=120)
        if status == 200:
            return True
        if url not in self._warm_refused:
            self._warm_refused.add(url)
            log.warning("standby %s refused its warm-up request (%s): %s", url, status, str(body)[:200])
        return False

    def fill_once(self) -> None:
        """One pass of the filler: start what the pool wants, check the warming members."""
        for role in list(self.pool.policy.size):
            for _ in range(self.pool.want(role)):
                url = self.base.add(role)
                self.pool.add_warming(url, role)
        for m in list(self.pool.members.values()):
            if m.state is State.WARMING and not self._stop.is_set():
                self._check_warming(m.url, m.started_at)

    def _fill_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.fill_once()
            except Exception:  # noqa: BLE001 - the filler must survive a failed start
                log.exception("standby fill step failed")
            self._wake.wait(self.poll_s)
            self._wake.clear()
