"""Many DHT nodes in one trio loop, over real gRPC on loopback.

Time is real here (gRPC's threads are), so these tests use short expiries only where expiry is
not under test; expiry itself runs on an injected fake clock shared by the nodes.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import trio

from swarmd.node.dht import BootstrapError, DHTConfig, DHTNode, Value, open_dht
from swarmd.node.dht.caller import FIND, STORE, TimeoutPolicy
from swarmd.node.dht.ids import id_to_bytes, key_id
from swarmd.node.dht.lookup import STALE_HOLDERS
from swarmd.node.dht.records import fingerprint, sign_record
from swarmd.node.dht.service import MAX_KNOWN
from swarmd.protocol import dht_pb2 as pb
from swarmd.protocol import rpc
from swarmd.protocol.identity import Identity

TTL = 300.0


def run(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    return trio.run(fn, *args)


class FakeClock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@dataclass
class Peers:
    nodes: list[DHTNode] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    scopes: list[trio.CancelScope] = field(default_factory=list)
    alive: list[bool] = field(default_factory=list)

    def kill(self, i: int) -> None:
        self.scopes[i].cancel()
        self.alive[i] = False

    def live(self) -> list[int]:
        return [i for i, a in enumerate(self.alive) if a]


@asynccontextmanager
async def dht_peers(
    n: int, *, config: DHTConfig | None = None, clock: Callable[[], float] = time.time
) -> AsyncIterator[Peers]:
    """n nodes, each joining through up to three random earlier ones."""
    s = Peers()
    rng = random.Random(n)

    async def host(peers: list[str], *, task_status: trio.TaskStatus[None]) -> None:
        with trio.CancelScope() as scope:
            async with open_dht(
                Identity.generate(), bootstrap=peers, config=config, clock=clock
            ) as (
                node,
                server,
            ):
                s.nodes.append(node)
                s.addresses.append(str(server.address))
                s.scopes.append(scope)
                s.alive.append(True)
                task_status.started()
                await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            await nursery.start(host, rng.sample(s.addresses, min(3, len(s.addresses))))
        # Callers enter a routing table once they answered a ping back (admission.py): let
        # the joins' verifications finish, as a network that has been up a moment has.
        with trio.fail_after(10):
            while any(node.admission.pending for node in s.nodes):
                await trio.sleep(0.01)
        yield s
        nursery.cancel_scope.cancel()


# 25 s of real sockets, and a store's replica count moves with the machine's load; the same
# behaviour at 300 nodes with a third killed runs in virtual time in
# tests/unit/test_sim_dht.py (test_reads_find_every_key_after_a_third_of_the_nodes_die).
@pytest.mark.slow
def test_64_nodes_every_node_gets_what_any_stored_even_after_20_percent_die() -> None:
    async def main() -> None:
        rng = random.Random(1)
        async with dht_peers(64) as s:
            assert min(len(n.table) for n in s.nodes) >= 10
            stored: dict[str, bytes] = {}
            for i in rng.sample(range(64), 24):
                key, value = f"key/{i}", rng.randbytes(40)
                replicas = await s.nodes[i].store(key, value, time.time() + TTL)
                # The replicas' Stores go out in parallel; on a loaded 2-core CI machine a few
                # can miss their deadline (seen: 14 of 20 once, when a store made 20).
                # Republishing restores them; what must hold is a majority now, and every get
                # below.
                assert replicas > DHTConfig().replicas // 2
                stored[key] = value
            keys = list(stored)
            # Every node reads some key another node stored.
            for i, node in enumerate(s.nodes):
                key = keys[i % len(keys)]
                found = await node.get_value(key)
                assert found is not None and found.value == stored[key], (i, key)
            for i in rng.sample(range(64), 13):  # 20%
                s.kill(i)
            await trio.sleep(0.2)
            misses = []
            for i in s.live():
                key = keys[i % len(keys)]
                with trio.fail_after(3):
                    found = await s.nodes[i].get_value(key)
                if found is None or found.value != stored[key]:
                    misses.append((i, key))
            assert misses == []

    run(main)


def test_sub_keys_from_many_owners_merge_and_announce_watch() -> None:
    async def main() -> None:
        async with dht_peers(16) as s:
            key = "run/demo/round/17"
            for i in range(10):
                await s.nodes[i].store(key, b"ready%d" % i, time.time() + TTL, subkey=f"n{i}")
            merged = await s.nodes[15].get_map(key, exhaustive=True)
            assert {k: v.value for k, v in merged.items()} == {
                f"n{i}": b"ready%d" % i for i in range(10)
            }
            assert merged["n3"].owner == s.nodes[3].peer_id
            # An owner updates its entry with a later expiry; the others stay.
            await s.nodes[3].store(key, b"again", time.time() + TTL + 10, subkey="n3")
            merged = await s.nodes[12].get_map(key)
            assert merged["n3"].value == b"again" and len(merged) == 10

            # announce/watch: peers under a key, bound to their own peer ids.
            seen: list[set[str]] = []
            async with trio.open_nursery() as nursery:

                async def watcher() -> None:
                    async for current in s.nodes[0].watch("ready/18", interval=0.05):
                        seen.append({str(p) for p in current})
                        if len(current) == 3:
                            return

                nursery.start_soon(watcher)
                async with (
                    s.nodes[5].announce("ready/18", b"a", ttl=5),
                    s.nodes[6].announce("ready/18", b"b", ttl=5),
                    s.nodes[7].announce("ready/18", b"c", ttl=5),
                ):
                    with trio.fail_after(5):
                        while not seen or len(seen[-1]) < 3:
                            await trio.sleep(0.05)
                    found = await s.nodes[9].peers("ready/18")
                    assert {p: v.value for p, v in found.items()} == {
                        s.nodes[5].peer_id: b"a",
                        s.nodes[6].peer_id: b"b",
                        s.nodes[7].peer_id: b"c",
                    }
                    async with s.nodes[8].announce("ready/18", b"d", ttl=5):
                        # Exhaustive: a quorum read may stop at three nodes that the store
                        # did not reach (16 nodes, routing tables still filling).
                        here = await s.nodes[9].peers("ready/18", exhaustive=True)
                        assert s.nodes[8].peer_id in here
                    # Leaving withdraws at once, long before the 5 s ttl would have: an empty
                    # value replaces the announcement everywhere, and peers() leaves it out.
                    assert set(await s.nodes[9].peers("ready/18", exhaustive=True)) == {
                        s.nodes[i].peer_id for i in (5, 6, 7)
                    }
                    withdrawn = await s.nodes[9].get_map("ready/18", exhaustive=True)
                    assert withdrawn[str(s.nodes[8].peer_id)].value == b""
            assert seen[-1] == {str(s.nodes[i].peer_id) for i in (5, 6, 7)}
            assert await s.nodes[9].peers("ready/18", exhaustive=True) == {}

    run(main)


def test_expired_values_disappear_on_a_fake_clock() -> None:
    clock = FakeClock()

    async def main() -> None:
        async with dht_peers(8, clock=clock) as s:
            await s.nodes[0].store("short", b"v", clock.now + 10)
            await s.nodes[0].store("long", b"w", clock.now + 100)
            await s.nodes[1].store("dict", b"x", clock.now + 10, subkey="a")
            await s.nodes[2].store("dict", b"y", clock.now + 100, subkey="b")
            assert isinstance(await s.nodes[5].get("short"), Value)
            assert set(await s.nodes[5].get_map("dict", exhaustive=True)) == {"a", "b"}
            clock.now += 11
            for node in s.nodes:
                assert await node.get("short") is None
                assert set(await node.get_map("dict")) == {"b"}
                found = await node.get_value("long")
                assert found is not None and found.value == b"w"
            assert all(not n.storage.get(b"short") for n in s.nodes)
            clock.now += 100
            assert await s.nodes[3].get("long") is None
            assert sum(len(n.storage.records()) for n in s.nodes) == 0

    run(main)


def test_forged_oversized_and_replayed_stores_are_refused() -> None:
    async def main() -> None:
        async with dht_peers(4) as s:
            target = s.nodes[1]
            address = s.addresses[1]
            me = Identity.generate()
            client = rpc.RpcClient(me)
            try:
                good = sign_record(me, b"k", b"good", time.time() + 60)
                forged = dataclasses.replace(good, value=b"evil").to_pb()
                unsigned = dataclasses.replace(good, signature=b"").to_pb()
                big = sign_record(me, b"big", b"x" * (64 << 10 + 1), time.time() + 60).to_pb()
                other = Identity.generate()
                impostor = sign_record(other, b"k2", b"v", time.time() + 60).to_pb()
                impostor.owner_key = me.public_key  # claims to be me
                resp = await client.unary(
                    address,
                    STORE,
                    pb.StoreRequest(records=[good.to_pb(), forged, unsigned, big, impostor]),
                    pb.StoreResponse,
                )
                refused = pb.StoreResponse.REFUSED
                assert list(resp.outcomes) == [pb.StoreResponse.STORED] + [refused] * 4
                assert "signature" in resp.reasons[1]
                assert "not signed" in resp.reasons[2]
                assert "exceeds" in resp.reasons[3]
                assert "signature" in resp.reasons[4]
                assert [r.value for r in target.storage.get(b"k")] == [b"good"]
                assert target.storage.get(b"big") == [] and target.storage.get(b"k2") == []

                # A newer version, then the old one replayed: the newer one stays.
                newer = sign_record(me, b"k", b"newer", time.time() + 120)
                await client.unary(
                    address, STORE, pb.StoreRequest(records=[newer.to_pb()]), pb.StoreResponse
                )
                resp = await client.unary(
                    address, STORE, pb.StoreRequest(records=[good.to_pb()]), pb.StoreResponse
                )
                assert list(resp.outcomes) == [pb.StoreResponse.SUPERSEDED]
                assert [r.value for r in target.storage.get(b"k")] == [b"newer"]

                # Too many records in one call.
                many = pb.StoreRequest(records=[good.to_pb()] * 300)
                with pytest.raises(rpc.RpcError) as info:
                    await client.unary(address, STORE, many, pb.StoreResponse)
                assert info.value.code is rpc.StatusCode.INVALID_ARGUMENT
            finally:
                client.close()

            # The same signed request sent twice: the second is a replay.
            body = pb.StoreRequest(records=[sign_record(me, b"r", b"v", time.time() + 60).to_pb()])
            raw = body.SerializeToString()
            # Addressed to the server, as a client does once it knows who listens there.
            to = client.peer_id(address)
            metadata = me.sign_request(STORE, raw, recipient=to).to_metadata()

            def send_twice() -> list[str]:
                codes = []
                with grpc.insecure_channel(address) as channel:
                    call = channel.unary_unary(STORE)
                    for _ in range(2):
                        try:
                            call(raw, metadata=metadata, timeout=5)
                            codes.append("OK")
                        except grpc.RpcError as exc:
                            codes.append(exc.code().name)
                return codes

            assert await trio.to_thread.run_sync(send_twice) == ["OK", "UNAUTHENTICATED"]

    run(main)


def test_getters_ignore_forged_records_served_by_malicious_nodes() -> None:
    async def main() -> None:
        # Seven replicas: every node keeps one, node 0 (whose honest copy the others must
        # find) among them; with the default 5 of 7, node 0 kept its own record only when its
        # id was among the key's closest (a CI rehearsal: no copy to read, IndexError).
        async with dht_peers(7, config=DHTConfig(replicas=7)) as s:
            await s.nodes[0].store("cfg", b"honest", time.time() + 60)
            honest = s.nodes[0].storage.get(b"cfg")[0]
            forged = dataclasses.replace(honest, value=b"evil", expires_ms=honest.expires_ms + 5000)
            # Nodes 1-4 serve a forged newer version (planted past their own checks); nodes 5
            # and 6 hold nothing, so they must read the value from the others.
            for node in s.nodes[1:5]:
                node.storage._plain[b"cfg"] = forged
            for node in s.nodes[5:]:
                node.storage._plain.pop(b"cfg", None)
            for node in s.nodes[5:]:
                found = await node.get_value("cfg")
                assert found is None or found.value == b"honest"
                records = await node.get_records("cfg", exhaustive=True)
                assert [r.value for r in records] == [b"honest"]

    run(main)


def test_dead_nodes_are_routed_around_and_evicted() -> None:
    async def main() -> None:
        async with dht_peers(12) as s:
            await s.nodes[0].store("x", b"1", time.time() + 60)
            dead = [2, 5, 7]
            for i in dead:
                s.kill(i)
            await trio.sleep(0.2)
            dead_ids = {s.nodes[i].peer_id for i in dead}
            asker = s.nodes[1]
            assert any(p in asker.table for p in dead_ids)
            with trio.fail_after(2):
                found = await asker.get_value("x")
                await asker.store("y", b"2", time.time() + 60)
            assert found is not None and found.value == b"1"
            # The dead nodes it tried are out of its table and backed off, not retried at once.
            assert all(p not in asker.table for p in dead_ids if asker.table.in_backoff(p))
            assert any(asker.table.in_backoff(p) for p in dead_ids)

    run(main)


def test_find_answers_many_targets_in_one_call() -> None:
    async def main() -> None:
        # Six replicas: node 0, whose answer is checked, keeps one of its own record.
        async with dht_peers(6, config=DHTConfig(replicas=6)) as s:
            await s.nodes[0].store("a", b"1", time.time() + 60)
            client = rpc.RpcClient(Identity.generate())
            try:
                keys = [b"a", b"b", b"c"]
                resp = await client.unary(
                    s.addresses[0],
                    FIND,
                    pb.FindRequest(targets=[id_to_bytes(key_id(k)) for k in keys], keys=keys),
                    pb.FindResponse,
                )
            finally:
                client.close()
            assert len(resp.results) == 3
            assert all(len(r.nodes) == 5 for r in resp.results)
            assert [len(r.records) for r in resp.results] == [1, 0, 0]

    run(main)


def test_find_leaves_out_records_the_caller_lists_as_known() -> None:
    async def main() -> None:
        # Every node keeps a replica of every record (the default's 5 replicas are fewer
        # than the 6 nodes): node 0 must hold all three, since what is measured is its answer.
        async with dht_peers(6, config=DHTConfig(replicas=6)) as s:
            # A store that timed out on a loaded machine is redone, as its owner's
            # republishing would (seen in CI: 2 of 3, a join's rebootstrap timed out under load).
            with trio.fail_after(20):
                while len(held := s.nodes[0].storage.get(b"round")) < 3:
                    mine = {r.subkey for r in held}
                    for node in s.nodes[:3]:
                        if str(node.peer_id).encode() not in mine:
                            await node.store(
                                "round", b"me", time.time() + 60, subkey=str(node.peer_id)
                            )
                    await trio.sleep(0.05)
            assert len(held) == 3
            client = rpc.RpcClient(Identity.generate())

            async def find(
                known: list[bytes], key: bytes = b"round", nodes_only_if_empty: bool = False
            ) -> pb.FindResult:
                resp = await client.unary(
                    s.addresses[0],
                    FIND,
                    pb.FindRequest(
                        targets=[id_to_bytes(key_id(key))],
                        keys=[key],
                        known=known,
                        nodes_only_if_empty=nodes_only_if_empty,
                    ),
                    pb.FindResponse,
                )
                return resp.results[0]

            every = [fingerprint(r) for r in held]
            try:
                everything = await find([])
                some = await find([every[0], every[2], b"12345678"])
                all_known = await find(every, nodes_only_if_empty=True)
                absent = await find([], key=b"nobody", nodes_only_if_empty=True)
                with pytest.raises(rpc.RpcError, match="known records") as info:
                    await find([b"12345678"] * (MAX_KNOWN + 1))
            finally:
                client.close()
            assert (len(everything.records), everything.omitted) == (3, 0)
            assert (len(some.records), some.omitted) == (1, 2)
            assert some.records[0].signature == held[1].signature
            assert len(everything.nodes) == len(some.nodes) == 5
            # A holder's node list would go unused by a light read; a non-holder's is kept.
            assert (len(all_known.records), all_known.omitted, len(all_known.nodes)) == (0, 3, 0)
            assert (len(absent.records), len(absent.nodes)) == (0, 5)
            assert info.value.code is rpc.StatusCode.INVALID_ARGUMENT

    run(main)


def test_a_key_reader_transfers_only_new_records_and_light_reads_ask_few_nodes() -> None:
    async def main() -> None:
        async with dht_peers(8) as s:
            reader_node = s.nodes[7]
            for node in s.nodes[:3]:
                await node.store("round", b"me", time.time() + 60, subkey=str(node.peer_id))
            reader = reader_node.reader("round")
            assert set(await reader.peers()) == {n.peer_id for n in s.nodes[:3]}
            # Nothing new: the nodes asked answer with counts, not records.
            transferred: list[int] = []
            lookup = reader_node._lookup

            async def counting(*args: Any, **kwargs: Any) -> Any:
                result = await lookup(*args, **kwargs)
                transferred.append(len(result.records))
                queried.append(result.queried)
                return result

            queried: list[int] = []
            reader_node._lookup = counting  # type: ignore[method-assign]
            assert set(await reader.peers()) == {n.peer_id for n in s.nodes[:3]}
            await s.nodes[3].store("round", b"me", time.time() + 60, subkey=str(s.nodes[3].peer_id))
            assert set(await reader.peers(light=True)) == {n.peer_id for n in s.nodes[:4]}
            assert set(await reader.peers(light=True)) == {n.peer_id for n in s.nodes[:4]}
            # Full read: nothing new; light reads: the new record once, then nothing. A light
            # read stops at the first node with news (every node has it here), and with none
            # at the second node holding only what the reader has (one could be a replica
            # the latest store had not reached: lookup.STALE_HOLDERS).
            assert transferred == [0, 1, 0]
            assert queried[0] >= 3 and queried[1:] == [1, STALE_HOLDERS]

    run(main)


def test_bootstrap_fails_clearly_when_no_peer_answers() -> None:
    async def main() -> None:
        config = DHTConfig(bootstrap_timeout_s=2)
        with pytest.raises(BootstrapError, match=r"no bootstrap peer answered.*127\.0\.0\.1:1"):
            async with open_dht(Identity.generate(), bootstrap=["127.0.0.1:1"], config=config):
                pass

    run(main)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="get_quorum"):
        DHTConfig(get_quorum=0)
    with pytest.raises(ValueError, match="refresh_interval_s"):
        DHTConfig(refresh_interval_s=0)


def test_periodic_refresh_evicts_dead_contacts_without_any_lookup() -> None:
    # Contacts go stale after 0.2 s, so live ones are pinged all the time: with the default
    # 250 ms timeout floor, one slow answer on a loaded CI machine evicted a live node before
    # the check below (seen once in CI). A dead node's port refuses at once, so a 1 s floor
    # still shows eviction in well under the 3 s allowed.
    config = DHTConfig(refresh_interval_s=0.3, stale_after_s=0.2, timeouts=TimeoutPolicy(min_s=1.0))

    async def main() -> None:
        async with dht_peers(6, config=config) as s:
            dead = s.nodes[3].peer_id
            assert all(dead in n.table for i, n in enumerate(s.nodes) if i != 3)
            s.kill(3)
            with trio.fail_after(3):
                while any(dead in n.table for n in s.nodes[:3] + s.nodes[4:]):
                    await trio.sleep(0.05)
            assert len(s.nodes[0].table) == 4

    run(main)


def test_a_node_that_lost_every_contact_rejoins_within_seconds() -> None:
    """A partition evicts all of a node's contacts; lookups cannot refill an empty table, so
    the node must re-bootstrap soon after the network heals, not at its next minute refresh."""
    config = DHTConfig(refresh_interval_s=120, bootstrap_timeout_s=0.5)

    async def main() -> None:
        async with dht_peers(3, config=config) as s:
            cut = s.nodes[2]
            attempts = 0
            rejoin = cut.bootstrap

            async def counted(peers: list[str]) -> None:
                nonlocal attempts
                attempts += 1
                await rejoin(peers)

            cut.bootstrap = counted  # type: ignore[method-assign]
            for contact in cut.table.contacts():
                cut.table.failed(contact.peer_id)
            assert len(cut.table) == 0
            with trio.fail_after(10):  # back-off (2 s) + a few re-bootstrap attempts
                while len(cut.table) == 0:
                    await trio.sleep(0.1)
            # While the bootstrap peer is still in back-off, attempts are paced, not a spin.
            assert 1 <= attempts <= 8, attempts

    run(main)


def test_stores_in_a_small_network_skip_the_node_lookup_until_the_network_changes() -> None:
    """Fewer than k nodes: one node lookup finds them all, and stores after it go straight to
    them; a node that joins shows in the routing table and brings the lookup back."""

    async def main() -> None:
        # Eight replicas, more than the nodes: every store reaches all of them.
        async with dht_peers(6, config=DHTConfig(replicas=8)) as s:
            writer = s.nodes[0]
            lookups: list[bytes | None] = []
            lookup = writer._lookup

            async def counting(target: int, key: bytes | None, *args: Any, **kw: Any) -> Any:
                lookups.append(key)
                return await lookup(target, key, *args, **kw)

            writer._lookup = counting  # type: ignore[method-assign]
            for name in (b"a", b"b", b"c"):
                assert await writer.store(name, b"v", time.time() + 60) == 6
            assert lookups == [None], lookups  # one node lookup, for the first store only
            assert all(n.storage.get(b"c") for n in s.nodes)
            async with open_dht(Identity.generate(), bootstrap=[s.addresses[0]]) as (late, _):
                assert late.peer_id in writer.table
                assert await writer.store(b"d", b"v", time.time() + 60) == 7
                assert lookups == [None, None], lookups
                assert late.storage.get(b"d")

    run(main)
