"""The strategies a run config's `algo` names: one entry per algorithm, one module each."""

from __future__ import annotations

from swarmd.node.algorithms.demo.strategy import DeMoStrategy
from swarmd.node.algorithms.diloco.strategy import DiLoCoStrategy
from swarmd.node.algorithms.streaming.strategy import StreamingStrategy
from swarmd.node.algorithms.swarm.strategy import SwarmStrategy
from swarmd.node.peer.options import JoinError
from swarmd.node.peer.strategy import Strategy

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
