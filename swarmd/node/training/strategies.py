"""The strategies a run config's `algo` names: one entry per algorithm, one module each."""

from __future__ import annotations

from swarmd.node.training.demo import DeMoStrategy
from swarmd.node.training.diloco import DiLoCoStrategy
from swarmd.node.training.options import JoinError
from swarmd.node.training.strategy import Strategy
from swarmd.node.training.streaming import StreamingStrategy
from swarmd.node.training.swarm import SwarmStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    s.algo: s for s in (DiLoCoStrategy, StreamingStrategy, DeMoStrategy, SwarmStrategy)
}


def strategy_for(algo: str) -> type[Strategy]:
    try:
        return STRATEGIES[algo]
    except KeyError:  # a run config made by a newer swarmd that this one cannot train
        raise JoinError(
            f"this swarmd cannot train algo {algo!r} (it knows {', '.join(STRATEGIES)})"
        ) from None
