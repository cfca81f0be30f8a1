"""Conversions between tensors and bytes, and input checks shared by the codecs."""

from __future__ import annotations

import torch

from swarmd.compression.errors import CompressionError
from swarmd.compression.wire import FLOAT_DTYPES


def check_float_input(tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise CompressionError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise CompressionError(f"codecs take float tensors, got {tensor.dtype}")
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise CompressionError("codecs take dense (strided) tensors")


def flat_float32(tensor: torch.Tensor) -> torch.Tensor:
    """Contiguous 1-D float32 view or copy; non-contiguous inputs are copied once here."""
    check_float_input(tensor)
    return tensor.detach().to(device="cpu", dtype=torch.float32).reshape(-1).contiguous()


def require_finite(tensor: torch.Tensor, what: str) -> None:
    if tensor.numel() and not bool(torch.isfinite(tensor).all()):
        raise CompressionError(f"{what} contains NaN or infinity")


def to_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().reshape(-1).contiguous()
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


def from_bytes(data: memoryview | bytes, dtype: torch.dtype, count: int) -> torch.Tensor:
    """Copy `count` elements out of `data` into a fresh, writable tensor.

    The copy keeps the result independent of the caller's buffer (and avoids torch's
    warning about read-only buffers, which is process-global state unsafe across threads).
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if len(data) != count * itemsize:
        raise CompressionError(f"expected {count * itemsize} bytes for {count} x {dtype}")
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
