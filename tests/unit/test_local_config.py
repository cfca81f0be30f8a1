"""`--local-workers`, `--precision`: what a machine can honour, said before joining."""

from __future__ import annotations

import pytest
import torch

from swarmd.node.peer.local.config import (
    LocalConfig,
    LocalConfigError,
    choose_precision,
    count_workers,
)
from swarmd.node.peer.local.protocol import batch_index
from swarmd.node.peer.runconfig import RunConfig, RunConfigError


def test_worker_counts() -> None:
    assert count_workers("3", "cpu") == 3
    assert count_workers(" auto ", "cpu") == 1  # no GPU here: this process alone
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(LocalConfigError, match="--local-workers"):
            count_workers(bad, "cpu")


def test_precision_choice() -> None:
    cpu = torch.device("cpu")
    assert choose_precision("auto", cpu) == "fp32"  # CPU autocast is slower than fp32
    assert choose_precision("BF16", cpu) == "bf16"
    with pytest.raises(LocalConfigError, match="--precision"):
        choose_precision("fp8", cpu)


def test_local_config_validates() -> None:
    assert LocalConfig(workers=4).backend == "gloo"
    assert LocalConfig(workers=2).rank_device(1) == torch.device("cpu")
    with pytest.raises(LocalConfigError, match="workers"):
        LocalConfig(workers=0)
    with pytest.raises(LocalConfigError, match="precision"):
        LocalConfig(precision="fp16")  # type: ignore[arg-type]
    with pytest.raises(LocalConfigError, match="timeout"):
        LocalConfig(timeout_s=float("nan"))


def test_cuda_ranks_need_as_many_gpus() -> None:
    with pytest.raises(ValueError, match=r"CUDA GPU|this machine has"):
        LocalConfig(workers=64, device="cuda")


def test_ranks_read_disjoint_consecutive_batches() -> None:
    seen = [batch_index(s, r, 3) for s in range(4) for r in range(3)]
    assert seen == list(range(12))


def test_max_local_workers_bounds_the_weight() -> None:
    one = RunConfig(name="t", max_local_workers=1)
    eight = RunConfig(name="t")
    assert eight.max_weight == 8 * one.max_weight
    with pytest.raises(RunConfigError, match="max_local_workers"):
        RunConfig(name="t", max_local_workers=0)
