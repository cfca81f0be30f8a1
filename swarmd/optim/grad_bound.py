"""How much one micro-batch may move a pipeline stage: its gradient against the stage's recent ones.

A SWARM stage adds the parameter gradient of every micro-batch a trainer sends it into the
round's sum, and only the averaged sum is clipped. One trainer that sent its backward calls
x(-1000) (finite, within the wire's range) therefore chose the stage's direction: the honest
stages' validation loss rose 1.6-1.9x (issue 47 item 2). The stage cannot recompute what
the trainer's upstream gradient should have been, but it can see a micro-batch whose
gradient is far larger than the micro-batches before it.

`NormBound` keeps the norms of the stage's last WINDOW micro-batches (refused ones too, so
that an honest change of scale is followed once it holds for half the window) and, once it
has WARMUP of them, scales a micro-batch beyond CLIP x their median down to CLIP x
(per-example clipping, as DP-SGD does, at a bound that follows the run) and refuses one
beyond REFUSE x: the stage leaves it out of its sum and logs its caller, without banning it
(a trainer relays the gradient a later stage's server answered, so it may not be the liar).
Honest micro-batches of the tiny built-in model reach 12x the median (measured: a bound of
10x refused one of 800 in a clean run).
A liar holding less than half of a stage's micro-batches cannot move the median out of the
honest range. What it can still do: send a sign-flipped gradient at an honest norm,
worth up to CLIP honest micro-batches each (README, Security).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

WINDOW = 64
WARMUP = 8
REFUSE = 100.0
CLIP = 3.0


class GradientRefused(ValueError):
    """A micro-batch's gradient is REFUSE times beyond the stage's recent median or more."""


@dataclass
class NormBound:
    window: int = WINDOW
    warmup: int = WARMUP
    refuse: float = REFUSE
    clip: float = CLIP

    def __post_init__(self) -> None:
        if not (1 <= self.warmup <= self.window and 1 <= self.clip <= self.refuse):
            raise ValueError("NormBound needs 1 <= warmup <= window and 1 <= clip <= refuse")
        self._norms: deque[float] = deque(maxlen=self.window)

    def factor(self, norm: float) -> float:
        """What to scale a micro-batch's gradient of ``norm`` by: 1, or less when it is
        clipped; raises GradientRefused beyond the refusal bound."""
        if not math.isfinite(norm):
            raise GradientRefused("the gradient is not finite")
        median = statistics.median(self._norms) if len(self._norms) >= self.warmup else 0.0
        self._norms.append(norm)
        if median <= 0.0 or norm <= self.clip * median:
            return 1.0
        if norm > self.refuse * median:
            raise GradientRefused(
                f"a gradient of norm {norm:.3g}, {norm / median:.0f}x the median of the stage's "
                f"last {len(self._norms) - 1} micro-batches (at most {self.refuse:g}x)"
            )
        return self.clip * median / norm
