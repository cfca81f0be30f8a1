"""DiLoCo (Douillard et al., 2023): many local AdamW steps, one averaged outer step.

Each peer trains its own copy for H inner steps, then the group averages the *pseudo-gradient*
`global - local` (what H steps of AdamW moved the weights, pointing "uphill" like a gradient)
and every peer applies the same average to the same global parameters with Nesterov SGD. One
vector crosses the network every H steps instead of every step: H times less traffic than
data parallelism, before compression.

Pure torch, no I/O. The averaging function is injected: the daemon passes the networked
all-reduce (which compresses with int8 + error feedback); tests and benchmarks pass an
in-process mean. It is called with the flat fp32 pseudo-gradient and this peer's weight (the
number of samples it trained on since the last sync), and must return the group's weighted
mean: a tensor, an object with a `.tensor` (and optionally `.ok`) such as the all-reduce's
result, or None when the round failed.

Choices, and why:

* The global parameters and the outer momentum live in fp32 on the CPU whatever the model's
  device and dtype: they change by small averaged steps that bf16 would round away, and the
  averaging layer works on CPU tensors anyway. They are the state a joiner downloads
  (`state_dict`), with a round counter.
* The inner AdamW state is kept across rounds and never averaged, as in the paper's
  Algorithm 1 and OpenDiLoCo: resetting it would throw away the second-moment estimates every
  H steps and make each round start with Adam's large bias-corrected first steps. It is local
  state (`local_state_dict`): a restart restores it, a joiner starts it fresh.
* When the round fails (the function returns None, or a non-finite average), the default
  (`on_failure="local"`) applies this peer's own pseudo-gradient as if it were a group of one:
  the work is kept, the round counter stays in step with the swarm, and the small divergence
  from the others is what the next successful average (or a state sync) absorbs; this is what
  hivemind-style optimisers do. `on_failure="defer"` instead leaves the global parameters
  alone and keeps training locally for another H steps; the next pseudo-gradient then covers
  both periods and carries their combined sample count as its weight, so nothing is lost or
  counted twice, at the cost of this peer's round counter falling behind.
* A partial result (some parts of the vector kept this peer's values, reported as `ok` False)
  is applied as it is: those parts are exactly the "local" fallback, part by part.
* An exception raised by the averaging function propagates and leaves every piece of state as
  it was, so the caller may retry, call `apply_outer(pg, None)`, or keep training.
* `inner_seconds` bounds a round by time as well as by H: volunteers' GPUs differ by several
  times, and with H steps alone the slow peers reach each round's group after it has closed
  (a grid of 100 simulated peers of log-normal speeds σ 0.5, H = 500: 10% of peer-rounds
  averaged). With every peer training the same seconds from the round's first step, members
  that ended a round together come to the next together; each is weighted by the samples it
  trained, so the average is over tokens, as before. H stays the run clock's length of a round
  (`progress`: the learning-rate schedule, total_steps) and a cap on a fast peer's steps; a
  peer that reaches H early waits the round's time out (`time_left`) before it syncs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from swarmd.optim.flat import flatten, unflatten_into
from swarmd.optim.forward import InnerForward
from swarmd.optim.outer import Averaged, AverageFn, FlatOuter, OuterStatus, read_average
from swarmd.optim.schedule import LrSchedule
from swarmd.optim.statedicts import (
    GLOBAL_PREFIX,
    MOMENTUM_PREFIX,
    ROUND_KEY,
    check_global_state,
    flat_from_state,
    global_tensors,
    inner_state_dict,
    load_inner_state,
)

__all__ = [
    "AverageFn",
    "Averaged",
    "DiLoCo",
    "DiLoCoConfig",
    "FailurePolicy",
    "OuterStatus",
    "OuterStepReport",
]

FailurePolicy = Literal["local", "defer"]


def _finite(name: str, value: object, *, low: float, high: float, low_open: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"DiLoCoConfig.{name} must be a finite number, got {value!r}")
    ok = (low < value if low_open else low <= value) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"DiLoCoConfig.{name} must be in {bracket}{low}, {high}], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class DiLoCoConfig:
    """Defaults are the paper's: H=500, AdamW lr 4e-4 (betas 0.9/0.95, weight decay 0.1),
    Nesterov SGD lr 0.7 momentum 0.9. `grad_clip` bounds each inner step's gradient norm
    (None: no clipping). With `outer_momentum` 0 the outer step is plain SGD (`nesterov` has
    no effect), and `outer_lr=1, outer_momentum=0` makes one peer's DiLoCo exactly its inner
    AdamW."""

    inner_steps: int = 500
    inner_lr: float = 4e-4
    inner_betas: tuple[float, float] = (0.9, 0.95)
    inner_eps: float = 1e-8
    inner_weight_decay: float = 0.1
    grad_clip: float | None = 1.0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    on_failure: FailurePolicy = "local"
    #: The inner optimiser: AdamW as in the paper, or plain SGD (betas/eps unused), which makes
    #: DiLoCo with H=1, outer lr 1 and no momentum exactly data-parallel SGD.
    inner_optimizer: Literal["adamw", "sgd"] = "adamw"
    #: The inner learning rate over the run's inner steps (`progress`), times `inner_lr`.
    lr_schedule: LrSchedule = field(default_factory=LrSchedule)
    #: A round also ends once this many seconds have passed since its first inner step (0:
    #: H steps however long they take); see the module notes.
    inner_seconds: float = 0.0

    def __post_init__(self) -> None:
        h = self.inner_steps
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise ValueError(f"DiLoCoConfig.inner_steps must be a positive int, got {h!r}")
        _finite("inner_lr", self.inner_lr, low=0.0, high=math.inf, low_open=True)
        betas = self.inner_betas
        if not (isinstance(betas, tuple) and len(betas) == 2):
            raise ValueError(f"DiLoCoConfig.inner_betas must be a pair, got {betas!r}")
        for b in betas:
            _finite("inner_betas", b, low=0.0, high=1.0, low_open=False)
            if b >= 1.0:
                raise ValueError(f"DiLoCoConfig.inner_betas must be < 1, got {betas!r}")
        _finite("inner_eps", self.inner_eps, low=0.0, high=math.inf, low_open=True)
        _finite(
            "inner_weight_decay", self.inner_weight_decay, low=0.0, high=math.inf, low_open=False
        )
        if self.grad_clip is not None:
            _finite("grad_clip", self.grad_clip, low=0.0, high=math.inf, low_open=True)
        _finite("outer_lr", self.outer_lr, low=0.0, high=math.inf, low_open=True)
        _finite("outer_momentum", self.outer_momentum, low=0.0, high=1.0, low_open=False)
        if self.outer_momentum >= 1.0:
            raise ValueError(f"DiLoCoConfig.outer_momentum must be < 1, got {self.outer_momentum}")
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"DiLoCoConfig.nesterov must be a bool, got {self.nesterov!r}")
        if self.inner_optimizer not in ("adamw", "sgd"):
            raise ValueError(
                f"DiLoCoConfig.inner_optimizer must be 'adamw' or 'sgd', got "
                f"{self.inner_optimizer!r}"
            )
        _finite("inner_seconds", self.inner_seconds, low=0.0, high=math.inf, low_open=False)
        if self.on_failure not in ("local", "defer"):
            raise ValueError(
                f"DiLoCoConfig.on_failure must be 'local' or 'defer', got {self.on_failure!r}"
            )


@dataclass(frozen=True)
class OuterStepReport:
    """What one outer step did; `round` is the round counter after it."""

    round: int
    #: "carried": see `DiLoCo.carry`.
    status: OuterStatus | Literal["carried"]
    #: Samples this peer trained on for this pseudo-gradient (its averaging weight).
    weight: float
    inner_steps: int
    #: L2 norms of this peer's pseudo-gradient and of what was applied (the group average).
    pseudo_grad_norm: float
    applied_norm: float
    reason: str | None = None


# -- pieces shared with streaming DiLoCo ----------------------------------------------------


def trainable(model: nn.Module) -> tuple[list[str], list[nn.Parameter]]:
    """The names and parameters the optimisers train (and the global state covers), in order."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("model has no trainable parameters")
    return [n for n, _ in named], [p for _, p in named]


def build_inner_optimizer(
    params: Sequence[nn.Parameter], config: DiLoCoConfig
) -> torch.optim.Optimizer:
    if config.inner_optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.inner_lr, weight_decay=config.inner_weight_decay)
    # On a GPU the fused kernel updates every parameter in a few launches instead of a
    # handful per tensor (torch's foreach default), which matters once steps take milliseconds.
    return torch.optim.AdamW(
        params,
        lr=config.inner_lr,
        betas=config.inner_betas,
        eps=config.inner_eps,
        weight_decay=config.inner_weight_decay,
        fused=True if all(p.is_cuda for p in params) else None,
    )


def train_step(
    model: nn.Module,
    params: Sequence[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    grad_clip: float | None,
    batch: tuple[torch.Tensor, torch.Tensor],
) -> tuple[float, int]:
    """One inner step on the local parameters; returns (batch loss, samples in the batch)."""
    x, y = batch
    device = params[0].device
    model.train()
    _, loss = model(x.to(device), y.to(device))
    if not isinstance(loss, torch.Tensor):
        raise TypeError("model(idx, targets) must return (logits, loss) with a tensor loss")
    optimizer.zero_grad(set_to_none=True)
    torch.autograd.backward(loss)
    if grad_clip is not None:
        nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    return float(loss.detach()), int(x.shape[0])


def forward_step(
    forward: InnerForward,
    params: Sequence[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    grad_clip: float | None,
    batch: tuple[torch.Tensor, torch.Tensor],
) -> tuple[float, int]:
    """`train_step` through `forward` (every local rank takes it); returns (this rank's batch
    loss, the samples of every rank's batch)."""
    forward.begin(float(optimizer.param_groups[0]["lr"]), optimizer_step=True)
    loss, samples = forward.run(
        lambda: train_step(forward.module, params, optimizer, grad_clip, batch)
    )
    forward.end()
    return loss, samples * forward.world


class DiLoCo:
    """One peer's DiLoCo state around `model` (whose parameters are the local copy).

    The trainer loop is: `inner_step(batch)` until `should_sync()`, then
    `await outer_step(average)`. The outer step can also be driven in pieces,
    `pg = pseudo_gradient()` ... `apply_outer(pg, averaged)`, so the daemon can run the torch
    work in a worker thread and only the averaging in its event loop.
    """

    def __init__(
        self,
        model: nn.Module,
        config: DiLoCoConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self._clock = clock
        self.config = config = config or DiLoCoConfig()
        self.names, self._params = trainable(model)
        self._shapes = [p.shape for p in self._params]
        self.numel = sum(p.numel() for p in self._params)
        # The global copy is one flat fp32 tensor, so the outer step is one fused update and
        # the pseudo-gradient needs no gathering; per-parameter views give it names.
        self.outer = FlatOuter(
            flatten(self._params), config.outer_lr, config.outer_momentum, config.nesterov
        )
        self._global = self.outer.values
        self.inner_optimizer = build_inner_optimizer(self._params, config)
        #: What inner steps run through (local ranks, mixed precision): optim/forward.py.
        self.forward = InnerForward(model)
        self.round = 0
        #: Inner steps and samples since the global parameters were last updated.
        self.steps_since_sync = 0
        self.samples_since_sync = 0
        self._sync_due = config.inner_steps
        #: When this round's first inner step began (None: not yet), for `inner_seconds`.
        self._began: float | None = None

    # -- inner loop -------------------------------------------------------------------------

    @property
    def age(self) -> int:
        """How far along the run this global state is, to compare it with other peers'
        (catch-up, donor choice): the round counter. A deferred round leaves the state, and
        so its hash, unchanged."""
        return self.round

    @property
    def progress(self) -> int:
        """The run's inner steps so far as this peer sees them (the learning-rate schedule's
        clock): H per round of the global state, plus this peer's steps since."""
        return self.round * self.config.inner_steps + self.steps_since_sync

    def inner_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """One AdamW step on the local parameters; returns the batch loss."""
        self.config.lr_schedule.apply(self.inner_optimizer, self.config.inner_lr, self.progress)
        if self._began is None:
            self._began = self._clock()
        loss, samples = forward_step(
            self.forward, self._params, self.inner_optimizer, self.config.grad_clip, batch
        )
        self.steps_since_sync += 1
        self.samples_since_sync += samples
        return loss

    def should_sync(self) -> bool:
        """True once H inner steps (2H, ... after deferred rounds) have run since the last
        update of the global parameters, or `inner_seconds` have passed since the round's
        (or a deferred round's) first step."""
        if self.steps_since_sync >= self._sync_due:
            return True
        limit, began = self.config.inner_seconds, self._began
        return limit > 0 and began is not None and self._clock() - began >= limit

    def time_left(self) -> float:
        """Seconds left of this round's `inner_seconds` (0 without them, or before the
        round's first step): a peer that ran its H steps early waits them out before it
        syncs. Ending at H, it reached the round's roll call alone, ahead of everyone: it
        led a roll of the few other capped peers, which committed the round's one roster
        without the rest (1,000 simulated peers of σ 0.5 speeds, H capping the fastest 0.3%:
        no peer-round averaged; 100 peers with H capping a third of them: 9%)."""
        limit, began = self.config.inner_seconds, self._began
        if limit <= 0 or began is None:
            return 0.0
        return max(0.0, limit - (self._clock() - began))

    # -- outer step -------------------------------------------------------------------------

    def pseudo_gradient(self) -> torch.Tensor:
        """`global - local`, flat fp32 on the CPU (a fresh tensor the caller may keep)."""
        return self._global - flatten(self._params)

    async def outer_step(self, average: AverageFn) -> OuterStepReport:
        """Average the pseudo-gradient with the group and apply it (see the module notes for
        failures). Exceptions from `average` propagate with all state unchanged."""
        pg = self.pseudo_gradient()
        result = await average(pg, self.weight())
        return self.apply_outer(pg, result)

    def weight(self) -> float:
        """This peer's averaging weight: samples trained since the last global update (at
        least 1, so a peer that syncs with no new samples still counts as itself)."""
        return float(max(1, self.samples_since_sync))

    def apply_outer(
        self, pseudo_grad: torch.Tensor, result: torch.Tensor | Averaged | None
    ) -> OuterStepReport:
        """Apply an averaged pseudo-gradient (or the failure policy when `result` is None)."""
        if pseudo_grad.shape != (self.numel,):
            raise ValueError(
                f"pseudo-gradient has shape {tuple(pseudo_grad.shape)}, expected ({self.numel},)"
            )
        averaged, status, reason = read_average(result, self.numel)
        pg_norm = float(pseudo_grad.norm())
        weight, steps = self.weight(), self.steps_since_sync
        self._began = None
        if averaged is None and self.config.on_failure == "defer":
            self._sync_due = self.steps_since_sync + self.config.inner_steps
            return OuterStepReport(self.round, "deferred", weight, steps, pg_norm, 0.0, reason)
        if averaged is None:
            averaged = pseudo_grad.detach().to(torch.float32)
        self.outer.step(averaged)
        unflatten_into(self._global, self._params)
        self.round += 1
        self.steps_since_sync = 0
        self.samples_since_sync = 0
        self._sync_due = self.config.inner_steps
        return OuterStepReport(
            self.round, status, weight, steps, pg_norm, float(averaged.norm()), reason
        )

    def carry(self, pseudo_grad: torch.Tensor) -> OuterStepReport:
        """The round passes with nothing applied: the global parameters and the outer
        momentum stay, the round counter moves on, and the round's inner steps and samples
        carry into the next pseudo-gradient (global - local covers both rounds, weighted by
        both rounds' samples: nothing is lost or counted twice, as with "defer").

        For a round that nobody could average (every grid group above the rows fell short,
        so each member sat it out and no state came): members that all carry stay on one
        state, the same round as everyone's. Applying their own pseudo-gradients ("local")
        made one state per peer, and the next round threw all but one of them away (12
        peers in groups of 4: twice in 30 rounds)."""
        steps, weight = self.steps_since_sync, self.weight()
        self.round += 1
        # The run's clock (`progress`) moves on by the round, as for an applied one.
        self.steps_since_sync = max(0, steps - self._sync_due)
        self._sync_due = self.config.inner_steps
        self._began = None
        norm = float(pseudo_grad.norm())
        return OuterStepReport(self.round, "carried", weight, steps, norm, 0.0, "no average")

    # -- flat views -------------------------------------------------------------------------

    def flat_params(self) -> torch.Tensor:
        """The local parameters as one fresh flat fp32 CPU tensor."""
        return flatten(self._params)

    def global_flat(self) -> torch.Tensor:
        """A copy of the global parameters, flat fp32."""
        return self._global.clone()

    # -- global state (what joiners download) -----------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The global state as flat named tensors (copies):

        `global.<param>` (fp32), `outer_momentum.<param>` (fp32) and `round` (int64 scalar).
        Taken between rounds it is all a peer needs to join: its local parameters become the
        global ones and its inner AdamW starts fresh.
        """
        out = global_tensors(self.names, self._shapes, self._global, self.outer.momentum())
        out[ROUND_KEY] = torch.tensor(self.round, dtype=torch.int64)
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Adopt a global state (e.g. downloaded from donors): validates every tensor first,
        then sets global parameters, outer momentum and round, and resets the local
        parameters to the global ones (local progress since the last sync is discarded)."""
        counters = check_global_state(state, self.names, self._shapes, [ROUND_KEY])
        self.outer.load(
            flat_from_state(state, GLOBAL_PREFIX, self.names, self._shapes),
            flat_from_state(state, MOMENTUM_PREFIX, self.names, self._shapes),
        )
        self.round = counters[ROUND_KEY]
        unflatten_into(self._global, self._params)
        self.steps_since_sync = 0
        self.samples_since_sync = 0
        self._sync_due = self.config.inner_steps
        self._began = None

    # -- local state (what a restart restores; never shipped) -------------------------------

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """Local parameters, inner AdamW state and counters as flat named tensors: with
        `state_dict` it resumes training bit-identically, even mid-round."""
        out = inner_state_dict(self.names, self._params, self.inner_optimizer)
        out["steps_since_sync"] = torch.tensor(self.steps_since_sync, dtype=torch.int64)
        out["samples_since_sync"] = torch.tensor(self.samples_since_sync, dtype=torch.int64)
        out["sync_due"] = torch.tensor(self._sync_due, dtype=torch.int64)
        return out

    def load_local_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore `local_state_dict` (after `load_state_dict` for the global part)."""
        counters = ("steps_since_sync", "samples_since_sync", "sync_due")
        for key in counters:
            if key not in state:
                raise ValueError(f"local state: missing {key!r}")
        load_inner_state(self.names, self._params, self.inner_optimizer, state)
        self.steps_since_sync = int(state["steps_since_sync"])
        self.samples_since_sync = int(state["samples_since_sync"])
        self._sync_due = int(state["sync_due"])
