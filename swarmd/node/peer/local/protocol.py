"""What rank 0 says to the other local ranks, and how parameters reach them.

Rank 0 decides everything (it alone talks to the swarm); the other ranks follow a stream of
commands, each one broadcast from rank 0 as a tiny tensor: take inner step s at learning rate
lr, compute gradients for step s only (DeMo, whose step rank 0 takes alone), take rank 0's
parameters (after an outer step, a catch-up, a DeMo step), or stop. Every rank sees the same
stream in the same order, so the collectives inside DDP's backward always pair up.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from swarmd.node.peer.local.config import LocalConfig
from swarmd.optim.flat import params_digest, unflatten_into


class Op(enum.IntEnum):
    STOP = 0
    INNER = 1
    GRADS = 2
    SYNC = 3
    DIGEST = 4


def send_command(device: torch.device, op: Op, step: int = 0, lr: float = 0.0) -> None:
    """Rank 0: broadcasts one command (float64: steps up to 2^53 and the lr stay exact)."""
    cmd = torch.tensor([float(op), float(step), lr], dtype=torch.float64, device=device)
    dist.broadcast(cmd, src=0)


def receive_command(device: torch.device) -> tuple[Op, int, float]:
    """Any other rank: waits for rank 0's next command."""
    cmd = torch.zeros(3, dtype=torch.float64, device=device)
    dist.broadcast(cmd, src=0)
    values = cmd.cpu().tolist()
    return Op(int(values[0])), int(values[1]), float(values[2])


@torch.no_grad()
def broadcast_params(params: Sequence[torch.Tensor]) -> None:
    """Rank 0's parameter values onto every rank, as one flat buffer (one collective)."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    dist.broadcast(flat, src=0)
    if dist.get_rank() != 0:
        unflatten_into(flat, params)


@torch.no_grad()
def gather_digests(params: Sequence[torch.Tensor], device: torch.device) -> list[bytes]:
    """Every rank's digest of its parameters' exact bytes, in rank order: equal digests are
    bit-identical replicas (what DDP's averaged gradients promise after every step)."""
    mine = torch.frombuffer(bytearray(params_digest(params)), dtype=torch.int64).to(device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.cpu().numpy().tobytes() for t in out]


def batch_index(step: int, rank: int, world: int) -> int:
    """Which of the shard's batches rank `rank` trains on at the peer's inner step `step`:
    consecutive ranks take consecutive batches, so one process reading batches sN..sN+N-1 as
    one combined batch computes exactly the step the N ranks take together."""
    return step * world + rank


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a local rank needs to build the same model and read its own batches; written
    by rank 0 to a file the worker reads (`python -m swarmd.node.peer.local.worker SPEC`)."""

    #: The run config, exactly as signed (RunConfig.to_json).
    run_config: str
    shard: int
    #: The peer's ranks, device, precision, compilation and collective timeout.
    local: LocalConfig
    #: Rank 0's inner optimizer state at the start (DiLoCo family; "" for none): the ranks
    #: must start from the same moments, or their identical gradients lead to different steps.
    inner_state: str
    #: Whether the ranks take optimizer steps (False: they only help compute gradients).
    optimizer: bool

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, path: Path) -> WorkerSpec:
        values = json.loads(path.read_text())
        return cls(**{**values, "local": LocalConfig(**values["local"])})
