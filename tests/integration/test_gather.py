"""Sticky-group all-gather (algorithms/demo/gather.py, DeMo's exchange) between real processes."""

from __future__ import annotations

import json
import signal
import sys

import trio

from swarmd.node.algorithms.demo.gather import PUT_GATHER, GatherConfig, Gatherer, GatherResult
from swarmd.node.algorithms.demo.gather_sign import signed_info
from swarmd.node.averaging.group import Group, Member
from swarmd.node.bans import Bans
from swarmd.node.metrics import Metrics
from swarmd.protocol import averaging_pb2 as apb
from swarmd.protocol import rpc
from swarmd.protocol.framing import TensorMeta
from swarmd.protocol.identity import Identity
from tests.harness.gather_peer import digest, payload
from tests.harness.processes import HARNESS, Proc, ProcessGroup

SCRIPT = str(HARNESS / "gather_peer.py")
PAYLOAD = 200_000


def _peers(processes: ProcessGroup, hashes: list[str]) -> list[Proc]:
    return processes.start_many(
        [
            [sys.executable, SCRIPT, json.dumps({"index": i, "hash": h})]
            for i, h in enumerate(hashes)
        ],
        stdin=True,
    )


def _start(peers: list[Proc], group: str, steps: int, clients: int = 0) -> None:
    """The last ``clients`` peers are client-mode members: the group names them at a closed
    port, so any member that dialled one would fail."""
    members = sorted(
        [
            str(p.info["peer_id"]),
            *(["127.0.0.1:1", True] if i >= len(peers) - clients else [p.address]),
        ]
        for i, p in enumerate(peers)
    )
    for p in peers:
        p.send({"group": group, "members": members, "steps": steps, "payload_bytes": PAYLOAD})


def _expected(peers: list[Proc], step: int) -> dict[str, str]:
    return {str(p.info["peer_id"]): digest(payload(i, step, PAYLOAD)) for i, p in enumerate(peers)}


def test_every_member_gets_every_payload_every_step(processes: ProcessGroup) -> None:
    peers = _peers(processes, ["same", "same", "same"])
    _start(peers, "g1", steps=8)
    for step in range(8):
        outs = [p.receive(timeout=30) for p in peers]
        for out in outs:
            assert out["step"] == step
            assert out["senders"] == _expected(peers, step), out
            assert out["late"] == [] and out["dropped"] == [] and out["agree"] is True


def test_client_mode_members_get_every_payload_through_the_reachable_ones(
    processes: ProcessGroup,
) -> None:
    """2 reachable members, 2 client-mode ones nobody can dial: the clients push to the
    reachable members and pull everything, a client's payload to the other client through a
    reachable member; every member gets every payload every step, none late."""
    peers = _peers(processes, ["same"] * 4)
    _start(peers, "g5", steps=6, clients=2)
    for step in range(6):
        outs = [p.receive(timeout=30) for p in peers]
        for out in outs:
            assert out["step"] == step
            assert out["senders"] == _expected(peers, step), out
            assert out["late"] == [] and out["dropped"] == [] and out["agree"] is True, out


def test_clients_go_on_through_the_other_reachable_member_when_one_dies(
    processes: ProcessGroup,
) -> None:
    """A reachable member killed: the client pulls the other client's payload through the
    remaining reachable member, and the three go on."""
    peers = _peers(processes, ["same"] * 4)
    _start(peers, "g6", steps=10, clients=2)
    for _ in range(2):
        for p in peers:
            p.receive(timeout=30)
    victim = peers[0]
    victim.process.send_signal(signal.SIGKILL)
    dead = str(victim.info["peer_id"])
    survivors = peers[1:]
    for _ in range(2, 10):
        outs = [p.receive(timeout=30) for p in survivors]
    for out in outs:  # the last step: everyone but the dead member heard
        live = {k: v for k, v in _expected(peers, 9).items() if k != dead}
        assert out["senders"] == live, out


def test_a_killed_member_is_late_then_dropped_and_the_others_go_on(
    processes: ProcessGroup,
) -> None:
    peers = _peers(processes, ["same", "same", "same"])
    steps = 12
    _start(peers, "g2", steps=steps)
    for _ in range(3):
        for p in peers:
            p.receive(timeout=30)
    victim, survivors = peers[2], peers[:2]
    victim.process.send_signal(signal.SIGKILL)
    dead = str(victim.info["peer_id"])
    dropped_at: list[int] = []
    after_drop: list[float] = []
    for _ in range(3, steps):
        outs = [p.receive(timeout=30) for p in survivors]
        for out in outs:
            senders = out["senders"]
            assert isinstance(senders, dict)
            live = {k: v for k, v in _expected(peers, int(str(out["step"]))).items() if k != dead}
            # Every survivor's payload arrives every step; the dead member's never again
            # after it died (a step in flight at the kill may still carry it).
            assert {k: senders[k] for k in live} == live, out
            assert out["seconds"] < 10, out  # within one deadline (max_deadline_s is 8)
            if dropped_at and int(str(out["step"])) > max(dropped_at):
                after_drop.append(float(str(out["seconds"])))
            if out["dropped"]:
                assert out["dropped"] == [dead]
                dropped_at.append(int(str(out["step"])))
    # Both survivors dropped it after two late steps, at the same step.
    assert len(dropped_at) == 2 and dropped_at[0] == dropped_at[1], dropped_at
    # Once dropped, steps no longer wait for it (min_deadline_s is 1: waiting would show).
    assert after_drop and max(after_drop) < 1.0, after_drop


def test_a_member_whose_state_differs_learns_it(processes: ProcessGroup) -> None:
    peers = _peers(processes, ["same", "same", "drifted"])
    _start(peers, "g3", steps=2)
    for _ in range(2):
        outs = [p.receive(timeout=30) for p in peers]
        assert [o["agree"] for o in outs] == [True, True, False], outs


def test_payloads_are_checked_before_they_are_received() -> None:
    """Strangers, steps outside the window, oversized and duplicate payloads are refused
    with their reason; the member's step still completes with the honest payload."""

    async def main() -> None:
        ids = [Identity.generate() for _ in range(2)]
        clients = [rpc.RpcClient(i) for i in ids]
        stranger = rpc.RpcClient(Identity.generate())
        gatherer = Gatherer(clients[0], ids[0].peer_id, GatherConfig(max_payload_bytes=1000))
        async with (
            rpc.serve([gatherer.service()], "127.0.0.1", 0, identity=ids[0]) as server,
            trio.open_nursery() as nursery,
        ):
            address = str(server.address)
            members = tuple(Member(i.peer_id, address) for i in ids)  # the other never serves
            group = Group(b"g" * 32, members)
            gatherer.start(group, 0, nursery)

            async def put(
                client: rpc.RpcClient, step: int, nbytes: int, signer: Identity | None = None
            ) -> rpc.StatusCode:
                assert client.identity is not None
                signer = signer or client.identity
                info = signed_info(signer, group.round_id, step, bytes(nbytes), b"")
                meta = TensorMeta("uint8", (nbytes,), info=info.SerializeToString())
                try:
                    await client.put_tensor(address, PUT_GATHER, meta, bytes(nbytes), apb.GatherAck)
                except rpc.RpcError as exc:
                    return exc.code
                return rpc.StatusCode.OK

            codes = [
                await put(stranger, 0, 10),
                await put(clients[1], 0, 5000),
                await put(clients[1], 9, 10),
                await put(clients[1], 0, 10, signer=Identity.generate()),  # not its key
                await put(clients[1], 0, 10),
                await put(clients[1], 0, 10),
            ]
            result = await gatherer.gather(b"mine")
            nursery.cancel_scope.cancel()
        for c in (*clients, stranger):
            c.close()
        S = rpc.StatusCode
        assert codes == [
            S.PERMISSION_DENIED,
            S.INVALID_ARGUMENT,
            S.FAILED_PRECONDITION,
            S.INVALID_ARGUMENT,
            S.OK,
            S.ALREADY_EXISTS,
        ]
        assert result.payloads == {ids[0].peer_id: b"mine", ids[1].peer_id: bytes(10)}
        assert result.late == []

    trio.run(main)


def test_a_member_that_dropped_us_is_dropped_at_once() -> None:
    """A member whose group no longer names us (it dropped us while we were paused) refuses
    our payload: we stop waiting for it that step instead of striking it out deadline after
    deadline."""

    metrics = Metrics()

    async def main() -> None:
        ids = [Identity.generate() for _ in range(3)]
        clients = [rpc.RpcClient(i) for i in ids[:2]]
        config = GatherConfig(min_deadline_s=6.0, max_deadline_s=8.0)
        gatherers = [
            Gatherer(c, i.peer_id, config, metrics) for c, i in zip(clients, ids, strict=False)
        ]
        async with (
            rpc.serve([gatherers[0].service()], "127.0.0.1", 0, identity=ids[0]) as s0,
            rpc.serve([gatherers[1].service()], "127.0.0.1", 0, identity=ids[1]) as s1,
            trio.open_nursery() as nursery,
        ):
            a, b = Member(ids[0].peer_id, str(s0.address)), Member(ids[1].peer_id, str(s1.address))
            other = Member(ids[2].peer_id, "127.0.0.1:9")
            gatherers[0].start(Group(b"g" * 32, (a, b)), 0, nursery)
            gatherers[1].start(Group(b"g" * 32, (b, other)), 0, nursery)  # a was dropped
            result = await gatherers[0].gather(b"mine")
            nursery.cancel_scope.cancel()
        for c in clients:
            c.close()
        assert result.dropped == [ids[1].peer_id]
        assert result.seconds < 2.0, result.seconds  # not the 4 s first deadline
        assert gatherers[0].group is not None and gatherers[0].group.members == (a,)

    trio.run(main)
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

    async def main() -> dict[str, object]:
        ids = [Identity.generate() for _ in range(3)]
        clients = [rpc.RpcClient(i) for i in ids]
        bans = Bans(own=ids[1].peer_id)
        config = GatherConfig(min_deadline_s=1.0, max_deadline_s=2.0)
        relay = _TamperingRelay(clients[0], ids[0].peer_id, config)
        c1 = Gatherer(clients[1], ids[1].peer_id, config, bans=bans)
        c2 = Gatherer(clients[2], ids[2].peer_id, config)
        results: dict[str, object] = {}
        async with (
            rpc.serve([relay.service()], "127.0.0.1", 0, identity=ids[0]) as server,
            trio.open_nursery() as nursery,
        ):
            members = (
                Member(ids[0].peer_id, str(server.address)),
                Member(ids[1].peer_id, "127.0.0.1:1", client=True),
                Member(ids[2].peer_id, "127.0.0.1:1", client=True),
            )
            group = Group(b"t" * 32, members)
            for g in (relay, c1, c2):
                g.start(group, 0, nursery)

            async def run(name: str, g: Gatherer, data: bytes) -> None:
                results[name] = await g.gather(data)

            async with trio.open_nursery() as steps:
                steps.start_soon(run, "relay", relay, b"r" * 100)
                steps.start_soon(run, "c1", c1, b"a" * 100)
                steps.start_soon(run, "c2", c2, b"b" * 100)
            nursery.cancel_scope.cancel()
        for c in clients:
            c.close()
        results["banned"] = bans.banned(ids[0].peer_id)
        results["ids"] = ids
        return results

    out = trio.run(main)
    ids = out["ids"]
    assert isinstance(ids, list)
    relay, c1 = out["relay"], out["c1"]
    assert isinstance(relay, GatherResult) and isinstance(c1, GatherResult)
    # The relay itself heard both clients (they push to it).
    assert set(relay.payloads) == {i.peer_id for i in ids}
    # The first client got the relay's own payload intact and refused the altered one.
    assert c1.payloads.get(ids[0].peer_id) in (None, b"r" * 100)
    assert ids[2].peer_id not in c1.payloads and ids[2].peer_id in c1.late
    assert b"b" * 100 not in c1.payloads.values()
    assert out["banned"] is True
