"""DiLoCo's optimiser in one process, without the network: a tiny GPT and batches for it,
and averages done in memory (a peer alone, or k peers meeting in a `MeanGroup`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import torch
import trio

from swarmd.optim import DiLoCo, OuterStepReport
from swarmd.workloads import GPTConfig
from tests.harness.batches import random_batches

TINY_GPT = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
Batch = tuple[torch.Tensor, torch.Tensor]
#: What DiLoCo.outer_step is handed: (pseudo-gradient, weight) -> the group's mean, or None.
Average = Callable[[torch.Tensor, float], Awaitable[torch.Tensor | None]]


def tiny_batches(n: int, seed: int, batch: int = 4, block: int = 16) -> list[Batch]:
    """Seeded random batches that fit TINY_GPT."""
    return random_batches(n, seed, batch, block)


async def average_alone(pg: torch.Tensor, weight: float) -> torch.Tensor:
    """The average of a group of one: the peer's own pseudo-gradient."""
    return pg


def run_outer_step(opt: DiLoCo, average: Average) -> OuterStepReport:
    """One outer step of `opt`, averaged by `average`, in its own trio run."""

    async def go() -> OuterStepReport:
        return await opt.outer_step(average)

    return trio.run(go)


class MeanGroup:
    """K peers that meet in-process: each contributes (tensor, weight); all receive the
    weighted mean once everyone has contributed, like a lossless all-reduce."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.contributions: dict[int, tuple[torch.Tensor, float]] = {}
        self.done = trio.Event()
        self.mean: torch.Tensor | None = None

    def member(self, index: int) -> Average:
        async def average(pg: torch.Tensor, weight: float) -> torch.Tensor:
            self.contributions[index] = (pg.clone(), weight)
            if len(self.contributions) == self.k:
                total = sum(w for _, w in self.contributions.values())
                self.mean = sum(t * (w / total) for t, w in self.contributions.values())
                self.done.set()
            await self.done.wait()
            assert self.mean is not None
            return self.mean.clone()

        return average


def outer_step_together(peers: Sequence[DiLoCo]) -> tuple[MeanGroup, list[OuterStepReport]]:
    """One outer step of every peer at once, averaged in one MeanGroup; the group (its mean)
    and each peer's report."""
    group = MeanGroup(len(peers))
    reports: list[OuterStepReport | None] = [None] * len(peers)

    async def run_one(i: int) -> None:
        reports[i] = await peers[i].outer_step(group.member(i))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(len(peers)):
                nursery.start_soon(run_one, i)

    trio.run(main)
    assert all(r is not None for r in reports)
    return group, [r for r in reports if r is not None]
