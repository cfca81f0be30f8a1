"""One flat fp32 vector for many parameter tensors: the shape averaging works in.

The averaging layer moves one 1-D float32 tensor per round; these helpers are the only place
that knows how a model's parameters are laid out in it (in the given order, each flattened
row-major), so the layout cannot differ between the peer that sends and the one that applies.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch


def numel(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def _sync_cuda(tensors: Sequence[torch.Tensor]) -> None:
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A fresh 1-D float32 CPU tensor holding every tensor's values in order.

    From a GPU the tensor is in pinned (page-locked) memory and every copy is queued at once,
    then waited for: pinned copies run at the link's full speed (pageable ones are staged
    through a bounce buffer, tensor by tensor), and torch's host allocator reuses the pinned
    block round after round. The pinned result also makes the copy back (`unflatten_into`)
    a direct one.
    """
    on_gpu = any(t.is_cuda for t in tensors)
    out = torch.empty(numel(tensors), dtype=torch.float32, pin_memory=on_gpu)
    offset = 0
    for t in tensors:
        n = t.numel()
        out[offset : offset + n].copy_(t.detach().reshape(-1), non_blocking=on_gpu)
        offset += n
    if on_gpu:
        _sync_cuda(tensors)
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
    """Copy `flat` back into `tensors` in place, converting dtype and device as needed (from
    pinned memory, the copies to a GPU are queued together and waited for: `flat` may be
    changed as soon as this returns)."""
    fast = flat.is_pinned()
    for dst, src in zip(tensors, views(flat, [t.shape for t in tensors]), strict=True):
        dst.copy_(src, non_blocking=fast and dst.is_cuda)
    if fast:
        _sync_cuda(tensors)


@torch.no_grad()
def params_digest(tensors: Sequence[torch.Tensor]) -> bytes:
    """Blake2b (16 bytes) of the tensors' exact bytes in order: equal digests are bit-identical
    values (members that took the same steps; replicas of one peer's local ranks)."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()
