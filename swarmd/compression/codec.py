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


@runtime_checkable
class SegmentedCodec(Codec, Protocol):
    """A codec that can hand its payload over in pieces (header, then views of tensors'
    memory), so a sender streams them without first joining them into one buffer."""

    def encode_segments(self, tensor: torch.Tensor) -> list[bytes | memoryview]: ...


def encode_segments(codec: Codec, tensor: torch.Tensor) -> list[bytes | memoryview]:
    """`codec.encode(tensor)` in pieces; the concatenation is the same bytes."""
    if isinstance(codec, SegmentedCodec):
        return codec.encode_segments(tensor)
    return [codec.encode(tensor)]
