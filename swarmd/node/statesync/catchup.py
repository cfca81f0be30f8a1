"""Which state a peer should take from the group instead of going on with its own.

Peers average only with peers holding the very same global state (the matchmaking key carries
the state hash), so a peer whose state is not the group's must download the group's, or it
trains alone forever. The question is which advertised state is "the group's". Round numbers
alone cannot say: a peer that found no group (cut off from the network, or the only one ready)
still makes an outer step of its own and counts a round, so after an outage it may be *ahead*
of the group in rounds with a state nobody else has. Seen on four network-namespace hosts: a
host cut off for three rounds came back one round ahead of the other three, ignored their
states because they were "older", and averaged alone for minutes; had it been one round further
ahead, the other three would have thrown their averaged state away for its lone one.

"Round" here is the state's age as adverts carry it (`Optimizer.age`): the round counter, or in
streaming DiLoCo the turn, which a deferred fragment round moves even though no round counter
does.

So each peer remembers the last round at which its state was shared with others (an outer step
averaged in a group, or a state downloaded from donors), and:

- a peer that has made rounds alone since then compares states by how many peers hold them
  (its own counts once), then by round: the group's state wins over its own lone one however
  many lone rounds it made; rounds at or before its last shared round are the past it already
  had (stale adverts it still sees while cut off), not a group to follow;
- a peer whose state is shared keeps the rule that a newer round wins (a late peer follows the
  group), except a newer state that only one peer holds while others still hold this peer's
  state: that is a lone peer ahead of the group, not the group;
- either way, between states as many peers hold, one its holders say is shared (their
  adverts' `shared`) beats one made alone, and only then does the hash decide. A member
  whose partner had not advertised the round yet once saw the lone state of a peer paused
  through the round, one holder against one, and took it on its hash (CI: test_chaos).

Two groups that never met cannot settle which state is the group's by counting: a running peer
follows only peers it has averaged with or downloaded from (`SharedState.met`: strangers'
adverts once took over every honest peer), so each side sees only itself. Seen on four
network-namespace hosts: the first round formed two pairs (live heartbeats still counted 2 at
the run's start), their states differed from then on, the matchmaking key carries the state
hash, and the pairs averaged apart for the rest of the run. The run's creator is the one peer
everyone trusts already (its config names the model), so its advert is the *anchor*: a peer
whose state is shared takes the creator's state when the creator says that state is shared too
(averaged in a group since the creator started, not made alone) and it is not one this peer
held before, whatever its round; a peer holding the creator's state keeps it whatever others
hold, and the creator keeps its own shared state against any other of its round, so the two
sides never swap. Rounds cannot decide it: in a test the two pairs ran two
rounds apart at the same pace, so "follow the creator when it is as new or newer" never fired.
A creator state this peer held before is the creator running late on this peer's own line (it
has not published this round yet), not another line: the other rules decide then. A lone
creator anchors nothing (the others would follow a state only it has); a peer that made lone
rounds counts the creator as one vote like any other.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from swarmd.node.statesync.donor import StateAdvert


def state_to_take(
    others: Sequence[StateAdvert],
    my_round: int,
    my_hash: bytes,
    shared_round: int,
    anchor: StateAdvert | None = None,
    past: Collection[bytes] = (),
    *,
    i_anchor: bool = False,
) -> bytes | None:
    """The hash of the state to download from ``others`` (other peers' adverts), or None to
    keep this peer's state (``my_round``, ``my_hash``; shared with others at ``shared_round``).
    ``anchor``: the run creator's advert, if this peer is not the creator and sees one;
    ``past``: hashes of states this peer held before; ``i_anchor``: this peer is the creator
    and its state is shared (its advert says so)."""
    if anchor is not None and anchor.shared and my_round <= shared_round:
        if anchor.state_hash == my_hash:
            return None
        if anchor.state_hash not in past:
            return anchor.state_hash
    if i_anchor and my_round <= shared_round and all(a.round <= my_round for a in others):
        # The others of its round take the creator's state: were it to take theirs on the
        # tie-break below, the two would swap and still differ.
        return None
    # States a holder says it shared (averaged in a group, or downloaded): between states held
    # by as many peers, one of those beats one its holder made alone.
    vouched = {a.state_hash for a in others if a.shared}
    if my_round > shared_round:
        fresh = [a for a in others if a.round > shared_round]
        votes: dict[bytes, tuple[int, int]] = {my_hash: (1, my_round)}
        for a in fresh:
            count, round_no = votes.get(a.state_hash, (0, a.round))
            votes[a.state_hash] = (count + 1, max(round_no, a.round))
        best = max(votes, key=lambda h: (votes[h][0], h in vouched, votes[h][1], h))
        return None if best == my_hash else best
    current = [a for a in others if a.round >= my_round]
    if not current:
        return None
    holders: dict[bytes, int] = {}
    for a in current:
        holders[a.state_hash] = holders.get(a.state_hash, 0) + 1
    newest = max(a.round for a in current)
    mine = holders.get(my_hash, 0)
    if newest > my_round:
        ahead = {a.state_hash for a in current if a.round == newest}
        want = max(ahead, key=lambda h: (holders[h], h))
        if holders[want] < 2 and mine > 0:
            return None
        return want
    # Same round, different states (two groups formed): the one more peers hold wins, this
    # peer's own vote included, so that the two sides of a tie pick the same state; this
    # peer's (shared: it averaged or downloaded it) beats, at a tie, one made alone. Without
    # that, a peer paused through a round's all-reduce stepped alone, a member of the round
    # whose partner's advert was not out yet saw one holder against one, took the lone state
    # on its hash, and the run ended on two states (CI: test_chaos).
    vouched.add(my_hash)

    def rank(h: bytes) -> tuple[int, bool, bytes]:
        return holders.get(h, 0) + (h == my_hash), h in vouched, h

    want = max(holders.keys() | {my_hash}, key=rank)
    return None if want == my_hash else want
