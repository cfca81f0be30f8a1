"""torch <-> framing: the only protocol module that imports torch.

Kept apart so the DHT-only node, which never touches tensors, does not pay for importing torch.
"""

from __future__ import annotations

from typing import Any

import torch

from swarmd.protocol.errors import FramingError
from swarmd.protocol.framing import TensorMeta

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}


def tensor_meta(tensor: torch.Tensor, name: str = "") -> TensorMeta:
    if tensor.dtype not in _NAMES:
        raise FramingError(f"dtype {tensor.dtype} cannot be sent")
    return TensorMeta(dtype=_NAMES[tensor.dtype], shape=tuple(tensor.shape), name=name)


def tensor_payload(tensor: torch.Tensor) -> memoryview:
    """A byte view of the tensor's storage (a copy only if it is not contiguous or not on CPU)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    # Reinterpreting as uint8 works for every dtype, including bfloat16 which numpy lacks.
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def tensor_from_bytes(meta: TensorMeta, data: bytearray | memoryview) -> torch.Tensor:
    """Wraps received bytes as a tensor without copying (the buffer must be writable)."""
    if memoryview(data).nbytes != meta.nbytes:
        raise FramingError(f"got {memoryview(data).nbytes} B for a tensor of {meta.nbytes} B")
    if meta.nbytes == 0:
        return torch.empty(meta.shape, dtype=_TORCH_DTYPES[meta.dtype])
    raw = torch.frombuffer(data, dtype=torch.uint8)
    return raw.view(_TORCH_DTYPES[meta.dtype]).reshape(meta.shape)
