"""What every state is checked for before it is loaded: this model's layout, finite values,
and a loss not clearly worse than the state the peer holds."""

from __future__ import annotations

import torch

from swarmd.node.statesync.snapshot import StateSnapshot, layout_mismatch, layout_of
from swarmd.node.statesync.vet import nonfinite, worse_than_ours
from swarmd.workloads import evaluate
from swarmd.workloads.gpt import GPT, GPTConfig


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(4, 3), "b": torch.zeros(3), "round": torch.tensor(2)}


def test_a_manifest_of_this_models_state_fits() -> None:
    snap = StateSnapshot.build(_state(), round=2)
    assert snap.manifest.layout == layout_of(_state())
    assert layout_mismatch(layout_of(_state()), snap.manifest.layout) is None


def test_each_kind_of_misfit_is_named() -> None:
    mine = layout_of(_state())
    bigger = layout_of({**_state(), "w": torch.ones(1 << 20, 3)})
    assert "tensor 'w' is" in (layout_mismatch(mine, bigger) or "")
    half = layout_of({**_state(), "b": torch.zeros(3, dtype=torch.float16)})
    assert "float16" in (layout_mismatch(mine, half) or "")
    extra = layout_of({**_state(), "evil": torch.zeros(1)})
    assert "has a tensor 'evil'" in (layout_mismatch(mine, extra) or "")
    fewer = layout_of({"w": torch.ones(4, 3)})
    assert "lacks tensor" in (layout_mismatch(mine, fewer) or "")


def test_non_finite_states_are_named() -> None:
    assert nonfinite(_state()) is None
    for bad in (float("nan"), float("inf"), -float("inf")):
        state = _state()
        state["b"][1] = bad
        assert nonfinite(state) == "tensor 'b' holds NaN or infinity"
    assert nonfinite({"w": torch.full((3,), 3e38)}) is None  # huge but finite: float64 norm


def test_a_state_clearly_worse_than_ours_is_refused() -> None:
    assert worse_than_ours(89.0, 3.6) is not None  # the scrambled takeover's figures
    assert worse_than_ours(5.44, 5.44) is None  # the seeded init, offered back
    assert worse_than_ours(3.7, 3.6) is None  # a group state within noise of ours
    assert worse_than_ours(2.0, 3.6) is None  # better is always welcome
    assert worse_than_ours(float("nan"), 3.6) is not None
    assert "limit 4.600" in (worse_than_ours(5.0, 3.6) or "")


def test_a_state_is_judged_without_touching_the_model() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8))
    batches = [(torch.randint(0, 16, (2, 8)), torch.randint(0, 16, (2, 8)))]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    own = evaluate(model, batches)
    scrambled = {n: torch.randn_like(p) * 30 for n, p in model.named_parameters()}
    theirs = evaluate(model, batches, scrambled)
    assert theirs > 4 * own
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert evaluate(model, batches) == own
    assert evaluate(model, batches, before) == own  # the model's own values, passed in
