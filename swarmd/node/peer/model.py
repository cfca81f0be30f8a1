"""The run's model, built the same way on every peer (seeded), on this peer's device."""

from __future__ import annotations

from pathlib import Path

import torch

from swarmd.node.peer.options import JoinError
from swarmd.node.peer.runconfig import RunConfig
from swarmd.workloads import GPT, GPTConfig, ModelLoadError, load_model, resolve_device
from swarmd.workloads.weights import from_gpt2, read_weights, to_gpt2


def gpt_config(config: RunConfig) -> GPTConfig | None:
    """The built-in GPT's shape in this run (None: the run names a user's model)."""
    if config.model != "builtin":
        return None
    return GPTConfig(
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_embd=config.n_embd,
        block_size=config.block_size,
        # A pipeline's first and last stages live on different peers: a tied embedding
        # would be two copies drifting apart.
        tie_weights=config.algo != "swarm",
    )


def build_model(config: RunConfig, device: str, init: Path | None = None) -> torch.nn.Module:
    """The built-in GPT or the user's model from the run config, seeded by the run, or with
    the weights in ``init`` (the creator's --init-weights), moved to `device` (--device: a
    peer's own choice; the state on the wire stays fp32 CPU)."""
    torch.manual_seed(config.seed)  # a user model's init is then the same on every peer
    model: torch.nn.Module
    gpt = gpt_config(config)
    if gpt is not None:
        model = GPT(gpt, seed=config.seed)
    else:
        try:
            model = load_model(config.model)
        except ModelLoadError as exc:
            raise JoinError(str(exc)) from None
    if init is not None:
        load_weights(model, config, init)
    return model.to(resolve_device(device))


def load_weights(model: torch.nn.Module, config: RunConfig, path: Path) -> None:
    """Loads a safetensors file in the names `swarmd export` writes (GPT-2's for the built-in
    GPT, the model's own otherwise) into ``model``; every parameter must be there with its
    shape. Raises WeightsError saying what does not fit."""
    params = dict(model.named_parameters())
    gpt = gpt_config(config)
    if gpt is None:
        tensors = read_weights(path, {n: p.shape for n, p in params.items()})
    else:
        shapes = {n: t.shape for n, t in to_gpt2(params, gpt).items()}
        tensors = from_gpt2(read_weights(path, shapes), gpt)
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor)
