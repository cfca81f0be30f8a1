"""Who came to a round, so that a peer that heartbeats and never joins stops costing every round.

A round waits for as many peers as heartbeat in the run (up to the target group size). Three
identities that heartbeat and never announce themselves for a round made every round of two
honest peers sit out the whole gather window: 0.16 s rounds became 10.8 s (issue 46). Here a
peer remembers who was live, was counted in its target, and did not come (the round formed
short of that target without them), and does not wait for them in the next rounds: a lone
staller 1 round after its first miss, then 2, 4 and at most MAX_SKIP rounds after each
further miss in a row. A peer seen announcing for a round is waited for again at once. The
peers not waited for share one schedule (the longest skip any of them earned), so stallers
first seen in different rounds do not come due in turns.

Why back off rather than wait again only for peers seen announcing: the peers that are not
waited for are exactly the ones nobody sees announcing, because a group that stops waiting
forms before they arrive. Two halves of a run that were cut apart hold different states and
never announce under each other's keys; after the cut healed, the half that waits for nobody
never saw the other half again (tests/integration/test_split_heal.py failed so). Waiting again
after a bounded pause is what lets the late ones back in; a staller costs one gather window in
MAX_SKIP + 1 rounds once it has missed a few.

Only a round that formed short of this peer's target marks anyone: when the target was
reached early, the peers who had not announced yet were not waited for. A round whose leader
committed before this peer's own deadline counts as short too (a member that had not marked
the stallers made the next round wait whenever it was the one to lead). Marks follow the live
set: a peer whose heartbeat lapsed is forgotten, so the record never outgrows the run's live
peers.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from swarmd.protocol.identity import PeerId

#: The most rounds a peer that keeps missing is not waited for between two waits.
MAX_SKIP = 8


@dataclass
class Gathered:
    """What one round's gathering is told (the peers it excuses) and saw (`form_group` fills
    that in)."""

    #: Live peers not waited for (attendance): each that announces anyway raises the size the
    #: gathering waits for by one, up to ``most``. Else two of three peers, one of them the
    #: excused one, formed a pair the moment they saw each other and left the third, expected
    #: and a second away, alone under a key nobody else would use again (seen under `swarmd
    #: chaos`: the run ended split).
    excused: frozenset[PeerId] = frozenset()
    #: The run's largest group (0: nothing excused, nothing to raise).
    most: int = 0
    #: How many peers were live (this one included) when the round was counted; 0: not
    #: known. No raise waits for more than there are.
    live: int = 0
    #: The peers this gathering is for, when known in advance (a grid group, grid.py): it may
    #: stop as soon as each of them announced or is stood for by one that did.
    expected: frozenset[PeerId] | None = None
    #: Peers whose places this peer fills in the group (grid.takeover), announced with it.
    stands_for: frozenset[PeerId] = frozenset()
    #: One group a key (a grid round's roll call): every peer seen goes into one group, and
    #: a peer that finds a group committed without it forms none (it takes that group's
    #: round instead). Two rolls of one round are two lines: the 10 slower of 40 simulated
    #: peers formed a second roll once the first had closed, every round.
    one_group: bool = False
    #: Every peer seen announcing itself for the round, this one included.
    announced: set[PeerId] = field(default_factory=set)
    #: One group a key, formed without this peer: its members (whose round's state it takes).
    committed: frozenset[PeerId] = frozenset()
    #: The round formed without reaching this peer's target (at the gathering's deadline, or
    #: by a leader's group): each live peer that had not announced was not there.
    short: bool = False

    def wanted(self, target: int, visible: Collection[PeerId]) -> int:
        """The group size to gather for, given the target counted before the round and the
        peers seen announcing: one more for each excused peer among them, up to ``most`` and
        to the live peers, never below the target.

        Capped at the live peers because a target min_group_size had raised already held
        room for the excused peer: two live peers of a min-2 run, one a joiner in its first
        round, waited for 3 when it came, the whole gather window (10 s of a 1 s round).
        Still counted from the target, not from the peers waited for: with two excused of
        three live, the first to come must keep the wait at 3, or it pairs with this peer and
        leaves the third alone on a line of its own (`swarmd chaos`, round 26; a change
        that counted from the peers waited for was reverted for it)."""
        came = len(self.excused.intersection(visible))
        if not came:
            return target
        raised = min(max(self.most, target), target + came)
        return max(target, min(raised, self.live)) if self.live else raised


@dataclass
class _Missing:
    misses: int
    #: The first round (this peer's count) in which it is waited for again.
    until: int


class Attendance:
    """The live peers this peer does not wait for now (see the module docstring)."""

    def __init__(self) -> None:
        self._rounds = 0
        self._missing: dict[PeerId, _Missing] = {}
        #: The live peers this peer has read a heartbeat of (kept to the live set).
        self._known: set[PeerId] = set()

    def _note_new(self, live: Collection[PeerId]) -> None:
        """A peer whose heartbeat is new is not waited for in its first round (after this
        peer's own first): it heartbeats once it holds the run's state, then trains a round's
        inner steps before it can announce, so the round it appears in closes before it
        comes, and waiting for it cost every round with a joiner the whole gather window
        (1,000 simulated peers, 5% replaced a round: a 6.5 s roll call against a 5 s
        window). If it comes anyway it raises the size waited for (`Gathered.wanted`); from
        its second round it is waited for as any peer. A peer that then rolls alone and
        steps on its own while the joiners average together is pulled onto their line by
        catch-up (`SharedState._knows_someone_live`): before that, the creator's only
        partner, the creator killed, stepped alone for a whole run (CI; reverted once)."""
        new = set(live) - self._known
        self._known |= new
        if self._rounds:
            for p in new:
                self._missing.setdefault(p, _Missing(0, self._rounds + 1))

    @property
    def absent(self) -> set[PeerId]:
        """The peers not waited for in the coming round."""
        return {p for p, m in self._missing.items() if m.until > self._rounds}

    def expected(self, live: Collection[PeerId]) -> int:
        """How many of ``live`` the coming round should wait for."""
        self._note_new(live)
        return len(set(live) - self.absent)

    def target(self, live: Collection[PeerId], min_size: int, max_size: int) -> int:
        """The group size the coming round waits for: the expected peers, within the run's
        min and target group sizes."""
        return max(min_size, min(max_size, self.expected(live)))

    def gathering(self, live: Collection[PeerId], most: int) -> Gathered:
        """What the coming round's gathering is told: whom of ``live`` it excuses, and the
        run's largest group."""
        self._note_new(live)
        alive = set(live)
        return Gathered(excused=frozenset(self.absent & alive), most=most, live=len(alive))

    def record(self, live: Collection[PeerId], gathered: Gathered) -> set[PeerId]:
        """Accounts one round; returns the peers newly not waited for."""
        alive = set(live)
        # Counted in this round's target, they are not new in the next (and the set keeps to
        # the live peers).
        self._known = alive
        absent = self.absent
        waited_for = alive - absent
        self._rounds += 1
        self._missing = {
            p: m for p, m in self._missing.items() if p in alive and p not in gathered.announced
        }
        if not gathered.short:
            return set()
        newly = waited_for - gathered.announced
        for p in newly:
            misses = self._missing[p].misses + 1 if p in self._missing else 1
            self._missing[p] = _Missing(misses, self._rounds)
        # One schedule for all of them: the peers marked now and those already not waited
        # for come due together, after the longest skip any of them has earned. Each on its
        # own schedule, a staller first seen a round after the others came due in the rounds
        # between theirs, and every round waited out the window (seen in CI: two of three
        # stallers' heartbeats read in round 1, the third in round 2, then all four rounds
        # waited 10 s).
        # Only when someone new missed, never earlier than a peer's own due round: else every
        # short round (a lone peer held at min_group_size) would put the absent ones off
        # again and again.
        marked = [p for p in self._missing if p in newly or (p in absent and p in alive)]
        if newly:
            most = max(self._missing[p].misses for p in marked)
            until = self._rounds + min(MAX_SKIP, 2 ** (most - 1))
            for p in marked:
                m = self._missing[p]
                self._missing[p] = _Missing(m.misses, max(m.until, until))
        return newly
