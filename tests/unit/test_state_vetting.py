"""What every state is checked for before it is loaded: this model's layout, finite values."""

from __future__ import annotations

import torch

from swarmd.node.statesync.snapshot import StateSnapshot, layout_mismatch, layout_of
from swarmd.node.statesync.vet import nonfinite


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
