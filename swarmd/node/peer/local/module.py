"""The module an inner step calls: the model, in bf16 autocast, wrapped for DDP, compiled.

The parameters stay the model's own fp32 tensors whatever wraps them, so the global state,
the pseudo-gradient and everything on the wire are unchanged by these choices: autocast runs
the matrix products in bf16 and keeps the weights, the optimizer and the loss's softmax in fp32
(torch's autocast policy), which is the usual mixed-precision recipe.
"""

from __future__ import annotations

import inspect
from typing import Any, cast

import torch
from torch import nn

from swarmd.node.peer.local.config import Precision


class Autocast(nn.Module):
    """Runs `inner` under torch.autocast in `dtype` on `device_type`."""

    def __init__(self, inner: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner = inner
        self.device_type = device_type
        self.dtype = dtype

    def forward(self, *args: Any) -> Any:
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            return self.inner(*args)


def training_module(
    model: nn.Module,
    device: torch.device,
    precision: Precision,
    *,
    compile_model: bool,
    ddp: bool,
) -> nn.Module:
    """What the inner step calls. DDP (gradients averaged across the local ranks during the
    backward, bucketed and overlapped with it) goes innermost so autocast and compilation see
    one module; buffers are not broadcast each forward (the built-in model has none, and a
    user model's buffers are not state the swarm shares either)."""
    module: nn.Module = model
    if ddp:
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        # Newer torch renames broadcast_buffers (and syncs buffers once at the start, which is
        # what we want anyway: every rank then starts from rank 0's).
        params = inspect.signature(DistributedDataParallel.__init__).parameters
        sync: dict[str, Any] = (
            {"forward_sync_buffers": False}
            if "forward_sync_buffers" in params
            else {"broadcast_buffers": False}
        )
        module = DistributedDataParallel(model, device_ids=ids, **sync)
    if precision == "bf16":
        module = Autocast(module, device.type, torch.bfloat16)
    if compile_model:
        module = cast(nn.Module, torch.compile(module))
    return module
