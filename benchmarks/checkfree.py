"""CheckFree: a SWARM pipeline loses every server of one stage; what each way back costs.

CheckFree (Blagoev et al. 2025, "All is Not Lost: LLM Recovery without Checkpoints"; code:
gensyn-ai/CheckFree) rebuilds a lost intermediate stage from its two neighbours, their layers
averaged with weights from their last gradient norms, and trains on with a fresh optimiser at
a slightly higher learning rate; nothing is stored while nothing fails. swarmd builds it
(optim/checkfree.py, node/recovery.py); this measures it, in two parts.

1. Loss, in one process, deterministic. The run's model is built by the daemon's own code
   (`build_model` of a `RunConfig` with `algo = "swarm"`, `swarm_stages = 4`, `cut_stages`, a
   `StageTrainer` per stage from `recovery.build_all`) and driven synchronously: a
   round is `--micro-batches` micro-batches (forward through stages 0-2, `last` on stage 3,
   the stateless backward through stages 2-0), then `take` and `apply` on every stage (one
   server per stage: what it took is its stage's average). Micro-batch j of round r is the
   trainer's batch r*k + j (`TokenSource.train_batch`, addressed by seed and step): every arm
   sees the same tokens in the same round. Validation loss: `evaluate` on the first
   `--val-batches` batches of the held-out split. After round T every server of stage 1 is
   gone, and the arms go on from that same state to round N:
   (a) nofail: nothing is lost.
   (b) checkfree: stage 1 rebuilt as the daemon's rebuilder does: a freshly built trainer
       (fresh AdamW) set to `checkfree.recover` of stages 0 and 2 with their
       `last_grad_norm`s, at `checkfree.LR_SCALE` times the run's learning rate.
   (c) random: stage 1 from a model built with another seed (seed + 1000), fresh AdamW (the
       run's own seeded init, the pipeline's start, is reported for stage 0 below).
   (d) checkpoint, the conventional baseline: the whole pipeline's state (every stage's
       `state_dict`) is saved every C rounds (N/8); at the failure every stage rolls back to
       the last one, and the rounds since are lost: the arm still spends N rounds, so it ends
       with N - lost effective rounds (`lost_rounds`; their batches are not replayed). T is
       N/2 + C/2, midway between checkpoints (the expected loss of a failure at a random
       time). Writing a checkpoint costs nothing here (a real one stalls or needs storage).
   `--stage2` loses stage 2 too, in arms of its own. `steps_to_baseline`: rounds after T until
   the checkfree curve is first within 1% of the nofail curve at the same round (-1: never;
   `steps_to_stay`: and stays within it to N), at the resolution of `--eval-every`.
   The first stage lost, in the run above (no swaps): the daemon restarts it from the run's
   seed (`first_seed`), or a random init as in (c) (`first_random`); `first_checkpoint` is
   (d) itself (a whole-pipeline rollback does not depend on which stage failed).
   CheckFree+ (`--skip-plus` leaves it out): the same run with `swarm_swap = 0.5` (the
   trainer's route swaps the end stages with their neighbours on every other micro-batch,
   algorithms/swarm/route.py), trained from round 0 to T, then: `plus_nofail` (no failure),
   `first_plus` / `last_plus` (stage 0 / stage 3 lost and rebuilt as
   recovery.rebuild_end does: the partner's blocks and the copy of the embedding /
   head the partner's server fetched after the last round, fresh AdamW at LR_SCALE), and
   `plus_first_seed` (stage 0 restarted from the seed in the swapped run). Unlike a real run:
   no fp16 activations, no stale gradients, no int8 averaging.

2. Recovery time, `swarmd join` processes on loopback as in test_checkfree_join.py (not run
   with `--skip-loopback`): a bootstrap, a server per stage of 4, a trainer; once every stage
   has stepped, stage 1's server is SIGKILLed; when the trainer reports the stage missing
   (the dead record lapsed) a spare server joins stage 1, finds it lost and rebuilds it.
   Then the same with `swarm_swap = 0.5` and stage 0 lost (CheckFree+): the `_first` keys.
   `recovery_s`: the spare's own figure, from its detection of the loss to its first trained
   round; `recovery_total_s`: from the SIGKILL (the record's lapse and the spare's start
   included); `detect_s`: from the SIGKILL to the trainer's `stage_missing`.

Measured (2 cores, seeds 0 and 1, defaults: N=200, T=112, 12 rounds lost): checkfree ended
+0.60% / +0.52% above nofail, random -0.45% / -0.36%, checkpoint +0.98% / +0.46%; a lost first
stage +6.8% / +5.1% (seed restart); recovery_s 4.3 / 4.6 s (22 s from the SIGKILL). So the
3% and 10 s targets were met, "checkfree below random" was not: in this model a fresh block is
close to the identity (GPT-2's residual projections start at std 0.005), so a random middle
stage costs almost nothing, while CheckFree's weights leaned 0.91-0.95 to stage 0 (its
blocks' gradient norm 12x stage 2's at seed 0), making stage 1 a near copy of stage 0's blocks.

CheckFree+ (2026-11-27, seeds 0 and 1, one thread, the same defaults): the swapped run ends
+0.59% / +1.09% above nofail without failure; its first stage lost and rebuilt: +0.93% /
+0.75% (the targets, below a seed restart and within 3%: met); a seed restart in the swapped
run +2.79% / +3.10%; a lost last stage rebuilt: +0.48% / +0.72%.

The last line: `loss_nofail=… loss_checkfree=… loss_random=… loss_checkpoint=… recovery_s=…
steps_to_baseline=… first_random=… first_checkpoint=… lost_rounds=…` and more; the line
before says whether the issue's targets (checkfree below random and within 3% of nofail,
recovery under 10 s) were met: checked, never tuned for.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarmd.node.algorithms.swarm import recovery
from swarmd.node.algorithms.swarm.route import route, swap_for
from swarmd.node.algorithms.swarm.server_role import cut_stages
from swarmd.node.peer.context import PeerContext
from swarmd.node.peer.model import build_model
from swarmd.node.peer.runconfig import RunConfig
from swarmd.optim import checkfree
from swarmd.optim.stage import StageTrainer
from swarmd.workloads import TokenSource, evaluate, lm_loss, load_source
from tests.harness.join import join_cmd, start_bootstrap, wait_for
from tests.harness.processes import Proc, ProcessGroup

STAGES = 4
#: CheckFree+'s share of swapped micro-batches (the paper's: every other one).
SWAP_SHARE = 0.5
#: The "random" arms' init: a model built with the run's seed plus this.
RANDOM_SEED_OFFSET = 1000
#: Within this share of the nofail curve counts as back (the issue's 1%).
BACK_WITHIN = 0.01
START_S = 120.0

Batch = tuple[torch.Tensor, torch.Tensor]
Curve = dict[int, float]
Stages = list[StageTrainer]
_T0 = time.monotonic()


def log(text: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f}s] {text}", file=sys.stderr, flush=True)


def run_config(seed: int, lr: float) -> RunConfig:
    """The run: the built-in GPT of 8 blocks cut into 4 stages (2 blocks each; stage 0 also
    holds the embedding, stage 3 the head), small enough to train in minutes on 2 cores."""
    return RunConfig(
        name="checkfree", n_layer=8, n_head=4, n_embd=64, block_size=64, batch_size=8,
        inner_lr=lr, seed=seed, data_shards=1, algo="swarm", swarm_stages=STAGES,
    )  # fmt: skip


@dataclass(frozen=True)
class Setup:
    config: RunConfig
    source: TokenSource
    val: list[Batch]
    rounds: int
    fail_at: int
    checkpoint_every: int
    micro_batches: int
    eval_every: int


@dataclass(frozen=True)
class Snapshot:
    """A whole pipeline's state: each stage's state_dict (cloned) and last gradient norm."""

    round: int
    states: list[dict[str, torch.Tensor]]
    norms: list[float]


class Pipeline(nn.Module):
    """The stages composed, with the GPT's `forward(idx, targets) -> (logits, loss)`."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = idx
        for part in self.parts:
            h = part(h)
        return h, None if targets is None else lm_loss(h, targets)


# -- the in-process pipeline -------------------------------------------------------------------


def build(config: RunConfig) -> Stages:
    """The run's seeded model cut into its stages, a trainer each, as a stage server builds
    them (server_role.StageServer._build_stages; build_all reads only the peer's config)."""
    modules = cut_stages(build_model(config, "cpu"), config.swarm_stages)
    return recovery.build_all(cast(PeerContext, SimpleNamespace(config=config)), modules)


def snapshot(stages: Stages) -> Snapshot:
    return Snapshot(
        stages[0].round, [t.state_dict() for t in stages], [t.last_grad_norm for t in stages]
    )


def restore(setup: Setup, snap: Snapshot) -> Stages:
    stages = build(setup.config)
    for t, state, norm in zip(stages, snap.states, snap.norms, strict=True):
        t.load_state_dict(state)
        t.last_grad_norm = norm
    return stages


def batches(setup: Setup, r: int) -> list[Batch]:
    """Round r's micro-batches: the trainer's r*k .. r*k + k - 1 (same in every arm)."""
    c, k = setup.config, setup.micro_batches
    return [
        setup.source.train_batch(0, c.data_shards, c.batch_size, c.block_size, c.seed, r * k + j)
        for j in range(k)
    ]


def train_round(stages: Stages, micro: list[Batch], first_seq: int, swap: float) -> None:
    """The micro-batches through the pipeline (along the trainer's route,
    algorithms/swarm/route.py: the end stages swapped with their neighbours on a `swap` share
    of them), then every stage's
    take + apply (one server a stage: what it took is the stage's average, as in
    StageServer._round)."""
    for j, (x, y) in enumerate(micro):
        *through, last = route(len(stages), swap_for(first_seq + j, len(stages), swap))
        inputs: list[torch.Tensor] = [x]
        for hop in through:
            inputs.append(stages[hop.stage].forward(inputs[-1], part=hop.part))
        _, g = stages[last.stage].last(inputs[-1], y, part=last.part)
        for hop, h in zip(reversed(through), reversed(inputs[:-1]), strict=True):
            assert g is not None
            g = stages[hop.stage].backward(h, g, part=hop.part)
    for t in stages:
        grad, count = t.take()
        if count and bool(grad.any()):
            t.apply(grad)
        else:
            t.skip()


def val_loss(setup: Setup, stages: Stages) -> float:
    return evaluate(Pipeline([t.module for t in stages]), setup.val)


def evaluated(setup: Setup, n: int) -> bool:
    return n % setup.eval_every == 0 or n in (setup.fail_at, setup.rounds)


def prefix(setup: Setup) -> tuple[Curve, Snapshot, Snapshot]:
    """Rounds 0..T-1 (shared by every arm): the curve, the state at T, the last checkpoint."""
    stages = build(setup.config)
    curve = {0: val_loss(setup, stages)}
    checkpoint = snapshot(stages)  # a run's init is its first checkpoint
    for r in range(setup.fail_at):
        train_round(stages, batches(setup, r), r * setup.micro_batches, setup.config.swarm_swap)
        n = r + 1
        if n % setup.checkpoint_every == 0:
            checkpoint = snapshot(stages)
        if evaluated(setup, n):
            curve[n] = val_loss(setup, stages)
            log(f"round {n}: validation loss {curve[n]:.4f}")
    return curve, snapshot(stages), checkpoint


def go_on(setup: Setup, stages: Stages, name: str) -> Curve:
    """Rounds T..N-1 from `stages` (already failed and recovered as the arm says)."""
    curve = {setup.fail_at: val_loss(setup, stages)}
    for r in range(setup.fail_at, setup.rounds):
        train_round(stages, batches(setup, r), r * setup.micro_batches, setup.config.swarm_swap)
        if evaluated(setup, r + 1):
            curve[r + 1] = val_loss(setup, stages)
    log(f"{name}: loss {curve[setup.fail_at]:.4f} at round {setup.fail_at}, "
        f"{curve[setup.rounds]:.4f} at {setup.rounds}")  # fmt: skip
    return curve


# -- what each arm does to the lost stage -------------------------------------------------------

Failure = Callable[[Setup, Stages, int], Stages]


def swapped(stages: Stages, i: int, fresh: StageTrainer) -> Stages:
    fresh.round = stages[i].round
    return [*stages[:i], fresh, *stages[i + 1 :]]


def with_checkfree(setup: Setup, stages: Stages, i: int) -> Stages:
    """recovery.rebuild, in process: a fresh trainer set to CheckFree's average of its
    neighbours, weighted by their last gradient norms, at LR_SCALE."""
    fresh = build(setup.config)[i]
    before, after = stages[i - 1], stages[i + 1]
    rec = checkfree.recover(
        fresh.module, before.module, after.module, before.last_grad_norm, after.last_grad_norm
    )
    fresh.set_lr_scale(checkfree.LR_SCALE)
    log(f"stage {i} rebuilt: weights {rec.weight_before:.3f}/{rec.weight_after:.3f} from "
        f"gradient norms {rec.norm_before:.3g}/{rec.norm_after:.3g}")  # fmt: skip
    return swapped(stages, i, fresh)


def with_checkfree_plus(setup: Setup, stages: Stages, i: int) -> Stages:
    """recovery.rebuild_end, in process: a fresh trainer of the lost end stage takes its
    swap partner's blocks and the partner server's copy of its edge layers (refreshed after
    every round: the copy at the failure), at LR_SCALE."""
    fresh = build(setup.config)[i]
    partner = stages[1 if i == 0 else len(stages) - 2]
    copy = stages[i].edge_vector()  # what the partner's server fetched after the last round
    checkfree.recover_end(fresh.part("edge"), fresh.part("blocks"), partner.module, copy)
    fresh.set_lr_scale(checkfree.LR_SCALE)
    log(f"stage {i} rebuilt by CheckFree+ from stage {partner.index} and the edge copy")
    return swapped(stages, i, fresh)


def run_plus_arms(setup: Setup) -> dict[str, Curve]:
    """CheckFree+: the same run trained with the end stages swapped on SWAP_SHARE of the
    micro-batches; no failure, the first (last) stage lost and rebuilt by CheckFree+, and the
    first stage restarted from the seed in that run."""
    plus = replace(setup, config=replace(setup.config, swarm_swap=SWAP_SHARE))
    before, at_failure, _ = prefix(plus)
    plan: list[tuple[str, Failure | None, int]] = [
        ("plus_nofail", None, 0),
        ("first_plus", with_checkfree_plus, 0),
        ("last_plus", with_checkfree_plus, STAGES - 1),
        ("plus_first_seed", with_seed, 0),
    ]
    arms: dict[str, Curve] = {}
    for name, fail, i in plan:
        stages = restore(plus, at_failure)
        arms[name] = before | go_on(plus, fail(plus, stages, i) if fail else stages, name)
    return arms


def with_random(setup: Setup, stages: Stages, i: int) -> Stages:
    other = replace(setup.config, seed=setup.config.seed + RANDOM_SEED_OFFSET)
    return swapped(stages, i, build(other)[i])


def with_seed(setup: Setup, stages: Stages, i: int) -> Stages:
    """What the daemon does for a lost first or last stage: the run's seeded init."""
    return swapped(stages, i, build(setup.config)[i])


def run_arms(setup: Setup, stage2: bool) -> tuple[dict[str, Curve], int]:
    """Every arm's curve (the shared rounds before T included) and the rounds lost."""
    before, at_failure, checkpoint = prefix(setup)
    lost = at_failure.round - checkpoint.round
    log(f"failure after round {setup.fail_at}; last checkpoint at round {checkpoint.round} "
        f"({lost} rounds lost)")  # fmt: skip
    plan: list[tuple[str, Failure | None, int]] = [
        ("nofail", None, 0),
        ("checkfree", with_checkfree, 1),
        ("random", with_random, 1),
    ]
    if stage2:
        plan += [("stage2_checkfree", with_checkfree, 2), ("stage2_random", with_random, 2)]
    plan += [("first_seed", with_seed, 0), ("first_random", with_random, 0)]
    arms: dict[str, Curve] = {}
    for name, fail, i in plan:
        stages = restore(setup, at_failure)
        arms[name] = before | go_on(setup, fail(setup, stages, i) if fail else stages, name)
    arms["checkpoint"] = before | go_on(setup, restore(setup, checkpoint), "checkpoint")
    return arms, lost


def steps_back(curve: Curve, baseline: Curve, fail_at: int, stay: bool = False) -> int:
    """Rounds after the failure until `curve` is first within BACK_WITHIN of the baseline
    (`stay`: and within it at every evaluation after); -1 if never."""
    rounds = sorted(k for k in curve if k >= fail_at)
    back = [curve[n] <= baseline[n] * (1 + BACK_WITHIN) for n in rounds]
    for j, n in enumerate(rounds):
        if back[j] and (not stay or all(back[j:])):
            return n - fail_at
    return -1


# -- recovery time on loopback ------------------------------------------------------------------


def run_toml(c: RunConfig) -> str:
    """The run file of the same run (rounds every 2 s, no rebalancing: one server a stage)."""
    keys = ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "inner_lr", "seed")
    keys += ("data_shards", "swarm_stages", "swarm_swap")
    return "".join(f"{k} = {getattr(c, k)}\n" for k in keys) + (
        'algo = "swarm"\nswarm_round_s = 2.0\nswarm_rebalance_s = 0\n'
    )


def _server(root: Path, boot: str, name: str, stage: int, *extra: str) -> list[str]:
    return join_cmd(root, name, boot, "--role", "server", "--stage", str(stage), *extra,
                    steps=1_000_000)  # fmt: skip


def loopback(config: RunConfig, lost: int = 1) -> dict[str, float]:
    """The SIGKILL of stage `lost`'s only server and its rebuild by a spare, as real processes
    (started as tests/harness/swarm.py starts stages; every child stopped at the end,
    before its state directory goes). A first stage needs the run to swap (CheckFree+)."""
    with tempfile.TemporaryDirectory(prefix="swarmd-checkfree-") as tmp:
        root, processes = Path(tmp), ProcessGroup()
        try:
            (root / "run.toml").write_text(run_toml(config))
            boot = start_bootstrap(processes, root)
            commands = [_server(root, boot, f"s{i}", i) for i in range(STAGES)]
            commands[0] += ["--create-run", str(root / "run.toml")]
            servers = processes.start_many(commands, timeout=START_S)
            for s in servers:
                wait_for(s, "stage", timeout=START_S)
            log("loopback: a server on each of the 4 stages; the trainer starts")
            (trainer,) = processes.start_many(
                [join_cmd(root, "t", boot, "--role", "trainer", steps=1_000_000)]
            )
            for s in servers:  # every stage has stepped: their records carry gradient norms
                _first_trained_round(s, START_S)
            _first_trained_round(servers[1], START_S)  # and stage 1 copied stage 0's edge
            time.sleep(4)  # a record refresh
            killed = time.time()
            servers[lost].process.send_signal(signal.SIGKILL)
            log(f"loopback: stage {lost}'s server SIGKILLed")
            missing = wait_for(trainer, "stage_missing", timeout=60)
            log(f"loopback: the trainer reports stage {lost} missing; the spare joins")
            (spare,) = processes.start_many([_server(root, boot, "spare", lost)], timeout=START_S)
            return _recovered(spare, killed, float(missing["time"]))
        finally:
            processes.close()


def _event(proc: Proc, timeout: float) -> dict[str, Any]:
    return proc.receive(timeout)


def _first_trained_round(proc: Proc, timeout: float) -> dict[str, Any]:
    while (e := _event(proc, timeout))["event"] != "stage_round" or not e["micro_batches"]:
        pass
    return e


def _recovered(spare: Proc, killed: float, missing: float) -> dict[str, float]:
    """The spare's recovery, from its events up to its first trained round."""
    method, took = "none", math.nan
    while (e := _event(spare, START_S))["event"] != "stage":
        if e["event"] == "stage_recovered":
            method, took = str(e["method"]), float(e.get("seconds", math.nan))
    log(f"loopback: the spare serves stage {e['stage']} ({e['origin']} start, recovery: {method})")
    e = _first_trained_round(spare, 60)
    return {
        "recovery_s": float(e.get("recovery_s", math.nan)),
        "recovery_total_s": float(e["time"]) - killed,
        "detect_s": missing - killed,
        "rebuild_s": took,
        "checkfree_rebuilt": float(method in ("checkfree", "checkfree+")),
    }


# -- report ------------------------------------------------------------------------------------


def table(arms: dict[str, Curve], setup: Setup, lost: int) -> None:
    names = list(arms)
    print(f"\nvalidation loss by round (failure after round {setup.fail_at}; checkpoint arm: "
          f"{lost} rounds lost, its effective round is the round - {lost})")  # fmt: skip
    print("round  " + " ".join(f"{n:>16}" for n in names))
    for n in sorted(arms["nofail"]):
        print(f"{n:5d}  " + " ".join(f"{arms[a][n]:16.4f}" for a in names))
    base = arms["nofail"][setup.rounds]
    print("\narm                at failure     final   vs nofail")
    for a in names:
        c = arms[a]
        print(f"{a:17s} {c[setup.fail_at]:10.4f} {c[setup.rounds]:9.4f} "
              f"{100 * (c[setup.rounds] / base - 1):+10.2f}%")  # fmt: skip


def targets(report: dict[str, Any]) -> str:
    cf, rnd, nf = report["loss_checkfree"], report["loss_random"], report["loss_nofail"]
    rec = report.get("recovery_s", math.nan)
    gap = 100 * (cf / nf - 1)

    def yes(ok: bool) -> str:
        return "met" if ok else "NOT met"

    parts = [
        f"checkfree < random: {yes(cf < rnd)}",
        f"checkfree within 3% of nofail ({gap:+.2f}%): {yes(gap <= 3)}",
        f"recovery_s < 10 ({rec:.2f} s): " + ("not measured" if math.isnan(rec) else yes(rec < 10)),
    ]
    if "loss_first_plus" in report:
        plus, seed = report["loss_first_plus"], report["loss_plus_first_seed"]
        first = 100 * (plus / nf - 1)
        rec = report.get("recovery_s_first", math.nan)
        parts += [
            f"first stage: CheckFree+ < seed restart: {yes(plus < seed)}",
            f"CheckFree+ within 3% of nofail ({first:+.2f}%): {yes(first <= 3)}",
            f"recovery_s_first < 10 ({rec:.2f} s): "
            + ("not measured" if math.isnan(rec) else yes(rec < 10)),
        ]
    return "targets: " + "; ".join(parts)


def measured(run: Callable[[], dict[str, float]], suffix: str) -> dict[str, float]:
    """A loopback run's figures, keys with `suffix`; NaN (said, not hidden) if it failed."""
    try:
        return {k + suffix: v for k, v in run().items()}
    except AssertionError as exc:  # a process failed or timed out
        log(f"loopback{suffix} failed: {str(exc)[:2000]}")
        return {f"recovery_s{suffix}": math.nan, f"recovery_total_s{suffix}": math.nan}


def make_setup(args: argparse.Namespace) -> Setup:
    rounds = 48 if args.quick else args.rounds
    every = args.checkpoint_every or max(1, rounds // 8)
    fail_at = args.fail_at or rounds // 2 + every // 2
    if not 0 < fail_at < rounds:
        raise SystemExit(f"--fail-at must be in (0, {rounds})")
    config = run_config(args.seed, args.lr)
    source = load_source("builtin")
    val = source.validation_batches(config.batch_size, config.block_size, args.val_batches)
    return Setup(config, source, val, rounds, fail_at, every, args.micro_batches,
                 args.eval_every or (4 if args.quick else 10))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seed", type=int, default=0, help="the run's seed: init and data order")
    ap.add_argument("--rounds", type=int, default=200, help="N, rounds of every arm")
    ap.add_argument("--fail-at", type=int, default=0, help="T (default N/2 + C/2)")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="C (default N/8)")
    ap.add_argument("--lr", type=float, default=0.002, help="the run's inner_lr (AdamW)")
    ap.add_argument("--micro-batches", type=int, default=4, help="per round")
    ap.add_argument("--eval-every", type=int, default=0, help="rounds (default 10; quick 4)")
    ap.add_argument("--val-batches", type=int, default=16)
    ap.add_argument("--stage2", action="store_true", help="also lose stage 2, arms of its own")
    ap.add_argument("--skip-loopback", action="store_true", help="no recovery_s (processes)")
    ap.add_argument("--skip-plus", action="store_true", help="no CheckFree+ arms (first stage)")
    ap.add_argument("--quick", action="store_true", help="48 rounds")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the children are stopped
    setup = make_setup(args)
    c = setup.config
    log(f"S={STAGES}, n_layer={c.n_layer}, n_embd={c.n_embd}, batch {c.batch_size}x"
        f"{c.block_size}, {setup.micro_batches} micro-batches a round, N={setup.rounds}, "
        f"T={setup.fail_at}, C={setup.checkpoint_every}, lr {c.inner_lr:g}, seed {c.seed}, "
        f"{torch.get_num_threads()} threads")  # fmt: skip
    arms, lost = run_arms(setup, args.stage2)
    n = setup.rounds
    report: dict[str, Any] = {
        "loss_nofail": arms["nofail"][n],
        "loss_checkfree": arms["checkfree"][n],
        "loss_random": arms["random"][n],
        "loss_checkpoint": arms["checkpoint"][n],
    }
    if not args.skip_plus:
        plus = run_plus_arms(setup)
        arms |= plus
        report |= {f"loss_{k}": plus[k][n] for k in plus}
    if not args.skip_loopback:
        report.update(measured(lambda: loopback(c), ""))
        if not args.skip_plus:
            report.update(
                measured(lambda: loopback(replace(c, swarm_swap=SWAP_SHARE), 0), "_first")
            )
    report["steps_to_baseline"] = steps_back(arms["checkfree"], arms["nofail"], setup.fail_at)
    report["steps_to_stay"] = steps_back(arms["checkfree"], arms["nofail"], setup.fail_at, True)
    report["random_steps_to_stay"] = steps_back(arms["random"], arms["nofail"], setup.fail_at, True)
    report |= {
        "first_seed": arms["first_seed"][n],
        "first_random": arms["first_random"][n],
        "first_checkpoint": arms["checkpoint"][n],
        "lost_rounds": lost,
        "rounds": n,
        "fail_at": setup.fail_at,
    }
    if args.stage2:
        report |= {k: arms[k][n] for k in ("stage2_checkfree", "stage2_random")}
    report["wall_s"] = time.monotonic() - _T0
    table(arms, setup, lost)
    print(targets(report))
    print(
        " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in report.items())
    )


if __name__ == "__main__":
    main()
