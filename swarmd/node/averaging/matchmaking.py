"""Group formation for one (run, round, fragment) through the DHT: no coordinator, no deadlock.

1. Every ready peer announces itself (address, bandwidth) under the round's key, signed.
2. It watches that key until ``target_group_size`` peers are visible or the gather deadline
   passes (then it goes on with whoever is there, if at least ``min_group_size``).
3. It cuts the peers it saw (sorted by id) into ⌈n / target⌉ groups of near-equal size
   (`partition`); in its own group, the lowest reachable peer id is the leader (a client-mode
   peer, one that nobody can dial, never leads: nobody can ping it to see that it is alive).
   The leader publishes the member list as a group record inside its own announcement
   (re-signed, replacing it); every other peer waits for a record that names it, preferring
   the lowest leader id, and derives the round id from the record's exact bytes. A peer still
   gathering that reads a record naming it goes at once: its leader is already waiting for it.

Peers that see different sets cannot deadlock — nobody waits on anybody's answer, only on
the DHT, with deadlines — and they cannot silently average with the wrong peers: the round id
covers the member list, so a peer that followed another leader is simply missing from this
round and is dropped by its deadline. A peer left out of every group withdraws its
announcement (a later arrival must not lead a group with it) and skips to the next round.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import trio

from swarmd.node.averaging.allreduce import Group, Member
from swarmd.node.averaging.announcements import MAX_STANDS_FOR, Commitment, View, Waits
from swarmd.node.averaging.attendance import Gathered
from swarmd.node.averaging.partition import leader_of, partition
from swarmd.node.averaging.probes import available
from swarmd.node.dht import DHTNode
from swarmd.protocol import averaging_pb2 as apb
from swarmd.protocol import rpc
from swarmd.protocol.errors import ProtocolError
from swarmd.protocol.identity import PeerId

log = logging.getLogger("swarmd.matchmaking")


@dataclass(frozen=True)
class MatchmakingConfig:
    target_group_size: int = 16
    min_group_size: int = 2
    #: Longest wait for the group to fill before going on with whoever is there.
    gather_s: float = 5.0
    #: Longest a follower waits for its leader's group record.
    commit_wait_s: float = 5.0
    #: How often the DHT is read while waiting: first after ``poll_s``, then each wait
    #: ``poll_growth`` times longer, up to ``max_poll_s``. A get asks several nodes and each
    #: answers with every announcement, so steady 0.1 s polls cost a peer that waits a few
    #: seconds for slower ones tens of KB per round (measured: 30 KB per peer with arrivals
    #: 0.5 s apart); backing off keeps quick rounds quick and slow gathers cheap.
    poll_s: float = 0.1
    poll_growth: float = 1.5
    max_poll_s: float = 1.0
    #: Lifetime of announcements and group records.
    ttl_s: float = 120.0
    #: How long an announced peer has to answer a ping before it is left out of the group.
    probe_s: float = 3.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_group_size <= self.target_group_size:
            raise ValueError("need 1 <= min_group_size <= target_group_size")
        for name in ("gather_s", "commit_wait_s", "poll_s", "ttl_s", "probe_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MatchmakingConfig.{name} must be positive")
        if not self.poll_growth >= 1 or not self.max_poll_s >= self.poll_s:
            raise ValueError("MatchmakingConfig needs poll_growth >= 1 and max_poll_s >= poll_s")

    def polls(self) -> Iterator[float]:
        """The waits between successive reads of the DHT."""
        wait = self.poll_s
        while True:
            yield wait
            wait = min(wait * self.poll_growth, self.max_poll_s)


def _enough(visible: Collection[Member], target: int) -> bool:
    """Whether gathering may stop early: the target is visible and one of them is reachable
    to lead (a client that stopped at two clients gave up a round its reachable peer led).
    The count first: a roll call's polls ask this with hundreds of peers short of the
    target."""
    return len(visible) >= target and leader_of(list(visible)) is not None


def _group(key: str, commitment: Commitment) -> Group:
    return Group(round_id_of(key, commitment.record), commitment.members)


def round_id_of(key: str, record: bytes) -> bytes:
    return hashlib.sha256(b"swarmd/round/v1\0" + key.encode() + b"\0" + record).digest()


async def _lead(
    dht: DHTNode,
    key: str,
    me: Member,
    info: apb.MemberInfo,
    members: list[Member],
    after: float,
    cfg: MatchmakingConfig,
) -> Group:
    """This peer leads: it commits to ``members`` by adding the group to its announcement.

    The commitment is one DHT value (64 KiB by default). A grid round's roll call names
    every peer of the round, about 65 B each with an IPv4 address: from about 1,000 members
    the record no longer fits, and storing it raised out of the round. Then only the members
    that fit are committed (the leader, then the lowest ids); the others find the roll
    committed without them and take the round's state."""
    limit = dht.config.storage.records.max_value_bytes
    ranked = sorted(members, key=lambda m: (m.peer_id != me.peer_id, m.peer_id))
    keep = len(ranked)
    while True:
        chosen = sorted(ranked[:keep], key=lambda m: m.peer_id)
        info.group = apb.GroupRecord(members=[_entry(m) for m in chosen]).SerializeToString()
        size = len(info.SerializeToString())
        if size <= limit or keep <= 2:
            break
        keep = min(keep - 1, int(keep * limit / size * 0.98))
    if keep < len(ranked):
        log.warning(
            "round %s: a group record of all %d members exceeds the DHT's %d B values; "
            "committing %d of them (the others sit this round out)",
            key, len(ranked), limit, keep,
        )  # fmt: skip
    # The same slot as the announcement: a later expiry (than ``after``, the announcement's)
    # replaces it on every replica.
    until = max(dht.now() + cfg.ttl_s, after)
    await dht.store(key, info.SerializeToString(), until, subkey=str(me.peer_id), republish=False)
    return Group(round_id_of(key, info.group), tuple(chosen))


def _entry(m: Member) -> apb.GroupMember:
    return apb.GroupMember(
        peer_id=m.peer_id.raw, address=m.address, bandwidth=m.bandwidth, client=m.client
    )


async def _gather(
    dht: DHTNode, key: str, me: Member, cfg: MatchmakingConfig, gathered: Gathered
) -> tuple[View, Commitment | None]:
    """Reads the round's announcements until the target is visible or the gather deadline;
    returns what was read, and the group naming this peer if a leader committed to one.
    The target grows by each peer ``gathered`` excuses that announces anyway."""
    view = View(dht, key, me)
    waits = Waits(cfg.polls(), cfg.gather_s)
    # The last read is made at the deadline (and may take up to max_poll_s): with backed-off
    # polls the previous one can be a second old, and a peer whose announcement landed since
    # would be left out by some and not others.
    seen = 0
    with trio.move_on_after(cfg.gather_s + cfg.max_poll_s):
        while True:
            stored = view.next_store()  # before the read: a record landing during it counts
            await view.read(waits)
            grew, seen = len(view.visible) > seen, len(view.visible)
            # A leader that saw fewer peers than this one waits for (its own target reached)
            # has committed to a group naming this peer and is already waiting for it in the
            # all-reduce: go now. Gathering on would only make it drop this peer (seen: a
            # leader that counted one live peer at a run's start averaged alone, and the
            # follower that gathered for 10 s then averaged alone too, in the "same" group).
            if (mine := view.mine()) is not None:
                return view, mine
            if gathered.one_group and view.committed():
                break  # the key's one group formed without this peer
            want = gathered.wanted(cfg.target_group_size, view.visible)
            enough = _enough(view.visible.values(), want) or (
                gathered.expected is not None
                and view.covers(gathered.expected)
                and leader_of(list(view.visible.values())) is not None
            )
            # More peers than one group, and the last read found new ones: they are still
            # arriving, and groups cut now are cut from a view the others will not share.
            # Stores on 8 nodes instead of 20 (half the time) let the first readers of 16
            # peers arriving at once cut from 5-12: 4 peers a round went alone (81% of
            # peer-rounds averaged, against 100% when every read waited for the last store).
            settling = enough and grew and seen > want and not gathered.one_group
            if (enough and not settling) or not await waits.sleep(stored):
                break
    return view, None


def _announcement(me: Member, gathered: Gathered) -> apb.MemberInfo:
    return apb.MemberInfo(
        address=me.address,
        bandwidth=me.bandwidth,
        client=me.client,
        stands_for=[p.raw for p in sorted(gathered.stands_for)[:MAX_STANDS_FOR]],
    )


async def form_group(
    dht: DHTNode,
    key: str,
    me: Member,
    config: MatchmakingConfig | None = None,
    gathered: Gathered | None = None,
) -> Group | None:
    """The group this peer averages with for ``key``, or None (too few peers: skip the round).
    ``gathered``, if given, tells the gathering whom it excuses (each that comes raises the
    size waited for) or which peers it is for (`Gathered.expected`: done once each came or is
    stood for), and is told who announced and whether the gathering fell short
    (attendance.py: whom the next round need not wait for).

    Gathering stops once the target is visible, also when more peers are coming: waiting for
    every live peer (up to the gather deadline) so that all cut the same groups was measured
    in the simulator and lost more to waiting than it won (48 peers of mixed speeds, target
    16: 69-78% of peer-rounds averaged against 85-89%)."""
    cfg = config or MatchmakingConfig()
    gathered = Gathered() if gathered is None else gathered
    info = _announcement(me, gathered)
    # Not republished: a round is over in seconds; the record only has to outlive it for
    # latecomers (ttl_s); republishing re-sent every round's records a minute after it ended.
    announced_until = dht.now() + cfg.ttl_s
    await dht.store(
        key, info.SerializeToString(), announced_until, subkey=str(me.peer_id), republish=False
    )
    view, mine = await _gather(dht, key, me, cfg, gathered)
    group = await _formed(dht, key, me, cfg, gathered, info, announced_until, view, mine)
    if group is None:
        await _withdraw(dht, key, me, info, announced_until, cfg)
    return group


async def _withdraw(
    dht: DHTNode,
    key: str,
    me: Member,
    info: apb.MemberInfo,
    announced_until: float,
    cfg: MatchmakingConfig,
) -> None:
    """Replaces this peer's announcement with a withdrawn one (a later expiry replaces it on
    every replica), so that a peer arriving at the key later does not count it: seen in the
    simulator (tests/unit/test_sim_peers.py), a joiner came to a round's key after its group
    had formed, led a group with a peer that had given the round up ten seconds before (alive,
    so the probe passed), waited out the all-reduce's deadlines for its parts, and ended the
    round "averaged" in a group of two on a state of its own. Best effort, bounded by a
    probe's time: a store that fails leaves the old announcement to its expiry."""
    info.withdrawn = True
    info.group = b""
    with trio.move_on_after(cfg.probe_s):
        try:
            await dht.store(
                key, info.SerializeToString(), announced_until + 0.01,
                subkey=str(me.peer_id), republish=False,
            )  # fmt: skip
        except (rpc.RpcError, ProtocolError) as exc:
            log.info("round %s: could not withdraw this peer's announcement: %s", key, exc)


async def _formed(
    dht: DHTNode,
    key: str,
    me: Member,
    cfg: MatchmakingConfig,
    gathered: Gathered,
    info: apb.MemberInfo,
    announced_until: float,
    view: View,
    mine: Commitment | None,
) -> Group | None:
    """The group ``view`` and ``mine`` give this peer (leading it if it is the leader), or
    None."""
    # The members of a leader's group came, also those whose announcements this peer had
    # not read yet: counted as absent, they would not be waited for in the next rounds.
    seen = set(view.visible) | ({m.peer_id for m in mine.members} if mine else set())
    gathered.announced = seen
    # Excused peers that came make the groups this peer cuts as large as it waited for.
    size = gathered.wanted(cfg.target_group_size, seen)
    if gathered.one_group:
        if view.committed():
            log.info("round %s: the key's one group formed without this peer", key)
            gathered.short = True
            gathered.committed = frozenset(view.committed())
            return None
        size = max(size, len(seen))
    cfg = dataclasses.replace(cfg, target_group_size=size)
    # Short even when a leader's group came first: the round still formed without the peers
    # this one counted, and every member must reach the same verdict, or the ones that still
    # count them make the next round wait when they lead it.
    gathered.short = len(seen) < cfg.target_group_size
    if mine is not None:
        return _group(key, mine)
    ordered = await available(
        dht, view.visible.values(), view.committed(), me, cfg.target_group_size, cfg.probe_s,
        gathered.one_group,
    )  # fmt: skip
    lead = leader_of(ordered)
    if lead is None:
        log.warning(
            "round %s: the %d peers visible are all unreachable (client mode): a group needs "
            "at least one peer that others can dial",
            key,
            len(ordered),
        )
        return None
    candidates = next((c for c in partition(ordered, cfg.target_group_size) if me in c), [])
    if len(candidates) < cfg.min_group_size:
        log.info("round %s: %d peers visible, not enough for a group", key, len(view.visible))
        return None
    own_lead = leader_of(candidates)
    assert own_lead is not None  # partition gives every group a reachable member
    leader = own_lead.peer_id

    if leader == me.peer_id:
        return await _lead(dht, key, me, info, candidates, announced_until + 0.01, cfg)

    return await _follow(view, key, leader, cfg)


async def _follow(view: View, key: str, leader: PeerId, cfg: MatchmakingConfig) -> Group | None:
    """A follower's wait for ``leader``'s group record naming it; another leader's group
    is settled for only if ours never shows up within the deadline.

    The wait runs ``commit_wait_s`` past the leader's own gathering, not past this peer's: a
    leader that announced after this peer gathers until its own deadline, later than ours.
    It had announced by the time this peer first read it, so its gathering and probes end
    by then + gather_s + max_poll_s + probe_s. Waiting from this peer's deadline instead,
    the first four of 100 simulated peers gave up 0.3 s before their leader committed the
    roll call naming them, and every grid group holding them lost a member: 95 of 99 peers
    sat the round out."""
    fallback: Commitment | None = None
    seen = view.seen_at.get(leader, trio.current_time())
    leader_done = seen + cfg.gather_s + cfg.max_poll_s + cfg.probe_s
    wait_s = max(0.0, leader_done - trio.current_time()) + cfg.commit_wait_s
    waits = Waits(cfg.polls(), wait_s)
    with trio.move_on_after(wait_s + cfg.max_poll_s):
        while True:
            stored = view.next_store()
            await view.read(waits)
            best = view.mine()
            if best is not None and best.leader <= leader:
                return _group(key, best)
            fallback = best
            if not await waits.sleep(stored):
                break
    if fallback is not None:
        return _group(key, fallback)
    log.info("round %s: no group record names this peer", key)
    return None
