"""One peer's round on the grid (grid.py): level after level, each of its groups averages
the blocks its members hold, until it holds the mean of every contribution. The same code
runs in the simulator (sim/rounds.py) and is what a daemon's strategy calls.

Per group, two all-reduces at once: the blocks (this peer's slots in the group, as one
weighted mean), and a small fp32 tally of the weight they cover and which of the group's
slots came (the averager reports no totals). The tally marks a member's slots 2 and the
others 1, not 1 among zeros: the averager drops a member whose part's norm is far above the
others', and the members' tallies would disagree. Only the rows (level 0) use error
feedback: a residual added above would reach its own group's mean and no other's.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import trio

from swarmd.node.averaging.allreduce import Averager, Group, Member
from swarmd.node.averaging.attendance import Gathered
from swarmd.node.averaging.codecs import CodecName
from swarmd.node.averaging.config import AllReduceResult
from swarmd.node.averaging.grid import Grid, takeover
from swarmd.node.averaging.matchmaking import MatchmakingConfig, form_group
from swarmd.node.dht import DHTNode
from swarmd.protocol.identity import PeerId


@dataclass(frozen=True)
class GridConfig:
    """How a grid round averages."""

    #: The grid's axis bound: the largest group at any level.
    target_group_size: int = 16
    #: The blocks' codec (None: the averager's); the tallies are always fp32.
    codec: CodecName | None = None
    #: Names the rows' error-feedback residuals: one per distinct vector a peer averages on
    #: the grid (each streaming fragment has its own).
    ef_key: str = "grid"

    def __post_init__(self) -> None:
        if self.target_group_size < 2:
            raise ValueError("GridConfig.target_group_size must be at least 2")


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
    left_out: bool = False
    met: frozenset[PeerId] = frozenset()


@dataclass
class GridPeer:
    """This peer's side of a round whose roster a roll call committed (`roll_call`,
    `on_roster`): each level's group is built from the roster's members directly.

    Gathering each level by matchmaking instead (the first daemon version) let an upper
    group close at its window before a late member: results under one roster differed and
    the run took 7.2x one group's wall time."""

    averager: Averager
    me: Member
    config: GridConfig
    #: The roster's members as the roll call committed them (address, bandwidth).
    members: Mapping[PeerId, Member]

    async def average(
        self,
        grid: Grid,
        key: str,
        value: torch.Tensor,
        weight: float,
    ) -> GridOutcome:
        """The round under ``key`` (the round's key: each group's round id is drawn from it,
        its level and its coordinates)."""
        share = weight * grid.share(self.me.peer_id)
        held = {k: _Block(value, share) for k in grid.slots_of(self.me.peer_id)}
        row_size, dropped = 1, 0
        met: set[PeerId] = set()
        for level in range(grid.levels):
            by_group: dict[tuple[int, ...], list[int]] = {}
            for k in held:
                by_group.setdefault(grid.group(k, level), []).append(k)
            out: dict[tuple[int, ...], _Result] = {}
            async with trio.open_nursery() as nursery:
                for n, (g, mine) in enumerate(by_group.items()):
                    blocks = [held[k] for k in mine]
                    nursery.start_soon(self._group, grid, key, level, g, mine, blocks, n, out)
            nxt: dict[int, _Block] = {}
            for g, res in out.items():
                mine = by_group[g]
                taken = takeover(g, res.lost, functools.partial(grid.clashes, level=level))
                for k in [*mine, *(k for k, to in taken.items() if to in mine)]:
                    nxt[k] = res.block
                if not level:
                    row_size, dropped = max(row_size, res.members), dropped + res.dropped
                met |= res.met
            if any(res.left_out for res in out.values()):
                return GridOutcome(None, row_size, dropped, frozenset(met))
            held = nxt
        value = next(iter(held.values())).value
        return GridOutcome(value, row_size, dropped, frozenset(met))

    def _direct(self, grid: Grid, key: str, level: int, g: tuple[int, ...]) -> Group | None:
        """The group of ``g`` from the roll call's members, in slot order: every member
        builds the same one, its round id drawn from the group's name (None: this peer
        holds every slot of it)."""
        order = dict.fromkeys(grid.server(k) for k in g)
        if len(order) < 2:
            return None
        label = f"{key}/{grid.label(g[0], level)}"
        return Group(hashlib.sha256(label.encode()).digest(), tuple(self.members[p] for p in order))

    async def _group(
        self, grid: Grid, key: str, level: int, g: tuple[int, ...], mine: list[int],
        blocks: list[_Block], n: int, out: dict[tuple[int, ...], _Result],
    ) -> None:  # fmt: skip
        """One of this peer's groups at ``level``: it contributes the weighted mean of the
        blocks it holds in ``g`` with their summed weight (the group's mean is the same as
        if each block came alone)."""
        me = self.me.peer_id
        weight = sum(b.weight for b in blocks)
        value = torch.stack([b.value * (b.weight / weight) for b in blocks]).sum(0)
        if me not in grid.expected(g):
            # Only slots it took over from a peer lost below: the other members build the
            # group with that peer, not this one. It takes the round's state instead.
            out[g] = _Result(_Block(value, weight), set(g) - set(mine), 1, 0, True)
            return
        group = self._direct(grid, key, level, g)
        if group is None:
            out[g] = _Result(_Block(value, weight), set(), 1, 0)
            return
        # Declared weights stay near 1 (the run bounds them): a block at this level covers
        # about this many slots.
        scale = float(math.prod(grid.shape[:level]))
        marks = torch.ones(1 + len(g))
        marks[0] = weight / scale
        for k in mine:
            marks[1 + g.index(k)] = 2.0
        sibling = Group(hashlib.sha256(group.round_id + b"/slots").digest(), group.members)
        got: dict[str, AllReduceResult] = {}

        async def reduce_blocks() -> None:
            got["blocks"] = await self.averager.allreduce(
                group, value, weight / scale, key=f"{self.config.ef_key}{level}/{n}",
                feedback=not level, codec=self.config.codec,
            )  # fmt: skip

        async def reduce_tally() -> None:
            got["tally"] = await self.averager.allreduce(
                sibling, marks, 1.0, key=f"{self.config.ef_key}w{level}/{n}", codec="fp32"
            )

        # The blocks and the tally at once: each is a few round trips of small messages,
        # and one after the other they were two of a grid round's four latencies.
        async with trio.open_nursery() as both:
            both.start_soon(reduce_blocks)
            both.start_soon(reduce_tally)
        result, tally = got["blocks"], got["tally"]
        kept = len(group.members) - len(tally.dropped)
        sums = tally.tensor * kept
        came = {k for j, k in enumerate(g) if float(sums[1 + j]) - kept > 0.5}
        # Above the rows, a block that did not make it in (a member dropped mid-reduce, a
        # slot lost below and not taken over) may be in the other groups' means and not in
        # this one's: this peer's result is not the round's, and it takes the round's state
        # instead (as left out).
        partial = bool(level) and not (result.whole and tally.whole and came == set(g))
        gone = set(result.dropped) | set(tally.dropped)
        met = frozenset(m.peer_id for m in group.members if m.peer_id not in gone) - {me}
        out[g] = _Result(
            _Block(result.tensor, float(sums[0]) * scale), set(g) - came, len(group.members),
            len(result.dropped), partial, met,
        )  # fmt: skip


async def roll_call(
    dht: DHTNode, key: str, me: Member, mm: MatchmakingConfig, expected: int, gathered: Gathered
) -> Group | None:
    """A grid round's roll call under ``key``/roll: one gathering of every live peer this
    peer expects (``expected``, at least the run's min_group_size), no tensor. Its leader's
    group record is the roster every member plans the round's grid from (`on_roster`).

    Each excused peer that answers raises the wait by one, up to every one of them
    (``gathered`` is updated in place: the caller accounts it to attendance). Capped at the
    run's group size, as rows are, an excused peer that came took the place of an expected
    one still on its way, which then sat the round out.

    One roll a round (`Gathered.one_group`): every peer seen is in it, and a peer that
    finds the roll committed without it (it came after the roll closed) gets None and
    takes the round's state, instead of rolling a second line with the other latecomers."""
    want = max(mm.min_group_size, expected)
    gathered.most = max(gathered.most, want + len(gathered.excused))
    gathered.one_group = True
    cfg = dataclasses.replace(mm, target_group_size=want)
    return await form_group(dht, f"{key}/roll", me, cfg, gathered)


RollVerdict = Literal["sit_out", "alone", "grid"]


def roll_verdict(roll: Group | None, gathered: Gathered, me: PeerId) -> RollVerdict:
    """What a roll call's outcome leaves this peer to do, the same in a daemon (loop.py) and
    in the simulator (sim/rounds.py), which kept a copy of this rule each: "sit_out" when
    others answered and committed a roster without it (it came after the roll closed: it
    takes their round's state, as a peer left out of a group does); "alone" when no roll of
    two formed (it steps on its own); else "grid"."""
    if roll is None and gathered.announced - {me}:
        return "sit_out"
    if roll is None or len(roll.members) < 2:
        return "alone"
    return "grid"


def on_roster(
    roll: Group, key: str, averager: Averager, me: Member, config: GridConfig
) -> tuple[Grid, GridPeer]:
    """The round's grid planned from a roll call's members, and this peer's side of it,
    each level's group built from those members with no gathering (every member plans the
    same groups and ends with the same mean)."""
    roster = [m.peer_id for m in roll.members]
    grid = Grid.plan(roster, config.target_group_size, key.encode())
    members = {m.peer_id: m for m in roll.members}
    return grid, GridPeer(averager, me, config, members)


__all__ = [
    "GridConfig",
    "GridOutcome",
    "GridPeer",
    "RollVerdict",
    "on_roster",
    "roll_call",
    "roll_verdict",
]
