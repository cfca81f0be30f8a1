"""The inner learning-rate schedule: its shape, and that it runs on the run's clock (the
global state's age), not on a peer's own step count."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from swarmd.optim import DiLoCo, DiLoCoConfig, StreamingConfig, StreamingDiLoCo
from swarmd.optim.schedule import LrSchedule
from swarmd.workloads import GPT, GPTConfig
from tests.harness.batches import random_batches

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)


def test_warmup_then_cosine_down_to_the_final_ratio_and_held() -> None:
    s = LrSchedule("cosine", warmup_steps=10, decay_steps=110, final_ratio=0.1)
    assert s.factor(0) == pytest.approx(0.1)
    assert s.factor(4) == pytest.approx(0.5)
    assert s.factor(10) == pytest.approx(1.0)
    assert s.factor(60) == pytest.approx(0.55)  # half way down the cosine: (1 + 0.1) / 2
    assert s.factor(110) == pytest.approx(0.1)
    assert s.factor(10_000) == pytest.approx(0.1)
    factors = [s.factor(i) for i in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(factors))


def test_constant_warms_up_and_then_stays() -> None:
    s = LrSchedule("constant", warmup_steps=4)
    assert [s.factor(i) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert LrSchedule().factor(0) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "step"}, "must be one of constant, cosine"),
        ({"kind": "cosine", "warmup_steps": 5, "decay_steps": 5}, "decay_steps > warmup_steps"),
        ({"warmup_steps": 1.5}, "warmup_steps must be an integer"),
        ({"final_ratio": math.nan}, "final_ratio must be in"),
    ],
)
def test_bad_schedules_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LrSchedule(**kwargs)  # type: ignore[arg-type]


def _lr(opt: torch.optim.Optimizer) -> float:
    return float(opt.param_groups[0]["lr"])


def test_diloco_follows_the_run_not_its_own_steps() -> None:
    schedule = LrSchedule("cosine", warmup_steps=2, decay_steps=40)
    config = DiLoCoConfig(inner_steps=4, inner_lr=1e-2, lr_schedule=schedule)
    batches = random_batches(3, seed=0, batch=2, block=16)
    veteran = DiLoCo(GPT(TINY, seed=0), config)
    veteran.inner_step(batches[0])
    assert _lr(veteran.inner_optimizer) == pytest.approx(1e-2 * schedule.factor(0))
    # A state five rounds on, as a joiner downloads it from the group.
    state = veteran.state_dict()
    state = {**state, "round": torch.tensor(5, dtype=torch.int64)}
    joiner = DiLoCo(GPT(TINY, seed=1), config)
    joiner.load_state_dict(state)
    assert joiner.progress == 5 * 4
    joiner.inner_step(batches[1])
    assert _lr(joiner.inner_optimizer) == pytest.approx(1e-2 * schedule.factor(20))
    joiner.inner_step(batches[2])
    assert _lr(joiner.inner_optimizer) == pytest.approx(1e-2 * schedule.factor(21))


def test_streaming_counts_turns_of_h_over_p_steps() -> None:
    schedule = LrSchedule("cosine", warmup_steps=0, decay_steps=16)
    base = DiLoCoConfig(inner_steps=8, inner_lr=1e-2, lr_schedule=schedule)
    opt = StreamingDiLoCo(GPT(TINY, seed=0), StreamingConfig(base, fragments=2, overlap_steps=0))
    opt.turn, opt.steps_in_turn = 3, 1  # turns of H/P = 4 steps
    assert opt.progress == 13
    opt.inner_step(random_batches(1, seed=0, batch=2, block=16)[0])
    assert _lr(opt.inner_optimizer) == pytest.approx(1e-2 * schedule.factor(13))
