"""How a simulated run is run: seeded, in virtual time, with CPU work on the loop.

One seed must replay a run: what the code under simulation draws from besides the scenario's
own sources is seeded here, and trio is told to order its tasks deterministically."""

from __future__ import annotations

import gc
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar, TypeVarTuple

import torch
import trio
import trio.testing

from swarmd.node.runtime import offload

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


def seed_process(seed: int) -> None:
    """Seeds the `random` module (what code under simulation draws from without an injected
    RNG) and trio's scheduler.

    trio wakes tasks whose deadlines tie in the order of their cancel scopes' id() (memory
    addresses), then shuffles each batch with a private RNG; the flag below is the one
    Hypothesis and pytest-trio set to make it sort each batch by task creation order before
    a seeded shuffle. Without it two runs of one seed differed in the calls they made."""
    random.seed(seed)
    setattr(trio._core._run, "_ALLOW_DETERMINISTIC_SCHEDULING", True)  # noqa: B010 (Final)
    trio._core._run._r.seed(seed)


def run_virtual(main: Callable[[*Ts], Awaitable[T]], *args: *Ts, seed: int) -> T:
    """``main(*args)`` in its own trio run under MockClock (autojump: time leaps to the next
    deadline whenever every task waits), seeded, with offloaded CPU work run inline
    (runtime/offload.py: a thread's work would let the clock jump past deadlines), and torch
    on one thread: the simulation's small tensors gained nothing from a second thread but
    its spinning against other work (a 48-peer grid run beside another process: 56 s of
    wall time on two threads, 36 s on one; the same report)."""
    saved = random.getstate(), trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING
    threads = torch.get_num_threads()
    seed_process(seed)
    offload.run_inline(True)
    torch.set_num_threads(1)
    try:
        return trio.run(main, *args, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        torch.set_num_threads(threads)
        offload.run_inline(False)
        _restore(*saved)


def _restore(random_state: object, deterministic: bool) -> None:
    """Leaves the process as the run found it: the `random` module's state and trio's
    scheduling as before, and the run's garbage collected now. A simulated swarm leaves
    millions of cyclic objects; collected later, they stalled whatever real-socket trio run
    came next in the same process for long enough to miss its deadlines (seen: a matchmaking
    test after the simulator's tests failed 3 runs of 7; with this collection, none of 6)."""
    random.setstate(random_state)  # type: ignore[arg-type]
    setattr(trio._core._run, "_ALLOW_DETERMINISTIC_SCHEDULING", deterministic)  # noqa: B010
    trio._core._run._r.seed()
    gc.collect()
