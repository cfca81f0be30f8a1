"""Error feedback: what a lossy codec dropped this step is added back next step.

Biased compressors (top-k, low-rank, coarse int8) lose the same directions every step; by
carrying the residual `input - decode(encode(input))` forward, the *sum* of what peers
receive tracks the sum of what was sent, with an error bounded by one step's residual.
The state is one float32 tensor per parameter name, so it can be checkpointed with the
rest of the trainer state and restored after a restart.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from swarmd.compression.buffers import check_float_input, require_finite
from swarmd.compression.codec import Codec
from swarmd.compression.errors import CompressionError
from swarmd.compression.wire import DecodeLimits


class ResidualStore:
    """Per-name float32 residuals; the reusable core of every error-feedback scheme."""

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    def compensate(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor + residual[key]` as a fresh float32 tensor (the input stays untouched)."""
        check_float_input(tensor)
        out = tensor.detach().to(device="cpu", dtype=torch.float32, copy=True)
        residual = self._residuals.get(key)
        if residual is not None:
            if residual.shape != out.shape:
                raise CompressionError(
                    f"residual for {key!r} has shape {tuple(residual.shape)}, "
                    f"input has {tuple(out.shape)}"
                )
            out += residual
        return out

    def record(self, key: str, compensated: torch.Tensor, decoded: torch.Tensor) -> None:
        """Remember what the codec dropped: `compensated - decoded`."""
        if compensated.shape != decoded.shape:
            raise CompressionError(
                f"decoded shape {tuple(decoded.shape)} != input shape {tuple(compensated.shape)}"
            )
        self._residuals[key] = compensated.to(torch.float32) - decoded.to(torch.float32)

    def residual(self, key: str) -> torch.Tensor | None:
        return self._residuals.get(key)

    def take(self, key: str) -> torch.Tensor | None:
        """Removes and returns the residual: a caller that adds it in and will `store` the
        next one reuses its memory, and a round that never finishes cannot add it twice."""
        return self._residuals.pop(key, None)

    def store(self, key: str, residual: torch.Tensor) -> None:
        """Keeps `residual` itself (no copy) as the residual for `key`."""
        check_float_input(residual)
        if residual.dtype != torch.float32:
            raise CompressionError(f"residuals are float32, got {residual.dtype}")
        self._residuals[key] = residual.detach()

    def reset(self, key: str | None = None) -> None:
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._residuals.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace all residuals; refuses anything that is not a finite float tensor."""
        loaded: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            if not isinstance(key, str):
                raise CompressionError(f"residual keys must be str, got {type(key).__name__}")
            check_float_input(value)
            require_finite(value, f"residual {key!r}")
            loaded[key] = value.detach().to(device="cpu", dtype=torch.float32, copy=True)
        self._residuals = loaded


class ErrorFeedback:
    """Wrap any codec: `encode(key, x)` sends `x + residual` and keeps what got lost.

    Encoding costs one extra local decode, which is the only way to know exactly what the
    receivers will see for codecs whose loss depends on the data (top-k, int8, low-rank).
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.residuals = ResidualStore()

    def encode(self, key: str, tensor: torch.Tensor) -> bytes:
        data, _ = self.encode_with_decoded(key, tensor)
        return data

    def encode_with_decoded(self, key: str, tensor: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """Also return what receivers will decode (float32), which callers often need."""
        compensated = self.residuals.compensate(key, tensor)
        data = self.codec.encode(compensated)
        limits = DecodeLimits.for_tensor(compensated)
        decoded = self.codec.decode(data, limits).to(torch.float32)
        self.residuals.record(key, compensated, decoded)
        return data, decoded

    def residual(self, key: str) -> torch.Tensor | None:
        return self.residuals.residual(key)

    def reset(self, key: str | None = None) -> None:
        self.residuals.reset(key)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.residuals.state_dict()

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.residuals.load_state_dict(state)
