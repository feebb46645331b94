"""Layer: service (no SGLang import). Liveness probes: is each instance's HTTP process answering?

The health checks (`control_loops`) ask SGLang's /health, which a busy server may answer late,
so they are patient: a stopped process (SIGSTOP, a hung host) took them over 13 s to see. This
loop asks every routable instance for /model_info, which SGLang's HTTP process answers without
the scheduler (a plain GET over pooled keep-alive connections), every `liveness_interval_s`;
`liveness_failures` probes in a row unanswered within `liveness_timeout_s` (or refused) mark the
instance down at once, unless one of its streams
delivered a piece meanwhile, and the watchdog then fails over the requests on it that have no
token yet. Taking an instance back stays with the health checks.
The first answer of each instance also teaches the router the model's limits (`fetch_limits`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from kllm_plugins.plugins.bigpd_router.core.registry import Instance
from kllm_plugins.plugins.bigpd_router.service.proxy import UPSTREAM_ERRORS
from kllm_plugins.plugins.bigpd_router.service.ticks import tick

if TYPE_CHECKING:
    from kllm_plugins.plugins.bigpd_router.service.router import Router

log = logging.getLogger("kllm.bigpd_router.liveness")


class Liveness:
    def __init__(self, router: Router) -> None:
        self.r = router
        self.misses: dict[str, int] = {}

    async def _probe(self, inst: Instance) -> None:
        try:
            status, _ = await self.r.proxy.get(inst.url, "/model_info", self.r.cfg.liveness_timeout_s)
            ok = status < 500
        except UPSTREAM_ERRORS:  # TimeoutError included (an OSError)
            ok = False
        if ok:
            self.misses.pop(inst.url, None)
            if inst.url not in self.r.limits_from:
                await self.r.learn_limits(inst.url)
            return
        n = self.misses[inst.url] = self.misses.get(inst.url, 0) + 1
        if n >= self.r.cfg.liveness_failures and inst.routable and not self.heard_from(inst):
            self.r.registry.mark_down(inst.url, f"{n} liveness probes unanswered within "
                                                f"{self.r.cfg.liveness_timeout_s:g} s")

    def heard_from(self, inst: Instance) -> bool:
        """A stream from `inst` delivered a piece within the last liveness_timeout_s: it is alive, only
        slow to answer probes (a busy HTTP process, or this router's own loop running late)."""
        since = time.monotonic() - self.r.cfg.liveness_timeout_s
        return any(w.inst is inst and w.ticket is not None and (w.ticket.t_last or 0.0) >= since
                   for w in self.r.proxy.watchdog.active)

    async def run(self) -> None:
        cfg = self.r.cfg
        while True:
            insts = [i for i in self.r.registry if i.routable]
            await asyncio.gather(*(self._probe(i) for i in insts), return_exceptions=True)
            await tick(cfg.liveness_interval_s)
