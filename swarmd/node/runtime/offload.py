"""Where a peer's CPU work runs: a worker thread in a daemon, inline in the simulator.

A daemon hands encoding, reducing, hashing and proofs to worker threads so that its trio loop
keeps serving calls. Under trio's MockClock a task waiting for a thread counts as blocked, so
virtual time jumps past deadlines while the thread computes (trio issue #456): the simulator
(swarmd/node/sim) switches this module to inline, where the work runs on the loop and the
simulated compute is charged as virtual time by whoever models it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, TypeVarTuple

import trio

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

_inline = False


def run_inline(inline: bool) -> None:
    """Runs offloaded work on the calling task from now on (True: the simulator's process)
    or in worker threads (False: the default)."""
    global _inline
    _inline = inline


async def run_sync(
    fn: Callable[[*Ts], T], *args: *Ts, limiter: trio.CapacityLimiter | None = None
) -> T:
    """``fn(*args)`` in a worker thread, at most ``limiter``'s share at once (or inline, see
    `run_inline`, where the loop runs one at a time anyway)."""
    if _inline:
        await trio.lowlevel.checkpoint()
        return fn(*args)
    return await trio.to_thread.run_sync(fn, *args, limiter=limiter)
