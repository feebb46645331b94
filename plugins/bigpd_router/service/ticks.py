"""Layer: service (no SGLang import). Periodic sleeps on a shared grid of the loop's clock.

The router's background loops (watchdog, liveness probes, health checks, load polls, drains) each
wake up periodically. Waking a sleeping process is what costs the CPU, more than the little work
done then (about 0.2 ms a wake-up on a quiet VM, against tens of microseconds of Python), so each
loop sleeps until the next multiple of its period on the event loop's clock rather than for a
period from wherever it is: the periods are multiples of each other (0.1, 0.2, 0.5, 1, 2 s), their
timers fall due together and one wake-up serves all of them. The mean period is unchanged.
"""
from __future__ import annotations

import asyncio


def until_tick(period: float, now: float) -> float:
    """Seconds from `now` to the next multiple of `period`, at least half a period (a loop whose
    round ran up to a grid point does not run again at once)."""
    delay = period - now % period
    return delay + period if delay < period / 2 else delay


async def tick(period: float) -> None:
    """Sleep until the next multiple of `period` on the running loop's clock (see `until_tick`)."""
    if period <= 0:
        return await asyncio.sleep(0)
    await asyncio.sleep(until_tick(period, asyncio.get_running_loop().time()))
