"""Chunked orthonormal DCT-II, the transform DeMo sends top-k coefficients of.

Gradients and momenta are smooth within small windows, so their energy concentrates in
few DCT coefficients per chunk. Chunking (<= 64 per axis, a divisor of the dimension, so
there is no padding) keeps the transform a small dense matmul and keeps indices narrow.
The basis is orthonormal, so the inverse is the transpose and round trips are exact up to
float rounding.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

DEFAULT_MAX_CHUNK = 64


def largest_divisor_at_most(n: int, limit: int) -> int:
    """Largest d <= limit dividing n (1 for primes above the limit and for n = 0)."""
    if n < 0 or limit < 1:
        raise ValueError(f"need n >= 0 and limit >= 1, got n={n}, limit={limit}")
    for d in range(min(n, limit), 0, -1):
        if n % d == 0:
            return d
    return 1  # pragma: no cover - d = 1 always divides


@lru_cache(maxsize=64)
def dct_matrix(size: int) -> torch.Tensor:
    """Orthonormal DCT-II basis D (size x size): coefficients = D @ x, x = D.T @ coefficients."""
    k = torch.arange(size, dtype=torch.float64).unsqueeze(1)
    j = torch.arange(size, dtype=torch.float64).unsqueeze(0)
    basis = torch.cos(math.pi * (2 * j + 1) * k / (2 * size)) * math.sqrt(2.0 / size)
    basis[0] /= math.sqrt(2.0)
    return basis.to(torch.float32)


def as_matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    """How a tensor is chunked: 0-/1-D as a single row, N-D as first dim x the rest."""
    if len(shape) <= 1:
        return 1, math.prod(shape)
    return shape[0], math.prod(shape[1:])


def chunk_sizes(shape: tuple[int, ...], max_chunk: int = DEFAULT_MAX_CHUNK) -> tuple[int, int]:
    """(rows, cols) of one chunk: 1-D chunks for vectors, 2-D blocks for matrices."""
    n, m = as_matrix(shape)
    return largest_divisor_at_most(n, max_chunk), largest_divisor_at_most(m, max_chunk)


def to_blocks(x: torch.Tensor, cn: int, cm: int) -> torch.Tensor:
    """(n, m) -> (n/cn * m/cm, cn, cm), chunks in row-major order."""
    n, m = x.shape
    return x.reshape(n // cn, cn, m // cm, cm).permute(0, 2, 1, 3).reshape(-1, cn, cm)


def from_blocks(blocks: torch.Tensor, n: int, m: int) -> torch.Tensor:
    cn, cm = blocks.shape[1], blocks.shape[2]
    return blocks.reshape(n // cn, m // cm, cn, cm).permute(0, 2, 1, 3).reshape(n, m)


def dct_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """Forward 2-D DCT of each (cn, cm) block: Dn @ B @ Dm^T."""
    out = torch.matmul(blocks, dct_matrix(blocks.shape[2]).T)
    if blocks.shape[1] > 1:  # 1-D chunks: the row transform is the identity
        out = torch.matmul(dct_matrix(blocks.shape[1]), out)
    return out


def idct_blocks(coeffs: torch.Tensor) -> torch.Tensor:
    """Inverse of `dct_blocks`: Dn^T @ C @ Dm."""
    out = torch.matmul(coeffs, dct_matrix(coeffs.shape[2]))
    if coeffs.shape[1] > 1:
        out = torch.matmul(dct_matrix(coeffs.shape[1]).T, out)
    return out
