"""The strategy seam: every algorithm a run config accepts has a strategy, the lifecycle
refuses what it cannot train instead of guessing, and what each algorithm serves on every
peer comes from the algorithm."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest

from swarmd.node.algorithms.demo.gather import Gatherer
from swarmd.node.algorithms.demo.strategy import DeMoStrategy
from swarmd.node.algorithms.registry import STRATEGIES, strategy_for
from swarmd.node.algorithms.swarm.stage_service import StageHost
from swarmd.node.algorithms.swarm.strategy import SwarmStrategy
from swarmd.node.bans import Bans
from swarmd.node.metrics import Metrics
from swarmd.node.peer.context import PeerContext
from swarmd.node.peer.options import JoinError
from swarmd.node.peer.runconfig import ALGORITHMS
from swarmd.node.peer.strategy import HostParts, Strategy
from swarmd.protocol.identity import Identity
from swarmd.protocol.rpc import RpcClient


def test_every_algorithm_has_its_strategy() -> None:
    assert set(STRATEGIES) == set(ALGORITHMS)
    for algo in ALGORITHMS:
        cls = strategy_for(algo)
        assert issubclass(cls, Strategy)
        assert cls.algo == algo


def test_unknown_algorithm_is_a_join_error() -> None:
    with pytest.raises(JoinError, match="cannot train algo 'pipedream'"):
        strategy_for("pipedream")


def _parts() -> HostParts:
    identity = Identity.generate()
    metrics = Metrics()
    return HostParts(RpcClient(identity, observer=metrics), identity.peer_id, metrics, Bans())


def test_each_algorithm_hosts_its_own_service() -> None:
    """What a peer serves before it knows its run's algorithm comes from the algorithms
    themselves (the lifecycle names none): DeMo's all-gather and SWARM's stage calls, each
    under a service name of its own; DiLoCo and streaming DiLoCo use the shared averager."""
    hosts = {algo: cls.host(_parts()) for algo, cls in STRATEGIES.items()}
    assert isinstance(hosts["demo"], Gatherer)
    assert isinstance(hosts["swarm"], StageHost)
    assert hosts["diloco"] is None and hosts["streaming-diloco"] is None
    names = [h.service().name for h in hosts.values() if h is not None]
    assert len(set(names)) == len(names) == 2


def test_a_strategy_gets_only_the_host_it_asks_for() -> None:
    hosts = {"demo": DeMoStrategy.host(_parts()), "swarm": SwarmStrategy.host(_parts())}
    peer = cast(PeerContext, SimpleNamespace(hosts=hosts))
    assert PeerContext.host(peer, "swarm", StageHost) is hosts["swarm"]
    with pytest.raises(TypeError, match="demo's host is a Gatherer, not a StageHost"):
        PeerContext.host(peer, "demo", StageHost)
