"""A SWARM run's settings and a peer's SWARM flags are checked before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmd.node.algorithms.swarm.config import SwarmConfig
from swarmd.node.peer.options import JoinOptions


def test_join_options_check_the_swarm_flags(tmp_path: Path) -> None:
    opts = JoinOptions(run="r", state_dir=tmp_path, role="server", stage=2, slowdown=3.0)
    assert (opts.role, opts.stage, opts.slowdown) == ("server", 2, 3.0)
    for bad in ({"role": "leader"}, {"stage": -1}, {"stage": 64}, {"slowdown": 0.5}):
        with pytest.raises(ValueError):
            JoinOptions(run="r", state_dir=tmp_path, **bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        {"stages": 0},
        {"stages": True},
        {"round_s": 0.1},
        {"round_s": float("nan")},
        {"rebalance_s": -1},
        {"rebalance_gain": 0.5},
        {"activations": "int4"},
        {"inflight": 0},
        {"call_timeout_s": 1e9},
    ],
)
def test_swarm_config_refuses(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SwarmConfig(**bad)  # type: ignore[arg-type]
