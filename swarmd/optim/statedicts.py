"""A DiLoCo-style global state as named tensors, and a peer's local (inner) state: built,
checked and loaded here, shared by DiLoCo, streaming DiLoCo and DeMo's state. A state comes
from strangers (a donor's download), so it is checked whole before anything is loaded."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from swarmd.optim.flat import views

GLOBAL_PREFIX = "global."
MOMENTUM_PREFIX = "outer_momentum."
ROUND_KEY = "round"


def check_global_state(
    state: Mapping[str, torch.Tensor],
    names: Sequence[str],
    shapes: Sequence[torch.Size],
    counters: Iterable[str],
) -> dict[str, int]:
    """Validates a global state (`global.*`, `outer_momentum.*` and integer scalar `counters`)
    before anything is loaded, so a bad download changes nothing; returns the counters."""
    counters = list(counters)
    expected = {GLOBAL_PREFIX + n for n in names} | {MOMENTUM_PREFIX + n for n in names}
    expected |= set(counters)
    missing, extra = expected - state.keys(), state.keys() - expected
    if missing or extra:
        raise ValueError(
            f"global state does not match the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(extra)[:5]}"
        )
    values: dict[str, int] = {}
    for key in counters:
        t = state[key]
        if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.is_floating_point():
            raise ValueError(f"global state: {key!r} must be an integer scalar tensor")
        if int(t) < 0:
            raise ValueError(f"global state: {key} must be >= 0, got {int(t)}")
        values[key] = int(t)
    shape_of = dict(zip(names, shapes, strict=True))
    for key in expected - set(counters):
        shape = shape_of[key.split(".", 1)[1]]
        t = state[key]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"global state: {key!r} must be a floating-point tensor")
        if t.shape != shape:
            raise ValueError(
                f"global state: {key!r} has shape {tuple(t.shape)}, expected {tuple(shape)}"
            )
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"global state: {key!r} has NaN or infinite values")
    return values


def global_tensors(
    names: Sequence[str], shapes: Sequence[torch.Size], values: torch.Tensor, momentum: torch.Tensor
) -> dict[str, torch.Tensor]:
    """`global.<name>` and `outer_momentum.<name>` copies from flat tensors laid out by `names`."""
    out: dict[str, torch.Tensor] = {}
    for name, view in zip(names, views(values, shapes), strict=True):
        out[GLOBAL_PREFIX + name] = view.clone()
    for name, view in zip(names, views(momentum, shapes), strict=True):
        out[MOMENTUM_PREFIX + name] = view.clone()
    return out


def flat_from_state(
    state: Mapping[str, torch.Tensor],
    prefix: str,
    names: Sequence[str],
    shapes: Sequence[torch.Size],
) -> torch.Tensor:
    """The flat fp32 tensor laid out by `names` from `<prefix><name>` entries."""
    flat = torch.empty(sum(s.numel() for s in shapes), dtype=torch.float32)
    with torch.no_grad():
        for name, view in zip(names, views(flat, shapes), strict=True):
            view.copy_(state[prefix + name])
    return flat


def inner_state_dict(
    names: Sequence[str], params: Sequence[nn.Parameter], optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """Local parameters and the inner optimiser's per-parameter tensors, by name (CPU copies,
    so a peer may restart on another device than the one it saved from)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in zip(names, params, strict=True):
        out[f"local.{name}"] = p.detach().to("cpu", copy=True)
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"inner.{key}.{name}"] = value.detach().to("cpu", copy=True)
    return out


def load_inner_state(
    names: Sequence[str],
    params: Sequence[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    state: Mapping[str, torch.Tensor],
) -> None:
    """Restores `inner_state_dict` (validates the parameters first)."""
    inner: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    for name, p in zip(names, params, strict=True):
        value = state.get(f"local.{name}")
        if value is None or value.shape != p.shape:
            raise ValueError(f"local state: missing or mis-shaped 'local.{name}'")
        prefix, suffix = "inner.", "." + name
        entries = {
            k[len(prefix) : -len(suffix)]: v
            for k, v in state.items()
            if k.startswith(prefix) and k.endswith(suffix) and "." not in k[6 : -len(suffix)]
        }
        if entries:
            # Moments go where the parameter is; Adam's `step` counter stays a CPU scalar, as
            # torch's own Optimizer.load_state_dict leaves it for the default implementations.
            inner[p] = {
                k: v.detach().to("cpu" if k == "step" else p.device, copy=True)
                for k, v in entries.items()
            }
    with torch.no_grad():
        for name, p in zip(names, params, strict=True):
            p.copy_(state[f"local.{name}"])
    optimizer.state.clear()
    for p, entries in inner.items():
        optimizer.state[p] = dict(entries)
