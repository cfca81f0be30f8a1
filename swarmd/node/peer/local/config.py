"""How a peer trains on its own machine: local ranks, precision, compilation.

A peer's own choices, like `--device`: never part of the run config, never on the wire. The
run sees one peer whatever N is; only the peer's sample weight grows with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from swarmd.workloads import resolve_device

Precision = Literal["fp32", "bf16"]

#: Seconds a collective between local ranks may take before the peer gives up on a rank: a
#: hung rank (not dead, so its sockets stay open) must not hang the peer for ever.
DEFAULT_TIMEOUT_S = 120.0


class LocalConfigError(ValueError):
    """An option the machine cannot honour (more ranks than GPUs, bf16 on a CPU without it)."""


def count_workers(spec: str, device: str) -> int:
    """`--local-workers`: a positive count, or `auto` (one per visible GPU when the peer trains
    on CUDA, else 1)."""
    text = spec.strip().lower()
    if text == "auto":
        if resolve_device(device).type == "cuda":
            return max(1, torch.cuda.device_count())
        return 1
    try:
        n = int(text)
    except ValueError:
        raise LocalConfigError(f"--local-workers must be a count or auto, got {spec!r}") from None
    if n < 1:
        raise LocalConfigError(f"--local-workers must be >= 1, got {n}")
    return n


def choose_precision(spec: str, device: torch.device) -> Precision:
    """`--precision auto` is bf16 autocast on a CUDA GPU that has bf16 (Ampere and newer),
    fp32 elsewhere: CPU autocast is slower than fp32 on most CPUs."""
    text = spec.strip().lower()
    if text == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return "bf16"
        return "fp32"
    if text not in ("fp32", "bf16"):
        raise LocalConfigError(f"--precision must be auto, fp32 or bf16, got {spec!r}")
    return "bf16" if text == "bf16" else "fp32"


@dataclass(frozen=True)
class LocalConfig:
    #: Ranks on this machine, rank 0 included (1: no other process is started).
    workers: int = 1
    #: Rank 0's device; rank r of a CUDA peer takes the GPU r places after it.
    device: str = "cpu"
    precision: Precision = "fp32"
    #: torch.compile the training forward (every rank compiles its own; minutes on a GPU).
    compile: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise LocalConfigError(f"workers must be a positive int, got {self.workers!r}")
        if self.precision not in ("fp32", "bf16"):
            raise LocalConfigError(f"precision must be fp32 or bf16, got {self.precision!r}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise LocalConfigError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        base = resolve_device(self.device)
        if base.type == "cuda":
            first = base.index or 0
            if first + self.workers > torch.cuda.device_count():
                raise LocalConfigError(
                    f"{self.workers} local workers from {base} need GPUs {first} to "
                    f"{first + self.workers - 1}; this machine has "
                    f"{torch.cuda.device_count()}"
                )
        elif base.type != "cpu" and self.workers > 1:
            raise LocalConfigError(f"local workers run on CUDA GPUs or the CPU, not on {base}")

    def rank_device(self, rank: int) -> torch.device:
        """Where rank `rank` trains: the CPU, or its own GPU."""
        base = resolve_device(self.device)
        if base.type == "cuda":
            return torch.device("cuda", (base.index or 0) + rank)
        return base

    @property
    def backend(self) -> str:
        """NCCL between GPUs, gloo between CPU processes."""
        return "nccl" if resolve_device(self.device).type == "cuda" else "gloo"
