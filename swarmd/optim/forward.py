"""What an inner step's forward and backward run through, and who else takes the step.

A peer alone trains its model directly. A peer with several local ranks (`swarmd join
--local-workers N`, swarmd/node/peer/local) runs the same step on every rank at once, each on its
own batch, with gradients averaged between them inside the backward (DDP): the optimisers then
see one step on an N-times larger batch. The optimisers stay ignorant of processes and
collectives: they ask this object for the module to call, tell it before each step (so the
other ranks start the same step) and after it, and count its `world` samples per batch row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import nn

T = TypeVar("T")


class InnerForward:
    """The default: one process, the model itself (mixed precision or a compiled module may
    stand in for it: `module` is what the step calls, the parameters stay the model's)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        #: Ranks taking each step together; the step's samples count this many times over.
        self.world = 1

    def begin(self, lr: float, *, optimizer_step: bool) -> None:
        """Before the forward: `lr` is the inner learning rate of this step; without an
        optimizer step the other ranks only help compute the gradients (DeMo)."""

    def run(self, step: Callable[[], T]) -> T:
        """Runs the step (its forward and backward, where other ranks' collectives happen), so
        that a failure of those can be told apart from one of the step itself."""
        return step()

    def end(self) -> None:
        """After the step has changed the parameters (or left them for the caller)."""
