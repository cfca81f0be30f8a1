"""The pieces of an outer step that DiLoCo and streaming DiLoCo share.

`FlatOuter` is one flat fp32 global copy with its own Nesterov SGD: DiLoCo has one for the whole
model, streaming DiLoCo one per fragment, so each fragment keeps its own momentum. `read_average`
turns whatever an averaging function returned into a checked tensor (or a failure with a
reason), so both optimisers apply exactly the same rules to a group's answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

OuterStatus = Literal["averaged", "partial", "local", "deferred"]


class Averaged(Protocol):
    """What an averaging function may return besides a bare tensor (e.g. AllReduceResult)."""

    @property
    def tensor(self) -> torch.Tensor: ...


AverageFn = Callable[[torch.Tensor, float], Awaitable["torch.Tensor | Averaged | None"]]


@dataclass(frozen=True)
class OuterSnapshot:
    """A copy of a FlatOuter's state, to undo a step (eager updates replace a stand-in)."""

    values: torch.Tensor
    momentum: torch.Tensor | None


class FlatOuter:
    """A flat fp32 CPU global copy and the Nesterov SGD that moves it.

    The global copy lives in fp32 on the CPU whatever the model's device and dtype: it changes
    by small averaged steps that bf16 would round away, and the averaging layer works on CPU
    tensors anyway.
    """

    def __init__(self, values: torch.Tensor, lr: float, momentum: float, nesterov: bool) -> None:
        if values.dim() != 1 or values.dtype != torch.float32 or values.device.type != "cpu":
            raise ValueError("FlatOuter holds a flat float32 CPU tensor")
        self.values = values
        self._sgd = torch.optim.SGD(
            [values], lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0
        )

    @property
    def numel(self) -> int:
        return self.values.numel()

    def step(self, averaged: torch.Tensor) -> None:
        """One outer step with `averaged` (the group's pseudo-gradient) as the gradient."""
        self.values.grad = averaged.detach().to(torch.float32).clone()
        self._sgd.step()
        self.values.grad = None

    def momentum(self) -> torch.Tensor:
        """The momentum buffer; zeros before the first step, which is exactly what SGD behaves
        as when it creates the buffer lazily (0 * momentum + grad)."""
        buf = self._sgd.state.get(self.values, {}).get("momentum_buffer")
        return buf if isinstance(buf, torch.Tensor) else torch.zeros_like(self.values)

    def load(self, values: torch.Tensor, momentum: torch.Tensor) -> None:
        with torch.no_grad():
            self.values.copy_(values)
        self._sgd.state[self.values] = {"momentum_buffer": momentum.detach().clone()}

    def snapshot(self) -> OuterSnapshot:
        buf = self._sgd.state.get(self.values, {}).get("momentum_buffer")
        return OuterSnapshot(
            self.values.detach().clone(), buf.clone() if isinstance(buf, torch.Tensor) else None
        )

    def restore(self, snap: OuterSnapshot) -> None:
        with torch.no_grad():
            self.values.copy_(snap.values)
        if snap.momentum is None:
            self._sgd.state.pop(self.values, None)
        else:
            self._sgd.state[self.values] = {"momentum_buffer": snap.momentum.clone()}


def read_average(
    result: torch.Tensor | Averaged | None, numel: int
) -> tuple[torch.Tensor | None, OuterStatus, str | None]:
    """(averaged fp32 CPU tensor or None, status, reason) from an averaging function's answer.

    None means the round failed (no answer, or a non-finite one): the caller applies its failure
    policy. A result whose `ok` is False (some parts kept this peer's own values) is "partial"
    and is applied as it is. A wrong shape is a bug in the caller and raises.
    """
    if result is None:
        return None, "local", "averaging failed"
    averaged = result if isinstance(result, torch.Tensor) else result.tensor
    ok = True if isinstance(result, torch.Tensor) else bool(getattr(result, "ok", True))
    if averaged.shape != (numel,):
        raise ValueError(f"averaged tensor has shape {tuple(averaged.shape)}, expected ({numel},)")
    averaged = averaged.detach().to(device="cpu", dtype=torch.float32)
    if not bool(torch.isfinite(averaged).all()):
        return None, "local", "averaged tensor is not finite"
    return averaged, "averaged" if ok else "partial", None
