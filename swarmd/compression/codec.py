"""The codec interface every compressor implements, so wrappers compose (error feedback,
zstd framing) without knowing which codec they wrap."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from swarmd.compression.wire import DecodeLimits


@runtime_checkable
class Codec(Protocol):
    """Turns a tensor into self-describing bytes and back."""

    def encode(self, tensor: torch.Tensor) -> bytes: ...

    def decode(
        self, data: bytes | bytearray | memoryview, limits: DecodeLimits
    ) -> torch.Tensor: ...
