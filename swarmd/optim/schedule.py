"""The inner learning rate over a run: constant, or linear warm-up then cosine decay.

The schedule is a function of the *run's* progress in inner steps, which every peer reads
from the global state it holds (DiLoCo: round × H; streaming: turn × H/P), plus the steps it
has made since. So a peer that joins late, or catches up by state sync, takes the schedule
up where the group is instead of warming up again from its own step 0. DiLoCo's paper trains
its inner AdamW with warm-up and cosine decay; at the end of a run the local models then
barely move, and the last outer steps average nearly agreeing replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

ScheduleKind = Literal["constant", "cosine"]
SCHEDULES: tuple[ScheduleKind, ...] = ("constant", "cosine")


@dataclass(frozen=True)
class LrSchedule:
    """`factor(step)` multiplies the base learning rate.

    * `warmup_steps`: linear from 1/warmup_steps up to 1 over the first steps (both kinds).
    * `cosine`: then a half cosine from 1 down to `final_ratio`, reached at `decay_steps`
      (counted from step 0, warm-up included) and held after it.
    """

    kind: ScheduleKind = "constant"
    warmup_steps: int = 0
    decay_steps: int = 0
    final_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(
                f"lr schedule must be one of {', '.join(SCHEDULES)}, got {self.kind!r}"
            )
        for name in ("warmup_steps", "decay_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.kind == "cosine" and self.decay_steps <= self.warmup_steps:
            raise ValueError(
                f"a cosine schedule needs decay_steps > warmup_steps, got {self.decay_steps} "
                f"and {self.warmup_steps}"
            )
        ratio = self.final_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio <= 1:
            raise ValueError(f"final_ratio must be in [0, 1], got {ratio!r}")

    def factor(self, step: int) -> float:
        """The multiplier for the inner step that follows `step` steps of the run."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        done = min(1.0, (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps))
        return self.final_ratio + (1 - self.final_ratio) * 0.5 * (1 + math.cos(math.pi * done))

    def apply(self, optimizer: torch.optim.Optimizer, base_lr: float, step: int) -> None:
        """Sets every parameter group's learning rate for the next step."""
        lr = base_lr * self.factor(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
