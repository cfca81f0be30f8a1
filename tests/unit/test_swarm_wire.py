"""The stage bundle: what a trainer and a stage server exchange, and what is refused."""

from __future__ import annotations

import struct

import pytest
import torch

from swarmd.node.algorithms.swarm import wire


def _bytes(views: list[memoryview]) -> bytes:
    return b"".join(bytes(v) for v in views)


@pytest.mark.parametrize("codec", ["fp32", "fp16", "bf16", "int8"])
def test_round_trip_keeps_shapes_and_values_within_the_codec(codec: str) -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, 5))
    hidden = torch.randn(2, 5, 8)
    loss = torch.tensor(3.25)
    back = wire.decode(_bytes(wire.encode([tokens, hidden, loss], codec)))
    assert torch.equal(back[0], tokens) and back[0].dtype == torch.int64
    assert back[1].shape == hidden.shape and back[1].dtype == torch.float32
    tol = {"fp32": 0.0, "fp16": 1e-3, "bf16": 1e-2, "int8": 1e-2}[codec]
    err = (back[1] - hidden).abs().max() / hidden.abs().max()
    assert err <= tol, err
    assert float(back[2]) == 3.25  # a scalar travels exactly (never int8)


def test_int8_is_about_a_quarter_of_fp32() -> None:
    hidden = torch.randn(4, 32, 64)
    fp32 = sum(v.nbytes for v in wire.encode([hidden], "fp32"))
    int8 = sum(v.nbytes for v in wire.encode([hidden], "int8"))
    assert int8 < 0.3 * fp32


_GOOD = b"".join(
    bytes(v)
    for v in wire.encode([torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))], "fp16")
)


@pytest.mark.parametrize(
    "data",
    [
        b"XXXX" + _GOOD[4:],  # bad magic
        _GOOD[:-1],  # cut short
        _GOOD + b"\0",  # padded
        _GOOD[:4] + bytes([9]) + _GOOD[5:],  # too many entries
        b"",
        # A dimension of zero, one beyond the bound, too many dims.
        *(
            wire.MAGIC + struct.pack(f"<BBB{len(d)}I", 1, 0, len(d), *d)
            for d in ((0, 3), (1 << 25, 1), (1, 1, 1, 1, 1))
        ),
    ],
)
def test_refuses_what_is_malformed(data: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.decode(data)


def test_refuses_nan_and_inf() -> None:
    for bad in (float("nan"), float("inf")):
        x = torch.zeros(1, 2, 3)
        x[0, 1, 2] = bad
        with pytest.raises(wire.WireError, match="NaN or infinite"):
            wire.decode(_bytes(wire.encode([x], "fp32")))


def test_expect_names_the_wrong_shape() -> None:
    t = [torch.zeros(2, 3, 4)]
    wire.expect(t, [(None, None, 4)], "Forward")
    with pytest.raises(wire.WireError, match=r"Forward: tensor 0 has shape \(2, 3, 4\)"):
        wire.expect(t, [(None, None, 5)], "Forward")
    with pytest.raises(wire.WireError, match="expected 2 tensors"):
        wire.expect(t, [(None,), (None,)], "Backward")
