"""Faults a simulated DiLoCo run schedules from its seed (sim/rounds.py applies them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from swarmd.node.chaos.byzantine import LIES

FaultKind = Literal["kill", "partition", "slow", "liar"]


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: when the run enters ``at_round``, ``share`` of the live peers
    (drawn from the seed) are killed for good, cut off from the rest, slowed ``factor``
    times, or lie (chaos/byzantine.py's lies: a declared weight of 1e9, an update x100 or
    sign-flipped) for ``rounds`` rounds."""

    at_round: int
    kind: FaultKind
    share: float
    rounds: int = 1
    factor: float = 4.0
    lie: str = "weight"

    def __post_init__(self) -> None:
        if self.kind not in ("kill", "partition", "slow", "liar"):
            raise ValueError(f"fault kind {self.kind!r}: kill, partition, slow or liar")
        if self.at_round < 1 or self.rounds < 1:
            raise ValueError("a fault's at_round and rounds must be at least 1")
        if not 0 < self.share < 1:
            raise ValueError("a fault's share of the live peers is between 0 and 1")
        if not self.factor >= 1:
            raise ValueError("a slow fault's factor must be at least 1")
        if self.lie not in LIES:
            raise ValueError(f"lie {self.lie!r}: one of {', '.join(LIES)}")


__all__ = ["Fault", "FaultKind"]
