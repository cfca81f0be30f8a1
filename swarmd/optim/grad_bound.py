"""How much one micro-batch may move a pipeline stage: its gradient against the stage's recent ones.

A SWARM stage adds the parameter gradient of every micro-batch a trainer sends it into the
round's sum, and only the averaged sum is clipped. One trainer that sent its backward calls
x(-1000) (finite, within the wire's range) therefore chose the stage's direction: the honest
stages' validation loss rose 1.6-1.9x (issue 47 item 2). The stage cannot recompute what
the trainer's upstream gradient should have been, but it can see a micro-batch whose
gradient is far larger than the micro-batches before it.

`NormBound` scales a micro-batch beyond CLIP x the reference down to CLIP x (per-example
clipping, as DP-SGD does, at a bound that follows the run) and, once it has WARMUP norms,
refuses one beyond REFUSE x: the stage leaves it out of its sum and logs its caller, without
banning it (a trainer relays the gradient a later stage's server answered, so it may not be
the liar). Honest gradients are heavy-tailed: at the tiny built-in model's first stage the
largest of 1,600 micro-batches reached 7-77x the median over four clean runs and 170x in
one CI run, so an honest micro-batch is left out about once in several thousand (a bound of
10x left out 5 of 1,600); clipping alone would let a x(-1000) liar in at CLIP x an honest
micro-batch on every call.

The reference is the low median of the norms the stage let in lately from *other* callers
(all callers while fewer than WARMUP came from others), and what the window keeps is what
was let in, at the norm it was let in at. So a caller cannot raise the bound it is held to,
and a liar sending up to half of the micro-batches (two trainers, one lying) is held to the
honest ones' scale. Two first versions fell to that: one kept refused norms in a window of
all callers, and a liar sending every other micro-batch x(-1000) raised the median until it
passed as merely clipped (6.11 against 3.44); keeping only what was let in, from all
callers, still left the liar's clipped entries half the window, so the median was the
honest window's maximum and the liar's micro-batches got in at 13 honest ones' norm each.
An honest scale that jumps beyond REFUSE x for good is followed by starting over after a
full window of refusals in a row, which a liar cannot cause while an honest trainer's
micro-batches still get in.

What a liar can still do (README, Security): send a sign-flipped gradient at an honest norm,
worth up to CLIP honest micro-batches each; as the only other caller of a stage, send tiny
gradients so that the honest trainer's are clipped to nothing (it stalls the stage; it does
not steer it); and the very first micro-batch a stage sees has nothing to be held against.
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
        #: (caller, norm let in) of the last `window` micro-batches let in.
        self._let_in: deque[tuple[str, float]] = deque(maxlen=self.window)
        self._refused_in_a_row = 0

    def reference(self, caller: str = "") -> float:
        """The norm ``caller`` is held to: the low median of what others had let in, or of
        everything while others had fewer than `warmup` (0.0: nothing yet)."""
        others = [n for c, n in self._let_in if c != caller]
        pool = others if len(others) >= self.warmup else [n for _, n in self._let_in]
        return statistics.median_low(pool) if pool else 0.0

    def factor(self, norm: float, caller: str = "") -> float:
        """What to scale a micro-batch's gradient of ``norm`` from ``caller`` by: 1, or less
        when it is clipped; raises GradientRefused beyond the refusal bound (after warm-up)."""
        if not math.isfinite(norm):
            raise GradientRefused("the gradient is not finite")
        ref = self.reference(caller)
        if ref > 0.0 and norm > self.refuse * ref and len(self._let_in) >= self.warmup:
            self._refused_in_a_row += 1
            if self._refused_in_a_row >= self.window:
                self._let_in.clear()  # a lasting change of scale: learn it again
                self._refused_in_a_row = 0
            raise GradientRefused(
                f"a gradient of norm {norm:.3g}, {norm / ref:.0f}x the median of what the stage "
                f"let in lately (at most {self.refuse:g}x)"
            )
        self._refused_in_a_row = 0
        if ref <= 0.0 or norm <= self.clip * ref:
            self._let_in.append((caller, norm))
            return 1.0
        self._let_in.append((caller, self.clip * ref))
        return self.clip * ref / norm
