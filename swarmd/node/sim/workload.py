"""A synthetic DiLoCo workload with a known optimum, cheap enough for 1,000 simulated peers.

Peer i minimises f_i(θ) = ½ Σ_j q_j (θ_j − c_ij)²: a curvature q the run shares (its data's
distribution) and an optimum c_i of its own (its non-IID shard), drawn around θ* = 0 with a
spread of ``heterogeneity``. H steps of gradient descent at rate η on f_i have a closed form,
θ_H = c_i + (1 − ηq)^H ⊙ (θ_0 − c_i), so a peer's inner phase costs O(P), not O(H·P·batch),
and its pseudo-gradient is (1 − (1 − ηq)^H) ⊙ (θ_0 − c_i).

The run's objective is the population's mean, F(θ) = E_i f_i(θ) = ½ Σ q (θ − θ*)² + ½ σ² Σ q:
a state's loss is F at it, the same for every set of peers, so a forked line's drift towards
its own members' optima shows as loss, as a real model's validation loss would.

Why a quadratic and not the tiny GPT: the question at 1,000 peers is whether every peer's
contribution reaches every peer and what waiting costs; a workload whose optimum is known
answers it exactly, in microseconds a peer-round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from swarmd.optim.outer import FlatOuter


@dataclass(frozen=True)
class QuadraticConfig:
    """The synthetic problem and DiLoCo's optimisers on it (outer: DiLoCoConfig's defaults)."""

    inner_lr: float = 0.05
    #: Curvatures are log-uniform in [curvature_min, curvature_max] (an ill-conditioned
    #: problem: some coordinates converge within a round, some over many).
    curvature_min: float = 0.01
    curvature_max: float = 1.0
    #: Standard deviation of a peer's optimum around the run's (how non-IID the shards are).
    heterogeneity: float = 1.0
    #: Every coordinate of the first state.
    start: float = 3.0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.curvature_min <= self.curvature_max:
            raise ValueError("need 0 < curvature_min <= curvature_max")
        if not 0 < self.inner_lr * self.curvature_max < 2:
            raise ValueError("inner_lr x curvature_max must be in (0, 2): inner GD diverges")
        if not (self.heterogeneity >= 0 and math.isfinite(self.start)):
            raise ValueError("heterogeneity must be >= 0 and start finite")
        if not (self.outer_lr > 0 and 0 <= self.outer_momentum < 1):
            raise ValueError("outer_lr > 0 and 0 <= outer_momentum < 1 are required")


class Quadratic:
    """One run's problem: its curvature, each peer's optimum (drawn from the seed on demand,
    so 1,000 peers hold no more than their states), and the closed-form inner phase."""

    def __init__(self, dims: int, inner_steps: int, config: QuadraticConfig, seed: int) -> None:
        self.config, self.dims, self.seed = config, dims, seed
        gen = torch.Generator().manual_seed(seed * 7919 + 1)
        span = math.log(config.curvature_max / config.curvature_min)
        log_q = math.log(config.curvature_min) + span * torch.rand(dims, generator=gen)
        self.q = log_q.exp().to(torch.float64)
        self.inner_steps = inner_steps
        #: What h inner steps leave of a state's distance to the peer's optimum, by h (a
        #: time-bounded round runs fewer than H on a slow peer).
        self._kept: dict[int, torch.Tensor] = {}
        self._floor = 0.5 * config.heterogeneity**2 * float(self.q.sum())

    def optimum(self, peer: int) -> torch.Tensor:
        """Peer ``peer``'s c_i (float64), the same every time it is asked."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + peer + 17)
        z = torch.randn(self.dims, generator=gen, dtype=torch.float64)
        return z * self.config.heterogeneity

    def start(self) -> torch.Tensor:
        return torch.full((self.dims,), self.config.start, dtype=torch.float32)

    def gain(self, steps: int | None = None) -> torch.Tensor:
        """1 − (1 − ηq)^h: the share of a state's distance to a peer's optimum that h inner
        steps (H if None) cover, per coordinate (float64)."""
        h = self.inner_steps if steps is None else steps
        if h not in self._kept:
            self._kept[h] = (1 - self.config.inner_lr * self.q) ** h
        return 1 - self._kept[h]

    def pseudo_gradient(
        self, state: torch.Tensor, optimum: torch.Tensor, steps: int | None = None
    ) -> torch.Tensor:
        """θ_0 − θ_h after h inner steps (H if None) from ``state`` (float32, as DiLoCo sends
        it)."""
        delta = self.gain(steps) * (state.to(torch.float64) - optimum)
        return delta.to(torch.float32)

    def loss(self, state: torch.Tensor) -> float:
        """F(θ): the population's mean loss at ``state`` (θ* = 0)."""
        return 0.5 * float((self.q * state.to(torch.float64) ** 2).sum()) + self._floor

    def outer(self, state: torch.Tensor | None = None) -> FlatOuter:
        """A peer's outer optimiser over a copy of ``state`` (the start if None)."""
        c = self.config
        values = (self.start() if state is None else state).clone()
        return FlatOuter(values, c.outer_lr, c.outer_momentum, c.nesterov)
