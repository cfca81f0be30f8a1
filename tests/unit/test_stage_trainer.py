"""A pipeline of StageTrainers computes what the whole model does: the same loss, the same
gradients, the same AdamW step; stage state round-trips and refuses another stage's."""

from __future__ import annotations

import copy

import pytest
import torch

from swarmd.optim.grad_bound import GradientRefused, NormBound
from swarmd.optim.stage import StageOptConfig, StageTrainer
from swarmd.workloads import GPT, GPTConfig, lm_loss

CFG = GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=8, tie_weights=False)


def _pipeline(model: GPT, n: int) -> list[StageTrainer]:
    opt = StageOptConfig(lr=1e-2, grad_clip=None)
    return [StageTrainer(m, i, n, opt, lm_loss) for i, m in enumerate(model.stages(n))]


def _micro_batch(stages: list[StageTrainer], x: torch.Tensor, y: torch.Tensor) -> float:
    inputs = [x]
    for s in stages[:-1]:
        inputs.append(s.forward(inputs[-1]))
    loss, grad = stages[-1].last(inputs[-1], y)
    for i in range(len(stages) - 2, -1, -1):
        grad = stages[i].backward(inputs[i], grad)  # type: ignore[arg-type]
    return loss


@pytest.mark.parametrize("n", [1, 2, 3])
def test_pipeline_equals_the_whole_model(n: int) -> None:
    torch.manual_seed(0)
    whole = GPT(CFG, seed=1)
    piped = copy.deepcopy(whole)
    stages = _pipeline(piped, n)
    ref_opt = torch.optim.AdamW(whole.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    for _ in range(3):
        batches = [(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))) for _ in range(2)]
        ref_opt.zero_grad()
        ref_losses = []
        for x, y in batches:
            _, loss = whole(x, y)
            assert loss is not None
            (loss / len(batches)).backward()
            ref_losses.append(float(loss.detach()))
        ref_opt.step()
        losses = [_micro_batch(stages, x, y) for x, y in batches]
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for s in stages:
            grad, count = s.take()
            assert count == len(batches)
            # take() divides by count + 1 (see StageTrainer.weight): the mean is back with it.
            s.apply(grad * (count + 1) / count)
    for (name, a), b in zip(whole.named_parameters(), piped.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_state_round_trips_and_refuses_another_stage() -> None:
    a = _pipeline(GPT(CFG, seed=1), 3)
    b = _pipeline(GPT(CFG, seed=2), 3)
    _micro_batch(a, torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
    for s in a:
        grad, _ = s.take()
        s.apply(grad)
    b[1].load_state_dict(a[1].state_dict())
    assert b[1].round == 1
    for k, v in a[1].state_dict().items():
        torch.testing.assert_close(b[1].state_dict()[k], v, msg=k)
    with pytest.raises(ValueError, match="layout"):
        b[0].load_state_dict(a[1].state_dict())


def test_apply_refuses_a_bad_average() -> None:
    (s,) = _pipeline(GPT(CFG, seed=1), 1)
    with pytest.raises(ValueError):
        s.apply(torch.full((s.numel,), float("nan")))
    with pytest.raises(ValueError):
        s.apply(torch.zeros(s.numel + 1))


def test_a_micro_batch_with_non_finite_gradients_is_refused_and_not_accumulated() -> None:
    stages = _pipeline(GPT(CFG, seed=1), 2)
    x = torch.randint(0, 256, (2, 8))
    h = stages[0].forward(x)
    huge = torch.full_like(h, 3e38)
    with pytest.raises(ValueError, match="not finite"):
        stages[0].backward(x, huge)
    assert stages[0].pending == 0
    grad, count = stages[0].take()
    assert count == 0 and not bool(grad.any())
    # Outputs and input gradients beyond what the wire carries are refused too.
    with pytest.raises(ValueError, match="exceeds"):
        stages[0].forward(x, bound=1e-6)
    with pytest.raises(ValueError, match="exceeds"):
        stages[1].last(h, torch.randint(0, 256, (2, 8)), bound=1e-12)
    assert stages[1].pending == 0


def test_a_check_call_answers_what_the_call_does_and_applies_nothing() -> None:
    stages = _pipeline(GPT(CFG, seed=2), 2)
    x, y = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    h = stages[0].forward(x)
    checked_loss, checked_grad = stages[1].last(h, y, apply=False)
    assert stages[1].pending == 0 and all(not p.grad.any() for p in stages[1].params)  # type: ignore[union-attr]
    loss, grad = stages[1].last(h, y)
    assert stages[1].pending == 1
    assert checked_loss == loss and torch.equal(checked_grad, grad)  # type: ignore[arg-type]
    h1 = h.detach().requires_grad_(False)
    blocks = _pipeline(GPT(CFG, seed=2), 3)[1]
    mid = blocks.forward(h1)
    g = torch.randn_like(mid)
    checked = blocks.backward(h1, g, apply=False)
    assert blocks.pending == 0 and all(not p.grad.any() for p in blocks.params)  # type: ignore[union-attr]
    assert torch.equal(checked, blocks.backward(h1, g))  # type: ignore[arg-type]
    assert blocks.pending == 1


def test_norm_bound_refuses_outsized_clips_large_and_follows_a_lasting_change() -> None:
    bound = NormBound(window=16, warmup=4, refuse=10.0, clip=3.0)  # refuse: 100 by default
    # Warming up: nothing is refused, but what is let in is clipped from the second on.
    assert bound.factor(1.0) == 1.0
    assert bound.factor(50.0) == pytest.approx(3.0 / 50.0)
    assert [bound.factor(n) for n in (1.0, 1.0)] == [1.0, 1.0]
    with pytest.raises(GradientRefused, match="x the median"):
        bound.factor(1000.0)
    assert bound.factor(6.0) == pytest.approx(3.0 / 6.0)  # clipped to 3x the median (1.0)
    assert bound.factor(2.0) == 1.0
    with pytest.raises(GradientRefused):
        bound.factor(float("nan"))
    # Gradients 20x the median for good are refused until a full window of them in a row.
    outcomes = []
    for _ in range(18):
        try:
            outcomes.append(bound.factor(40.0))
        except GradientRefused:
            outcomes.append(0.0)
    assert outcomes[:16] == [0.0] * 16 and outcomes[-1] == 1.0


def test_a_liar_with_half_the_micro_batches_is_held_to_the_honest_scale() -> None:
    """Two first versions let a liar sending every other micro-batch x1000 move the bound:
    one kept refused norms (the median rose until the lie passed as clipped), the other
    held every caller to all callers' median (the liar's clipped entries made it the
    honest window's maximum: 13 honest micro-batches' norm each). Each caller is now held
    to the others' norms, so the liar gets in at CLIP x an honest median at most."""
    gen = torch.Generator().manual_seed(0)
    honest = torch.exp(torch.randn(2000, generator=gen)).tolist()  # spread ~12x, as measured
    high = 3.0 * sorted(honest)[int(0.75 * len(honest))]
    for lie in (1000.0, 20.0):
        bound = NormBound()
        let_in, refused = 0.0, 0
        for i, h in enumerate(honest):
            pair = [("honest", h), ("liar", h * lie)]
            for caller, n in pair if i % 2 else pair[::-1]:
                try:
                    factor = bound.factor(n, caller)
                except GradientRefused:
                    assert caller == "liar", (lie, i, n)
                    refused += 1
                    continue
                if caller == "liar" and i > 0:
                    let_in = max(let_in, n * factor)
        assert 0.0 < let_in <= high, (lie, let_in, high)
        assert refused > (len(honest) * 0.9 if lie == 1000.0 else -1), refused


def test_a_trainer_s_outsized_backward_is_left_out_of_the_sum() -> None:
    """Issue 47 item 2: a trainer that sends its backward x(-1000) (finite, in range)
    moved the stage as much as 1000 honest micro-batches; now nothing of it is summed, and
    the stage says why (the call is still answered: the trainer may only have relayed it)."""
    torch.manual_seed(0)
    first, last = _pipeline(GPT(CFG, seed=1), 2)
    for _ in range(8):  # honest micro-batches: the stage's recent norms
        _micro_batch([first, last], torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
    x, y = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    hidden = first.forward(x)
    _, grad = last.last(hidden, y)
    assert grad is not None
    before = [p.grad.clone() for p in first.params]  # type: ignore[union-attr]
    pending = first.pending
    first.backward(x, grad * -1000.0)
    assert first.left_out is not None and "x the median" in first.left_out
    assert first.pending == pending
    for p, g in zip(first.params, before, strict=True):
        torch.testing.assert_close(p.grad, g)
    first.backward(x, grad)  # the honest one still counts
    assert first.pending == pending + 1 and first.left_out is None
    # The round's take counts what was left out per caller, and the next round starts at 0.
    first.backward(x, grad * -1000.0, caller="liar")
    first.take()
    assert first.taken_left_out == {"": 1, "liar": 1}
    first.take()
    assert first.taken_left_out == {}
