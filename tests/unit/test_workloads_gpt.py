"""The built-in GPT: shapes, initial loss, size and speed of the default, stage splitting."""

from __future__ import annotations

import math
import time

import pytest
import torch

from swarmd.workloads import GPT, GPTConfig, lm_loss

TINY = GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16)


def test_forward_backward_shapes() -> None:
    model = GPT(TINY, seed=0)
    idx = torch.randint(0, 256, (4, 16))
    logits, loss = model(idx)
    assert logits.shape == (4, 16, 256) and loss is None
    logits, loss = model(idx, torch.randint(0, 256, (4, 16)))
    assert loss is not None and loss.shape == ()
    loss.backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    # Shorter sequences are fine; longer ones are refused with a clear message.
    assert model(idx[:, :5])[0].shape == (4, 5, 256)
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(torch.zeros(1, 17, dtype=torch.int64))


def test_initial_loss_is_uniform_over_bytes() -> None:
    model = GPT(TINY, seed=0)
    torch.manual_seed(1)
    _, loss = model(torch.randint(0, 256, (8, 16)), torch.randint(0, 256, (8, 16)))
    assert loss is not None
    assert abs(loss.item() - math.log(256)) < 0.1


def test_weight_tying() -> None:
    model = GPT(TINY, seed=0)
    assert model.head.lm_head.weight is model.embed.wte.weight
    untied = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, tie_weights=False))
    assert untied.head.lm_head.weight is not untied.embed.wte.weight
    assert (
        untied.num_params()
        == GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)).num_params() + 256 * 32
    )


def test_default_size_and_speed() -> None:
    model = GPT(GPTConfig(), seed=0)
    assert 2_000_000 <= model.num_params() <= 5_000_000
    x = torch.randint(0, 256, (8, 128))
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        _, loss = model(x, x)
        assert loss is not None
        loss.backward()
        best = min(best, time.perf_counter() - start)
    # Stated budget is 0.5 s on one core; the margin absorbs a loaded CI machine.
    assert best < 1.0, f"default forward+backward took {best:.3f} s"


def test_deterministic_init() -> None:
    a, b = GPT(TINY, seed=7), GPT(TINY, seed=7)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert not torch.equal(GPT(TINY, seed=8).embed.wte.weight, a.embed.wte.weight)
    # Without a seed, init follows torch's global generator and leaves it as if used.
    torch.manual_seed(3)
    c = GPT(TINY)
    torch.manual_seed(3)
    d = GPT(TINY)
    assert torch.equal(c.embed.wte.weight, d.embed.wte.weight)
    # A private seed does not disturb the global generator.
    torch.manual_seed(5)
    GPT(TINY, seed=1)
    after = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(1))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_stages_compose_to_the_full_model(n: int) -> None:
    model = GPT(TINY, seed=0)
    stages = model.stages(n)
    assert len(stages) == n
    idx = torch.randint(0, 256, (2, 16))
    targets = torch.randint(0, 256, (2, 16))
    h = idx
    for stage in stages:
        h = stage(h)
    logits, loss = model(idx, targets)
    assert torch.equal(h, logits)
    assert loss is not None and torch.equal(lm_loss(h, targets), loss)
    # The stages hold every parameter; only the tied embedding is shared (first and last).
    ids = [id(p) for s in stages for p in s.parameters()]
    assert set(ids) == {id(p) for p in model.parameters()}
    shared = 1 if n > 1 else 0
    assert len(ids) == len(set(ids)) + shared


def test_stage_count_validated() -> None:
    model = GPT(TINY, seed=0)
    for bad in (0, 4, -1):
        with pytest.raises(ValueError, match="number of stages"):
            model.stages(bad)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_layer": 0}, "n_layer"),
        ({"vocab_size": 1.5}, "vocab_size"),
        ({"n_embd": 30, "n_head": 4}, "divisible"),
        ({"dropout": 1.0}, "dropout"),
        ({"block_size": True}, "block_size"),
        ({"tie_weights": 1}, "tie_weights"),
    ],
)
def test_config_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)  # type: ignore[arg-type]
