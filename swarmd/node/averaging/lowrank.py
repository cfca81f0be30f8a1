"""PowerSGD through the butterfly: a low-rank average of a pseudo-gradient in two all-reduces.

PowerSGD (Vogels et al. 2019) approximates the group's mean M̄ of each 2-D tensor by one
warm-started power-iteration step: every member computes P_i = M_i Q (n × r) and the group
averages them (pass 1); every member orthonormalises the same averaged P into P̂ and computes
Q_i = M_iᵀ P̂ (m × r), which the group averages (pass 2); the result is P̂ Q̄ᵀ. Both passes are
weighted means of flat vectors, so each is one ordinary fault-tolerant all-reduce (a sub-group
per pass: its own round id and parts). Tensors that would not shrink (1-D ones, small ones)
travel whole in pass 2, averaged exactly.

Why the survivors agree even when members die: pass 1's reduced P is the same on every member
that completed it, so P̂ is too; pass 2 then averages Q over whoever took part, and P̂ Q̄ᵀ =
P̂ P̂ᵀ M̄ is the same projection of the same mean on every survivor. (A member whose warm Q
differs from the others', a joiner's seeded one, only makes the projection a worse one, not
a different one per member.) If either pass leaves a part un-averaged, members hold different
vectors: the whole result is then this member's own input, flagged as failed, which DiLoCo
applies as a round of one (as it does for int8's failed parts), and PowerSGD's Q and error
feedback are reset, since what they assumed was sent was not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import trio

from swarmd.compression.lowrank import PowerSGD, PowerSGDRound, matrix_shape
from swarmd.node.averaging.allreduce import Averager
from swarmd.node.averaging.config import AllReduceResult
from swarmd.node.averaging.group import Group, sub_group
from swarmd.node.runtime import offload
from swarmd.optim.flat import views
from swarmd.protocol.identity import PeerId


def _begin(
    psgd: PowerSGD, names: Sequence[str], shapes: Sequence[torch.Size], flat: torch.Tensor
) -> tuple[list[PowerSGDRound], torch.Tensor]:
    rounds = [psgd.begin(n, v) for n, v in zip(names, views(flat, shapes), strict=True)]
    ps = [r.p.reshape(-1) for r in rounds if r.p is not None]
    return rounds, torch.cat(ps) if ps else torch.zeros(0)


def _second(rounds: list[PowerSGDRound], p_mean: torch.Tensor) -> torch.Tensor:
    parts, offset = [], 0
    for r in rounds:
        if r.p is None:
            continue
        size = r.p.numel()
        parts.append(r.compute_q(p_mean[offset : offset + size].view_as(r.p)).reshape(-1))
        offset += size
    parts += [r.dense.reshape(-1).float() for r in rounds if r.dense is not None]
    return torch.cat(parts)


def _finish(rounds: list[PowerSGDRound], q_mean: torch.Tensor) -> torch.Tensor:
    """Pass 2's vector holds every compressed tensor's Q, then every dense tensor, each in
    round order (`_second`); the mean comes back in the tensors' own order."""
    pieces: list[torch.Tensor | None] = [None] * len(rounds)
    offset = 0
    for compressed in (True, False):
        for i, r in enumerate(rounds):
            if r.passthrough == compressed:
                continue
            shape = (matrix_shape(r.shape)[1], r.rank) if compressed else r.shape
            size = math.prod(shape)
            pieces[i] = r.finish(q_mean[offset : offset + size].view(shape)).reshape(-1)
            offset += size
    return torch.cat([p.float() for p in pieces if p is not None])


def _failed(
    local: torch.Tensor, group: Group, dropped: set[PeerId], start: float
) -> AllReduceResult:
    return AllReduceResult(
        tensor=local.clone(),
        dropped=dropped,
        failed_parts=list(range(len(group.members))),
        recovered_parts=[],
        duration_s=trio.current_time() - start,
    )


async def allreduce_lowrank(
    averager: Averager,
    group: Group,
    flat: torch.Tensor,
    weight: float,
    psgd: PowerSGD,
    names: Sequence[str],
    shapes: Sequence[torch.Size],
) -> AllReduceResult:
    """The group's low-rank weighted mean of `flat` (laid out as `names`/`shapes`, the run's
    model: the same on every member). Never raises for peer failures."""
    start = trio.current_time()
    rounds, p = await offload.run_sync(_begin, psgd, names, shapes, flat)
    dropped: set[PeerId] = set()
    recovered: set[int] = set()
    p_mean = p
    if p.numel():
        first = await averager.allreduce(
            sub_group(group, "lowrank/P"), p, weight, key="lowrank/P", codec="fp32"
        )
        dropped |= first.dropped
        recovered |= set(first.recovered_parts)
        if not first.ok:
            psgd.reset()
            return _failed(flat, group, dropped, start)
        p_mean = first.tensor
    q = await offload.run_sync(_second, rounds, p_mean)
    second = await averager.allreduce(
        sub_group(group, "lowrank/Q"), q, weight, key="lowrank/Q", codec="fp32"
    )
    dropped |= second.dropped
    if not second.ok:
        psgd.reset()
        return _failed(flat, group, dropped, start)
    mean = await offload.run_sync(_finish, rounds, second.tensor)
    return AllReduceResult(
        tensor=mean,
        dropped=dropped,
        failed_parts=[],
        recovered_parts=sorted(recovered | set(second.recovered_parts)),
        duration_s=trio.current_time() - start,
    )
