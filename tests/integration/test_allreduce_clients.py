"""Client-mode members (issue 27): peers nobody can dial still contribute to and receive the
all-reduce. Their announced address is one where nothing listens (the kernel refuses every
connection, as a NAT router does), so any call the group made to them would fail."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import torch

from tests.harness.allreduce import load_result, start_peers, weighted_mean
from tests.harness.clients import UNREACHABLE
from tests.harness.processes import Proc, ProcessGroup


def client_members(peers: list[Proc], clients: set[int]) -> list[list[object]]:
    """The group as every member sees it: clients flagged, with an address nobody answers."""
    rows: list[list[object]] = []
    for i, p in enumerate(peers):
        client = i in clients
        rows.append([str(p.info["peer_id"]), UNREACHABLE if client else p.address, client])
    return sorted(rows, key=lambda r: str(r[0]))


def test_two_clients_of_four_get_the_exact_mean(processes: ProcessGroup, tmp_path: Path) -> None:
    peers = start_peers(processes, tmp_path)
    group = client_members(peers, {1, 3})
    for name in ("c1", "c2"):
        for p in peers:
            p.send({"round": name, "members": group})
        outs = [p.receive(timeout=60) for p in peers]
        assert all(o["ok"] and o["dropped"] == [] and o["failed_parts"] == [] for o in outs), outs
        assert all(o["recovered_parts"] == [] for o in outs), outs  # nothing went round a relay
        results = [load_result(o) for o in outs]
        assert torch.equal(results[0], weighted_mean([0, 1, 2, 3]))
        assert all(torch.equal(r, results[0]) for r in results)


def test_int8_with_clients_agrees_everywhere(processes: ProcessGroup, tmp_path: Path) -> None:
    peers = start_peers(processes, tmp_path, codec="int8")
    group = client_members(peers, {0, 2})
    for p in peers:
        p.send({"round": "q", "members": group})
    outs = [p.receive(timeout=60) for p in peers]
    assert all(o["ok"] and o["failed_parts"] == [] for o in outs), outs
    results = [load_result(o) for o in outs]
    assert all(torch.equal(r, results[0]) for r in results)
    err = float((results[0] - weighted_mean([0, 1, 2, 3])).abs().max())
    assert err < 0.05, err


def test_a_reducer_killed_mid_round_leaves_its_part_to_the_other(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """Two clients depend on two reachable members; one of those dies mid-round: its part is
    reduced by the other reachable member (the fallback never picks a client), and the two
    clients and the survivor end with the same values."""
    peers = start_peers(processes, tmp_path, behaviors={3: "slow"})
    group = client_members(peers, {0, 1})
    for p in peers:
        p.send({"round": "k", "members": group})
    time.sleep(0.5)
    peers[3].process.send_signal(signal.SIGKILL)
    start = time.monotonic()
    outs = [p.receive(timeout=60) for p in peers[:3]]
    assert time.monotonic() - start < 40
    victim = str(peers[3].info["peer_id"])
    # The surviving reducer dropped the victim's contributions, and the clients, which reduce
    # nothing, learn it from its part's proof: all three say alike that the victim is not in
    # the mean (the clients said nobody was dropped before). Everyone obtained the victim's
    # part another way.
    assert all(o["dropped"] == [victim] for o in outs), outs
    assert all(o["ok"] and o["failed_parts"] == [] and o["recovered_parts"] for o in outs), outs
    results = [load_result(o) for o in outs]
    assert all(torch.equal(r, results[0]) for r in results)
    assert torch.allclose(results[0], weighted_mean([0, 1, 2]), atol=1e-6)
