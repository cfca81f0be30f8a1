"""How far apart a simulated run's states are, round by round, against the ideal run (one
group of everybody from the same start), kept online so that 1,000 states cost two vectors
a round."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from swarmd.node.sim.workload import Quadratic


@dataclass(frozen=True)
class RoundLine:
    """The live peers' states after one round: how far apart, and the loss of one group of
    everybody that took part (the exact mean of all contributions, from the same start)."""

    round: int
    peers: int
    #: RMS distance of the states from their mean, relative to the mean's norm (0: one line).
    spread: float
    ideal_loss: float


class Lines:
    """Per round, online: the sum and squared norms of the honest peers' states after it
    (their spread without keeping N states), and the sum of the contributors' optima (the
    ideal run's pseudo-gradient: one group of everybody is the mean over its members)."""

    def __init__(self, rounds: int, dims: int) -> None:
        self.states = [torch.zeros(dims, dtype=torch.float64) for _ in range(rounds)]
        self.optima = [torch.zeros(dims, dtype=torch.float64) for _ in range(rounds)]
        self.squares = [0.0] * rounds
        self.count = [0] * rounds

    def add(self, r: int, state: torch.Tensor, optimum: torch.Tensor) -> None:
        s = state.to(torch.float64)
        self.states[r] += s
        self.optima[r] += optimum
        self.squares[r] += float(s.dot(s))
        self.count[r] += 1

    def finish(self, work: Quadratic) -> tuple[RoundLine, ...]:
        """Each round's spread, and the ideal run replayed from the start."""
        ideal = work.outer()
        lines = []
        for r, n in enumerate(self.count):
            if not n:
                break
            mean = self.states[r] / n
            norm2 = float(mean.dot(mean))
            spread = math.sqrt(max(0.0, self.squares[r] / n - norm2) / max(norm2, 1e-300))
            ideal.step(work.pseudo_gradient(ideal.values, self.optima[r] / n))
            lines.append(RoundLine(r, n, spread, work.loss(ideal.values)))
        return tuple(lines)


__all__ = ["Lines", "RoundLine"]
