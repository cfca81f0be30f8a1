"""The seam between the peer lifecycle and an algorithm: the `Strategy` interface.

The lifecycle (lifecycle.py) owns what every algorithm shares: identity, the server and its
services, DHT bootstrap, the run config, metrics, heartbeats, progress output, the stop signal
and the final summary. A strategy owns how one algorithm trains and talks: what it syncs, when,
with whom, and what state a joiner downloads. The lifecycle never branches on the algorithm; it
looks the strategy up by the run config's `algo` in the table it is given
(algorithms/registry.py, passed in by `swarmd join`) and calls, in this order:

1. `join()` once, before this peer's heartbeat is announced: build the model and take the
   state to start from (what a joiner downloads). Peers wait for every live heartbeat in their
   rounds, so a peer is not announced while it is still downloading.
2. `train(nursery)` once: the training loop, until `peer.should_stop`; it returns the inner
   steps done. Background work of the strategy (an overlapped round) goes in `nursery`, the
   lifecycle's, which outlives the loop and is cancelled when the peer leaves.
3. `round` when the loop has returned, for the `stopped` summary.

This follows torchft's split of a `Manager` (membership, quorum, recovery: the lifecycle's
part) from the training loop that calls it, with the loop itself inside the strategy, as in
prime-diloco, where the outer DiLoCo step sits beside the inner loop it interrupts; each
strategy's settings stay in its own typed config (torchtitan's per-component configs), built
from the run config by `RunConfig.diloco_config()` / `streaming_config()`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
import trio
from torch import nn

from swarmd.node.bans import Bans
from swarmd.node.metrics import Metrics
from swarmd.node.peer.context import Hosted, PeerContext
from swarmd.node.peer.net import PeerNet, SocketNet
from swarmd.node.peer.options import JoinError, JoinOptions
from swarmd.optim.forward import InnerForward
from swarmd.protocol import rpc
from swarmd.protocol.identity import PeerId


class HasForward(Protocol):
    #: What the optimiser's inner steps run through (swarmd/optim/forward.py).
    forward: InnerForward


@dataclass
class LocalTarget:
    """What a peer's local ranks (swarmd/node/peer/local) need of a strategy to share its inner
    steps: the model, its trained parameters, the optimiser whose steps they join, and how."""

    model: nn.Module
    params: list[nn.Parameter]
    owner: HasForward
    shard: int
    #: The inner optimiser's state the ranks start from (None: they take no optimizer steps
    #: and only help compute gradients, as for DeMo, whose step rank 0 takes alone).
    inner_state: dict[str, torch.Tensor] | None


@dataclass(frozen=True)
class HostParts:
    """What the lifecycle has when it makes the algorithms' hosts, before any run is known."""

    client: rpc.TensorCaller
    peer_id: PeerId
    metrics: Metrics
    bans: Bans
    #: Its clocks and device (a SWARM stage's compute is timed through it).
    net: PeerNet = field(default_factory=SocketNet)


class Strategy(ABC):
    """How one algorithm trains and talks; one instance per run a peer joins."""

    #: The `RunConfig.algo` this strategy trains.
    algo: ClassVar[str]

    @classmethod
    def needs_reachable(cls, opts: JoinOptions) -> str | None:
        """Why a peer with these options must be reachable to train this algorithm, said at
        join to a peer others cannot dial (None: it trains in client mode, issue 27)."""
        return None

    @classmethod
    def host(cls, parts: HostParts) -> Hosted | None:
        """The service this algorithm needs on every peer's port from the start (None:
        none beyond the shared ones); its strategy finds it in `PeerContext.hosts`."""
        return None

    def __init__(self, peer: PeerContext) -> None:
        self.peer = peer

    @abstractmethod
    async def join(self) -> None:
        """Builds the model and takes the state to start from: the group's (downloaded), this
        peer's saved one, or the run's seeded init. Raises JoinError for what the user must
        fix (a model that cannot load, a config the model does not fit)."""

    @abstractmethod
    async def train(self, nursery: trio.Nursery) -> int:
        """Trains until `self.peer.should_stop(...)`; returns the inner steps done."""

    def local_target(self) -> LocalTarget | None:
        """After `join()`: what local ranks share (None: this algorithm trains in one
        process only)."""
        return None

    @property
    @abstractmethod
    def round(self) -> int:
        """The outer round this peer's state has reached (for the `stopped` line)."""


#: The algorithms a peer can train, by `RunConfig.algo` (algorithms/registry.py's).
Strategies = Mapping[str, type[Strategy]]


def strategy_for(strategies: Strategies, algo: str) -> type[Strategy]:
    try:
        return strategies[algo]
    except KeyError:  # a run config made by a newer swarmd that this one cannot train
        raise JoinError(
            f"this swarmd cannot train algo {algo!r} (it knows {', '.join(strategies)})"
        ) from None
