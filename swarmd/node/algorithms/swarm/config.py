"""A SWARM run's settings (`algo = "swarm"`), built from the run config by
`RunConfig.swarm_config()`: every peer of the run holds the same ones."""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarmd.node.algorithms.swarm.wire import ACTIVATION_CODECS

#: What a peer does in a SWARM run (`swarmd join --role`).
ROLES = ("auto", "trainer", "server", "both")


@dataclass(frozen=True)
class SwarmConfig:
    #: Pipeline stages the model is cut into (the built-in GPT: embeddings and the first
    #: blocks, blocks, the last blocks and the head).
    stages: int = 3
    #: Every `round_s` seconds (on the wall clock, so a stage's servers meet without talking
    #: first) the servers of each stage average their gradients and take one AdamW step.
    round_s: float = 5.0
    #: How often a server looks whether moving to another stage raises the pipeline's
    #: throughput (each look at a random time in [0.5, 1.5] x this, the first after at least
    #: one whole period, on rates measured on real traffic); 0: never.
    rebalance_s: float = 30.0
    #: A move must raise the slowest stage's throughput by this factor (Petals' balance
    #: quality: 0.75 there, i.e. 1.33x); measured throughputs are noisy.
    rebalance_gain: float = 1.25
    #: How activations and gradients travel: fp16, bf16, fp32 or int8 (a scale per row).
    activations: str = "fp16"
    #: Micro-batches one trainer keeps in flight (bounds its memory: the inputs of each hop
    #: of each micro-batch wait on the trainer for the backward).
    inflight: int = 4
    #: Longest a stage call may take before the trainer gives up on that server and retries
    #: the hop on another one.
    call_timeout_s: float = 30.0
    #: CheckFree+ (route.py): the share of micro-batches routed with the first two (and last
    #: two) stages swapped, so that a lost first or last stage can be rebuilt from its
    #: neighbour, whose servers then also keep a copy of its embedding or head. 0: off (a
    #: lost end stage restarts from the seed); the paper swaps half (0.5). Costs a swapped
    #: micro-batch one more hop per swapped pair, each way.
    swap: float = 0.0
    #: The share of forward hops a trainer repeats on a second server of the stage and
    #: compares (audit.py: a server caught answering unlike two others is left out); costs
    #: that share of the stages' forward compute (a forward is about a third of a hop's).
    audit: float = 0.125

    def __post_init__(self) -> None:
        s = self.stages
        if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= 64:
            raise ValueError(f"swarm_stages must be an integer in [1, 64], got {s!r}")
        for name in ("round_s", "call_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0.2 <= v <= 3600:
                raise ValueError(f"swarm_{name} must be a number of seconds in [0.2, 3600]")
        r = self.rebalance_s
        if isinstance(r, bool) or not isinstance(r, int | float) or not 0 <= r <= 86400:
            raise ValueError(f"swarm_rebalance_s must be in [0, 86400] seconds, got {r!r}")
        g = self.rebalance_gain
        if not isinstance(g, int | float) or not math.isfinite(g) or not 1 <= g <= 100:
            raise ValueError(f"swarm_rebalance_gain must be in [1, 100], got {g!r}")
        if self.activations not in ACTIVATION_CODECS:
            raise ValueError(
                f"swarm_activations must be one of {', '.join(ACTIVATION_CODECS)}, "
                f"got {self.activations!r}"
            )
        n = self.inflight
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 256:
            raise ValueError(f"swarm_inflight must be an integer in [1, 256], got {n!r}")
        for name in ("swap", "audit"):
            w = getattr(self, name)
            if isinstance(w, bool) or not isinstance(w, int | float) or not 0 <= w <= 1:
                raise ValueError(f"swarm_{name} must be a share in [0, 1], got {w!r}")
