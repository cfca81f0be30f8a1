"""Which announced peers a gathering may group with: those that answer a ping (an
announcement outlives its author). Probing is the largest cost of a big round, so each
peer probes only the peers whose liveness its own decision depends on."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import trio

from swarmd.node.averaging.allreduce import Member
from swarmd.node.averaging.partition import partition
from swarmd.node.dht import DHTNode
from swarmd.protocol import rpc
from swarmd.protocol.errors import ProtocolError
from swarmd.protocol.identity import PeerId

log = logging.getLogger("swarmd.matchmaking")


async def answering(dht: DHTNode, members: list[Member], timeout: float) -> set[PeerId]:
    """The members that answer a DHT ping (proving their peer id) within ``timeout``.

    The ping gets all of ``timeout``, not the DHT's round-trip-based deadline: a peer whose
    link is busy sending its last all-reduce answers late, and leaving a live member out
    splits the round (seen in the simulator: a grid group's member, left out by a 0.4 s
    deadline, took its block out of the round)."""
    alive: set[PeerId] = set()

    async def probe(member: Member) -> None:
        with trio.move_on_after(timeout):
            try:
                await dht.caller.ping(member.address, member.peer_id, timeout=timeout)
            except (rpc.RpcError, ProtocolError) as exc:
                log.info("leaving %s out of the group: %s", member.peer_id.short(), exc)
                return
            alive.add(member.peer_id)

    async with trio.open_nursery() as nursery:
        for member in members:
            nursery.start_soon(probe, member)
    return alive


#: Above this many available peers per target group size, a peer probes only the group the
#: partition gives it, not everybody it read (see `available`).
PROBE_ALL_UP_TO = 2


async def available(
    dht: DHTNode,
    visible: Iterable[Member],
    committed: set[PeerId],
    me: Member,
    target: int,
    probe_s: float,
    one_group: bool = False,
) -> list[Member]:
    """The announced peers this one may group with: not committed elsewhere, and alive.

    Up to PROBE_ALL_UP_TO × the target, every announced peer is probed, so a dead one is left
    out before the groups are cut (17 announced, one dead: one group of 16, not 8 and 8).
    Beyond that, only the peers of this peer's own group (as cut from all announced) are: the
    members of a group read the same announcements and probe the same peers, so they still
    agree, and a round costs each peer O(target) pings, not O(N). Probing all of them was the
    largest cost of a simulated 1,000-peer round (38% of its CPU: each peer pinged every peer
    it read, a million pings a round)."""
    # Announcements outlive their round: a latecomer still sees the peers that already
    # averaged this round together. They are committed to a group that does not name us;
    # forming a group with them would only wait for peers that will never answer.
    ordered = sorted((m for m in visible if m.peer_id not in committed), key=lambda m: m.peer_id)
    if one_group:
        return await _roll_available(dht, ordered, me, probe_s)
    if len(ordered) > PROBE_ALL_UP_TO * target:
        ordered = next((g for g in partition(ordered, target) if me in g), [me])
    # An announcement outlives its author: a peer killed or frozen after announcing must not
    # lead the group (its followers would wait for a record that never comes, then train
    # alone; seen under `swarmd chaos`, where it split the run for minutes) nor be waited for
    # in the all-reduce. Everyone who sees it probes it, so they agree on leaving it out.
    # Client-mode peers cannot be pinged: their fresh announcement is all there is, and a dead
    # one costs its reducers a deadline (as a peer that dies mid-round does).
    return await _answering_of(dht, ordered, me, probe_s)


async def _answering_of(
    dht: DHTNode, candidates: list[Member], me: Member, probe_s: float
) -> list[Member]:
    """``candidates`` less the reachable ones that do not answer a probe (this peer and
    client-mode peers are kept unprobed)."""
    probed = [m for m in candidates if m.peer_id != me.peer_id and not m.client]
    alive = await answering(dht, probed, probe_s)
    return [m for m in candidates if m.peer_id == me.peer_id or m.client or m.peer_id in alive]


#: How many of the lowest ids a roll call's peer probes at once while looking for its leader.
LEADER_PROBES = 4


async def _roll_available(
    dht: DHTNode, ordered: list[Member], me: Member, probe_s: float
) -> list[Member]:
    """`available` for one group a key (a roll call, `Gathered.one_group`): only its leader
    probes everybody. A follower needs only to know who leads, the lowest id that answers:
    it probes the ids below its own, LEADER_PROBES at a time in id order, and stops at the
    first batch with an answer. The rule is the one every peer applies when all are probed,
    so they agree as before; probing all, each of 100 simulated peers pinged the 99 others
    (a fifth of the run's CPU, a million pings a round at 1,000 peers)."""
    below = [m for m in ordered if m.peer_id < me.peer_id and not m.client]
    for at in range(0, len(below), LEADER_PROBES):
        batch = below[at : at + LEADER_PROBES]
        alive = await answering(dht, batch, probe_s)
        if alive:
            lead = next(m for m in batch if m.peer_id in alive)
            return [lead, me]
    # None below answered: this peer leads, and probes everybody above it.
    return await _answering_of(
        dht, [m for m in ordered if m.client or m.peer_id >= me.peer_id], me, probe_s
    )


__all__ = ["LEADER_PROBES", "PROBE_ALL_UP_TO", "answering", "available"]
