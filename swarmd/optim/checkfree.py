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


# -- CheckFree+: the first and last stages -----------------------------------------------------
#
# CheckFree+ (same paper, §4.2; their convergence_training_2.py) trains each end stage's
# neighbour to stand in for it: on half of the micro-batches the first two (and the last two)
# block stages run in swapped order, so stage 1's blocks also learn to act where stage 0's
# do. A lost end stage then takes its swap partner's blocks as they are (no average: there is
# one neighbour), and the layers the partner has no kind of (the embedding, the head: small)
# from a copy the partner's servers keep. Optimiser fresh, at LR_SCALE, as for CheckFree.


def edge_layers(stage: nn.Module, partner: nn.Module, first: bool) -> int:
    """How many leading (first stage) or trailing (last stage) layers of `stage` are of a
    kind its swap partner has none of: the embedding or the head, which a swapped micro-batch
    still runs at their own stage and which the partner keeps a copy of."""
    kinds = {type(c) for c in partner.children()}
    children = list(stage.children())
    count = 0
    for child in children if first else reversed(children):
        if type(child) in kinds:
            break
        count += 1
    return count


def check_partner(blocks: nn.Module, partner: nn.Module) -> None:
    """LayoutMismatch unless `partner` holds exactly as many layers of each kind in `blocks`
    as `blocks` does (an end stage and its swap partner cut alike; CheckFree+ copies one's
    blocks into the other)."""
    mine: dict[type, int] = {}
    for child in blocks.children():
        mine[type(child)] = mine.get(type(child), 0) + 1
    for kind, count in mine.items():
        theirs = sum(1 for c in partner.children() if type(c) is kind)
        if theirs != count:
            raise LayoutMismatch(
                f"an end stage holds {count} {kind.__name__} layers, its neighbour {theirs}"
            )


def split(stage: nn.Module, edge: int, first: bool) -> tuple[nn.Sequential, nn.Sequential]:
    """(the edge layers, the rest) of an end stage, as modules sharing its parameters."""
    children = list(stage.children())
    if not 0 < edge < len(children):
        raise LayoutMismatch(f"an end stage of {len(children)} layers has no {edge} edge layers")
    if first:
        return nn.Sequential(*children[:edge]), nn.Sequential(*children[edge:])
    return nn.Sequential(*children[-edge:]), nn.Sequential(*children[:-edge])


def flat_parameters(module: nn.Module) -> torch.Tensor:
    """The module's parameters as one fp32 vector (what a copy holds and the wire carries)."""
    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1).float() for p in module.parameters()])


def load_flat(module: nn.Module, flat: torch.Tensor) -> None:
    """Sets the module's parameters from `flat_parameters`' layout; LayoutMismatch if the
    size differs (a copy of another model's layer)."""
    params = list(module.parameters())
    want = sum(p.numel() for p in params)
    if flat.dim() != 1 or flat.numel() != want or not bool(torch.isfinite(flat).all()):
        raise LayoutMismatch(f"a copy of {flat.numel()} values for {want} parameters")
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def recover_end(edge: nn.Module, blocks: nn.Module, partner: nn.Module, copy: torch.Tensor) -> None:
    """CheckFree+: sets a lost first (last) stage's `blocks` to its swap partner's, layer by
    layer in order, and its `edge` layers (`split`) from `copy`, the partner servers' copy of
    them; LayoutMismatch (and nothing changed) if either does not fit."""
    pairs = [
        (name, w, src)
        for mine, theirs in _matching(blocks, partner)
        for (name, w), (_, src) in zip(
            mine.named_parameters(), theirs.named_parameters(), strict=True
        )
    ]
    for name, w, src in pairs:
        if src.shape != w.shape:
            raise LayoutMismatch(f"{name}: shape {tuple(src.shape)}, not {tuple(w.shape)}")
    load_flat(edge, copy)  # checks the copy before it writes anything
    with torch.no_grad():
        for _, w, src in pairs:
            w.copy_(src)
