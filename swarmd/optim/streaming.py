"""Streaming DiLoCo (Douillard et al., 2025): DiLoCo one fragment at a time, overlapped.

Plain DiLoCo sends the whole pseudo-gradient every H steps and the trainer waits for it. Here
the parameters are split into P fragments; fragment f syncs every H steps too, but at its own
offset, so one fragment (about 1/P of the model) is on the wire at any moment: peak bandwidth
falls by P. And its all-reduce starts τ inner steps before the fragment's outer step, so the
network works while the trainer keeps training.

The schedule is a sequence of *turns* of H/P inner steps; turn k belongs to fragment k mod P.
Within a turn:

* after H/P − τ inner steps the round *begins*: the fragment's pseudo-gradient
  `global_f − local_f` is taken and handed to the caller, who averages it with the group in the
  background (`begin_round`);
* after H/P inner steps the fragment's *outer step* is due (`finish_round`): the group's
  average moves the fragment's global copy by the fragment's own Nesterov SGD, and the local
  weights, which trained τ more steps meanwhile, are mixed with it:
  θ_local ← (1 − α)·θ_outer + α·θ_local. With α = 0 they simply become θ_outer.

Since τ < H/P, a round always ends before the next one begins: at most one fragment is in
flight. With P = 1, τ = 0, α = 0 this is exactly DiLoCo.

Each fragment has its own outer momentum and round counter. The global state (what a joiner
downloads) is every parameter's global copy and momentum under the same names DiLoCo uses, plus
`turn` (where the schedule is; the fragment due next is `turn mod P`), `fragment_round.<f>` and
`round` (their sum). The state's age, which catch-up and donor choice compare, is the turn
(`age`): a deferred round moves the turn but no round counter.

Failures: a fragment's round that fails follows DiLoCo's `on_failure` policy for that fragment
only; the schedule moves on to the next fragment either way, so one failed round never blocks
the others. With "defer" (what the daemon uses) the fragment's global copy stays as it was and
its next pseudo-gradient covers both periods; a round that failed for every peer thus leaves
all of them still identical. With "local" the peer applies its own pseudo-gradient.

Eager updates (Kale et al., 2025, 'Eager updates for overlapped communication and computation
in DiLoCo') are an option: when the group's average has not arrived by the outer step, the
peer applies its own pseudo-gradient as a stand-in (`apply_stand_in`) and keeps training
instead of waiting. When the average does arrive (`finish_round` again), the stand-in is
replaced: the fragment's outer state is restored from before the stand-in and the real
average applied, and the local weights are shifted by (1 − α)·(θ_outer − θ_stand-in). The paper
lets each worker keep the state its own stand-in produced; replacing it keeps every peer's
global copy bit-identical, which the daemon needs (peers average only with peers that hold the
same state). A stand-in must be replaced before the next round begins.

Pure torch, no I/O: the caller runs the averaging (see swarmd.node.algorithms.streaming, and
the in-process driver in tests/unit/test_streaming.py). How parameters split into fragments is
fragments.py; the round and report the caller handles are fragment_round.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from swarmd.optim.diloco import DiLoCoConfig, build_inner_optimizer, forward_step, trainable
from swarmd.optim.flat import flatten, views
from swarmd.optim.forward import InnerForward
from swarmd.optim.fragment_round import FragmentReport, FragmentRound, FragmentStatus, StandIn
from swarmd.optim.fragments import LAYOUTS, Fragment, FragmentLayout, layer_units, split_fragments
from swarmd.optim.outer import Averaged, read_average
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
    "LAYOUTS",
    "FragmentLayout",
    "FragmentReport",
    "FragmentRound",
    "FragmentStatus",
    "StreamingConfig",
    "StreamingDiLoCo",
    "layer_units",
    "split_fragments",
    "state_age",
]

TURN_KEY = "turn"
FRAGMENT_ROUND_PREFIX = "fragment_round."


@dataclass(frozen=True)
class StreamingConfig:
    """`diloco` holds what streaming shares with DiLoCo (H = `diloco.inner_steps`, the inner
    and outer optimisers, the failure policy). The rest:

    * `fragments` P: H must be divisible by P (fragment f syncs every H steps, one fragment
      every H/P steps);
    * `overlap_steps` τ: inner steps the round runs alongside training, 0 <= τ < H/P (so the
      round has ended before the next fragment's round begins);
    * `mix_alpha` α in [0, 1]: weight of the locally-continued weights in the merge;
    * `layout`: "strided" (layer i goes to fragment i mod P, so each fragment spans the whole
      depth, the paper's default), "sequential" (P contiguous runs of layers) or "balanced"
      (tensors, not whole layers, dealt largest first to the lightest fragment: the sizes
      even out to within one tensor, which bounds a sync's peak bytes closest to 1/P);
    * `eager`: apply the local pseudo-gradient as a stand-in when the average is late.
    """

    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    fragments: int = 1
    overlap_steps: int = 0
    mix_alpha: float = 0.0
    layout: FragmentLayout = "strided"
    eager: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.diloco, DiLoCoConfig):
            raise ValueError(f"StreamingConfig.diloco must be a DiLoCoConfig, got {self.diloco!r}")
        h, p, tau = self.diloco.inner_steps, self.fragments, self.overlap_steps
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"StreamingConfig.fragments must be a positive int, got {p!r}")
        if h % p:
            raise ValueError(
                f"inner_steps H={h} must be divisible by fragments P={p}: each fragment syncs "
                f"every H steps and one fragment every H/P steps"
            )
        if isinstance(tau, bool) or not isinstance(tau, int) or tau < 0:
            raise ValueError(f"StreamingConfig.overlap_steps must be an int >= 0, got {tau!r}")
        if tau >= h // p:
            raise ValueError(
                f"overlap_steps τ={tau} must be < H/P={h // p} (H={h}, P={p}): a fragment's "
                f"round must end before the next fragment's round begins"
            )
        a = self.mix_alpha
        if isinstance(a, bool) or not isinstance(a, int | float) or not math.isfinite(a):
            raise ValueError(f"StreamingConfig.mix_alpha must be a number, got {a!r}")
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"mix_alpha α={a} must be in [0, 1]")
        if self.layout not in LAYOUTS:
            raise ValueError(
                f"StreamingConfig.layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}"
            )
        if not isinstance(self.eager, bool):
            raise ValueError(f"StreamingConfig.eager must be a bool, got {self.eager!r}")

    @property
    def stride(self) -> int:
        """Inner steps per turn: H/P."""
        return self.diloco.inner_steps // self.fragments


def state_age(state: Mapping[str, torch.Tensor]) -> int:
    """The `age` of a global state dict of either algorithm: its turn, else its round."""
    return int(state[TURN_KEY] if TURN_KEY in state else state[ROUND_KEY])


class StreamingDiLoCo:
    """One peer's streaming DiLoCo state around `model` (whose parameters are the local copy).

    The trainer loop, one inner step at a time::

        loss = opt.inner_step(batch)
        if opt.round_due():         # H/P - τ steps into the turn
            rnd = opt.begin_round() # start averaging rnd.pseudo_grad in the background
        if opt.outer_due():         # H/P steps into the turn
            ...wait for the average (or, eager: opt.apply_stand_in() and go on)...
            report = opt.finish_round(average)

    With τ = 0 both are due at the same boundary: begin, then finish.
    """

    def __init__(self, model: nn.Module, config: StreamingConfig | None = None) -> None:
        self.model = model
        self.config = config = config or StreamingConfig()
        self.names, self._params = trainable(model)
        self._shapes = [p.shape for p in self._params]
        self.numel = sum(p.numel() for p in self._params)
        sizes = [p.numel() for p in self._params]
        members = split_fragments(self.names, sizes, config.fragments, config.layout)
        self._fragments = [
            Fragment(f, m, self.names, self._params, config.diloco) for f, m in enumerate(members)
        ]
        self.inner_optimizer = build_inner_optimizer(self._params, config.diloco)
        #: What inner steps run through (local ranks, mixed precision): optim/forward.py.
        self.forward = InnerForward(model)
        #: Turns completed: fragment `turn % P` is the one due.
        self.turn = 0
        self.steps_in_turn = 0
        #: Inner steps since this object was made (not part of any state).
        self.steps = 0
        self.pending: FragmentRound | None = None
        self._began = False

    # -- layout -----------------------------------------------------------------------------

    @property
    def fragments(self) -> int:
        return len(self._fragments)

    def fragment_names(self, fragment: int) -> list[str]:
        return list(self._fragments[fragment].names)

    def fragment_shapes(self, fragment: int) -> list[torch.Size]:
        """The shapes of `fragment_names`, in the order its pseudo-gradient is flattened."""
        return list(self._fragments[fragment].shapes)

    def fragment_numel(self, fragment: int) -> int:
        return self._fragments[fragment].numel

    @property
    def round(self) -> int:
        """Outer steps applied, over all fragments (the state's age is `age`, the turn)."""
        return sum(f.round for f in self._fragments)

    @property
    def age(self) -> int:
        """How far along the run this global state is, to compare it with other peers'
        (catch-up, donor choice): the turn, not the round. A fragment round deferred alone
        moves the turn, which is part of the state and its hash, but not the round; by rounds,
        such a peer would see the group's adverts of the turn before (not yet replaced) as the
        same age and a majority, take them, and so step back a turn, again and again."""
        return self.turn

    def fragment_round(self, fragment: int) -> int:
        return self._fragments[fragment].round

    @property
    def current_fragment(self) -> int:
        return self.turn % len(self._fragments)

    # -- inner loop -------------------------------------------------------------------------

    @property
    def progress(self) -> int:
        """The run's inner steps so far as this peer sees them (the learning-rate schedule's
        clock): H/P per turn of the global state, plus this peer's steps in this turn."""
        return self.turn * self.config.stride + self.steps_in_turn

    def inner_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """One inner step on the local parameters (all fragments); returns the batch loss."""
        dcfg = self.config.diloco
        dcfg.lr_schedule.apply(self.inner_optimizer, dcfg.inner_lr, self.progress)
        loss, samples = forward_step(
            self.forward, self._params, self.inner_optimizer, dcfg.grad_clip, batch
        )
        self.steps += 1
        self.steps_in_turn += 1
        for frag in self._fragments:
            frag.samples += samples
        return loss

    def round_due(self) -> bool:
        """True once H/P − τ steps of this turn have run and its round has not begun. The
        caller must first finish a round still pending (an eager stand-in)."""
        cfg = self.config
        return not self._began and self.steps_in_turn >= cfg.stride - cfg.overlap_steps

    def outer_due(self) -> bool:
        """True once H/P steps of this turn have run: the turn's fragment needs its average."""
        return self.steps_in_turn >= self.config.stride

    # -- one fragment's round ---------------------------------------------------------------

    def begin_round(self) -> FragmentRound:
        """Takes the due fragment's pseudo-gradient; the round is pending until finished."""
        if self.pending is not None:
            raise RuntimeError(
                f"fragment {self.pending.fragment}'s round (turn {self.pending.turn}) is still "
                "pending: at most one fragment is in flight"
            )
        if not self.round_due():
            raise RuntimeError("no round is due")
        frag = self._fragments[self.current_fragment]
        rnd = FragmentRound(
            fragment=frag.index,
            turn=self.turn,
            round=frag.round,
            pseudo_grad=frag.pseudo_gradient(),
            weight=float(max(1, frag.samples)),
            began_at_step=self.steps,
        )
        self.pending = rnd
        self._began = True
        return rnd

    def finish_round(self, result: torch.Tensor | Averaged | None) -> FragmentReport:
        """Applies the pending round's average (None: the round failed) at the turn's outer
        step, or replaces the eager stand-in applied for it."""
        rnd = self.pending
        if rnd is None:
            raise RuntimeError("no round is pending")
        if rnd._stand_in is not None:
            return self._replace_stand_in(rnd, result)
        if rnd.turn != self.turn or not self.outer_due():
            raise RuntimeError("the pending round's outer step is not due yet")
        frag = self._fragments[rnd.fragment]
        averaged, status, reason = read_average(result, frag.numel)
        weight = rnd.weight
        if averaged is None and self.config.diloco.on_failure == "defer":
            self.pending = None
            self._next_turn()
            return self._report(rnd, "deferred", 0.0, reason, weight)
        if averaged is None:
            averaged = rnd.pseudo_grad
        frag.outer.step(averaged)
        self._merge(frag)
        frag.round += 1
        frag.samples = 0
        self.pending = None
        self._next_turn()
        return self._report(rnd, status, float(averaged.norm()), reason, weight)

    def apply_stand_in(self) -> FragmentReport:
        """Eager: the outer step is due and the average has not arrived; apply this peer's own
        pseudo-gradient now and go on training. `finish_round` replaces it later."""
        if not self.config.eager:
            raise RuntimeError("stand-ins are for eager updates (StreamingConfig.eager)")
        rnd = self.pending
        if rnd is None or rnd._stand_in is not None or rnd.turn != self.turn:
            raise RuntimeError("no round awaits its outer step")
        if not self.outer_due():
            raise RuntimeError("the pending round's outer step is not due yet")
        frag = self._fragments[rnd.fragment]
        before = frag.outer.snapshot()
        frag.outer.step(rnd.pseudo_grad)
        self._merge(frag)
        rnd._stand_in = StandIn(before, frag.outer.values.clone(), frag.samples)
        frag.round += 1
        frag.samples = 0
        self._next_turn()
        return self._report(rnd, "eager", float(rnd.pseudo_grad.norm()), None, rnd.weight)

    def _replace_stand_in(
        self, rnd: FragmentRound, result: torch.Tensor | Averaged | None
    ) -> FragmentReport:
        stand_in = rnd._stand_in
        assert stand_in is not None
        frag = self._fragments[rnd.fragment]
        averaged, status, reason = read_average(result, frag.numel)
        frag.outer.restore(stand_in.before)
        applied = 0.0
        if averaged is None and self.config.diloco.on_failure == "defer":
            status = "deferred"
            frag.round -= 1
            frag.samples += stand_in.samples
        else:
            if averaged is None:
                averaged = rnd.pseudo_grad
            frag.outer.step(averaged)
            applied = float(averaged.norm())
        shift = (frag.outer.values - stand_in.after) * (1.0 - self.config.mix_alpha)
        with torch.no_grad():
            for p, delta in zip(frag.params, views(shift, frag.shapes), strict=True):
                p.add_(delta.to(device=p.device, dtype=p.dtype))
        self.pending = None
        report = self._report(rnd, status, applied, reason, rnd.weight)
        return dataclasses.replace(report, replaced_stand_in=True)

    def _merge(self, frag: Fragment) -> None:
        """θ_local ← (1 − α)·θ_outer + α·θ_local for the fragment's parameters."""
        alpha = self.config.mix_alpha
        if alpha == 1.0:
            return
        with torch.no_grad():
            for p, g in zip(frag.params, views(frag.outer.values, frag.shapes), strict=True):
                if alpha == 0.0:
                    p.copy_(g)
                else:
                    p.copy_(g * (1.0 - alpha) + p.detach().to("cpu", torch.float32) * alpha)

    def _next_turn(self) -> None:
        self.turn += 1
        self.steps_in_turn = 0
        self._began = False

    def _report(
        self,
        rnd: FragmentRound,
        status: FragmentStatus,
        applied: float,
        reason: str | None,
        weight: float,
    ) -> FragmentReport:
        return FragmentReport(
            fragment=rnd.fragment,
            round=self._fragments[rnd.fragment].round,
            turn=self.turn,
            status=status,
            weight=weight,
            pseudo_grad_norm=float(rnd.pseudo_grad.norm()),
            applied_norm=applied,
            steps_since_begin=self.steps - rnd.began_at_step,
            reason=reason,
        )

    # -- flat views -------------------------------------------------------------------------

    def flat_params(self) -> torch.Tensor:
        """The local parameters as one fresh flat fp32 CPU tensor (model order)."""
        return flatten(self._params)

    def global_flat(self) -> torch.Tensor:
        """A copy of the global parameters, flat fp32 in model order."""
        state = self.state_dict()
        return flatten([state[GLOBAL_PREFIX + n] for n in self.names])

    # -- global state (what joiners download) -----------------------------------------------

    def _check_quiet(self, what: str) -> None:
        rnd = self.pending
        if rnd is not None and rnd._stand_in is not None:
            raise RuntimeError(
                f"cannot {what} while fragment {rnd.fragment}'s eager stand-in awaits the "
                "group's average (it is this peer's alone)"
            )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The global state as flat named tensors (copies): `global.<param>`,
        `outer_momentum.<param>` (fp32, each in its fragment's optimiser), `turn`,
        `fragment_round.<f>` and `round` (int64 scalars). Not while an eager stand-in is
        pending: that state is this peer's alone."""
        self._check_quiet("take the global state")
        out: dict[str, torch.Tensor] = {}
        for frag in self._fragments:
            out.update(
                global_tensors(frag.names, frag.shapes, frag.outer.values, frag.outer.momentum())
            )
        ordered = {k: out[k] for p in (GLOBAL_PREFIX, MOMENTUM_PREFIX) for k in self._keys(p)}
        ordered[ROUND_KEY] = torch.tensor(self.round, dtype=torch.int64)
        ordered[TURN_KEY] = torch.tensor(self.turn, dtype=torch.int64)
        for frag in self._fragments:
            ordered[f"{FRAGMENT_ROUND_PREFIX}{frag.index}"] = torch.tensor(
                frag.round, dtype=torch.int64
            )
        return ordered

    def _keys(self, prefix: str) -> list[str]:
        return [prefix + n for n in self.names]

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Adopt a global state (e.g. downloaded from donors): validates it all first, then
        sets every fragment's global copy, momentum and round counter and the schedule's turn,
        and resets the local parameters to the global ones. Not while a round is pending."""
        if self.pending is not None:
            raise RuntimeError("cannot load a global state while a round is pending")
        fragment_keys = [f"{FRAGMENT_ROUND_PREFIX}{f.index}" for f in self._fragments]
        counters = check_global_state(
            state, self.names, self._shapes, [ROUND_KEY, TURN_KEY, *fragment_keys]
        )
        rounds = [counters[k] for k in fragment_keys]
        if sum(rounds) != counters[ROUND_KEY]:
            raise ValueError(
                f"global state: round {counters[ROUND_KEY]} is not the sum of the fragments' "
                f"rounds {rounds}"
            )
        for frag, rnd in zip(self._fragments, rounds, strict=True):
            frag.outer.load(
                flat_from_state(state, GLOBAL_PREFIX, frag.names, frag.shapes),
                flat_from_state(state, MOMENTUM_PREFIX, frag.names, frag.shapes),
            )
            frag.round = rnd
            frag.samples = 0
            with torch.no_grad():
                for p, g in zip(frag.params, views(frag.outer.values, frag.shapes), strict=True):
                    p.copy_(g)
        self.turn = counters[TURN_KEY]
        self.steps_in_turn = 0
        self._began = False

    # -- local state (what a restart restores; never shipped) -------------------------------

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """Local parameters, inner optimiser state and schedule counters. A round in flight is
        not saved: after a restart the turn's round begins again at the next step."""
        self._check_quiet("save the local state")
        out = inner_state_dict(self.names, self._params, self.inner_optimizer)
        out["steps_in_turn"] = torch.tensor(self.steps_in_turn, dtype=torch.int64)
        for frag in self._fragments:
            out[f"fragment_samples.{frag.index}"] = torch.tensor(frag.samples, dtype=torch.int64)
        return out

    def load_local_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore `local_state_dict` (after `load_state_dict` for the global part)."""
        keys = ["steps_in_turn", *(f"fragment_samples.{f.index}" for f in self._fragments)]
        for key in keys:
            if key not in state:
                raise ValueError(f"local state: missing {key!r}")
        load_inner_state(self.names, self._params, self.inner_optimizer, state)
        self.steps_in_turn = int(state["steps_in_turn"])
        for frag in self._fragments:
            frag.samples = int(state[f"fragment_samples.{frag.index}"])
        self._began = False
