"""Shared helpers of the bigpd_router unit tests (no SGLang): a healthy registry instance, a
settable clock, and an aiohttp app served on a free loopback port."""
from __future__ import annotations

import contextlib
from typing import AsyncIterator

from aiohttp import web

from kllm_plugins.plugins.bigpd_router.core.registry import Health, Instance, Role


def healthy(url: str, role: Role = Role.PLAIN, **kw: object) -> Instance:
    inst = Instance(url=url, role=role, **kw)  # type: ignore[arg-type]
    inst.health = Health.HEALTHY
    return inst


class Clock:
    """A clock the test moves by hand (`clock.t += 5`)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, shutdown_timeout=2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
