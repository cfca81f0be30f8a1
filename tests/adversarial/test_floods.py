"""A flooding stranger cannot stall a group's all-reduce or take its memory (issue 31),
against real processes.

Before: idle TCP connections to each peer's bulk port, reopened as soon as they were closed,
held every connection slot; honest calls met "bulk server busy" and members were dropped
(a group of three took 5.6x longer per round and lost averaged rounds). And a tensor call's
declared size (1.5 GiB) was allocated as soon as its header arrived, from anyone.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from benchmarks._memory_flood import MemoryFlood
from benchmarks.flood import Slowloris, rss_mb
from swarmd.node.averaging.exchange import PUT_PART
from swarmd.node.peer.service import PUT_TENSOR
from tests.harness.allreduce_peer import local_values
from tests.harness.processes import HARNESS, Proc, ProcessGroup
from tests.harness.transport import hello_of

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


def _group(processes: ProcessGroup, tmp_path: Path) -> tuple[list[Proc], torch.Tensor]:
    """A group of PEERS all-reduce processes after one calm round, and their exact mean."""
    script = str(HARNESS / "allreduce_peer.py")
    cfg = {"numel": NUMEL, "out_dir": str(tmp_path)}
    peers = processes.start_many(
        [[sys.executable, script, json.dumps({**cfg, "index": i})] for i in range(PEERS)],
        stdin=True,
    )
    before = _round(peers, "calm")
    assert all(o["ok"] and o["dropped"] == [] for o in before), before
    return peers, sum(local_values(i, NUMEL).double() for i in range(PEERS)) / PEERS


def _exact_round(peers: list[Proc], name: str, truth: torch.Tensor) -> None:
    outs = _round(peers, name)
    for o in outs:
        assert o["ok"] and o["dropped"] == [] and o["failed_parts"] == [], o
    results = [torch.load(str(o["file"])) for o in outs]
    assert all(torch.equal(r, results[0]) for r in results)
    assert torch.allclose(results[0].double(), truth, atol=1e-6)


def test_idle_connections_do_not_stall_the_group(processes: ProcessGroup, tmp_path: Path) -> None:
    peers, truth = _group(processes, tmp_path)
    attacker = Slowloris([hello_of(p.address).port for p in peers], IDLE_PER_PEER)
    attacker.start()
    try:
        time.sleep(1.0)  # every slot it can take is taken
        for name in ("flood1", "flood2", "flood3"):
            _exact_round(peers, name, truth)
    finally:
        attacker.halt.set()
        attacker.join(timeout=10)
    # The servers closed idle connections to make room (or refused them past the per-address
    # cap), so the attacker had to keep reopening: the attack was on, and was contained.
    assert attacker.reopened > 0


#: Issue 31's bound on a peer's memory growth under 50 huge declarations.
MAX_GROWTH_MB = 200


def _growth_mb(peers: list[Proc], before: list[float]) -> float:
    return max(rss_mb(p.process.pid) - b for p, b in zip(peers, before, strict=True))


def _flood(targets: list[tuple[str, str]], concurrent: int, calls: int) -> MemoryFlood:
    flood = MemoryFlood(targets, concurrent)
    flood.start()
    deadline = time.monotonic() + 30
    while flood.calls < calls and time.monotonic() < deadline:
        time.sleep(0.1)
    return flood


def test_declared_sizes_take_no_memory(processes: ProcessGroup, tmp_path: Path) -> None:
    """Fresh identities declaring 1.5 GiB tensors to PutPart and PutTensor, over bulk and
    gRPC, held open: each peer's peak RSS grows by less than 200 MB and rounds stay exact."""
    peers, truth = _group(processes, tmp_path)
    before = [rss_mb(p.process.pid) for p in peers]
    targets = [(p.address, path) for p in peers for path in (PUT_PART, PUT_TENSOR)]
    # Two at a time first: a server that allocates what is declared fails here, before fifty
    # such calls could take the machine's memory.
    probe = _flood(targets, 2, calls=8)
    probe.halt.set()
    probe.join(timeout=30)
    growth = _growth_mb(peers, before)
    assert growth < MAX_GROWTH_MB, f"two declarations: peak RSS grew by {growth:.0f} MB"
    assert probe.calls >= 8, "the calls were held, not refused"
    flood = _flood(targets, 50, calls=100)
    try:
        for name in ("mem1", "mem2"):
            _exact_round(peers, name, truth)
    finally:
        flood.halt.set()
        flood.join(timeout=30)
    growth = _growth_mb(peers, before)
    assert growth < MAX_GROWTH_MB, f"peak RSS grew by {growth:.0f} MB"
    # Every call was refused at its header, not left to time out holding its buffer.
    assert flood.calls >= 100 and flood.answered == flood.calls, (flood.calls, flood.answered)
