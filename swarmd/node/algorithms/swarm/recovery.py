"""Rebuilding a SWARM stage whose every server is gone, without a checkpoint (CheckFree).

A stage is *lost* when no server serves or joins it in the directory (a dead server's record
lapses within SwarmTimings.record_ttl_s) while the run has trained (another stage stepped): its
weights left with its servers. The first server to take the stage then rebuilds it from its
two neighbours (optim/checkfree.py): it downloads stages i-1 and i+1 (their servers' shared
states, as a joiner of those stages would) and averages their layers weighted by the norms of
their last gradients, which every server publishes in its directory record, so nothing is
stored or sent for recovery while nothing fails.

Two peers must not rebuild one stage with different weights: the rebuilder first takes a lease
(`swarmd/<run>/stage<i>/recovery`, an entry per asker; the earliest asker holds it, see
`take_lease`). The others wait for the holder's state to be advertised and download it.

CheckFree+ (runs with `swarm_swap` > 0): a lost first or last stage takes its swap partner's
blocks (stage 1's, resp. S-2's: trained to stand in by the swapped micro-batches, route.py)
and its embedding or head from the copy the partner's servers keep (copies.py). Without
it, or when no copy can be had, a lost end stage restarts from the run's seed, and says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio
from torch import nn

from swarmd.node.algorithms.swarm import copies, directory
from swarmd.node.algorithms.swarm.directory import StageRecord
from swarmd.node.algorithms.swarm.timings import SwarmTimings
from swarmd.node.dht import DHTNode
from swarmd.node.dht.records import RecordError
from swarmd.node.peer.context import PeerContext
from swarmd.node.peer.options import JoinError
from swarmd.node.peer.sharedstate import SharedState
from swarmd.node.runkeys import recovery_key
from swarmd.node.runtime import offload
from swarmd.optim.checkfree import (
    LR_SCALE,
    LayoutMismatch,
    Recovery,
    check_partner,
    edge_layers,
    recover,
    recover_end,
)
from swarmd.optim.stage import StageOptConfig, StageTrainer
from swarmd.protocol.identity import PeerId
from swarmd.workloads import lm_loss

log = logging.getLogger("swarmd.swarm")


class RecoveryFailed(Exception):
    """The stage could not be rebuilt from its neighbours (the message says why)."""


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
    a record lifetime): the download from them fails, and the seed is no state for a stage of a
    run that has trained. Then this server waits for the records to lapse (the stage is lost)
    or a server to answer, at most a record lifetime and two refreshes, before it takes the
    seed."""
    timings = peer.timings.swarm
    deadline = peer.net.monotonic() + timings.record_ttl_s + 2 * timings.refresh_s
    while True:
        records = await directory.read(peer.dht, peer.config.name, len(trainers))
        if lost(records, stage):
            origin = await take_lost_stage(peer, stage, trainers, state, records)
            return origin, origin in ("checkfree", "checkfree+")
        origin, _ = await state.take_initial()
        if origin != "fresh" or not trained(records, stage) or peer.net.monotonic() > deadline:
            return origin, False
        peer.out.event(
            "stage_wait",
            f"stage {stage}: no server of it answered; waiting for their records to lapse "
            "(then the stage is rebuilt)",
            stage=stage,
        )
        await trio.sleep(timings.refresh_s)


async def take_lease(
    dht: DHTNode, run: str, stage: int, me: PeerId, timings: SwarmTimings
) -> PeerId | None:
    """Who holds the stage's recovery lease, this peer having asked for it (None: no entry
    could be read). Each asker stores an entry under its own peer id; after `lease_settle_s`
    (for racers' entries to land) the holder is the earliest asker (the entry that expires
    first, ties by peer id), which every asker that reads both entries names alike. (A plain
    key held by its first owner was tried first: each asker's own node kept its own record,
    the newest expiry won every read, and two racers both rebuilt the stage in CI.)"""
    key = recovery_key(run, stage)
    try:
        await dht.store(
            key, b"rebuilding", dht.now() + timings.lease_s, subkey=str(me), republish=False
        )
    except RecordError as exc:
        log.info("stage %d recovery lease not stored: %s", stage, exc)
    await trio.sleep(timings.lease_settle_s)
    entries = await dht.peers(key, exhaustive=True)
    if not entries:
        return None
    return min(entries, key=lambda p: (entries[p].expires, str(p)))


async def _download(peer: PeerContext, stage: StageTrainer) -> None:
    """A neighbour's state from its servers, as a joiner of that stage takes it."""
    origin, _ = await SharedState(peer, stage, scope=f"stage{stage.index}").take_initial()
    if origin != "group":
        raise RecoveryFailed(f"could not download stage {stage.index}'s state ({origin})")


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
        await _download(peer, n)
    norms = [
        max((r.grad_norm for r in records.values() if r.stage == n.index), default=0.0)
        for n in neighbours
    ]

    def average() -> Recovery:
        try:
            return recover(target.module, neighbours[0].module, neighbours[1].module, *norms)
        except (LayoutMismatch, ValueError) as exc:
            raise RecoveryFailed(str(exc)) from None

    recovery = await offload.run_sync(average)
    target.set_lr_scale(LR_SCALE)
    target.round = max(n.round for n in neighbours)
    return Rebuilt(recovery, (neighbours[0].round, neighbours[1].round))


def build_all(peer: PeerContext, modules: list[nn.Module]) -> list[StageTrainer]:
    """A trainer for each of the model's stages (the neighbours' are download targets); with
    CheckFree+ the end stages' edge layers (embedding, head) are marked for swapped calls."""
    config = peer.config
    opt = StageOptConfig(lr=config.inner_lr, weight_decay=config.weight_decay)
    out = [StageTrainer(m, i, len(modules), opt, lm_loss) for i, m in enumerate(modules)]
    if config.swarm_swap > 0 and len(modules) >= 2:
        if not all(isinstance(m, nn.Sequential) for m in (modules[0], modules[-1])):
            raise JoinError("swarm_swap needs end stages that are nn.Sequential (called in parts)")
        try:
            out[0].set_edge(edge_layers(modules[0], modules[1], first=True))
            out[-1].set_edge(edge_layers(modules[-1], modules[-2], first=False))
            check_partner(out[0].part("blocks"), modules[1])
            check_partner(out[-1].part("blocks"), modules[-2])
        except ValueError as exc:  # LayoutMismatch, or an end stage with no edge layers
            raise JoinError(
                f"swarm_swap needs the first and last stages cut like their neighbours "
                f"(the built-in GPT: n_layer a multiple of swarm_stages): {exc}"
            ) from None
    return out


def edge_sizes(trainers: list[StageTrainer]) -> dict[str, int]:
    """The values of each end stage's edge layers, by copy name ("stage/edge")."""
    return {
        f"{t.index}/edge": sum(p.numel() for p in t.part("edge").parameters())
        for t in trainers
        if t.has_edge
    }


async def rebuild_end(
    peer: PeerContext,
    stage: int,
    stages: list[StageTrainer],
    records: dict[PeerId, StageRecord],
) -> tuple[StageTrainer, copies.Agreed, float]:
    """CheckFree+: downloads the lost end stage's swap partner, takes its blocks and the copy
    of the edge layers its servers keep (their agreed median: copies.agree); fresh optimiser
    at LR_SCALE. Returns the partner, the agreed copy and the partner's last gradient norm."""
    target, name = stages[stage], f"{stage}/edge"
    partner = stages[1 if stage == 0 else len(stages) - 2]
    await _download(peer, partner)
    servers = {
        p: r for p, r in records.items() if r.stage == partner.index and r.state == "serving"
    }
    got = await copies.fetch_all(peer, name, servers, edge_sizes(stages)[name])
    if not got:
        raise RecoveryFailed(f"no server of stage {partner.index} answered a copy of {name}")
    try:
        agreed = copies.agree(got)
    except ValueError as exc:
        raise RecoveryFailed(f"the copies of {name} disagree: {exc}") from None
    for pid in agreed.refused:
        log.warning(
            "stage %d: refused %s's copy of %s: %.2f from the copies' median",
            stage, pid.short(), name, agreed.distances[pid],
        )  # fmt: skip

    def apply() -> None:
        try:
            recover_end(target.part("edge"), target.part("blocks"), partner.module, agreed.values)
        except LayoutMismatch as exc:
            raise RecoveryFailed(str(exc)) from None

    await offload.run_sync(apply)
    target.set_lr_scale(LR_SCALE)
    # The copy's round is its server's word: the partner's state (its servers' shared one)
    # says where the run is.
    target.round = partner.round
    return partner, agreed, max((r.grad_norm for r in servers.values()), default=0.0)


async def take_rebuilt(state: SharedState, holder: PeerId) -> bool:
    """Waits (at most `SwarmTimings.recovery_wait_s`) for the lease holder's rebuilt state
    to be advertised, and downloads it from the holder (the lost servers' last adverts
    outlive them: they are not asked); whether that worked."""
    timings = state.peer.timings.swarm
    deadline = state.peer.net.monotonic() + timings.recovery_wait_s
    while state.peer.net.monotonic() < deadline:
        theirs = [a for a in await state.adverts() if a.owner == str(holder)]
        if theirs:
            return await state.sync_to(theirs)
        await trio.sleep(timings.recovery_poll_s)
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
    t0, count = peer.net.monotonic(), len(trainers)
    end = not 0 < stage < count - 1
    if end and not trainers[stage].has_edge:
        return await _from_seed(peer, stage, state, "CheckFree+ is off (swarm_swap = 0)")
    holder = await take_lease(
        peer.dht, peer.config.name, stage, peer.identity.peer_id, peer.timings.swarm
    )
    if holder is None:
        raise JoinError(f"stage {stage} was lost and its recovery lease cannot be taken; try again")
    if holder != peer.identity.peer_id:
        if await take_rebuilt(state, holder):
            return "group"
        raise JoinError(
            f"stage {stage} was lost and {holder.short()} did not rebuild it in time; try again"
        )
    if end:
        try:
            partner, agreed, norm = await rebuild_end(peer, stage, trainers, records)
        except RecoveryFailed as exc:
            return await _from_seed(peer, stage, state, f"CheckFree+ could not rebuild it: {exc}")
        _rebuilt_end(peer, trainers[stage], partner, (agreed, norm), peer.net.monotonic() - t0)
        return "checkfree+"
    try:
        rebuilt = await rebuild(peer, stage, trainers, records)
    except RecoveryFailed as exc:
        raise JoinError(f"stage {stage} was lost and could not be rebuilt: {exc}") from None
    rec, took = rebuilt.recovery, peer.net.monotonic() - t0
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


async def _from_seed(peer: PeerContext, stage: int, state: SharedState, why: str) -> str:
    """A lost end stage that cannot be rebuilt restarts from the run's seed, and says why."""
    peer.metrics.stage_recoveries.labels(method="seed").inc()
    peer.out.event(
        "stage_recovered",
        f"stage {stage} lost: it restarts from the run's seed ({why})",
        stage=stage,
        method="seed",
        why=why[:300],
    )
    origin, _ = await state.take_initial()
    return origin


def _rebuilt_end(
    peer: PeerContext,
    target: StageTrainer,
    partner: StageTrainer,
    copied: tuple[copies.Agreed, float],
    took: float,
) -> None:
    """`copied`: the agreed copy and the partner's last gradient norm."""
    stage, edge = target.index, "embedding" if target.first else "head"
    agreed, norm = copied
    refused = agreed.refused
    peer.metrics.stage_recoveries.labels(method="checkfree+").inc()
    peer.out.event(
        "stage_recovered",
        f"stage {stage} lost: rebuilt by CheckFree+ from stage {partner.index}'s blocks and "
        f"the median of {len(agreed.distances)} of its servers' copies of the {edge} (stage "
        f"round {agreed.round}; {len(refused)} refused), fresh AdamW at "
        f"{target.lr_scale:g}x lr, in {took:.1f} s",
        stage=stage,
        method="checkfree+",
        neighbours=[partner.index],
        weights=[1.0],
        norms=[norm],
        neighbour_rounds=[partner.round],
        copy_round=agreed.round,
        copies=len(agreed.distances),
        refused=[str(p) for p in refused],
        seconds=round(took, 3),
    )
