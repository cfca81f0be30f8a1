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
    (their spread without keeping N states), and what the ideal run's pseudo-gradient needs.

    The ideal run is one group of everybody that took part, each with the inner steps it
    ran: its pseudo-gradient is the weighted mean of g_i ⊙ (θ − c_i), with g_i the gain of
    peer i's steps (Quadratic.gain), so Σ w g_i and Σ w g_i ⊙ c_i are kept. With every peer
    at H steps this is g ⊙ (θ − mean c), the plain mean."""

    def __init__(self, rounds: int, dims: int) -> None:
        self.states = [torch.zeros(dims, dtype=torch.float64) for _ in range(rounds)]
        self.gains = [torch.zeros(dims, dtype=torch.float64) for _ in range(rounds)]
        self.pulls = [torch.zeros(dims, dtype=torch.float64) for _ in range(rounds)]
        self.weights = [0.0] * rounds
        self.squares = [0.0] * rounds
        self.count = [0] * rounds

    def add(
        self, r: int, state: torch.Tensor, optimum: torch.Tensor, gain: torch.Tensor,
        weight: float = 1.0,
    ) -> None:  # fmt: skip
        """Peer's state after round r, and what it contributed: its optimum, the gain of its
        inner steps and its weight."""
        s = state.to(torch.float64)
        self.states[r] += s
        self.gains[r] += weight * gain
        self.pulls[r] += weight * gain * optimum
        self.weights[r] += weight
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
            theta = ideal.values.to(torch.float64)
            delta = (self.gains[r] * theta - self.pulls[r]) / self.weights[r]
            ideal.step(delta.to(torch.float32))
            lines.append(RoundLine(r, n, spread, work.loss(ideal.values)))
        return tuple(lines)


__all__ = ["Lines", "RoundLine"]
