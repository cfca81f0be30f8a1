"""DeMo (Peng, Quesnelle, Kingma, 2024): decoupled momentum, only its fast components sent.

Each peer keeps its own momentum δ and never averages it. Every step it folds the gradient into
δ, cuts δ into small blocks, takes an orthonormal DCT-II of each block and sends only the `k`
largest coefficients per block (indices and values). What it sent is subtracted from δ, so the
slow, unsent components keep accumulating locally until they grow large enough to be sent:
error feedback without a separate residual. Everyone's sparse coefficients are averaged, inverse
transformed, and the *sign* of the result is the update (sign-SGD), so the step size is exactly
`lr` per element whatever the coefficients' scale.

Per parameter p with gradient g (None counts as zeros) and learning rate lr::

    δ ← β·δ + lr·g                         (β = compression_decay)
    (idx, val) ← top-k |DCT(δ)| per block  (what this peer sends: `prepare`)
    δ ← δ − IDCT(scatter(idx, val))        (error feedback)
    c ← mean over the peers that sent each coefficient (`apply`; each peer's
        norm clipped to the group's median, a peer opposed to the rest left out:
        demo_robust.py)
    p ← p·(1 − lr·wd) − lr·sign(IDCT(c))

This follows the reference implementation (github.com/bloc97/DeMo), written anew:

* Block sides are the largest divisor of each dimension that is at most `compression_chunk`
  (a dimension no larger than the chunk is one block; a prime above it gets blocks of 1), so
  blocks tile the tensor with no padding. 1-D tensors (and scalars) are cut into 1-D blocks of
  w; 2-D tensors into (rows/h × cols/w) blocks of h×w with a 2-D DCT; tensors with more
  dimensions are treated as the matrix (first dim × product of the rest), as
  `swarmd.compression.dct.as_matrix` does (the reference handles only 1-D and 2-D).
* A block's coefficients are flattened row-major (row frequency major): index = a·w + b.
  A `SparseUpdate` of a 2-D tensor has shape (rows/h, cols/w, k), of a 1-D tensor (n/w, k).
* Coefficients that several peers sent are averaged over those peers only; one that a single
  peer sent keeps its value (the reference's `scatter_reduce(mean, include_self=False)`).
  Averages are accumulated peer by peer in the order of `gathered`, with no atomics, so peers
  that apply the same lists in the same order get bit-identical parameters, on GPUs too.
* sign(0) = 0: an element whose decoded average is exactly zero does not move.
* δ and the transforms are kept in float32 (float64 for float64 parameters) whatever the
  parameter dtype: δ accumulates many small `lr·g` terms that bf16 would round away.
* Weight decay is decoupled (AdamW style) and scaled by lr, applied in `apply` just before the
  sign step; it touches only p while `prepare` touches only δ, so this matches the reference,
  which decays first.

Pure torch, no I/O: `prepare` gives what to send, the caller exchanges it (the daemon over the
network, with `swarmd.compression.sparse_wire`; tests in-process), `apply` takes everyone's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarmd.compression.dct import as_matrix, largest_divisor_at_most
from swarmd.compression.sparse_wire import (
    SparseLayout,
    SparseUpdate,
    dequantize_values,
    quantize_values,
)
from swarmd.optim.demo_robust import clipped_to_median, opposed

__all__ = ["DeMo", "DeMoConfig", "SparseLayout", "SparseUpdate", "dct_basis"]

DELTA_PREFIX = "delta."
#: DeMoConfig.value_bits -> sparse_wire's value dtype.
VALUE_DTYPES = {16: "bf16", 8: "int8", 4: "int4"}


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"DeMoConfig.{name} must be a finite number, got {value!r}")
    return float(value)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DeMoConfig.{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class DeMoConfig:
    """Defaults are the reference's: β = 0.999, k = 32 coefficients per block of at most
    64 x 64. `lr` is the sign-SGD step (every element moves by exactly lr) and also scales the
    gradient folded into δ, as in the reference; `weight_decay` is decoupled (p·(1 − lr·wd))."""

    lr: float = 1e-3
    compression_decay: float = 0.999
    compression_topk: int = 32
    compression_chunk: int = 64
    weight_decay: float = 0.0
    #: Bits a sent value takes on the wire: 16 (bf16, the reference's), 8 or 4 (integer codes
    #: with a scale per block, `sparse_wire.quantize_values`). Below 16 what is removed from δ
    #: is what the codes decode to, so the rounding stays in δ and is sent later.
    value_bits: int = 16
    #: Each peer's coefficients for a tensor are scaled down to at most this multiple of the
    #: peers' (lower) median norm for it before they are averaged (demo_robust.py); 0 turns
    #: it off (the reference's plain mean, which one peer's x(-1000) coefficients steer).
    clip_to_median: float = 2.0
    #: From three peers on, a peer whose coefficients point against most others' is left
    #: out of the step's mean while such peers are fewer than half (demo_robust.py).
    drop_opposed: bool = True

    def __post_init__(self) -> None:
        if _number("lr", self.lr) <= 0:
            raise ValueError(f"DeMoConfig.lr must be > 0, got {self.lr!r}")
        if not 0.0 <= _number("compression_decay", self.compression_decay) < 1.0:
            raise ValueError(
                f"DeMoConfig.compression_decay must be in [0, 1), got {self.compression_decay!r}"
            )
        _positive_int("compression_topk", self.compression_topk)
        _positive_int("compression_chunk", self.compression_chunk)
        if _number("weight_decay", self.weight_decay) < 0:
            raise ValueError(f"DeMoConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        if _number("clip_to_median", self.clip_to_median) < 0:
            raise ValueError(
                f"DeMoConfig.clip_to_median must be >= 0 (0: off), got {self.clip_to_median!r}"
            )
        if self.value_bits not in VALUE_DTYPES:
            raise ValueError(
                f"DeMoConfig.value_bits must be one of {sorted(VALUE_DTYPES)}, "
                f"got {self.value_bits!r}"
            )

    @property
    def value_dtype(self) -> str:
        """The wire's name for the values' encoding (`sparse_wire.encode_sparse`)."""
        return VALUE_DTYPES[self.value_bits]


def dct_basis(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Orthonormal DCT-II matrix D (coefficients = D @ x, x = D.T @ coefficients), computed in
    float64 and then cast, so float64 users get a float64-exact basis (`compression.dct`'s
    cached matrix is float32)."""
    k = torch.arange(size, dtype=torch.float64).unsqueeze(1)
    j = torch.arange(size, dtype=torch.float64).unsqueeze(0)
    basis = torch.cos(math.pi * (2 * j + 1) * k / (2 * size)) * math.sqrt(2.0 / size)
    basis[0] /= math.sqrt(2.0)
    return basis.to(dtype=dtype, device=device)


@dataclass(frozen=True)
class _Plan:
    """How one parameter is cut: its matrix view, block sides, grid and k."""

    shape: tuple[int, ...]
    rows: int
    cols: int
    h: int
    w: int
    grid: tuple[int, ...]
    k: int
    dtype: torch.dtype
    device: torch.device

    @property
    def blocks(self) -> int:
        return (self.rows // self.h) * (self.cols // self.w)

    @property
    def block_size(self) -> int:
        return self.h * self.w


def _plan(p: torch.Tensor, config: DeMoConfig) -> _Plan:
    shape = tuple(p.shape)
    rows, cols = as_matrix(shape)
    chunk = config.compression_chunk
    h = largest_divisor_at_most(rows, chunk)
    w = largest_divisor_at_most(cols, chunk)
    grid = (cols // w,) if len(shape) <= 1 else (rows // h, cols // w)
    k = min(max(config.compression_topk, 1), h * w)
    dtype = torch.promote_types(p.dtype, torch.float32)
    return _Plan(shape, rows, cols, h, w, grid, k, dtype, p.device)


class DeMo:
    """DeMo over a fixed list of parameters; see the module docstring for the algorithm.

    `prepare` reads each parameter's `.grad` and returns what this peer sends (one
    `SparseUpdate` per parameter, in order); `apply` takes every peer's list (this peer's own
    included) and moves the parameters. Both run under `torch.no_grad()`. `lr` may be changed
    between steps (a schedule); a step must use the same lr in `prepare` and `apply`.
    """

    def __init__(self, params: Sequence[torch.Tensor], config: DeMoConfig) -> None:
        params = list(params)
        if not params:
            raise ValueError("DeMo needs at least one parameter")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("DeMo was given the same parameter twice")
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor) or not p.is_floating_point():
                raise ValueError(f"DeMo parameter {i} is not a floating-point tensor")
        self.config = config
        self._params = params
        self._plans = [_plan(p, config) for p in params]
        self._delta = [
            torch.zeros(pl.shape, dtype=pl.dtype, device=pl.device) for pl in self._plans
        ]
        # One basis per (side, dtype, device), built once: the per-step transforms are matmuls.
        self._bases: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        for pl in self._plans:
            for side in (pl.h, pl.w):
                key = (side, pl.dtype, pl.device)
                if key not in self._bases:
                    self._bases[key] = dct_basis(side, pl.dtype, pl.device)
        self._lr = config.lr

    @property
    def lr(self) -> float:
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"DeMo.lr must be a number, got {value!r}")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"DeMo.lr must be finite and > 0, got {value!r}")
        self._lr = float(value)

    def layout(self) -> SparseLayout:
        """Per parameter: the grid shape of its `SparseUpdate` (all but the last dim) and the
        block size (coefficients per block, so indices lie in [0, block size)). This is what
        a receiver passes to `sparse_wire.decode_sparse`."""
        return [(pl.grid, pl.block_size) for pl in self._plans]

    # -- transforms ----------------------------------------------------------------------------

    def _forward(self, x: torch.Tensor, pl: _Plan) -> torch.Tensor:
        """(shape) -> (blocks, h·w) coefficients: D_h @ block @ D_w^T for every block."""
        blocks = x.reshape(pl.rows // pl.h, pl.h, pl.cols // pl.w, pl.w).transpose(1, 2)
        out = torch.matmul(blocks, self._bases[(pl.w, pl.dtype, pl.device)].T)
        if pl.h > 1:  # a 1-row block's row transform is the identity
            out = torch.matmul(self._bases[(pl.h, pl.dtype, pl.device)], out)
        return out.reshape(pl.blocks, pl.block_size)

    def _inverse(self, coeffs: torch.Tensor, pl: _Plan) -> torch.Tensor:
        """Inverse of `_forward`: (blocks, h·w) -> (shape), D_h^T @ C @ D_w per block."""
        c = coeffs.reshape(pl.rows // pl.h, pl.cols // pl.w, pl.h, pl.w)
        out = torch.matmul(c, self._bases[(pl.w, pl.dtype, pl.device)])
        if pl.h > 1:
            out = torch.matmul(self._bases[(pl.h, pl.dtype, pl.device)].T, out)
        return out.transpose(1, 2).reshape(pl.shape)

    # -- one step ------------------------------------------------------------------------------

    @torch.no_grad()
    def prepare(self) -> list[SparseUpdate]:
        """Fold each gradient into δ, pick its top-k DCT coefficients per block, remove them
        from δ, and return them (indices int64, values in δ's dtype, shape (*grid, k))."""
        beta, lr = self.config.compression_decay, self._lr
        out: list[SparseUpdate] = []
        for p, pl, delta in zip(self._params, self._plans, self._delta, strict=True):
            delta.mul_(beta)
            if p.grad is not None:
                delta.add_(p.grad.detach().to(device=pl.device, dtype=pl.dtype), alpha=lr)
            coeffs = self._forward(delta, pl)
            indices = coeffs.abs().topk(pl.k, dim=1, sorted=False).indices
            values = coeffs.gather(1, indices)
            if self.config.value_bits < 16:
                codes, scales = quantize_values(values, self.config.value_bits)
                values = dequantize_values(codes, scales).to(values.dtype)
            sent = torch.zeros_like(coeffs).scatter_(1, indices, values)
            delta.sub_(self._inverse(sent, pl))
            shape = (*pl.grid, pl.k)
            out.append(SparseUpdate(indices.view(shape), values.view(shape), pl.block_size))
        return out

    @torch.no_grad()
    def apply(self, gathered: Sequence[Sequence[SparseUpdate]]) -> list[int]:
        """Average every peer's coefficients, decode, and take the weight-decay + sign step;
        the positions of the peers left out of the mean (demo_robust.py).

        `gathered[j]` is peer j's list (this peer's own included). Everything is validated
        before any parameter changes, so a ValueError leaves the state as it was. Duplicate
        indices within one peer's block are not checked here (the wire decoder refuses them);
        they would count as two contributions, as in the reference.
        """
        self._check_gathered(gathered)
        lr, wd, cfg = self._lr, self.config.weight_decay, self.config
        indices = [
            [peer[i].indices.to(pl.device).reshape(pl.blocks, -1) for peer in gathered]
            for i, pl in enumerate(self._plans)
        ]
        values = [
            clipped_to_median(
                [
                    peer[i].values.to(device=pl.device, dtype=pl.dtype).reshape(pl.blocks, -1)
                    for peer in gathered
                ],
                cfg.clip_to_median,
            )
            for i, pl in enumerate(self._plans)
        ]
        shapes = [(pl.blocks, pl.block_size) for pl in self._plans]
        left_out = set(opposed(indices, values, shapes)) if cfg.drop_opposed else set()
        for p, pl, idx, val in zip(self._params, self._plans, indices, values, strict=True):
            total = torch.zeros(pl.blocks, pl.block_size, dtype=pl.dtype, device=pl.device)
            count = torch.zeros_like(total)
            for j, (ix, v) in enumerate(zip(idx, val, strict=True)):
                if j not in left_out:
                    total.scatter_add_(1, ix, v)
                    count.scatter_add_(1, ix, torch.ones_like(v))
            step = self._inverse(total / count.clamp_min(1.0), pl).sign_()
            if wd:
                p.mul_(1.0 - lr * wd)
            p.sub_(step.to(p.dtype), alpha=lr)
        return sorted(left_out)

    def step(
        self, exchange: Callable[[list[SparseUpdate]], Sequence[Sequence[SparseUpdate]]]
    ) -> None:
        """prepare, exchange, apply: one whole step with an in-process exchange."""
        self.apply(exchange(self.prepare()))

    def _check_gathered(self, gathered: Sequence[Sequence[SparseUpdate]]) -> None:
        if len(gathered) < 1:
            raise ValueError("DeMo.apply needs at least one peer's updates (this peer's own)")
        for j, peer in enumerate(gathered):
            if len(peer) != len(self._plans):
                raise ValueError(
                    f"peer {j} sent {len(peer)} updates; this model has {len(self._plans)}"
                )
            for i, (update, pl) in enumerate(zip(peer, self._plans, strict=True)):
                _check_update(update, pl, f"peer {j} parameter {i}")

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """δ per parameter (`delta.<i>`, CPU copies): all a restarted peer needs besides its
        parameters to continue exactly. δ is local state, never shipped to joiners."""
        return {f"{DELTA_PREFIX}{i}": d.detach().cpu().clone() for i, d in enumerate(self._delta)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`: checks the key set, shapes and finiteness of every tensor
        first, then copies, so a bad state changes nothing."""
        expected = {f"{DELTA_PREFIX}{i}" for i in range(len(self._plans))}
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ValueError(f"DeMo state: missing keys {missing}, unexpected keys {extra}")
        for i, pl in enumerate(self._plans):
            value = state[f"{DELTA_PREFIX}{i}"]
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                raise ValueError(f"DeMo state: delta.{i} is not a floating-point tensor")
            if tuple(value.shape) != pl.shape:
                raise ValueError(
                    f"DeMo state: delta.{i} has shape {tuple(value.shape)}, expected {pl.shape}"
                )
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"DeMo state: delta.{i} contains NaN or infinity")
        for i, delta in enumerate(self._delta):
            delta.copy_(state[f"{DELTA_PREFIX}{i}"])


def _check_update(update: SparseUpdate, pl: _Plan, where: str) -> None:
    """Shapes, dtypes, index range and finiteness: what scatter would otherwise turn into a
    device-side assert (CUDA) or a NaN parameter."""
    if not isinstance(update, SparseUpdate):
        raise ValueError(f"{where}: expected a SparseUpdate, got {type(update).__name__}")
    idx, val = update.indices, update.values
    if idx.dtype != torch.int64 or not val.is_floating_point():
        raise ValueError(
            f"{where}: indices must be int64 and values float, got {idx.dtype}/{val.dtype}"
        )
    if idx.shape != val.shape or tuple(idx.shape[:-1]) != pl.grid or idx.dim() != len(pl.grid) + 1:
        raise ValueError(
            f"{where}: indices {tuple(idx.shape)} and values {tuple(val.shape)} do not match "
            f"the grid {pl.grid} + (k,)"
        )
    k = idx.shape[-1]
    if update.block_size is not None and update.block_size != pl.block_size:
        raise ValueError(f"{where}: block size {update.block_size}, expected {pl.block_size}")
    if not 1 <= k <= pl.block_size:
        raise ValueError(f"{where}: k = {k} outside [1, {pl.block_size}]")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= pl.block_size):
        raise ValueError(f"{where}: index outside a {pl.block_size}-coefficient block")
    if not bool(torch.isfinite(val).all()):
        raise ValueError(f"{where}: values contain NaN or infinity")
