"""CheckFree+'s copies: the neighbours of the first and last stages keep their edge layers.

A swapped micro-batch (route.py) still runs the embedding at stage 0 and the head at
the last stage, so their neighbours' blocks learn to stand in for the end stages' blocks but
nothing of the embedding or head. CheckFree+ therefore keeps those edge layers (small: the
built-in GPT's embedding is 5% of the model) with the neighbouring stage's servers: each of
them fetches a copy from a server of the end stage after each of its own rounds (the `Part`
call, stage_service.py), and a peer rebuilding a lost end stage fetches the copy from them.
Nothing is stored in the DHT and nothing else moves while nothing fails.

A copy is only its server's word. The first answer used to be installed as it came: one
stage-1 server serving a poisoned embedding (finite values) left the pipeline 1.36x worse at
the end of the run (issue 47 item 5). A rebuild now asks up to ASKED servers at once and
installs their coordinate-wise median, only if more than half of the copies lie within AGREE
of it (relative to its norm); the others are named (`refused`). Honest copies differ only by
the rounds their servers fetched them at. Copies that agree with no majority (one honest
server and one liar) leave the stage to restart from the seed, which costs a few percent;
a single server's copy is still taken on its word.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import torch
import trio

from swarmd.node.algorithms.swarm import wire
from swarmd.node.algorithms.swarm.directory import StageRecord
from swarmd.node.algorithms.swarm.stage_service import EDGE_ROW, PART, StageHost
from swarmd.node.peer.context import PeerContext
from swarmd.protocol import rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.errors import ProtocolError
from swarmd.protocol.identity import PeerId

log = logging.getLogger("swarmd.swarm")

#: Servers asked at once for the copy a rebuild installs, and how far (relative to the norm
#: of the copies' median) a copy may lie from that median and still count as agreeing.
ASKED = 5
AGREE = 0.5


def kept_by(index: int, stages: int) -> list[str]:
    """The edge copies a server of stage `index` keeps ("stage/edge"): stage 1 keeps stage 0's
    and stage S-2 the last stage's (with 2 stages each keeps the other's)."""
    out = []
    if stages >= 2 and index == 1:
        out.append("0/edge")
    if stages >= 2 and index == stages - 2:
        out.append(f"{stages - 1}/edge")
    return out


def decode(data: bytearray, numel: int) -> tuple[int, torch.Tensor]:
    """A `Part` answer: the round and the flat values; WireError unless it is exactly a
    round and `numel` finite values in zero-padded rows of EDGE_ROW."""
    tensors = wire.decode(data)
    if len(tensors) != 2:
        raise wire.WireError(f"a copy is 2 tensors, not {len(tensors)}")
    rnd, rows = tensors
    padded = (numel + EDGE_ROW - 1) // EDGE_ROW * EDGE_ROW
    if rnd.dtype != torch.int64 or rnd.shape != (1,) or int(rnd[0]) < 0:
        raise wire.WireError("a copy's round must be one non-negative int64")
    if rows.dtype != torch.float32 or rows.dim() != 2 or rows.numel() != padded:
        raise wire.WireError(f"a copy of {rows.numel()} values for {numel} parameters")
    return int(rnd[0]), rows.reshape(-1)[:numel].clone()


async def fetch(
    peer: PeerContext, name: str, servers: dict[PeerId, StageRecord], numel: int
) -> tuple[int, torch.Tensor] | None:
    """`name`'s edge layers from one of `servers` (tried in random order), or None."""
    limit = 4 * ((numel + EDGE_ROW - 1) // EDGE_ROW * EDGE_ROW) + 1024
    order = list(servers.items())
    peer.net.rng.shuffle(order)
    for pid, record in order:
        try:
            _, data = await peer.client.get_tensor(
                record.address,
                PART,
                pb.TensorRequest(name=name),
                timeout=peer.timings.swarm.copy_fetch_timeout_s,
                max_bytes=limit,
                expect=pid,
            )
            return decode(data, numel)
        except (rpc.RpcError, ProtocolError, wire.WireError, trio.TooSlowError) as exc:
            log.info("copy of %s from %s: %s", name, pid.short(), exc)
    return None


async def fetch_all(
    peer: PeerContext, name: str, servers: dict[PeerId, StageRecord], numel: int
) -> dict[PeerId, tuple[int, torch.Tensor]]:
    """`name`'s copy from up to ASKED of `servers` at once: each that answered, by server."""
    chosen = random.sample(sorted(servers), min(ASKED, len(servers)))
    got: dict[PeerId, tuple[int, torch.Tensor]] = {}

    async def one(pid: PeerId) -> None:
        copy = await fetch(peer, name, {pid: servers[pid]}, numel)
        if copy is not None:
            got[pid] = copy

    async with trio.open_nursery() as nursery:
        for pid in chosen:
            nursery.start_soon(one, pid)
    return got


@dataclass(frozen=True)
class Agreed:
    """What a rebuild installs: the copies' median, the newest round of those that agree with
    it, and each copy's distance from it (relative to its norm)."""

    values: torch.Tensor
    round: int
    distances: dict[PeerId, float]

    @property
    def refused(self) -> list[PeerId]:
        return sorted(p for p, d in self.distances.items() if d > AGREE)


def agree(copies: dict[PeerId, tuple[int, torch.Tensor]]) -> Agreed:
    """The copies' coordinate-wise median if more than half of them lie within AGREE of it;
    ValueError (saying how far each was) otherwise, or if there are none."""
    if not copies:
        raise ValueError("no copy")
    ids = sorted(copies)
    ordered = torch.stack([copies[p][1] for p in ids]).sort(dim=0).values
    n = len(ids)
    median = (ordered[(n - 1) // 2] + ordered[n // 2]) / 2
    scale = max(float(torch.linalg.vector_norm(median)), 1e-12)
    distances = {p: float(torch.linalg.vector_norm(copies[p][1] - median)) / scale for p in ids}
    agreeing = [p for p in ids if distances[p] <= AGREE]
    if 2 * len(agreeing) <= n:
        far = ", ".join(f"{p.short()} {d:.2f}" for p, d in distances.items())
        raise ValueError(
            f"no majority of the {n} copies agrees (distances from their median: {far})"
        )
    return Agreed(median, max(copies[p][0] for p in agreeing), distances)


async def refresh(
    peer: PeerContext,
    index: int,
    stages: int,
    directory: dict[PeerId, StageRecord],
    sizes: dict[str, int],
) -> dict[str, tuple[int, torch.Tensor]]:
    """This server's copies fetched afresh (kept_by), each from a serving server of its end
    stage. The newest fetch is kept whatever round it states: a stage restarted from the seed
    counts its rounds from 0 again, and a round is only its server's word."""
    out = {}
    for name in kept_by(index, stages):
        stage = int(name.split("/")[0])
        servers = {p: r for p, r in directory.items() if r.stage == stage and r.state == "serving"}
        got = await fetch(peer, name, servers, sizes[name]) if name in sizes else None
        if got is not None:
            out[name] = got
    return out


class Keeper:
    """Refreshes a stage server's copies after each of its rounds, in the background (a
    round's timing never waits for a copy), one refresh at a time."""

    def __init__(self, peer: PeerContext, stages: int) -> None:
        self.peer, self.stages = peer, stages
        self.host = peer.host("swarm", StageHost)
        self.sizes: dict[str, int] = {}
        self._busy = False
        #: Counts the stages taken: a refresh begun for another stage stores nothing.
        self._taken = 0

    def serving(self, sizes: dict[str, int]) -> None:
        """A stage was taken: the edge sizes of this run's end stages; old copies go."""
        self.sizes = sizes
        self._taken += 1
        self.host.copies.clear()

    def after_round(
        self, nursery: trio.Nursery | None, index: int, directory: dict[PeerId, StageRecord]
    ) -> None:
        if self._busy or nursery is None or not kept_by(index, self.stages) or not self.sizes:
            return
        self._busy = True
        nursery.start_soon(self._refresh, index, dict(directory))

    async def _refresh(self, index: int, directory: dict[PeerId, StageRecord]) -> None:
        taken = self._taken
        try:
            got = await refresh(self.peer, index, self.stages, directory, self.sizes)
            if taken == self._taken:
                self.host.copies.update(got)
        except Exception:  # a copy is best effort: the next round tries again
            log.exception("refreshing the edge copies failed")
        finally:
            self._busy = False
