"""KeyReader: a key read again and again, merged record by record, each poll's news alone.

The reader's merged map must stay what `values.merge` gives for the same records (newest
version of each sub-key, lapsed ones gone, withdrawals not counted as announcements), while
`peers_changed` hands a poll only what is new since the last one."""

from __future__ import annotations

from collections.abc import Sequence

import trio

from swarmd.node.dht.reader import KeyReader
from swarmd.node.dht.records import Record, sign_record
from swarmd.node.dht.storage import Storage
from swarmd.node.dht.values import Value, announced_peers, merge
from swarmd.protocol.identity import Identity

KEY = b"run/roll"
NOW = 1_800_000_000.0


class FakeNode:
    """What a reader asks of its DHTNode: the records the DHT holds under the key (less the
    ones it lists as known, as a node's Find does) and the time."""

    def __init__(self) -> None:
        self.storage = Storage()
        self.time = NOW
        self.held: list[Record] = []
        self.known_listed: list[int] = []

    def now(self) -> float:
        return self.time

    async def get_records(
        self,
        key: str | bytes,
        *,
        exhaustive: bool = False,
        light: bool = False,
        local: bool = False,
        known: Sequence[bytes] = (),
    ) -> list[Record]:
        self.known_listed.append(len(known))
        skip = set(known)
        now_ms = int(self.time * 1000)
        return [r for r in self.held if r.expires_ms > now_ms and r.fingerprint not in skip]

    def admitted(self, key: bytes, entries: dict[str, Value]) -> dict[str, Value]:
        return entries


def announce(who: Identity, value: bytes, ttl: float, now: float = NOW) -> Record:
    return sign_record(who, KEY, value, now + ttl, subkey=str(who.peer_id).encode())


def test_each_poll_hands_over_only_what_is_new_and_the_map_stays_the_merge() -> None:
    async def main() -> None:
        node = FakeNode()
        reader = KeyReader(node, KEY)
        a, b, c = Identity.generate(), Identity.generate(), Identity.generate()
        node.held = [announce(a, b"a1", 60), announce(b, b"b1", 60)]
        assert set(await reader.peers_changed()) == {a.peer_id, b.peer_id}
        assert await reader.peers_changed() == {}  # nothing new: nothing handed over
        assert node.known_listed[-1] == 2  # and both records were listed as known
        # c arrives, and a re-announces with a later expiry: both are news, b is not.
        node.held += [announce(c, b"c1", 60), announce(a, b"a2", 90)]
        news = await reader.peers_changed()
        assert {p: v.value for p, v in news.items()} == {a.peer_id: b"a2", c.peer_id: b"c1"}
        # An older version arriving late changes nothing.
        node.held.append(announce(b, b"b0", 30))
        assert await reader.peers_changed() == {}
        assert await reader.get_map() == merge(node.held, node.time)
        peers = await reader.peers()
        assert {p: v.value for p, v in peers.items()} == {
            a.peer_id: b"a2", b.peer_id: b"b1", c.peer_id: b"c1"
        }  # fmt: skip

    trio.run(main)


def test_a_withdrawal_and_a_lapse_leave_the_peers_and_the_merge_agrees() -> None:
    async def main() -> None:
        node = FakeNode()
        reader = KeyReader(node, KEY)
        a, b, c = Identity.generate(), Identity.generate(), Identity.generate()
        node.held = [announce(a, b"a1", 60), announce(b, b"b1", 20), announce(c, b"c1", 60)]
        assert len(await reader.peers()) == 3
        node.held.append(announce(a, b"", 61))  # a withdraws (DHTNode.announce's exit)
        assert set(await reader.peers()) == {b.peer_id, c.peer_id}
        assert await reader.peers_changed() == {
            p: v for p, v in (await reader.peers()).items()
        }  # the first call: every announcement there is
        node.time += 30  # b's announcement lapses
        assert set(await reader.peers()) == {c.peer_id}
        expected = merge([r for r in node.held if r.expires_ms > node.time * 1000], node.time)
        assert isinstance(expected, dict)
        assert await reader.get_map() == expected
        assert set(announced_peers(expected)) == {c.peer_id}
        # Back after the lapse: news again.
        node.held.append(announce(b, b"b2", 60, now=node.time))
        assert set(await reader.peers_changed()) == {b.peer_id}

    trio.run(main)


def test_an_announcement_not_admitted_yet_is_handed_over_once_it_is() -> None:
    """A run's access rules admit a peer only once this peer has read that it is allowed: an
    announcement read before must come later, not be lost (CI: a secret run's two peers
    averaged apart when it was)."""

    class Gated(FakeNode):
        def __init__(self) -> None:
            super().__init__()
            self.allowed: set[str] = set()

        def admitted(self, key: bytes, entries: dict[str, Value]) -> dict[str, Value]:
            return {k: v for k, v in entries.items() if str(v.owner) in self.allowed}

    async def main() -> None:
        node = Gated()
        reader = KeyReader(node, KEY)
        a, b = Identity.generate(), Identity.generate()
        node.allowed = {str(a.peer_id)}
        node.held = [announce(a, b"a1", 60), announce(b, b"b1", 60)]
        assert set(await reader.peers_changed()) == {a.peer_id}
        assert await reader.peers_changed() == {}
        node.allowed.add(str(b.peer_id))
        assert set(await reader.peers_changed()) == {b.peer_id}

    trio.run(main)
