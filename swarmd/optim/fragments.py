"""Streaming DiLoCo's fragments: which parameters each holds, and each one's global copy.

The split is a pure function of the parameters' names and sizes, so every peer derives the same
fragments from the same model without exchanging anything; the layouts trade how evenly the
sizes come out (a sync's peak bytes) against keeping whole layers together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from swarmd.optim.diloco import DiLoCoConfig
from swarmd.optim.flat import flatten
from swarmd.optim.outer import FlatOuter

FragmentLayout = Literal["strided", "sequential", "balanced"]
LAYOUTS: tuple[FragmentLayout, ...] = ("strided", "sequential", "balanced")


def layer_units(names: Sequence[str]) -> list[tuple[str, list[int]]]:
    """Parameter indices grouped into layers, in model order: a name up to its first numeric
    component (`blocks.3.attn.qkv.weight` -> `blocks.3`); parameters outside numbered layers
    are grouped by their top-level module (`embed`, `head`)."""
    units: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        units.setdefault(_layer_of(name) or name.split(".")[0], []).append(i)
    return list(units.items())


def _layer_of(name: str) -> str | None:
    parts = name.split(".")
    for j, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: j + 1])
    return None


def split_fragments(
    names: Sequence[str], sizes: Sequence[int], fragments: int, layout: FragmentLayout
) -> list[list[int]]:
    """Parameter indices of each fragment (each in model order).

    Numbered layers are dealt out strided (or in contiguous runs); parameters outside them
    (embeddings, the final norm) go one by one, largest first, to the smallest fragment so
    far. The largest fragment is what a sync puts on the wire at its peak, so it should be
    close to 1/P of the model: with the built-in 4-layer GPT and P=4, giving the embedding
    module whole to one fragment made that fragment 29% of the model, balancing it 27%. The
    "balanced" layout deals single tensors instead (largest first, to the lightest fragment;
    each fragment still spans many layers): 25.5% there.
    """
    if layout == "balanced":
        return _balanced(sizes, fragments)
    layers = [(k, m) for k, m in layer_units(names) if _layer_of(names[m[0]]) is not None]
    placed = {j for _, members in layers for j in members}
    rest = sorted((j for j in range(len(names)) if j not in placed), key=lambda j: -sizes[j])
    if len(layers) + len(rest) < fragments:
        found = ", ".join(k for k, _ in layer_units(names))
        raise ValueError(
            f"the model has {len(layers)} layer(s) and {len(rest)} other parameter(s) "
            f"({found}), too few to split into {fragments} fragments"
        )
    out: list[list[int]] = [[] for _ in range(fragments)]
    load = [0] * fragments
    # With fewer layers than fragments, the layers take the first ones and the other
    # parameters fill the rest (the smallest fragment so far is an empty one).
    span = max(len(layers), fragments)
    for i, (_, members) in enumerate(layers):
        f = i % fragments if layout == "strided" else i * fragments // span
        out[f].extend(members)
        load[f] += sum(sizes[j] for j in members)
    _deal_to_lightest(rest, sizes, out, load)
    return [sorted(f) for f in out]


def _deal_to_lightest(
    order: Sequence[int], sizes: Sequence[int], out: list[list[int]], load: list[int]
) -> None:
    """Appends each index in ``order`` to the fragment with the least load so far (the lowest
    index among equals: deterministic, so every peer derives the same fragments)."""
    for j in order:
        f = min(range(len(out)), key=lambda k: load[k])
        out[f].append(j)
        load[f] += sizes[j]


def _balanced(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    if len(sizes) < fragments:
        raise ValueError(
            f"the model has {len(sizes)} parameter tensor(s), too few to split into "
            f"{fragments} fragments"
        )
    out: list[list[int]] = [[] for _ in range(fragments)]
    load = [0] * fragments
    # Largest first, model order among equals.
    _deal_to_lightest(sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)), sizes, out, load)
    return [sorted(f) for f in out]


class Fragment:
    """One fragment: its parameters, its global copy with its own outer SGD, its counters."""

    def __init__(
        self, index: int, members: list[int], names: list[str], params: list[nn.Parameter],
        config: DiLoCoConfig,
    ) -> None:  # fmt: skip
        self.index = index
        self.names = [names[i] for i in members]
        self.params = [params[i] for i in members]
        self.shapes = [p.shape for p in self.params]
        self.numel = sum(p.numel() for p in self.params)
        self.outer = FlatOuter(
            flatten(self.params), config.outer_lr, config.outer_momentum, config.nesterov
        )
        #: Successful outer steps of this fragment.
        self.round = 0
        #: Samples trained since this fragment's global copy last moved (its averaging weight).
        self.samples = 0

    def pseudo_gradient(self) -> torch.Tensor:
        return self.outer.values - flatten(self.params)
