"""One pipeline stage's training state: its layers, their accumulated gradients, AdamW.

A SWARM stage server (swarmd/node/algorithms/swarm) runs micro-batches through one contiguous
slice of the model for trainers it never sees the data of. This module is the torch side of it:

- `forward(x)`: the stage's output, no graph kept (nothing is cached between calls);
- `backward(x, grad_out)`: recomputes the forward from the inputs the trainer sends again
  and backpropagates `grad_out`; parameter gradients add up in `.grad`, the input's gradient
  goes back (stateless backward, as in SWARM and hivemind: any server of the stage can take
  a micro-batch's backward, whichever ran its forward, and no activation waits in memory for
  a backward that may never come; the price is one more forward per micro-batch);
- `last(x, targets)`: the last stage's forward, loss and backward in one call.

Every `round`, the servers of a stage average the gradients they accumulated (`take`) and
each applies the same average (`apply`): same parameters, same AdamW state, same step, so
they stay identical. `take` and `apply` split accumulation from stepping so the network part
runs between them while the stage goes on serving micro-batches (their gradients count in the
next round; SWARM's gradients are as stale).
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from swarmd.optim.checkfree import flat_parameters, split
from swarmd.optim.grad_bound import GradientRefused, NormBound

#: State-dict keys: the round, then parameters and AdamW moments by parameter name.
ROUND_KEY = "round"
PARAM_PREFIX = "param."
EXP_AVG_PREFIX = "adam.exp_avg."
EXP_AVG_SQ_PREFIX = "adam.exp_avg_sq."
STEP_KEY = "adam.step"
#: The stage's learning rate over the run's (1, or CheckFree's after a recovery: checkfree.py).
LR_SCALE_KEY = "adam.lr_scale"

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _check(what: str, t: torch.Tensor, bound: float) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{what} is not finite")
    if bound < math.inf and t.numel() and float(t.abs().max()) > bound:
        raise ValueError(f"{what} exceeds {bound:g} (beyond what the wire carries)")


@dataclass(frozen=True)
class StageOptConfig:
    """AdamW within a stage (the averaged gradient is one data-parallel step's)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    #: Bound on the averaged gradient's norm per step (None: none).
    grad_clip: float | None = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"StageOptConfig.lr must be > 0, got {self.lr!r}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"StageOptConfig.grad_clip must be > 0, got {self.grad_clip!r}")


class StageTrainer:
    """The layers of stage `index` of `count`, with the optimiser that trains them."""

    def __init__(
        self,
        module: nn.Module,
        index: int,
        count: int,
        config: StageOptConfig,
        loss: Loss,
        lr_scale: float = 1.0,
    ) -> None:
        if not 0 <= index < count:
            raise ValueError(f"stage index {index} out of range for {count} stages")
        self.module = module
        self.index, self.count = index, count
        self.config = config
        self._loss = loss
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"stage {index} has no trainable parameters")
        self.numel = sum(p.numel() for p in self.params)
        self.lr_scale = lr_scale
        self.opt = torch.optim.AdamW(
            self.params,
            lr=config.lr * lr_scale,
            betas=config.betas,
            weight_decay=config.weight_decay,
        )
        #: The L2 norm of the last averaged gradient this stage stepped on (before clipping):
        #: what CheckFree weighs a neighbour by when it rebuilds a lost stage.
        self.last_grad_norm = 0.0
        #: Micro-batches whose gradients are in `.grad` now, and (last stage) their summed loss.
        self.pending = 0
        self._loss_sum = 0.0
        #: The last stage's mean loss over the micro-batches of the last `take` (NaN: none).
        self.taken_loss = math.nan
        self.round = 0
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self._parts: dict[str, nn.Module] = {}
        #: Per part called (its parameters differ): how far one micro-batch may move it.
        self._bounds: dict[str, NormBound] = {}
        #: Why the last call's gradient was left out of the round's sum (None: it was not).
        self.left_out: str | None = None
        #: Micro-batches left out since the last `take`, per caller; `taken_left_out` holds
        #: the counts of the last `take` (what the round's event reports).
        self._left_out_by: Counter[str] = Counter()
        self.taken_left_out: dict[str, int] = {}
        #: Compute, rounds and loads may come from different worker threads (a state
        #: download loads outside the server's device limiter): one at a time.
        self._lock = threading.Lock()

    def set_edge(self, layers: int) -> None:
        """Marks this end stage's leading (first stage) or trailing (last stage) `layers` as
        its edge (the embedding, the head) and opens its parts to calls: `edge` (that many
        layers) and `blocks` (the rest), which CheckFree+'s swapped micro-batches call apart
        (optim/checkfree.py)."""
        if layers <= 0 or not (self.first or self.last_stage) or self.count < 2:
            self._parts = {}
            return
        edge, blocks = split(self.module, layers, self.first)
        self._parts = {"edge": edge, "blocks": blocks}

    def part(self, name: str) -> nn.Module:
        """The module a call names: the whole stage (""), or an end stage's part."""
        if not name:
            return self.module
        module = self._parts.get(name)
        if module is None:
            raise ValueError(f"stage {self.index} has no part {name!r}")
        return module

    @property
    def has_edge(self) -> bool:
        return "edge" in self._parts

    def takes_tokens(self, part: str = "") -> bool:
        """Whether a call of `part` takes token ids (the first stage's whole or edge)."""
        return self.first and part != "blocks"

    def edge_vector(self) -> torch.Tensor:
        """The edge layers' parameters as one vector (what the partner's servers copy)."""
        with self._lock:
            return flat_parameters(self.part("edge"))

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last_stage(self) -> bool:
        return self.index == self.count - 1

    @property
    def age(self) -> int:
        return self.round

    # -- the micro-batch calls -------------------------------------------------------------

    def forward(self, x: torch.Tensor, bound: float = math.inf, part: str = "") -> torch.Tensor:
        """The stage's (or `part`'s) output; ValueError if it is not finite or beyond `bound`
        (what the wire's format can carry)."""
        module = self.part(part)
        with torch.no_grad():
            out: torch.Tensor = module(x)
        _check("output", out, bound)
        return out

    def backward(
        self,
        x: torch.Tensor,
        grad_out: torch.Tensor,
        bound: float = math.inf,
        part: str = "",
        apply: bool = True,
        caller: str = "",
    ) -> torch.Tensor | None:
        """Recomputes, backpropagates; the input's gradient (None for token ids). Nothing is
        accumulated unless every gradient is finite (and the input's within `bound`): one bad
        micro-batch must not poison the round's sum. `apply` False: nothing is accumulated
        at all (a trainer checking another server's answer)."""
        module, tokens = self.part(part), self.takes_tokens(part)
        x = x if tokens else x.detach().requires_grad_(True)
        with self._lock:
            out = module(x)
            if out.shape != grad_out.shape:
                raise ValueError(
                    f"gradient of shape {tuple(grad_out.shape)} for {tuple(out.shape)}"
                )
            return self._accumulate(out, grad_out, x, bound, tokens, part, apply, caller)

    def last(
        self,
        x: torch.Tensor,
        targets: torch.Tensor,
        bound: float = math.inf,
        part: str = "",
        apply: bool = True,
        caller: str = "",
    ) -> tuple[float, torch.Tensor | None]:
        """The last stage (or its edge: the head): loss and the input's gradient, parameters'
        gradients accumulated (only if all is finite, as in `backward`; `apply` False: not at
        all)."""
        if part not in ("", "edge"):
            raise ValueError(f"the loss is the whole last stage's or its edge's, not {part!r}")
        module, tokens = self.part(part), self.takes_tokens(part)
        x = x if tokens else x.detach().requires_grad_(True)
        with self._lock:
            loss = self._loss(module(x), targets)
            value = float(loss.detach())
            if not math.isfinite(value):
                raise ValueError("loss is not finite")
            grad = self._accumulate(loss, None, x, bound, tokens, part, apply, caller)
            if apply:
                self._loss_sum += value
        return value, grad

    def _accumulate(
        self,
        out: torch.Tensor,
        grad_out: torch.Tensor | None,
        x: torch.Tensor,
        bound: float,
        tokens: bool,
        part: str,
        apply: bool = True,
        caller: str = "",
    ) -> torch.Tensor | None:
        """The parameter gradients go into the round's sum within the part's NormBound, held
        to what callers other than ``caller`` sent (grad_bound.py: scaled down, or left out,
        saying why in `left_out`; the call is still answered: the gradient may be a later
        stage's lie the caller relayed). A swapped
        micro-batch calls an end stage twice: its `blocks` call does not count, so weights
        and the mean loss are per micro-batch."""
        inputs = self.params if tokens else [*self.params, x]
        grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
        for name, g in zip(self.names, grads, strict=False):
            if g is not None and not bool(torch.isfinite(g).all()):
                raise ValueError(f"the gradient of {name} is not finite")
        g_x = None if tokens else grads[-1]
        if g_x is not None:
            _check("input gradient", g_x, bound)
        self.left_out = None
        if not apply:
            return g_x
        own = [g for g in grads[: len(self.params)] if g is not None]
        norm = (
            float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in own])))
            if own
            else 0.0
        )
        try:
            factor = self._bounds.setdefault(part, NormBound()).factor(norm, caller)
        except GradientRefused as exc:
            self.left_out = str(exc)
            self._left_out_by[caller] += 1
            return g_x
        for p, g in zip(self.params, grads, strict=False):
            if g is not None:
                p.grad.add_(g, alpha=factor)  # type: ignore[union-attr]
        self.pending += int(part != "blocks")
        return g_x

    # -- a round ---------------------------------------------------------------------------

    def take(self) -> tuple[torch.Tensor, int]:
        """The gradients accumulated since the last `take` as one flat vector (their sum over
        micro-batches divided by count + 1, see `weight`), and the micro-batch count; the
        accumulators start again from zero."""
        with self._lock:
            return self._take()

    def _take(self) -> tuple[torch.Tensor, int]:
        count = self.pending
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])  # type: ignore[union-attr]
        flat.div_(count + 1)
        for p in self.params:
            p.grad.zero_()  # type: ignore[union-attr]
        self.taken_loss = self._loss_sum / count if count else math.nan
        self.taken_left_out = dict(self._left_out_by)
        self._left_out_by.clear()
        self.pending, self._loss_sum = 0, 0.0
        return flat, count

    @staticmethod
    def weight(count: int) -> float:
        """A server's weight in its stage's average: its micro-batches plus one, so that a
        server that got none still takes part (weight 0 divides by nothing when every server
        was idle) and the average is the stage's mean gradient shrunk by N/(N+servers)."""
        return float(count + 1)

    def apply(self, grad: torch.Tensor) -> None:
        """One AdamW step on the stage's averaged gradient; the gradients accumulating for the
        next round are kept aside meanwhile."""
        with self._lock:
            self._apply(grad)

    def _apply(self, grad: torch.Tensor) -> None:
        if grad.shape != (self.numel,) or not bool(torch.isfinite(grad).all()):
            raise ValueError("averaged gradient has the wrong size or is not finite")
        self.last_grad_norm = float(torch.linalg.vector_norm(grad))
        kept = [p.grad for p in self.params]
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = grad[offset : offset + n].view_as(p).clone()
            offset += n
        if self.config.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip)
        self.opt.step()
        for p, g in zip(self.params, kept, strict=True):
            p.grad = g
        self.round += 1

    def skip(self) -> None:
        """A round in which the stage had no micro-batch: no step, only the round moves on
        (so the state's hash, which keys the next round's matchmaking, is a new one)."""
        with self._lock:
            self.round += 1

    # -- shared state (statesync) ----------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What the stage's servers hold in common: round, parameters, AdamW moments."""
        with self._lock:
            return self._state_dict()

    def _state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {ROUND_KEY: torch.tensor(self.round, dtype=torch.int64)}
        state = self.opt.state
        step = 0.0
        for name, p in zip(self.names, self.params, strict=True):
            out[PARAM_PREFIX + name] = p.detach().clone()
            s = state.get(p, {})
            out[EXP_AVG_PREFIX + name] = s.get("exp_avg", torch.zeros_like(p)).clone()
            out[EXP_AVG_SQ_PREFIX + name] = s.get("exp_avg_sq", torch.zeros_like(p)).clone()
            step = float(s["step"]) if "step" in s else step
        out[STEP_KEY] = torch.tensor(step, dtype=torch.float32)
        out[LR_SCALE_KEY] = torch.tensor(self.lr_scale, dtype=torch.float64)
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Takes a stage state (a joiner's download, a server following its stage); raises
        ValueError if it is another stage's or model's layout. Gradients accumulated for the
        next round are kept: they are this stage's, computed on a state a round or so off,
        as stale as any of SWARM's."""
        with self._lock:
            self._load(state)

    def _load(self, state: Mapping[str, torch.Tensor]) -> None:
        want = set(self._state_dict())
        if set(state) != want:
            raise ValueError("state does not match this stage's layout")
        step = float(state[STEP_KEY])
        with torch.no_grad():
            for name, p in zip(self.names, self.params, strict=True):
                src = state[PARAM_PREFIX + name]
                if src.shape != p.shape:
                    raise ValueError(f"{name}: shape {tuple(src.shape)}, expected {tuple(p.shape)}")
                p.copy_(src)
                if step > 0:
                    self.opt.state[p] = {
                        "step": torch.tensor(step),
                        "exp_avg": state[EXP_AVG_PREFIX + name].clone().to(p),
                        "exp_avg_sq": state[EXP_AVG_SQ_PREFIX + name].clone().to(p),
                    }
                else:
                    self.opt.state.pop(p, None)
        self.round = int(state[ROUND_KEY])
        self.set_lr_scale(float(state[LR_SCALE_KEY]))

    def set_lr_scale(self, scale: float) -> None:
        """The stage's learning rate becomes `scale` times the run's (CheckFree's recovery)."""
        if not (math.isfinite(scale) and 0 < scale <= 10):
            raise ValueError(f"learning-rate scale {scale!r} out of range")
        self.lr_scale = scale
        for group in self.opt.param_groups:
            group["lr"] = self.config.lr * scale

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """Nothing of a stage is this server's own (its accumulated gradients are not kept)."""
        return {}

    def load_local_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """See `local_state_dict`."""
