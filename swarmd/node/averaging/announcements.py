"""What a round's key holds, as one peer reads it: announcements (the member, the peers it
stands for, whether it withdrew), leaders' groups (`Commitment`), and the backed-off reads
(`Waits`) a gathering and a follower make of it. matchmaking.py decides from them."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import trio

from swarmd.node.averaging.allreduce import Member
from swarmd.node.averaging.partition import leader_of
from swarmd.node.dht import DHTNode, Value
from swarmd.protocol import averaging_pb2 as apb
from swarmd.protocol.identity import PeerId

log = logging.getLogger("swarmd.matchmaking")

#: The most peers one announcement may stand for (a grid slot's takeovers: at most a group's
#: size); only this many are kept, so a forged list cannot grow what a reader holds.
MAX_STANDS_FOR = 64


class Waits:
    """Backed-off sleeps between DHT reads that end exactly at a deadline, cut short when
    this peer's own DHT node stores a record under the round's key."""

    def __init__(self, polls: Iterator[float], seconds: float) -> None:
        """``polls``: the waits between reads (MatchmakingConfig.polls)."""
        self._deadline = trio.current_time() + seconds
        self._next = polls
        self._slept = False
        self._final = False
        #: The last sleep ended because a record arrived here: the next read is local.
        self.woken = False

    async def sleep(self, stored: trio.Event) -> bool:
        """Sleeps until the next read, or until ``stored`` is set (KeyReader.next_store);
        False once the deadline has passed (no more reads).

        Polls alone left a round waiting for news that was already in the DHT: with polls
        backed off to 0.5–1 s, the leader saw the last announcement, and its followers the
        group record, a poll later, about a second per round in all (measured in streaming
        rounds at 5 Mbit/s: 1.1–1.5 s from the last peer's arrival to the round's end).
        """
        left = self._deadline - trio.current_time()
        if left <= 0:
            return False
        wait = next(self._next)
        self._slept, self._final, self.woken = True, wait >= left, False
        with trio.move_on_after(min(wait, left)):
            await stored.wait()
            self.woken, self._final = True, False
        return True

    @property
    def light(self) -> bool:
        """Whether the next read may be light (DHTNode.get_records): reads between the first
        and the one at the deadline only look for a reason to stop early, and one node that
        holds the key is enough for that. The first and the last read ask the quorum."""
        return self._slept and not self._final


@dataclass(frozen=True)
class Commitment:
    """A leader's group, as published in its announcement."""

    leader: PeerId
    record: bytes  # the exact GroupRecord bytes: the round id derives from them
    members: tuple[Member, ...]

    @functools.cached_property
    def _ids(self) -> frozenset[PeerId]:
        return frozenset(m.peer_id for m in self.members)

    def names(self, peer: PeerId) -> bool:
        """Looked up, not scanned: every poll of a roll call asks it of the roster's group."""
        return peer in self._ids


def decode_group(leader: PeerId, raw: bytes) -> Commitment | None:
    record = apb.GroupRecord()
    try:
        record.ParseFromString(raw)
        members = tuple(
            Member(PeerId(m.peer_id), m.address, m.bandwidth, m.client) for m in record.members
        )
    except Exception:
        return None
    ids = [m.peer_id for m in members]
    if not members or ids != sorted(ids) or len(set(ids)) != len(ids):
        return None
    lead = leader_of(members)
    if lead is None or lead.peer_id != leader:
        return None  # only the leader itself (its lowest reachable id) may publish a group
    return Commitment(leader, raw, members)


#: An announcement: the member, its group if it leads one, and the peers it stands for.
Decoded = tuple[Member, Commitment | None, frozenset[PeerId]]


def decode(peer: PeerId, value: Value) -> Decoded | None:
    """An announcement: the member, its group if it has committed to one as leader, and the
    peers it stands for; None if it is malformed or withdrawn (its author left the round)."""
    info = apb.MemberInfo()
    try:
        info.ParseFromString(value.value)
        if info.withdrawn:
            return None
        member = Member(peer, info.address, info.bandwidth, info.client)
        stands_for = frozenset(
            PeerId(raw) for raw in info.stands_for[:MAX_STANDS_FOR] if len(raw) == len(peer.raw)
        )  # a malformed id is skipped, not the member
    except Exception:  # a malformed announcement only costs its author the round
        return None
    return member, (decode_group(peer, info.group) if info.group else None), stands_for


class View:
    """What this peer has read of the round's key: announced members and leaders' groups."""

    def __init__(self, dht: DHTNode, key: str, me: Member) -> None:
        self._reader = dht.reader(key)
        self._me = me.peer_id
        self.visible: dict[PeerId, Member] = {me.peer_id: me}
        #: When this peer first read each announcement (its author announced before then).
        self.seen_at: dict[PeerId, float] = {}
        self.groups: dict[PeerId, Commitment] = {}
        #: Peer -> the peers whose places it says it fills.
        self.stands_for: dict[PeerId, frozenset[PeerId]] = {}
        #: Each announcement decoded, by its author and bytes: every read lists all of them.
        self._decoded: dict[PeerId, tuple[bytes, Decoded | None]] = {}

    def _decode(self, peer: PeerId, value: Value) -> Decoded | None:
        """`_decode`, once per announcement: with 1,000 simulated peers under one key, the
        same announcements decoded again on each of a round's reads were a third of its CPU."""
        seen = self._decoded.get(peer)
        if seen is None or seen[0] != value.value:
            seen = self._decoded[peer] = (value.value, decode(peer, value))
        return seen[1]

    def next_store(self) -> trio.Event:
        return self._reader.next_store()

    async def read(self, waits: Waits) -> None:
        """Reads the key: this node's own records if a store here woke the peer, else the
        DHT (light or not, as `waits` says). Only the announcements new since the last read
        are decoded and walked (KeyReader.peers_changed): a roll call of N peers walked all
        N on every poll. A leader's group is checked against the members seen so far when
        it arrives (each read checked every group it listed, and kept the ones that held
        once, which comes to the same)."""
        found = await self._reader.peers_changed(light=waits.light, local=waits.woken)
        decoded = []
        for peer, value in found.items():
            if (d := self._decode(peer, value)) is not None:
                decoded.append((peer, d))
            elif peer != self._me:  # withdrawn since it was read (or malformed): not coming
                self.visible.pop(peer, None)
                self.groups.pop(peer, None)
        now = trio.current_time()
        for peer, (member, _, stands_for) in decoded:
            self.visible[peer] = member
            self.seen_at.setdefault(peer, now)
            self.stands_for[peer] = stands_for
        for peer, (_, group, _) in decoded:
            if group is not None and self._faithful(group):
                self.groups[peer] = group

    def covers(self, expected: frozenset[PeerId]) -> bool:
        """Whether each of ``expected`` announced or is stood for by a peer that did."""
        come = set(self.visible)
        for peer in self.visible:
            come |= self.stands_for.get(peer, frozenset())
        return expected <= come

    def _faithful(self, group: Commitment) -> bool:
        """Whether a leader's group states each member as the member announced itself (as far
        as this peer has read): the client flags decide who reduces, and a leader that marked
        every other reachable member a client would reduce the whole vector alone, with no
        fallback reducer and nobody to cross-check it; bandwidths size the parts."""
        for m in group.members:
            seen = self.visible.get(m.peer_id)
            if seen is not None and seen != m:
                log.warning("ignoring %s's group: it misstates member %s", group.leader.short(), m)
                return False
        return True

    def mine(self) -> Commitment | None:
        """The group naming this peer with the lowest leader, if any leader named it."""
        named = [g for g in self.groups.values() if g.names(self._me)]
        return min(named, key=lambda g: g.leader) if named else None

    def committed(self) -> set[PeerId]:
        """Peers in groups that do not name this peer: they average without it."""
        out: set[PeerId] = set()
        for group in self.groups.values():
            if not group.names(self._me):
                out |= {m.peer_id for m in group.members}
        return out
