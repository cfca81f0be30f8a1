"""One peer's round on the grid (grid.py): level after level, each of its groups averages
the blocks its members hold, until it holds the mean of every contribution. The same code
runs in the simulator (sim/rounds.py) and is what a daemon's strategy calls.

Per group, two all-reduces: the blocks (this peer's slots in the group, as one weighted
mean), and a small fp32 tally of the weight they cover and which of the group's slots came
(the averager reports no totals). The tally marks a member's slots 2 and the others 1, not 1
among zeros: the averager drops a member whose part's norm is far above the others', and
the members' tallies would disagree. Only the rows (level 0) use error feedback: a residual
added above would reach its own group's mean and no other's.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
import trio

from swarmd.node.averaging.allreduce import Averager, Group, Member
from swarmd.node.averaging.attendance import Attendance, Gathered
from swarmd.node.averaging.codecs import CodecName
from swarmd.node.averaging.grid import Grid, takeover
from swarmd.node.averaging.matchmaking import MatchmakingConfig, form_group
from swarmd.node.dht import DHTNode
from swarmd.protocol.identity import PeerId


@dataclass(frozen=True)
class GridConfig:
    """How a grid round gathers."""

    #: The rows' (level 0) matchmaking; its target group size is the grid's axis bound.
    matchmaking: MatchmakingConfig
    #: The gather window of the levels above the first. Their peers are all on their way
    #: (they finished the level below), only later than the first: a group that closed
    #: before a late member came left its block out of the round.
    upper_gather_s: float = 15.0
    #: The blocks' codec (None: the averager's); the tallies are always fp32.
    codec: CodecName | None = None

    def __post_init__(self) -> None:
        if not self.upper_gather_s > 0:
            raise ValueError("GridConfig.upper_gather_s must be positive")


@dataclass(frozen=True)
class GridOutcome:
    """What the round gave this peer."""

    #: The mean of every contribution that made the round; None: this peer was left out of
    #: a group (it came after the group's window), or one of its groups above the rows lost
    #: a block the others have: it must take the round's state instead.
    result: torch.Tensor | None
    #: Its row's size, and the members its row's all-reduce dropped.
    row_size: int
    dropped: int
    #: Virtual or wall seconds spent forming groups (the slowest group of each level).
    form_s: float
    #: The peers this peer averaged with at any level (those no all-reduce dropped).
    met: frozenset[PeerId] = frozenset()


@dataclass(frozen=True)
class _Block:
    value: torch.Tensor
    weight: float


@dataclass(frozen=True)
class _Result:
    block: _Block
    lost: set[int]
    members: int
    dropped: int
    form_s: float
    left_out: bool = False
    met: frozenset[PeerId] = frozenset()


@dataclass
class GridPeer:
    """This peer's side: its DHT node, averager, announcement and attendance."""

    dht: DHTNode
    averager: Averager
    me: Member
    attendance: Attendance
    config: GridConfig
    #: The roster's members as a roll call committed them (address, bandwidth): each
    #: level's group is then built from them directly, with no gathering. None: groups are
    #: formed by matchmaking.
    members: Mapping[PeerId, Member] | None = None

    async def average(
        self,
        grid: Grid,
        key: str,
        value: torch.Tensor,
        weight: float,
        live: Collection[PeerId],
    ) -> GridOutcome:
        """The round under ``key`` (the round's matchmaking key: groups append their level
        and coordinates). ``live``: the heartbeats attendance accounts against."""
        share = weight * grid.share(self.me.peer_id)
        held = {k: _Block(value, share) for k in grid.slots_of(self.me.peer_id)}
        row_size, dropped, form_s = 1, 0, 0.0
        met: set[PeerId] = set()
        for level in range(grid.levels):
            by_group: dict[tuple[int, ...], list[int]] = {}
            for k in held:
                by_group.setdefault(grid.group(k, level), []).append(k)
            out: dict[tuple[int, ...], _Result] = {}
            async with trio.open_nursery() as nursery:
                for n, (g, mine) in enumerate(by_group.items()):
                    blocks = [held[k] for k in mine]
                    nursery.start_soon(self._group, grid, key, level, g, mine, blocks, n, live, out)
            nxt: dict[int, _Block] = {}
            for g, res in out.items():
                mine = by_group[g]
                taken = takeover(g, res.lost, functools.partial(grid.clashes, level=level))
                for k in [*mine, *(k for k, to in taken.items() if to in mine)]:
                    nxt[k] = res.block
                if not level:
                    row_size, dropped = max(row_size, res.members), dropped + res.dropped
                met |= res.met
            form_s += max(res.form_s for res in out.values())
            if any(res.left_out for res in out.values()):
                return GridOutcome(None, row_size, dropped, form_s, frozenset(met))
            held = nxt
        value = next(iter(held.values())).value
        return GridOutcome(value, row_size, dropped, form_s, frozenset(met))

    def _direct(self, grid: Grid, label: str, g: tuple[int, ...]) -> Group:
        """The group of ``g`` from the roll call's members, in slot order: every member
        builds the same one (its round id from the group's key, ``label``)."""
        assert self.members is not None
        order = dict.fromkeys(grid.server(k) for k in g)
        return Group(hashlib.sha256(label.encode()).digest(), tuple(self.members[p] for p in order))

    async def _meet(
        self, grid: Grid, key: str, level: int, g: tuple[int, ...], mine: list[int],
        live: Collection[PeerId],
    ) -> tuple[Group | None, Gathered]:  # fmt: skip
        """Whom this peer averages ``g`` with: the roll call's members (`members`), or
        whoever matchmaking gathers. Level 0 waits for the row's peers less those attendance
        excuses; a level above waits for every peer its group's slots name, or the member
        standing for it (MemberInfo.stands_for)."""
        me = self.me.peer_id
        expected = grid.expected(g)
        label = f"{key}/{grid.label(g[0], level)}"
        if self.members is not None:
            gathered = Gathered(expected=frozenset(expected))
            gathered.announced.update(expected)
            return (self._direct(grid, label, g) if len(expected) > 1 else None), gathered
        cfg = self.config.matchmaking
        wait_for = len(expected)
        if not level:
            gathered = self.attendance.gathering(expected, cfg.target_group_size)
            wait_for = self.attendance.expected(expected)
        else:
            # Complete once every slot's peer came or is stood for by the member that took
            # its slot over: waiting for a peer that never came cost the upper window.
            taken = frozenset(grid.server(k) for k in mine) - {me}
            gathered = Gathered(expected=frozenset(expected), stands_for=taken)
        # A group waits for its expected peers, and the run's min_group_size never holds it
        # above them (a row of 2 slots waited its whole window for a third member that no
        # row holds, in a daemon run with min_group_size 3).
        most = max(2, min(cfg.target_group_size, wait_for))
        cfg = dataclasses.replace(
            cfg,
            target_group_size=most,
            min_group_size=min(cfg.min_group_size, most),
            gather_s=self.config.upper_gather_s if level else cfg.gather_s,
        )
        # A row whose other peers are all excused (attendance: they missed the last rounds)
        # does not gather: min_group_size would hold it the whole window for nobody (seen:
        # 10 s every round of a 6-peer daemon run, a forked-off peer in the roster).
        if len(expected) < 2 or wait_for < 2:
            return None, gathered
        group = await form_group(self.dht, label, self.me, cfg, gathered)
        if not level:
            self.attendance.record(live, gathered, among=expected)
        return group, gathered

    async def _group(
        self, grid: Grid, key: str, level: int, g: tuple[int, ...], mine: list[int],
        blocks: list[_Block], n: int, live: Collection[PeerId],
        out: dict[tuple[int, ...], _Result],
    ) -> None:  # fmt: skip
        """One of this peer's groups at ``level``: it contributes the weighted mean of the
        blocks it holds in ``g`` with their summed weight (the group's mean is the same as
        if each block came alone), in the group `_meet` finds."""
        me = self.me.peer_id
        weight = sum(b.weight for b in blocks)
        value = torch.stack([b.value * (b.weight / weight) for b in blocks]).sum(0)
        if self.members is not None and me not in grid.expected(g):
            # Only slots it took over from a peer lost below: the other members build the
            # group with that peer, not this one. It takes the round's state instead.
            out[g] = _Result(_Block(value, weight), set(g) - set(mine), 1, 0, 0.0, True)
            return
        t = trio.current_time()
        group, gathered = await self._meet(grid, key, level, g, mine, live)
        form_s = trio.current_time() - t
        if group is None or len(group.members) < 2:
            # Alone: a group without this peer formed (others of it announced), or nobody
            # else came (their slots are lost, and this peer serves them from now on).
            left_out = bool(gathered.announced - {me})
            out[g] = _Result(_Block(value, weight), set(g) - set(mine), 1, 0, form_s, left_out)
            return
        # Declared weights stay near 1 (the run bounds them): a block at this level covers
        # about this many slots.
        scale = float(math.prod(grid.shape[:level]))
        result = await self.averager.allreduce(
            group, value, weight / scale, key=f"grid{level}/{n}", feedback=not level,
            codec=self.config.codec,
        )  # fmt: skip
        marks = torch.ones(1 + len(g))
        marks[0] = weight / scale
        for k in mine:
            marks[1 + g.index(k)] = 2.0
        sibling = Group(hashlib.sha256(group.round_id + b"/slots").digest(), group.members)
        tally = await self.averager.allreduce(
            sibling, marks, 1.0, key=f"gridw{level}/{n}", codec="fp32"
        )
        kept = len(group.members) - len(tally.dropped)
        sums = tally.tensor * kept
        came = {k for j, k in enumerate(g) if float(sums[1 + j]) - kept > 0.5}
        # Above the rows, a block that was there and did not make it in (a member dropped
        # mid-reduce, one that announced and was left out) is in the other groups' means and
        # not in this one's: this peer's result is not the round's, and it takes the round's
        # state instead (as left out). A slot whose peer never came anywhere (a staller's,
        # not taken over) is missing from every group alike.
        partial = bool(level) and (
            bool(result.dropped) or bool(tally.dropped)
            or any(grid.server(k) in gathered.announced for k in set(g) - came)
        )  # fmt: skip
        gone = set(result.dropped) | set(tally.dropped)
        met = frozenset(m.peer_id for m in group.members if m.peer_id not in gone) - {me}
        out[g] = _Result(
            _Block(result.tensor, float(sums[0]) * scale), set(g) - came, len(group.members),
            len(result.dropped), form_s, partial, met,
        )  # fmt: skip


__all__ = ["GridConfig", "GridOutcome", "GridPeer"]
