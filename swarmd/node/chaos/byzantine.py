"""A Byzantine peer: `swarmd join` with swarmd's own code, except that its DiLoCo optimiser
misreports what it contributes to each round. `swarmd chaos --byzantine` swaps a peer for one
of these for a while; tests/adversarial mounts the same lies against real peers. The process
that tells them starts from cli/liar.py: the CLI is above chaos, never the other way round.

    SWARMD_LIE=weight   python -m swarmd.node.cli.liar join ...  # 1e9 samples, update x -1
    SWARMD_LIE=scale100 python -m swarmd.node.cli.liar join ...  # update x 100
    SWARMD_LIE=signflip python -m swarmd.node.cli.liar join ...  # update x -1
    SWARMD_LIE=weightflip ...  # 3.9x its samples (inside the run's bounds), update x -1

A declared weight beyond the run's bound is evidence (every reducer bans it); a flipped or
scaled update is finite and well-formed, so it is bounded (norm rules, robust aggregation when
the run asks for it), never proven.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the harness and schedules import this module without torch
    import torch

    from swarmd.optim.diloco import DiLoCo

#: The lies this module tells, by SWARMD_LIE value.
LIES = ("weight", "scale100", "signflip", "weightflip")
#: What "weightflip" multiplies its declared samples by: under the reducers' 4x-the-median
#: outlier rule and the run's bound (32x a one-rank peer).
WEIGHTFLIP = 3.9
ENV_VAR = "SWARMD_LIE"


def install(lie: str) -> None:
    """Makes every DiLoCo of this process tell ``lie`` from now on."""
    from swarmd.optim.diloco import DiLoCo

    if lie not in LIES:
        raise SystemExit(f"{ENV_VAR} must be one of {', '.join(LIES)}, not {lie!r}")
    honest = DiLoCo.pseudo_gradient
    factor = 100.0 if lie == "scale100" else -1.0

    def lying_pseudo_gradient(self: DiLoCo) -> torch.Tensor:
        return honest(self) * factor

    DiLoCo.pseudo_gradient = lying_pseudo_gradient  # type: ignore[method-assign]
    if lie == "weight":
        DiLoCo.weight = lambda self: 1e9  # type: ignore[method-assign]
    elif lie == "weightflip":
        honest_weight = DiLoCo.weight
        DiLoCo.weight = lambda self: WEIGHTFLIP * honest_weight(self)  # type: ignore[method-assign]
