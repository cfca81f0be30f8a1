"""The run's model, built the same way on every peer (seeded), on this peer's device."""

from __future__ import annotations

import torch

from swarmd.node.peer.options import JoinError
from swarmd.node.peer.runconfig import RunConfig
from swarmd.workloads import GPT, GPTConfig, ModelLoadError, load_model, resolve_device


def build_model(config: RunConfig, device: str) -> torch.nn.Module:
    """The built-in GPT or the user's model from the run config, seeded by the run, moved to
    `device` (--device: a peer's own choice; the state on the wire stays fp32 CPU)."""
    torch.manual_seed(config.seed)  # a user model's init is then the same on every peer
    model: torch.nn.Module
    if config.model == "builtin":
        model = GPT(
            GPTConfig(
                n_layer=config.n_layer,
                n_head=config.n_head,
                n_embd=config.n_embd,
                block_size=config.block_size,
                # A pipeline's first and last stages live on different peers: a tied
                # embedding would be two copies drifting apart.
                tie_weights=config.algo != "swarm",
            ),
            seed=config.seed,
        )
    else:
        try:
            model = load_model(config.model)
        except ModelLoadError as exc:
            raise JoinError(str(exc)) from None
    return model.to(resolve_device(device))
