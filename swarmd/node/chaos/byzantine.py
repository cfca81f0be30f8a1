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

from collections.abc import Callable
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


def _always() -> bool:
    return True


def install(lie: str, when: Callable[[], bool] = _always) -> None:
    """Makes every DiLoCo of this process tell ``lie`` from now on, while ``when()`` says the
    code running is the liar's (always, in a liar's process; in the simulator, whether the
    current host is the liar's: swarmd/node/sim/host.py)."""
    from swarmd.optim.diloco import DiLoCo

    if lie not in LIES:
        raise SystemExit(f"{ENV_VAR} must be one of {', '.join(LIES)}, not {lie!r}")
    honest, honest_weight = DiLoCo.pseudo_gradient, DiLoCo.weight
    factor = 100.0 if lie == "scale100" else -1.0
    claims: dict[str, Callable[[float], float]] = {
        "weight": lambda w: 1e9,
        "weightflip": lambda w: WEIGHTFLIP * w,
    }
    claimed = claims.get(lie)

    def lying_pseudo_gradient(self: DiLoCo) -> torch.Tensor:
        return honest(self) * factor if when() else honest(self)

    def lying_weight(self: DiLoCo) -> float:
        w = honest_weight(self)
        return claimed(w) if claimed is not None and when() else w

    DiLoCo.pseudo_gradient = lying_pseudo_gradient  # type: ignore[method-assign]
    DiLoCo.weight = lying_weight  # type: ignore[method-assign]
