"""A flooding stranger cannot stall a group's all-reduce (issue 31), against real processes.

Before: idle TCP connections to each peer's bulk port, reopened as soon as they were closed,
held every connection slot; honest calls met "bulk server busy" and members were dropped
(a group of three took 5.6x longer per round and lost averaged rounds).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.flood import Slowloris
from tests.helpers import ROOT, Proc, ProcessGroup, hello_of
from tests.integration.allreduce_peer import local_values

NUMEL = 50_000
PEERS = 3
#: More than a server's slots (TransportConfig.max_concurrent_rpcs, 64 by default).
IDLE_PER_PEER = 80


def _members(peers: list[Proc]) -> list[list[str]]:
    return sorted([str(p.info["peer_id"]), p.address] for p in peers)


def _round(peers: list[Proc], name: str) -> list[dict[str, object]]:
    for p in peers:
        p.send({"round": name, "members": _members(peers)})
    return [p.receive(timeout=90) for p in peers]


def test_idle_connections_do_not_stall_the_group(processes: ProcessGroup, tmp_path: Path) -> None:
    script = str(ROOT / "tests" / "integration" / "allreduce_peer.py")
    cfg = {"numel": NUMEL, "out_dir": str(tmp_path)}
    peers = processes.start_many(
        [[sys.executable, script, json.dumps({**cfg, "index": i})] for i in range(PEERS)],
        stdin=True,
    )
    truth = sum(local_values(i, NUMEL).double() for i in range(PEERS)) / PEERS
    before = _round(peers, "calm")
    assert all(o["ok"] and o["dropped"] == [] for o in before), before
    attacker = Slowloris([hello_of(p.address).port for p in peers], IDLE_PER_PEER)
    attacker.start()
    try:
        time.sleep(1.0)  # every slot it can take is taken
        for name in ("flood1", "flood2", "flood3"):
            outs = _round(peers, name)
            for o in outs:
                assert o["ok"] and o["dropped"] == [] and o["failed_parts"] == [], o
            results = [torch.load(str(o["file"])) for o in outs]
            assert all(torch.equal(r, results[0]) for r in results)
            assert torch.allclose(results[0].double(), truth, atol=1e-6)
    finally:
        attacker.halt.set()
        attacker.join(timeout=10)
    # The servers closed idle connections to make room (or refused them past the per-address
    # cap), so the attacker had to keep reopening: the attack was on, and was contained.
    assert attacker.reopened > 0
