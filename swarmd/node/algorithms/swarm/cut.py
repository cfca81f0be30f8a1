"""A model cut into SWARM pipeline stages, and the shapes that flow between them."""

from __future__ import annotations

import torch
from torch import nn

from swarmd.node.algorithms.swarm.stage_service import StageShape
from swarmd.node.peer.options import JoinError


def cut_stages(model: nn.Module, count: int) -> list[nn.Module]:
    """The model's `count` pipeline stages: the built-in GPT's `stages`, or a user model's
    own `stages(count)` (its last stage returns logits)."""
    stages = getattr(model, "stages", None)
    if not callable(stages):
        raise JoinError("algo swarm needs a model that declares its stages: stages(n) -> modules")
    try:
        out = list(stages(count))
    except ValueError as exc:
        raise JoinError(f"cannot cut the model into {count} stages: {exc}") from None
    if len(out) != count or not all(isinstance(m, nn.Module) for m in out):
        raise JoinError(f"the model's stages({count}) did not return {count} modules")
    return out


def probe_shape(stages: list[nn.Module], batch: int, block: int) -> StageShape:
    """The hidden width and vocabulary, from one token through the whole pipeline."""
    with torch.no_grad():
        h = torch.zeros(1, 1, dtype=torch.int64)
        widths = []
        for s in stages:
            h = s(h)
            widths.append(h.shape[-1])
    return StageShape(batch=batch, block=block, width=widths[0], vocab=widths[-1])
