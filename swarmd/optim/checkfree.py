"""CheckFree: rebuild a lost intermediate pipeline stage from its two neighbours.

Blagoev et al. 2025, "All is Not Lost: LLM Recovery without Checkpoints" (code:
gensyn-ai/CheckFree, simulate_training/convergence_training.py, the `ours-grad-avg` branch):
a stage i whose every copy is gone gets, for every weight,

    W_i = (a * W_{i+1} + b * W_{i-1}) / (a + b),   a = |g_{i+1}| + 1e-4,  b = |g_{i-1}| + 1e-4

where |g| is the L2 norm of the neighbour's whole gradient at its last step (one scalar per
stage, no average over steps: their L649-659). The neighbours' layers must have the recovered
stage's shapes: the pipeline is cut into stages of equal layers. The recovered stage starts a
fresh optimiser (no moments carried over) at `LR_SCALE` times the run's learning rate, kept
for the stage from then on (their `lr_scale`: 1.1 for the 124M model, 1.2 for 500M; 1.1 here,
the built-in GPT being of the small kind).

Their code measures |g| after clipping each stage's gradient to norm 1, which caps the weights
at 1 (then every pair of neighbours with raw norms above 1 averages 0.5/0.5); here it is the
norm before clipping, as the paper's text defines the weights (the gradients' norms).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

#: The recovered stage's learning rate over the run's (CheckFree's `lr_scale` for 124M).
LR_SCALE = 1.1
#: Added to each neighbour's gradient norm (theirs: a stage with a zero gradient still counts).
NORM_EPS = 1e-4


@dataclass(frozen=True)
class Recovery:
    """What a recovery used: the two neighbours' weights in the average, and their norms."""

    weight_before: float
    weight_after: float
    norm_before: float
    norm_after: float


class LayoutMismatch(ValueError):
    """The neighbours do not hold layers of the lost stage's shapes (stages of unequal
    layers): CheckFree cannot rebuild it from them."""


def _matching(target: nn.Module, neighbour: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """Pairs each layer of `target` with the neighbour's layer of the same class at the same
    position among that class (stage 0's embedding and the last stage's head have no pair:
    only the layers the lost stage has are taken)."""
    theirs: dict[type, list[nn.Module]] = {}
    for child in neighbour.children():
        theirs.setdefault(type(child), []).append(child)
    seen: dict[type, int] = {}
    pairs = []
    for child in target.children():
        k = seen.get(type(child), 0)
        seen[type(child)] = k + 1
        candidates = theirs.get(type(child), [])
        if k >= len(candidates):
            raise LayoutMismatch(f"the neighbour has no layer {k} of {type(child).__name__}")
        pairs.append((child, candidates[k]))
    return pairs


def recover(
    target: nn.Module,
    before: nn.Module,
    after: nn.Module,
    norm_before: float,
    norm_after: float,
) -> Recovery:
    """Sets `target`'s weights to CheckFree's average of `before` (stage i-1) and `after`
    (stage i+1); raises LayoutMismatch if their layers do not fit."""
    b = max(float(norm_before), 0.0) + NORM_EPS
    a = max(float(norm_after), 0.0) + NORM_EPS
    pairs_b, pairs_a = _matching(target, before), _matching(target, after)
    with torch.no_grad():
        for (mine, prev), (_, nxt) in zip(pairs_b, pairs_a, strict=True):
            for (name, w), (_, wb), (_, wa) in zip(
                mine.named_parameters(), prev.named_parameters(), nxt.named_parameters(),
                strict=True,
            ):  # fmt: skip
                if wb.shape != w.shape or wa.shape != w.shape:
                    raise LayoutMismatch(f"{name}: shapes {tuple(wb.shape)}, {tuple(wa.shape)}")
                w.copy_((a * wa + b * wb) / (a + b))
    return Recovery(b / (a + b), a / (a + b), norm_before, norm_after)
