"""Error feedback over every lossy codec: the running sum of decoded outputs tracks the
running sum of inputs, with a residual that stays bounded; state saves and restores."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.compression import (
    Codec,
    CompressionError,
    DctTopKCodec,
    DctTopKConfig,
    DecodeLimits,
    ErrorFeedback,
    HalfCodec,
    HalfConfig,
    Int8Codec,
    Int8Config,
    ResidualStore,
    ZstdFramed,
    decode,
)

# name -> (codec, delta): the codec keeps at least a fraction delta of the energy of its
# input (||x - C(x)||^2 <= (1 - delta) ||x||^2). Error feedback then keeps the residual
# under sqrt(1 - delta) / (1 - sqrt(1 - delta)) * max ||x_t|| <= 2 / delta * max ||x_t||,
# however many steps are taken. Inputs are 16 x 64, i.e. one 16 x 64 DCT chunk.
CODECS: dict[str, tuple[Codec, float]] = {
    "int8": (Int8Codec(Int8Config(block_size=32)), 0.9),
    "fp16": (HalfCodec(HalfConfig("float16")), 0.9),
    "bf16": (HalfCodec(HalfConfig("bfloat16")), 0.9),
    "dct-top32": (DctTopKCodec(DctTopKConfig(topk=32, values="float16")), 32 / 1024),
    "dct-sign": (DctTopKCodec(DctTopKConfig(topk=64, values="sign")), 64 / 1024 / 2),
    "zstd-int8": (ZstdFramed(Int8Codec(Int8Config(block_size=64))), 0.9),
}


@settings(max_examples=12, deadline=None, derandomize=True)
@given(name=st.sampled_from(sorted(CODECS)), seed=st.integers(0, 2**16))
def test_sum_of_outputs_tracks_sum_of_inputs(name: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    codec, delta = CODECS[name]
    ef = ErrorFeedback(codec)
    limits = DecodeLimits(max_elements=1 << 16, max_bytes=1 << 20)
    total_in = torch.zeros(16, 64)
    total_out = torch.zeros(16, 64)
    max_residual = max_input = 0.0
    for _ in range(60):
        x = torch.randn(16, 64, generator=gen)
        max_input = max(max_input, float(x.norm()))
        total_in += x
        data = ef.encode("w", x)
        total_out += decode(data, limits)  # what a receiver sees
        residual = ef.residual("w")
        assert residual is not None
        max_residual = max(max_residual, float(residual.norm()))
    residual = ef.residual("w")
    assert residual is not None
    # Telescoping: sum(out) = sum(in) - last residual.
    torch.testing.assert_close(total_out + residual, total_in, atol=1e-3, rtol=1e-4)
    # Bounded independently of the number of steps.
    assert max_residual <= 2 / delta * max_input


def test_without_feedback_top_k_drifts_but_with_feedback_it_does_not() -> None:
    codec = DctTopKCodec(DctTopKConfig(topk=2, values="float32"))
    limits = DecodeLimits(max_elements=4096, max_bytes=1 << 20)
    x = torch.linspace(-1, 1, 64 * 8).reshape(8, 64) ** 3  # the same input every step
    ef = ErrorFeedback(codec)
    sum_ef = torch.zeros_like(x)
    sum_plain = torch.zeros_like(x)
    for _ in range(50):
        sum_ef += decode(ef.encode("x", x), limits)
        sum_plain += decode(codec.encode(x), limits)
    target = 50 * x
    assert float((sum_ef - target).norm()) < 0.2 * float((sum_plain - target).norm())


def test_state_save_restore_and_shape_mismatch() -> None:
    ef = ErrorFeedback(Int8Codec(Int8Config(block_size=16)))
    x = torch.randn(10, 10)
    data, decoded = ef.encode_with_decoded("a", x)
    torch.testing.assert_close(decoded, decode(data, DecodeLimits(100, 10_000)))
    state = ef.state_dict()
    assert set(state) == {"a"} and state["a"].dtype == torch.float32
    restored = ErrorFeedback(Int8Codec(Int8Config(block_size=16)))
    restored.load_state_dict(state)
    assert ef.encode("a", x) == restored.encode("a", x)
    with pytest.raises(CompressionError, match="shape"):
        restored.encode("a", torch.randn(5))
    with pytest.raises(CompressionError):
        restored.load_state_dict({"a": torch.tensor([float("nan")])})
    restored.reset("a")
    assert restored.residual("a") is None
    restored.encode("a", torch.randn(5))
    restored.reset()
    assert restored.state_dict() == {}


def test_input_is_not_modified() -> None:
    x = torch.randn(100)
    before = x.clone()
    ef = ErrorFeedback(Int8Codec())
    ef.encode("k", x)
    ef.encode("k", x)
    assert torch.equal(x, before)


def test_residual_store_take_and_store_hand_over_the_tensor_itself() -> None:
    """take() empties the slot (a cancelled round cannot apply a residual twice); store()
    keeps the given float32 tensor without copying it."""
    store = ResidualStore()
    assert store.take("k") is None
    r = torch.randn(5)
    store.store("k", r)
    kept = store.residual("k")
    assert kept is not None and kept.data_ptr() == r.data_ptr()  # the same memory
    taken = store.take("k")
    assert taken is not None and taken.data_ptr() == r.data_ptr()
    assert store.residual("k") is None
    with pytest.raises(CompressionError):
        store.store("k", torch.randn(5, dtype=torch.float64))
