"""DeMo's sticky-group all-gather (algorithms/demo/gather.py) between gatherers on the simulated
network, in virtual time: what a member refuses, and how fast it gives up on a member. The
timings these tests assert (a member dropped within 2 s, not at a 4 s deadline) are the
protocol's: on loopback in the pytest process they were the machine's load too.
tests/integration/test_gather.py runs the exchange between real processes."""

from __future__ import annotations

import random

import trio

from swarmd.node.algorithms.demo.gather import PUT_GATHER, GatherConfig, Gatherer, GatherResult
from swarmd.node.algorithms.demo.gather_sign import signed_info
from swarmd.node.averaging.group import Group, Member
from swarmd.node.bans import Bans
from swarmd.node.metrics import Metrics
from swarmd.node.sim.dht import seeded_identity
from swarmd.node.sim.network import Host, NetworkConfig, SimNetwork, SimTensorClient
from swarmd.protocol import averaging_pb2 as apb
from swarmd.protocol import rpc
from swarmd.protocol.framing import TensorMeta
from swarmd.protocol.identity import Identity
from tests.harness.matchmaking import UNREACHABLE, run_sim


def _network(hosts: int, seed: int = 0) -> tuple[SimNetwork, list[Host]]:
    rng = random.Random(seed)
    net = SimNetwork(NetworkConfig(rtt_min_s=0.02, rtt_max_s=0.1), seed=seed)
    return net, [net.add_host(seeded_identity(rng)) for _ in range(hosts)]


def test_payloads_are_checked_before_they_are_received() -> None:
    """Strangers, steps outside the window, oversized and duplicate payloads are refused
    with their reason; the member's step still completes with the honest payload."""
    net, (own, other, stranger) = _network(3)
    gatherer = Gatherer(net.client(own), own.identity.peer_id, GatherConfig(max_payload_bytes=1000))
    net.serve(own, [gatherer.service()])
    # The other member never serves: only its puts reach the gatherer.
    group = Group(b"g" * 32, (Member(own.identity.peer_id, own.address),
                              Member(other.identity.peer_id, other.address)))  # fmt: skip
    codes: list[rpc.StatusCode] = []
    results: list[GatherResult] = []

    async def put(
        client: SimTensorClient, step: int, nbytes: int, signer: Identity | None = None
    ) -> rpc.StatusCode:
        assert client.identity is not None
        info = signed_info(signer or client.identity, group.round_id, step, bytes(nbytes), b"")
        meta = TensorMeta("uint8", (nbytes,), info=info.SerializeToString())
        try:
            await client.put_tensor(own.address, PUT_GATHER, meta, bytes(nbytes), apb.GatherAck)
        except rpc.RpcError as exc:
            return exc.code
        return rpc.StatusCode.OK

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            gatherer.start(group, 0, nursery)
            member, outsider = net.client(other), net.client(stranger)
            codes.extend([
                await put(outsider, 0, 10),
                await put(member, 0, 5000),
                await put(member, 9, 10),
                await put(member, 0, 10, signer=Identity.generate()),  # not its key
                await put(member, 0, 10),
                await put(member, 0, 10),
            ])  # fmt: skip
            results.append(await gatherer.gather(b"mine"))
            nursery.cancel_scope.cancel()

    run_sim(main)
    S = rpc.StatusCode
    assert codes == [
        S.PERMISSION_DENIED,
        S.INVALID_ARGUMENT,
        S.FAILED_PRECONDITION,
        S.INVALID_ARGUMENT,
        S.OK,
        S.ALREADY_EXISTS,
    ]
    assert results[0].payloads == {own.identity.peer_id: b"mine", other.identity.peer_id: bytes(10)}
    assert results[0].late == []


def test_a_member_that_dropped_us_is_dropped_at_once() -> None:
    """A member whose group no longer names us (it dropped us while we were paused) refuses
    our payload: we stop waiting for it that step instead of striking it out deadline after
    deadline."""
    metrics = Metrics()
    net, (a_host, b_host, gone) = _network(3)
    config = GatherConfig(min_deadline_s=6.0, max_deadline_s=8.0)
    gatherers = [
        Gatherer(net.client(h), h.identity.peer_id, config, metrics) for h in (a_host, b_host)
    ]
    for host, gatherer in zip((a_host, b_host), gatherers, strict=True):
        net.serve(host, [gatherer.service()])
    a = Member(a_host.identity.peer_id, a_host.address)
    b = Member(b_host.identity.peer_id, b_host.address)
    other = Member(gone.identity.peer_id, UNREACHABLE)
    results: list[GatherResult] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            gatherers[0].start(Group(b"g" * 32, (a, b)), 0, nursery)
            gatherers[1].start(Group(b"g" * 32, (b, other)), 0, nursery)  # a was dropped
            results.append(await gatherers[0].gather(b"mine"))
            nursery.cancel_scope.cancel()

    run_sim(main)
    assert results[0].dropped == [b.peer_id]
    assert results[0].seconds < 2.0, results[0].seconds  # not the 6 s first deadline
    assert gatherers[0].group is not None and gatherers[0].group.members == (a,)
    text = metrics.render().decode()
    assert 'swarmd_gather_steps_total{outcome="late"} 1.0' in text
    assert "swarmd_gather_members_dropped_total 1.0" in text


class _TamperingRelay(Gatherer):
    """A reachable member that flips a byte of every payload it passes on (not its own)."""

    async def _get_gathered(
        self, req: apb.GetGatheredRequest, ctx: rpc.CallContext
    ) -> tuple[TensorMeta, list[memoryview]]:
        meta, data = await super()._get_gathered(req, ctx)
        if bytes(req.sender) != self.me.raw:
            forged = bytearray(data[0])
            forged[0] ^= 1
            data = [memoryview(forged)]
        return meta, data


def test_a_relay_cannot_alter_a_payload_it_passes_on() -> None:
    """A client pulls the other client's payload through a reachable member that alters it:
    the signature fails, the client bans that member and counts the sender late instead of
    applying forged bytes."""
    net, hosts = _network(3)
    ids = [h.identity.peer_id for h in hosts]
    bans = Bans(own=ids[1])
    config = GatherConfig(min_deadline_s=1.0, max_deadline_s=2.0)
    relay = _TamperingRelay(net.client(hosts[0]), ids[0], config)
    c1 = Gatherer(net.client(hosts[1]), ids[1], config, bans=bans)
    c2 = Gatherer(net.client(hosts[2]), ids[2], config)
    net.serve(hosts[0], [relay.service()])
    members = (
        Member(ids[0], hosts[0].address),
        Member(ids[1], UNREACHABLE, client=True),
        Member(ids[2], UNREACHABLE, client=True),
    )
    group = Group(b"t" * 32, members)
    results: dict[str, GatherResult] = {}

    async def run(name: str, g: Gatherer, data: bytes) -> None:
        results[name] = await g.gather(data)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for g in (relay, c1, c2):
                g.start(group, 0, nursery)
            async with trio.open_nursery() as steps:
                steps.start_soon(run, "relay", relay, b"r" * 100)
                steps.start_soon(run, "c1", c1, b"a" * 100)
                steps.start_soon(run, "c2", c2, b"b" * 100)
            nursery.cancel_scope.cancel()

    run_sim(main)
    # The relay itself heard both clients (they push to it).
    assert set(results["relay"].payloads) == set(ids)
    # The first client got the relay's own payload intact and refused the altered one.
    got = results["c1"]
    assert got.payloads.get(ids[0]) in (None, b"r" * 100)
    assert ids[2] not in got.payloads and ids[2] in got.late
    assert b"b" * 100 not in got.payloads.values()
    assert bans.banned(ids[0]) is True
