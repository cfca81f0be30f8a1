"""Model weights in and out (swarmd/workloads/weights.py): the built-in GPT in Hugging Face's
GPT-2 layout, loaded by the real `transformers`, and every way a weights file can be wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from swarmd.workloads.gpt import GPT, GPTConfig
from swarmd.workloads.weights import (
    WEIGHTS_FILE,
    WeightsError,
    check_weights,
    from_gpt2,
    gpt2_config,
    read_weights,
    to_gpt2,
    write_weights,
)

SMALL = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16)


def _export(tmp: Path, config: GPTConfig, seed: int = 3) -> tuple[GPT, dict[str, torch.Size]]:
    model = GPT(config, seed=seed).eval()
    tensors = to_gpt2(dict(model.named_parameters()), config)
    write_weights(tmp, tensors, gpt2_config(config))
    return model, {k: v.shape for k, v in tensors.items()}


@pytest.mark.parametrize("tied", [True, False])
def test_transformers_loads_the_export_as_gpt2_with_the_same_logits(
    tmp_path: Path, tied: bool
) -> None:
    from transformers import AutoModelForCausalLM

    config = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, tie_weights=tied)
    model, _ = _export(tmp_path, config)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    tokens = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens)[0], hf(tokens).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", WEIGHTS_FILE]


def test_weights_read_back_into_swarmd_exactly(tmp_path: Path) -> None:
    model, shapes = _export(tmp_path, SMALL)
    back = from_gpt2(read_weights(tmp_path / WEIGHTS_FILE, shapes), SMALL)
    params = dict(model.named_parameters())
    assert set(back) == set(params)
    assert all(torch.equal(back[n], params[n]) for n in params)


def test_bf16_export_halves_the_file(tmp_path: Path) -> None:
    model = GPT(SMALL, seed=1)
    tensors = to_gpt2(dict(model.named_parameters()), SMALL)
    fp32 = write_weights(tmp_path / "a", tensors, None).stat().st_size
    bf16 = write_weights(tmp_path / "b", tensors, None, "bf16").stat().st_size
    assert bf16 < 0.6 * fp32


def _rewrite(path: Path, change: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    tensors.update(change)
    save_file(tensors, str(path))


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    _, shapes = _export(tmp_path, SMALL)
    path = tmp_path / WEIGHTS_FILE
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(WeightsError, match="not a readable safetensors file"):
        read_weights(path, shapes)


def test_an_oversized_file_is_refused_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import swarmd.workloads.weights as weights

    _, shapes = _export(tmp_path, SMALL)
    monkeypatch.setattr(weights, "MAX_WEIGHTS_BYTES", 1000)
    with pytest.raises(WeightsError, match="over the 1000 bytes allowed"):
        read_weights(tmp_path / WEIGHTS_FILE, shapes)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"transformer.wpe.weight": torch.zeros(8, 32)}, r"shape \(8, 32\), the run's model"),
        ({"transformer.wpe.weight": torch.zeros(16, 32, dtype=torch.int32)}, "not a float"),
        ({"transformer.wpe.weight": torch.full((16, 32), float("nan"))}, "NaN or infinite"),
        ({"transformer.extra": torch.zeros(1)}, "unknown: transformer.extra"),
    ],
)
def test_a_file_that_does_not_fit_the_model_says_why(
    tmp_path: Path, change: dict[str, torch.Tensor], error: str
) -> None:
    _, shapes = _export(tmp_path, SMALL)
    _rewrite(tmp_path / WEIGHTS_FILE, change)
    with pytest.raises(WeightsError, match=error):
        read_weights(tmp_path / WEIGHTS_FILE, shapes)


def test_a_missing_tensor_and_a_nonzero_bias_are_refused(tmp_path: Path) -> None:
    model, shapes = _export(tmp_path, SMALL)
    tensors = to_gpt2(dict(model.named_parameters()), SMALL)
    del tensors["transformer.ln_f.weight"]
    with pytest.raises(WeightsError, match=r"missing: transformer\.ln_f\.weight"):
        check_weights(tensors, shapes, "file")
    biased = to_gpt2(dict(model.named_parameters()), SMALL)
    biased["transformer.h.0.mlp.c_fc.bias"] += 0.1
    with pytest.raises(WeightsError, match="has no biases"):
        from_gpt2(biased, SMALL)


def test_a_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    model = GPT(SMALL, seed=1)
    tensors = to_gpt2(dict(model.named_parameters()), SMALL)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").mkdir()  # the rename onto it fails
    with pytest.raises(OSError):
        write_weights(out, tensors, gpt2_config(SMALL))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", WEIGHTS_FILE]
    assert not list(out.glob(".*.tmp"))
