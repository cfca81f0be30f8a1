"""`swarmd export`'s decisions without the network: which advertised state is the run's, and
what of a global state is written (swarmd/node/cli/export.py)."""

from __future__ import annotations

import pytest
import torch

from swarmd.node.cli.export import ExportError, choose_state, model_weights
from swarmd.node.peer.model import build_model
from swarmd.node.peer.runconfig import RunConfig
from swarmd.node.statesync.donor import StateAdvert
from swarmd.optim.statedicts import GLOBAL_PREFIX

A, B, C = b"a" * 32, b"b" * 32, b"c" * 32


def advert(state: bytes, round_: int, port: int, client: bool = False) -> StateAdvert:
    return StateAdvert(round_, state, f"127.0.0.1:{port}", 1000, client=client)


def test_the_newest_state_a_majority_holds_is_taken() -> None:
    adverts = [advert(A, 4, 1), advert(A, 4, 2), advert(A, 4, 3), advert(B, 5, 4)]
    # B is newer but one peer's alone: not the run's.
    assert choose_state(adverts, None) == (A, ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
    # Asked for one holder, the newest wins.
    assert choose_state(adverts, 1) == (B, ["127.0.0.1:4"])


def test_no_quorum_says_how_the_peers_split() -> None:
    adverts = [advert(A, 4, 1), advert(B, 5, 2), advert(C, 5, 3)]
    with pytest.raises(ExportError, match=r"1 of 3, 2 needed \(round"):
        choose_state(adverts, None)
    # A client-mode peer's state counts for nobody: nobody can download it.
    with pytest.raises(ExportError, match="can be dialled"):
        choose_state([advert(A, 4, 1, client=True)], None)


def _state(config: RunConfig) -> dict[str, torch.Tensor]:
    model = build_model(config, "cpu")
    state = {GLOBAL_PREFIX + n: p.detach().clone() for n, p in model.named_parameters()}
    state["round"] = torch.tensor(3)
    return state


def test_a_user_model_is_written_under_its_own_names() -> None:
    config = RunConfig(name="u", model="tests.harness.user_model:bigram")
    tensors, hf = model_weights(config, _state(config))
    assert hf is None
    model = build_model(config, "cpu")
    assert tensors.keys() == dict(model.named_parameters()).keys()


def test_a_state_that_does_not_fit_or_is_not_finite_is_refused() -> None:
    config = RunConfig(name="g", n_layer=1, n_head=2, n_embd=32, block_size=32)
    state = _state(config)
    tensors, hf = model_weights(config, state)
    assert hf is not None and hf["model_type"] == "gpt2"
    assert "transformer.h.0.attn.c_attn.weight" in tensors
    bigger = RunConfig(name="g", n_layer=2, n_head=2, n_embd=32, block_size=32)
    with pytest.raises(ExportError, match="does not fit the run's model"):
        model_weights(bigger, state)
    state[GLOBAL_PREFIX + "embed.wpe.weight"][0, 0] = float("nan")
    with pytest.raises(ExportError, match="unusable"):
        model_weights(config, state)
    with pytest.raises(ExportError, match="SWARM"):
        model_weights(RunConfig(name="s", algo="swarm"), state)
