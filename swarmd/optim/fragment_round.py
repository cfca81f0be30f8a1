"""A fragment's round as streaming DiLoCo's caller sees it: what to average, what happened.

The optimiser hands out a `FragmentRound` when a round begins and takes it back (with the
group's average) at the outer step; the caller, which runs the network, never needs the
optimiser's internals, and a `FragmentReport` is what it logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from swarmd.optim.outer import OuterSnapshot

FragmentStatus = Literal["averaged", "partial", "local", "deferred", "eager"]


@dataclass
class StandIn:
    """An eager stand-in's undo record: the fragment's outer state before it, the global copy
    it produced, and the samples it consumed (given back if the real round is deferred)."""

    before: OuterSnapshot
    after: torch.Tensor
    samples: int


@dataclass
class FragmentRound:
    """A fragment's round from `begin_round` until its average is applied.

    The caller averages `pseudo_grad` (weight `weight`) with the peers of the same `turn` and
    `fragment`, then passes the answer to `finish_round`.
    """

    fragment: int
    #: The schedule position (turns completed) when the round began: identical on every peer
    #: of the group, so it (with the fragment) names the round.
    turn: int
    #: The fragment's round counter when the round began.
    round: int
    pseudo_grad: torch.Tensor
    weight: float
    #: The optimiser's inner step counter when the round began.
    began_at_step: int
    _stand_in: StandIn | None = None

    @property
    def stand_in_applied(self) -> bool:
        return self._stand_in is not None


@dataclass(frozen=True)
class FragmentReport:
    """What one outer step of one fragment did (or what replacing its stand-in did)."""

    fragment: int
    #: The fragment's round counter and the schedule's turn after the step.
    round: int
    turn: int
    status: FragmentStatus
    weight: float
    pseudo_grad_norm: float
    applied_norm: float
    #: Inner steps this peer took since the round began (τ unless it waited longer: eager).
    steps_since_begin: int
    #: True when this replaces an eager stand-in.
    replaced_stand_in: bool = False
    reason: str | None = None
