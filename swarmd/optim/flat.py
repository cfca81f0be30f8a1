"""One flat fp32 vector for many parameter tensors: the shape averaging works in.

The averaging layer moves one 1-D float32 tensor per round; these helpers are the only place
that knows how a model's parameters are laid out in it (in the given order, each flattened
row-major), so the layout cannot differ between the peer that sends and the one that applies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def numel(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A fresh 1-D float32 CPU tensor holding every tensor's values in order."""
    out = torch.empty(numel(tensors), dtype=torch.float32)
    offset = 0
    for t in tensors:
        n = t.numel()
        out[offset : offset + n].copy_(t.detach().reshape(-1))
        offset += n
    return out


def views(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views into `flat` shaped like `shapes` (writes to a view write to `flat`)."""
    if flat.dim() != 1:
        raise ValueError(f"expected a 1-D tensor, got shape {tuple(flat.shape)}")
    total = sum(s.numel() for s in shapes)
    if flat.numel() != total:
        raise ValueError(f"flat tensor has {flat.numel()} values, the layout needs {total}")
    out = []
    offset = 0
    for s in shapes:
        n = s.numel()
        out.append(flat[offset : offset + n].view(s))
        offset += n
    return out


@torch.no_grad()
def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy `flat` back into `tensors` in place, converting dtype and device as needed."""
    for dst, src in zip(tensors, views(flat, [t.shape for t in tensors]), strict=True):
        dst.copy_(src)
