"""Sticky-group all-gather (algorithms/demo/gather.py, DeMo's exchange) between real processes.
What a member refuses, and how soon it drops one, is checked in virtual time:
tests/unit/test_sim_gather.py."""

from __future__ import annotations

import json
import signal
import sys

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


def _start(
    peers: list[Proc], group: str, steps: int, clients: int = 0, last: dict[int, int] | None = None
) -> None:
    """The last ``clients`` peers are client-mode members: the group names them at a closed
    port, so any member that dialled one would fail. ``last`` gives some peers (by index)
    fewer steps: such a peer sends nothing after them."""
    members = sorted(
        [
            str(p.info["peer_id"]),
            *(["127.0.0.1:1", True] if i >= len(peers) - clients else [p.address]),
        ]
        for i, p in enumerate(peers)
    )
    for i, p in enumerate(peers):
        n = (last or {}).get(i, steps)
        p.send({"group": group, "members": members, "steps": n, "payload_bytes": PAYLOAD})


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
    """The victim gathers 3 steps, then is killed: its last payload is of step 2. Killed while
    it still gathered, it could have sent step 3's payload to one survivor and not the other
    (CI saw them drop it at steps 4 and 5), so when each drops it would be a race."""
    peers = _peers(processes, ["same", "same", "same"])
    steps = 12
    _start(peers, "g2", steps=steps, last={2: 3})
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
            # Every survivor's payload arrives every step; the dead member's never again.
            assert senders == live, out
            assert out["seconds"] < 10, out  # within one deadline (max_deadline_s is 8)
            if dropped_at and int(str(out["step"])) > max(dropped_at):
                after_drop.append(float(str(out["seconds"])))
            if out["dropped"]:
                assert out["dropped"] == [dead]
                dropped_at.append(int(str(out["step"])))
    # Both survivors dropped it after two late steps (3 and 4).
    assert dropped_at == [4, 4], dropped_at
    # Once dropped, steps no longer wait for it (min_deadline_s is 1: waiting would show).
    assert after_drop and max(after_drop) < 1.0, after_drop


def test_a_member_whose_state_differs_learns_it(processes: ProcessGroup) -> None:
    peers = _peers(processes, ["same", "same", "drifted"])
    _start(peers, "g3", steps=2)
    for _ in range(2):
        outs = [p.receive(timeout=30) for p in peers]
        assert [o["agree"] for o in outs] == [True, True, False], outs
