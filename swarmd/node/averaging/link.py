"""What every all-reduce call of one averager shares (the client, measured throughput, metrics,
reused code buffers): the `Averager` lends it to each call's `Exchange`, and the proof checks
(verify.py) read the client and config from it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from swarmd.node.averaging.config import AllReduceConfig, Throughput
from swarmd.node.bans import Bans
from swarmd.node.metrics import Metrics
from swarmd.protocol import rpc


@dataclass
class Link:
    """What every exchange of one averager shares: the client, the measured throughput,
    metrics, and the int8 code buffers that rounds of the same key reuse."""

    client: rpc.TensorCaller
    config: AllReduceConfig
    metrics: Metrics | None
    #: Replaces the codec for this peer's own contributions; tests inject a lying peer.
    outgoing_encoder: Callable[[torch.Tensor], bytes] | None
    throughput: Throughput
    #: Whom this peer refuses, and where the evidence it finds goes (bans.py).
    bans: Bans
    #: Per error-feedback key and part, the int8 codes of the part this peer sent last
    #: round: every send has finished when a round returns, so the next round reuses them
    #: (3 x 25 MB of fresh pages per round in the 4 x 100 M benchmark, ~8% of its CPU).
    sent_codes: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)

    def deadline(self, nbytes: float) -> float:
        cfg = self.config
        expected = nbytes / max(self.throughput.value, 1.0)
        return min(cfg.max_deadline_s, cfg.min_deadline_s + cfg.deadline_slack * expected)

    def count_bytes(self, direction: str, codec: str, nbytes: int) -> None:
        if self.metrics is not None:
            self.metrics.on_averaging_bytes(direction, codec, nbytes)
