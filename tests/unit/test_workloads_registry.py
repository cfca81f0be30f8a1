"""`--model module:function`: user models load, and broken specs fail with clear messages."""

from __future__ import annotations

import itertools
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmd.workloads import GPT, ModelLoadError, evaluate, load_model

_counter = itertools.count()

USER_MODULE = """
import torch
from torch import nn
import torch.nn.functional as F


class Bigram(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(256, 256)

    def forward(self, idx, targets=None):
        logits = self.table(idx)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


class OnlyLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(256, 256)

    def forward(self, idx, targets=None):
        return self.table(idx)


def good():
    return Bigram()


def not_a_module():
    return "hello"


def only_logits():
    return OnlyLogits()


def raises():
    raise RuntimeError("no GPU here")


CONSTANT = 3
"""


@pytest.fixture
def user_module(tmp_path: Path) -> Iterator[str]:
    name = f"swarmd_user_models_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    sys.path.insert(0, str(tmp_path))
    try:
        yield name
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def test_builtin() -> None:
    assert isinstance(load_model("builtin"), GPT)


def test_user_model_loads_and_trains(user_module: str) -> None:
    model = load_model(f"{user_module}:good")
    x = torch.randint(0, 256, (2, 8))
    logits, loss = model(x, x)
    assert logits.shape == (2, 8, 256)
    assert evaluate(model, [(x, x)]) == pytest.approx(loss.item(), rel=1e-5)


@pytest.mark.parametrize(
    ("attr", "match"),
    [
        ("not_a_module", "returned str, not a torch.nn.Module"),
        ("only_logits", r"must return \(logits, loss\)"),
        ("raises", "calling it raised RuntimeError: no GPU here"),
        ("missing", "has no 'missing'"),
        ("CONSTANT", "is not callable"),
    ],
)
def test_broken_user_models(user_module: str, attr: str, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        load_model(f"{user_module}:{attr}")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("", "builtin"),
        ("justamodule", "not of the form 'module:function'"),
        ("mod:", "not of the form"),
        ("swarmd_no_such_module_xyz:f", "cannot import module 'swarmd_no_such_module_xyz'"),
    ],
)
def test_bad_specs(spec: str, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        load_model(spec)
