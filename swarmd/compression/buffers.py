"""Conversions between tensors and bytes, and input checks shared by the codecs."""

from __future__ import annotations

from typing import Any

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
    """Refuses NaN and infinity. The L2 norm is NaN or inf whenever an element is, and costs a
    tenth of `isfinite().all()` (no boolean tensor); only a non-finite norm, which a huge but
    finite input can also produce by overflow, pays for the exact check."""
    if not tensor.numel():
        return
    # Half types are summed in float32 (their own range overflows at a few hundred).
    low = tensor.dtype in (torch.float16, torch.bfloat16)
    norm = torch.linalg.vector_norm(tensor, dtype=torch.float32 if low else None)
    if bool(torch.isfinite(norm)):
        return
    if not bool(torch.isfinite(tensor).all()):
        raise CompressionError(f"{what} contains NaN or infinity")


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (contiguous tensors); callers join the views into one
    payload with `b"".join`, which copies each byte exactly once."""
    flat = tensor.detach().reshape(-1).contiguous()
    if flat.numel() == 0:
        return memoryview(b"")
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array)


def from_bytes(
    data: memoryview | bytes | bytearray, dtype: torch.dtype, count: int
) -> torch.Tensor:
    """`count` elements of `data` as a writable tensor.

    A `bytearray` (or a writable view of one) is wrapped without a copy: the tensor shares its
    memory, which is what a receiver that just assembled a payload wants (one pass less over
    hundreds of megabytes).
    Anything else is copied, which keeps the result independent of the caller's buffer (and
    avoids torch's warning about read-only buffers, process-global state unsafe across threads).
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if len(data) != count * itemsize:
        raise CompressionError(f"expected {count * itemsize} bytes for {count} x {dtype}")
    if count == 0:
        return torch.empty(0, dtype=dtype)
    if isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly):
        try:
            return torch.frombuffer(data, dtype=torch.uint8).view(dtype)
        except RuntimeError:
            pass  # e.g. an unaligned element offset: fall back to the copy
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
