"""Four all-reduce peers as real processes (allreduce_peer.py): start them, tell them who
is in a round, read their results, and the exact weighted mean those should equal."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from tests.harness.allreduce_peer import local_values
from tests.harness.processes import HARNESS, Proc, ProcessGroup

NUMEL = 50_000
#: Peer i's weight in the mean.
WEIGHTS = [1.0, 2.0, 3.0, 4.0]


def start_peers(
    processes: ProcessGroup, tmp_path: Path, behaviors: dict[int, str] | None = None, **cfg: Any
) -> list[Proc]:
    """Four peers of NUMEL values each, honest unless `behaviors` says otherwise; `cfg` goes
    to every peer (codec, ...)."""
    script = str(HARNESS / "allreduce_peer.py")
    commands = []
    for i in range(4):
        config = {
            "index": i,
            "numel": NUMEL,
            "weight": WEIGHTS[i],
            "behavior": (behaviors or {}).get(i, "honest"),
            "out_dir": str(tmp_path),
            **cfg,
        }
        commands.append([sys.executable, script, json.dumps(config)])
    return processes.start_many(commands, stdin=True)


def members(peers: list[Proc]) -> list[list[str]]:
    """The group as the peers are told it: [peer_id, address] rows, sorted."""
    return sorted([str(p.info["peer_id"]), p.address] for p in peers)


def run_round(peers: list[Proc], everyone: list[Proc], name: str) -> list[dict[str, Any]]:
    """One round `name` among `everyone`, started on `peers`; their results."""
    for p in peers:
        p.send({"round": name, "members": members(everyone)})
    return [p.receive(timeout=60) for p in peers]


def weighted_mean(indices: list[int]) -> torch.Tensor:
    """The exact weighted mean of the given peers' values (in float64, then float32)."""
    acc = torch.zeros(NUMEL, dtype=torch.float64)
    for i in indices:
        acc += local_values(i, NUMEL).double() * WEIGHTS[i]
    return (acc / sum(WEIGHTS[i] for i in indices)).float()


def load_result(out: dict[str, Any]) -> torch.Tensor:
    """The tensor a peer saved as a round's result."""
    tensor: torch.Tensor = torch.load(out["file"])
    return tensor
