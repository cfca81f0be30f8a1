"""The strategies a run config's `algo` names: one entry per algorithm, one package each.

`swarmd join` hands this table to the lifecycle (peer/lifecycle.py), which never imports an
algorithm itself.
"""

from __future__ import annotations

from swarmd.node.algorithms.demo.strategy import DeMoStrategy
from swarmd.node.algorithms.diloco.strategy import DiLoCoStrategy
from swarmd.node.algorithms.streaming.strategy import StreamingStrategy
from swarmd.node.algorithms.swarm.strategy import SwarmStrategy
from swarmd.node.peer import strategy
from swarmd.node.peer.strategy import Strategy

STRATEGIES: dict[str, type[Strategy]] = {
    s.algo: s for s in (DiLoCoStrategy, StreamingStrategy, DeMoStrategy, SwarmStrategy)
}


def strategy_for(algo: str) -> type[Strategy]:
    return strategy.strategy_for(STRATEGIES, algo)
