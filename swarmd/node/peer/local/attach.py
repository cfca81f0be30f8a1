"""Hands a strategy's inner steps to the peer's local ranks (or to the prepared module alone)."""

from __future__ import annotations

from pathlib import Path

import torch

from swarmd.node.peer.local.config import LocalConfig
from swarmd.node.peer.local.module import training_module
from swarmd.node.peer.local.protocol import WorkerSpec
from swarmd.node.peer.local.ranks import LocalRanks
from swarmd.node.peer.runconfig import RunConfig
from swarmd.node.peer.strategy import LocalTarget
from swarmd.optim.forward import InnerForward

#: Under the peer's --state-dir: the ranks' spec and starting optimizer state.
LOCAL_DIR = "local"


def attach_local(
    target: LocalTarget, local: LocalConfig, config: RunConfig, state_dir: Path
) -> LocalRanks | None:
    """With one rank: the strategy's steps run through the model in the chosen precision
    (compiled if asked). With N: starts ranks 1..N-1 and makes them take every step too."""
    if local.workers == 1:
        module = training_module(
            target.model,
            local.rank_device(0),
            local.precision,
            compile_model=local.compile,
            ddp=False,
        )
        target.owner.forward = InnerForward(module)
        return None
    work_dir = state_dir / LOCAL_DIR
    work_dir.mkdir(parents=True, exist_ok=True)
    inner = ""
    if target.inner_state is not None:
        path = work_dir / "inner.pt"
        torch.save(target.inner_state, path)
        inner = str(path)
    spec = WorkerSpec(
        run_config=config.to_json().decode(),
        shard=target.shard,
        local=local,
        inner_state=inner,
        optimizer=target.inner_state is not None,
    )
    ranks = LocalRanks.start(local, spec, target.model, target.params, work_dir)
    target.owner.forward = ranks
    return ranks
