"""The strategy seam: every algorithm a run config accepts has a strategy, and the lifecycle
refuses what it cannot train instead of guessing."""

from __future__ import annotations

import pytest

from swarmd.node.algorithms.registry import STRATEGIES, strategy_for
from swarmd.node.peer.options import JoinError
from swarmd.node.peer.runconfig import ALGORITHMS
from swarmd.node.peer.strategy import Strategy


def test_every_algorithm_has_its_strategy() -> None:
    assert set(STRATEGIES) == set(ALGORITHMS)
    for algo in ALGORITHMS:
        cls = strategy_for(algo)
        assert issubclass(cls, Strategy)
        assert cls.algo == algo


def test_unknown_algorithm_is_a_join_error() -> None:
    with pytest.raises(JoinError, match="cannot train algo 'pipedream'"):
        strategy_for("pipedream")
