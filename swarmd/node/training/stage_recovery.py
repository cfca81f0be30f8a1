"""Rebuilding a SWARM stage whose every server is gone, without a checkpoint (CheckFree).

A stage is *lost* when no server serves or joins it in the directory (a dead server's record
lapses within directory.RECORD_TTL_S) while the run has trained (another stage stepped): its
weights left with its servers. The first server to take the stage then rebuilds it from its
two neighbours (optim/checkfree.py): it downloads stages i-1 and i+1 (their servers' shared
states, as a joiner of those stages would) and averages their layers weighted by the norms of
their last gradients, which every server publishes in its directory record, so nothing is
stored or sent for recovery while nothing fails.

Two peers must not rebuild one stage with different weights: the rebuilder first takes a lease
(`swarmd/<run>/stage<i>/recovery`, an entry per asker; the earliest asker holds it, see
`take_lease`). The others wait for the holder's state to be advertised and download it.

Not built: CheckFree+ (the first and last stages, rebuilt from copies of the embedding and
head kept by their neighbours, trained to stand in by swapping neighbouring stages on half
the micro-batches); a lost first or last stage restarts from the run's seed, and says so.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import trio
from torch import nn

from swarmd.node.dht import DHTNode
from swarmd.node.dht.records import RecordError
from swarmd.node.swarm import directory
from swarmd.node.swarm.directory import StageRecord
from swarmd.node.training.context import PeerContext
from swarmd.node.training.options import JoinError
from swarmd.node.training.sharedstate import SharedState
from swarmd.optim.checkfree import LR_SCALE, LayoutMismatch, Recovery, recover
from swarmd.optim.stage import StageOptConfig, StageTrainer
from swarmd.protocol.identity import PeerId
from swarmd.workloads import lm_loss

log = logging.getLogger("swarmd.swarm")

#: How long a rebuilder's lease holds the stage (a rebuild downloads two stages' states).
LEASE_S = 120.0
#: How long an asker waits for other askers' lease entries before it reads who holds it.
LEASE_SETTLE_S = 2.0
#: How long a peer that lost the lease waits for the holder's rebuilt state to be advertised.
WAIT_S = 90.0
POLL_S = 1.0


class RecoveryFailed(Exception):
    """The stage could not be rebuilt from its neighbours (the message says why)."""


def recovery_key(run: str, stage: int) -> str:
    return f"swarmd/{run}/stage{stage}/recovery"


def trained(records: dict[PeerId, StageRecord], stage: int) -> bool:
    """Whether the run has trained: another stage than `stage` stepped on a gradient (its
    round counter alone moves in idle rounds too)."""
    return any(r.grad_norm > 0 for r in records.values() if r.stage != stage)


def lost(records: dict[PeerId, StageRecord], stage: int) -> bool:
    """Whether `stage` has no server left while the run has trained (at a run's start a
    stage's first server must take the seed, not its neighbours' average)."""
    if any(r.stage == stage and r.state in ("serving", "joining") for r in records.values()):
        return False
    return trained(records, stage)


async def take_stage_state(
    peer: PeerContext, stage: int, trainers: list[StageTrainer], state: SharedState
) -> tuple[str, bool]:
    """The stage's state for a server taking it: its servers', or rebuilt when it was lost.
    Returns the origin and whether it was rebuilt by CheckFree.

    A stage whose servers all died a moment ago still has their records (they lapse within
    RECORD_TTL_S): the download from them fails, and the seed is no state for a stage of a
    run that has trained. Then this server waits for the records to lapse (the stage is lost)
    or a server to answer, at most a record lifetime and two refreshes, before it takes the
    seed."""
    deadline = time.monotonic() + directory.RECORD_TTL_S + 2 * directory.REFRESH_S
    while True:
        records = await directory.read(peer.dht, peer.config.name, len(trainers))
        if lost(records, stage):
            origin = await take_lost_stage(peer, stage, trainers, state, records)
            return origin, origin == "checkfree"
        origin, _ = await state.take_initial()
        if origin != "fresh" or not trained(records, stage) or time.monotonic() > deadline:
            return origin, False
        peer.out.event(
            "stage_wait",
            f"stage {stage}: no server of it answered; waiting for their records to lapse "
            "(then the stage is rebuilt)",
            stage=stage,
        )
        await trio.sleep(directory.REFRESH_S)


async def take_lease(dht: DHTNode, run: str, stage: int, me: PeerId) -> PeerId | None:
    """Who holds the stage's recovery lease, this peer having asked for it (None: no entry
    could be read). Each asker stores an entry under its own peer id; after LEASE_SETTLE_S
    (for racers' entries to land) the holder is the earliest asker (the entry that expires
    first, ties by peer id), which every asker that reads both entries names alike. (A plain
    key held by its first owner was tried first: each asker's own node kept its own record,
    the newest expiry won every read, and two racers both rebuilt the stage in CI.)"""
    key = recovery_key(run, stage)
    try:
        await dht.store(key, b"rebuilding", dht.now() + LEASE_S, subkey=str(me), republish=False)
    except RecordError as exc:
        log.info("stage %d recovery lease not stored: %s", stage, exc)
    await trio.sleep(LEASE_SETTLE_S)
    entries = await dht.peers(key, exhaustive=True)
    if not entries:
        return None
    return min(entries, key=lambda p: (entries[p].expires, str(p)))


@dataclass(frozen=True)
class Rebuilt:
    recovery: Recovery
    rounds: tuple[int, int]


async def rebuild(
    peer: PeerContext,
    stage: int,
    stages: list[StageTrainer],
    records: dict[PeerId, StageRecord],
) -> Rebuilt:
    """Downloads stages `stage` ± 1 into their trainers, then sets `stages[stage]` to their
    CheckFree average with a fresh optimiser at LR_SCALE times the run's rate."""
    target = stages[stage]
    neighbours = (stages[stage - 1], stages[stage + 1])
    for n in neighbours:
        origin, _ = await SharedState(peer, n, scope=f"stage{n.index}").take_initial()
        if origin != "group":
            raise RecoveryFailed(f"could not download stage {n.index}'s state ({origin})")
    norms = [
        max((r.grad_norm for r in records.values() if r.stage == n.index), default=0.0)
        for n in neighbours
    ]

    def average() -> Recovery:
        try:
            return recover(target.module, neighbours[0].module, neighbours[1].module, *norms)
        except (LayoutMismatch, ValueError) as exc:
            raise RecoveryFailed(str(exc)) from None

    recovery = await trio.to_thread.run_sync(average)
    target.set_lr_scale(LR_SCALE)
    target.round = max(n.round for n in neighbours)
    return Rebuilt(recovery, (neighbours[0].round, neighbours[1].round))


def build_all(peer: PeerContext, modules: list[nn.Module]) -> list[StageTrainer]:
    """A trainer for each of the model's stages (the neighbours' are download targets)."""
    config = peer.config
    opt = StageOptConfig(lr=config.inner_lr, weight_decay=config.weight_decay)
    return [StageTrainer(m, i, len(modules), opt, lm_loss) for i, m in enumerate(modules)]


async def take_rebuilt(state: SharedState, holder: PeerId) -> bool:
    """Waits (at most WAIT_S) for the lease holder's rebuilt state to be advertised, and
    downloads it from the holder (the lost servers' last adverts outlive them: they are not
    asked); whether that worked."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        theirs = [a for a in await state.adverts() if a.owner == str(holder)]
        if theirs:
            return await state.sync_to(theirs)
        await trio.sleep(POLL_S)
    return False


async def take_lost_stage(
    peer: PeerContext,
    stage: int,
    trainers: list[StageTrainer],
    state: SharedState,
    records: dict[PeerId, StageRecord],
) -> str:
    """`stage` was lost: rebuild it (CheckFree, holding the lease), or take the state the
    lease's holder rebuilt; returns where the state came from ("checkfree", "group", or the
    seed's "fresh" for a first or last stage). Raises JoinError when it cannot be had."""
    t0, count = time.monotonic(), len(trainers)
    if not 0 < stage < count - 1:
        peer.metrics.stage_recoveries.labels(method="seed").inc()
        peer.out.event(
            "stage_recovered",
            f"stage {stage} lost: it restarts from the run's seed (CheckFree+, which "
            "rebuilds a first or last stage, is not built)",
            stage=stage,
            method="seed",
        )
        origin, _ = await state.take_initial()
        return origin
    holder = await take_lease(peer.dht, peer.config.name, stage, peer.identity.peer_id)
    if holder is None:
        raise JoinError(f"stage {stage} was lost and its recovery lease cannot be taken; try again")
    if holder != peer.identity.peer_id:
        if await take_rebuilt(state, holder):
            return "group"
        raise JoinError(
            f"stage {stage} was lost and {holder.short()} did not rebuild it in time; try again"
        )
    try:
        rebuilt = await rebuild(peer, stage, trainers, records)
    except RecoveryFailed as exc:
        raise JoinError(f"stage {stage} was lost and could not be rebuilt: {exc}") from None
    rec, took = rebuilt.recovery, time.monotonic() - t0
    peer.metrics.stage_recoveries.labels(method="checkfree").inc()
    peer.out.event(
        "stage_recovered",
        f"stage {stage} lost: rebuilt from stages {stage - 1} and {stage + 1} by CheckFree "
        f"(weights {rec.weight_before:.3f}/{rec.weight_after:.3f}, gradient norms "
        f"{rec.norm_before:.3g}/{rec.norm_after:.3g}), fresh AdamW at "
        f"{trainers[stage].lr_scale:g}x lr, in {took:.1f} s",
        stage=stage,
        method="checkfree",
        neighbours=[stage - 1, stage + 1],
        weights=[round(rec.weight_before, 4), round(rec.weight_after, 4)],
        norms=[rec.norm_before, rec.norm_after],
        neighbour_rounds=list(rebuilt.rounds),
        seconds=round(took, 3),
    )
    return "checkfree"
