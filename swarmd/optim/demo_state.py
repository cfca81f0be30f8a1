"""One peer's DeMo run around a model: what the group shares, what is the peer's own.

DeMo (optim/demo.py) moves every member's parameters by the same sign step each inner step,
so the parameters are the group's state, as DiLoCo's global copy is: joiners download them,
peers that drifted take them again (node/sharedstate.py, through the `SyncedState`
methods below). The momentum δ is each peer's own (what it has not sent yet): it is saved for
a restart, never shipped, and starts at zero for a peer that takes the group's parameters.

The state's `age` is the run's step counter, so states of different peers compare by how far
the run had got; the learning-rate schedule runs on it too, so a late joiner takes the schedule
up where the group is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from swarmd.compression.sparse_wire import SparseUpdate
from swarmd.optim.demo import DeMo, DeMoConfig
from swarmd.optim.diloco import trainable
from swarmd.optim.flat import params_digest
from swarmd.optim.forward import InnerForward
from swarmd.optim.schedule import LrSchedule
from swarmd.optim.statedicts import GLOBAL_PREFIX, ROUND_KEY


class DeMoRun:
    def __init__(
        self,
        model: nn.Module,
        config: DeMoConfig,
        schedule: LrSchedule,
        grad_clip: float | None = 1.0,
    ) -> None:
        self.model = model
        self.config, self.schedule = config, schedule
        #: The gradient's norm bound before it is folded into δ: the reference's training
        #: runs clip at 1.0 (bloc97/DeMo's OLMo configs, `max_grad_norm`), as swarmd's
        #: AdamW steps do. With β = 0.999, δ remembers an early huge gradient for thousands
        #: of steps.
        self.grad_clip = grad_clip
        self.names, self._params = trainable(model)
        self._shapes = [p.shape for p in self._params]
        self.opt = DeMo(self._params, config)
        #: What the gradients are computed through (local ranks average theirs in the
        #: backward, mixed precision): optim/forward.py.
        self.forward = InnerForward(model)
        #: Steps the run has taken (this state's age).
        self.step = 0

    @property
    def age(self) -> int:
        return self.step

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self._params)

    # -- a step ------------------------------------------------------------------------------

    def gradients(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """Forward and backward on ``batch``, leaving the gradients for `prepare`; the loss."""
        x, y = batch
        device = self._params[0].device
        self.model.train()
        for p in self._params:
            p.grad = None
        self.forward.begin(self.config.lr, optimizer_step=False)

        def step() -> torch.Tensor:
            _, loss = self.forward.module(x.to(device), y.to(device))
            if not isinstance(loss, torch.Tensor):
                raise TypeError("model(idx, targets) must return (logits, loss) with a tensor loss")
            torch.autograd.backward(loss)
            return loss

        loss = self.forward.run(step)
        self.forward.end()
        if self.grad_clip is not None:
            nn.utils.clip_grad_norm_(self._params, self.grad_clip)
        return float(loss.detach())

    def prepare(self) -> list[SparseUpdate]:
        """What this peer sends this step (the schedule's lr for the run's step)."""
        self.opt.lr = self.config.lr * self.schedule.factor(self.step)
        return self.opt.prepare()

    def apply(self, gathered: Sequence[Sequence[SparseUpdate]]) -> list[int]:
        """Every member's updates, in the same order on every member (floating-point sums
        depend on it): the step every member takes alike; the positions of the members
        left out of its mean (optim/demo_robust.py)."""
        left_out = self.opt.apply(gathered)
        self.step += 1
        return left_out

    def param_hash(self) -> bytes:
        """Blake2b of the parameters' bytes: equal on members that took the same steps."""
        return params_digest(self._params)

    # -- SyncedState -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """`global.<param>` (copies) and `round` (the step counter): what a joiner takes."""
        pairs = zip(self.names, self._params, strict=True)
        out = {GLOBAL_PREFIX + n: p.detach().cpu().clone() for n, p in pairs}
        out[ROUND_KEY] = torch.tensor(self.step, dtype=torch.int64)
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Takes the group's parameters and step (all checked first: a bad state changes
        nothing); δ starts again at zero, as the peer's unsent momentum belonged to its old
        parameters."""
        expected = {GLOBAL_PREFIX + n for n in self.names} | {ROUND_KEY}
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ValueError(f"DeMo state: missing {missing[:3]}, unexpected {extra[:3]}")
        for name, shape in zip(self.names, self._shapes, strict=True):
            value = state[GLOBAL_PREFIX + name]
            if not value.is_floating_point() or value.shape != shape:
                raise ValueError(f"DeMo state: {name} is not a float tensor of shape {shape}")
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"DeMo state: {name} holds NaN or infinity")
        step = state[ROUND_KEY]
        if step.dtype != torch.int64 or step.numel() != 1 or int(step) < 0:
            raise ValueError("DeMo state: round must be one non-negative int64")
        with torch.no_grad():
            for name, p in zip(self.names, self._params, strict=True):
                p.copy_(state[GLOBAL_PREFIX + name])
        self.step = int(step)
        zeros = {k: torch.zeros_like(v) for k, v in self.opt.state_dict().items()}
        self.opt.load_state_dict(zeros)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """δ: with `state_dict`, all a restarted peer needs to go on exactly."""
        return dict(self.opt.state_dict())

    def load_local_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.opt.load_state_dict(dict(state))
