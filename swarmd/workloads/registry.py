"""Models by name: the built-in GPT, or a user's own through `--model module:function`.

A user model is checked once at load time with a tiny forward pass, so a model with the wrong
calling convention fails at start-up with a message that says what was expected, rather than
mid-round on some peer.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from importlib.metadata import entry_points

import torch
from torch import nn

from swarmd.workloads.gpt import GPT, GPTConfig

BUILTIN = "builtin"
#: Names of the built-in model; anything else is a user's (see allowed.py for who may name one).
BUILTIN_MODELS = (BUILTIN, "gpt")
#: The entry-point group a package registers its models under (name = "module:function").
ENTRY_POINT_GROUP = "swarmd.workloads"
_PROBE_LEN = 2


class ModelLoadError(ValueError):
    """A model spec cannot be resolved or the model it names breaks the model contract."""


def installed_models() -> dict[str, str]:
    """Entry-point name -> its ``module:function``, for the models installed packages offer."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load_model(spec: str, *, check: bool = True) -> nn.Module:
    """Resolve `builtin`/`gpt` (the default `GPT`), an installed workload's name, or
    `package.module:function`. Imports code: call it only on a name the user allowed.

    The function is called with no arguments and must return an `nn.Module` whose
    `forward(idx, targets)` takes int64 token ids (batch, time) and returns `(logits, loss)`
    with a scalar loss. `check` runs that forward once on a 1 x 2 batch of token 0 to verify it.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ModelLoadError("model spec must be 'builtin' or 'module:function'")
    spec = spec.strip()
    if spec in BUILTIN_MODELS:
        return GPT(GPTConfig())
    spec = installed_models().get(spec, spec)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ModelLoadError(
            f"model spec {spec!r} is not of the form 'module:function' (e.g. 'mymodels:tiny')"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ModelLoadError(
            f"model spec {spec!r}: cannot import module {module_name!r}: {e}"
        ) from e
    factory: object = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise ModelLoadError(f"model spec {spec!r}: module {module_name!r} has no {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ModelLoadError(f"model spec {spec!r}: {attr!r} is not callable")
    model = _call(spec, factory)
    if not isinstance(model, nn.Module):
        raise ModelLoadError(
            f"model spec {spec!r}: {attr}() returned {type(model).__name__}, not a torch.nn.Module"
        )
    if check:
        check_model(model, spec)
    return model


def _call(spec: str, factory: Callable[[], object]) -> object:
    try:
        return factory()
    except Exception as e:
        raise ModelLoadError(
            f"model spec {spec!r}: calling it raised {type(e).__name__}: {e}"
        ) from e


def check_model(model: nn.Module, name: str = "model") -> None:
    """Run `model(idx, targets)` once on a tiny batch and check it returns (logits, loss)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    idx = torch.zeros(1, _PROBE_LEN, dtype=torch.int64, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(idx, idx)
    except Exception as e:
        raise ModelLoadError(
            f"{name}: forward(idx, targets) on int64 ids of shape (1, {_PROBE_LEN}) raised "
            f"{type(e).__name__}: {e}"
        ) from e
    finally:
        model.train(was_training)
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise ModelLoadError(
            f"{name}: forward(idx, targets) must return (logits, loss), got {type(out).__name__}"
        )
    logits, loss = out
    if not isinstance(logits, torch.Tensor) or logits.dim() < 2:
        raise ModelLoadError(f"{name}: logits must be a tensor of shape (batch, time, vocab)")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ModelLoadError(f"{name}: loss must be a scalar tensor, got {loss!r:.80}")
    if not math.isfinite(float(loss)):
        raise ModelLoadError(f"{name}: loss at load time is not finite ({float(loss)})")
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelLoadError(f"{name}: model has no trainable parameters")
