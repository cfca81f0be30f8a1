"""`swarmd join` with one lie: a real peer process running swarmd's own code, except that its
DiLoCo optimiser misreports what it contributes to each round.

    SWARMD_LIE=weight   python -m tests.adversarial.lying_peer join ...   # 1e9 samples, update x -1
    SWARMD_LIE=scale100 python -m tests.adversarial.lying_peer join ...   # update x 100

Everything else (matchmaking, the all-reduce, its own reductions) is honest swarmd code.
"""

from __future__ import annotations

import os

import torch

from swarmd.node.cli.app import entry
from swarmd.optim.diloco import DiLoCo

LIE = os.environ.get("SWARMD_LIE", "")
honest_pseudo_gradient = DiLoCo.pseudo_gradient


def lying_pseudo_gradient(self: DiLoCo) -> torch.Tensor:
    pg = honest_pseudo_gradient(self)
    return pg * (-1.0 if LIE == "weight" else 100.0)


if LIE not in ("weight", "scale100"):
    raise SystemExit(f"SWARMD_LIE must be weight or scale100, not {LIE!r}")
DiLoCo.pseudo_gradient = lying_pseudo_gradient  # type: ignore[method-assign]
if LIE == "weight":
    DiLoCo.weight = lambda self: 1e9  # type: ignore[method-assign]
entry()
