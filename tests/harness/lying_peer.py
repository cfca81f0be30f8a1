"""`swarmd join` with one lie: a real peer process running swarmd's own code, except that its
DiLoCo optimiser misreports what it contributes to each round (swarmd/node/chaos/byzantine.py,
the peer `swarmd chaos --byzantine` runs), or its reductions lie.

    SWARMD_LIE=weight   python -m tests.harness.lying_peer join ...   # 1e9 samples, update x -1
    SWARMD_LIE=scale100 python -m tests.harness.lying_peer join ...   # update x 100
    SWARMD_LIE=signflip python -m tests.harness.lying_peer join ...   # update x -1
    SWARMD_LIE=reducer  python -m tests.harness.lying_peer join ...   # serves its part x -1
    SWARMD_LIE=forger   python -m tests.harness.lying_peer join ...   # ... and forges its proof
    SWARMD_LIE=equivocator ...                                # ... a different proof per member
    SWARMD_LIE=demo1000 ...            # DeMo: its signed payloads carry its coefficients x -1000
    SWARMD_LIE=stage20 ...             # SWARM stage server: every answer it gives x -20
    SWARMD_LIE=trainer1000 ...         # SWARM trainer: every gradient it sends back x -1000
    SWARMD_LIE=copyflip ...            # SWARM stage server: the edge copies it serves x -1

Everything else (matchmaking, the all-reduce, its own reductions unless `reducer`) is honest
swarmd code.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from swarmd.node.averaging import round as round_module
from swarmd.node.chaos import byzantine
from swarmd.node.cli.app import entry
from tests.harness import forger

LIE = os.environ.get("SWARMD_LIE", "")


def lying_aggregate(*args: Any, **kwargs: Any) -> torch.Tensor:
    """The part this peer reduces, negated once aggregated: the same norm as the honest mean,
    so no norm bound notices; its proof is made honestly from what it received."""
    result: torch.Tensor = honest_aggregate(*args, **kwargs)
    return result.neg_()


def install_demo_scaled(factor: float) -> None:
    """Every DeMo step sends (and applies itself) its coefficients x ``factor``: finite,
    well-formed, signed, and the same bytes to every member, so its state agrees with theirs."""
    from swarmd.optim.demo import DeMo, SparseUpdate

    honest = DeMo.prepare

    def lying_prepare(self: DeMo) -> list[SparseUpdate]:
        return [SparseUpdate(u.indices, u.values * factor, u.block_size) for u in honest(self)]

    DeMo.prepare = lying_prepare  # type: ignore[method-assign]


def install_stage_answers_scaled(factor: float) -> None:
    """A stage server that computes honestly, at honest speed, and answers every call (its
    forwards' hidden states, a Last's loss and gradient, its backwards' gradients, Check
    calls too) x ``factor``: finite, well-formed, of the right shapes."""
    import types

    from swarmd.node.algorithms.swarm import stage_service, wire

    def lying_encode(tensors: list[torch.Tensor], codec: str) -> list[memoryview]:
        return wire.encode([t * factor if t.is_floating_point() else t for t in tensors], codec)

    stage_service.wire = types.SimpleNamespace(  # type: ignore[assignment,attr-defined]
        **{**vars(wire), "encode": lying_encode}
    )


def install_trainer_gradients_scaled(factor: float) -> None:
    """A SWARM trainer whose Backward calls carry the gradient x ``factor``: finite, in the
    wire's range, the shapes right (issue 47 item 2)."""
    from swarmd.node.algorithms.swarm import trainer
    from swarmd.node.algorithms.swarm.stage_service import BACKWARD

    honest = trainer.SwarmTrainer.checked

    async def lying_checked(
        self: trainer.SwarmTrainer, hop: Any, path: str, tensors: list[torch.Tensor],
        call: str, **kwargs: Any,
    ) -> list[torch.Tensor]:  # fmt: skip
        if path == BACKWARD:
            tensors = [tensors[0], tensors[1] * factor]
        return await honest(self, hop, path, tensors, call, **kwargs)

    trainer.SwarmTrainer.checked = lying_checked  # type: ignore[method-assign]


def install_copies_scaled(factor: float) -> None:
    """A SWARM stage server that keeps CheckFree+'s copy of an end stage's edge layers and
    serves it x ``factor`` (`Part` answers; finite, the right size) to a peer rebuilding
    that stage (issue 47 item 5)."""
    from swarmd.node.algorithms.swarm import stage_service

    honest = stage_service.rows
    stage_service.rows = lambda flat: honest(flat * factor)


LIES = (
    *byzantine.LIES, "reducer", "forger", "equivocator", "demo1000", "stage20", "trainer1000",
    "copyflip",
)  # fmt: skip
if LIE not in LIES:
    raise SystemExit(f"SWARMD_LIE must be one of {', '.join(LIES)}, not {LIE!r}")
honest_aggregate = round_module.__dict__["aggregate"]
if LIE == "forger":
    forger.install()
elif LIE == "equivocator":
    forger.install_equivocator()
elif LIE == "demo1000":
    install_demo_scaled(-1000.0)
elif LIE == "stage20":
    install_stage_answers_scaled(-20.0)
elif LIE == "trainer1000":
    install_trainer_gradients_scaled(-1000.0)
elif LIE == "copyflip":
    install_copies_scaled(-1.0)
elif LIE == "reducer":
    round_module.__dict__["aggregate"] = lying_aggregate
else:
    byzantine.install(LIE)  # the update lies: the same peer `swarmd chaos --byzantine` runs
entry()
