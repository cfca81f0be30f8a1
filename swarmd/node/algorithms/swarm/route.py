"""The hops of one micro-batch: in order, or with neighbouring stages swapped (CheckFree+).

CheckFree+ (Blagoev et al. 2025, §4.2; gensyn-ai/CheckFree, convergence_training_2.py: on
every odd micro-batch stages 1 and 2, and 5 and 6, of their 7 run in swapped order) trains
each end stage's neighbour to stand in for it, so that a lost first or last stage can be
rebuilt from its neighbour (optim/checkfree.py). Here the first stage holds the embedding and
its first blocks, so a swapped micro-batch runs the embedding at stage 0 (its `edge` part),
then stage 1, then stage 0's `blocks`, and on; at the end, stage S-1's `blocks`, then stage
S-2, then S-1's `edge` (the head, with the loss). With 3 stages the two swaps share stage 1:
swapped micro-batches alternate between the first pair and the last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Hop:
    stage: int
    #: "" (the whole stage), "edge" or "blocks" (an end stage's parts: the stage's
    #: optim.stage.StageTrainer.part).
    part: str = ""

    @property
    def name(self) -> str:
        """What the call names (TensorMeta.name): the stage, and the part if any."""
        return f"{self.stage}/{self.part}" if self.part else str(self.stage)


def parse(name: str) -> Hop:
    """A call's Hop from its name; ValueError if malformed."""
    stage, slash, part = name.partition("/")
    parts = ("edge", "blocks") if slash else ("",)
    if not (stage.isascii() and stage.isdigit()) or len(stage) > 3 or part not in parts:
        raise ValueError(f"a stage call names `stage` or `stage/edge|blocks`, not {name[:16]!r}")
    return Hop(int(stage), part)


def swap_for(seq: int, stages: int, share: float) -> str:
    """Which swap micro-batch `seq` takes: "" (none), "first", "last" or "both": `share` of
    the micro-batches, spread evenly over the sequence numbers."""
    if stages < 2 or share <= 0:
        return ""
    done = math.floor(seq * share)
    if math.floor((seq + 1) * share) == done:
        return ""
    if stages == 2:
        return "first"  # one pair: the first stage and the last
    if stages == 3:
        return "first" if done % 2 == 0 else "last"
    return "both"


def route(stages: int, swap: str = "") -> list[Hop]:
    """The hops of a micro-batch, forward order; the last hop computes the loss."""
    if stages == 1 or not swap:
        return [Hop(s) for s in range(stages)]
    last = stages - 1
    if stages == 2:
        return [Hop(0, "edge"), Hop(1, "blocks"), Hop(0, "blocks"), Hop(1, "edge")]
    head: list[Hop] = [Hop(0)]
    if swap in ("first", "both"):
        head = [Hop(0, "edge"), Hop(1), Hop(0, "blocks")]
    tail: list[Hop] = [Hop(last)]
    if swap in ("last", "both"):
        tail = [Hop(last, "blocks"), Hop(last - 1), Hop(last, "edge")]
    middle_from = 2 if swap in ("first", "both") else 1
    middle_to = last - 1 if swap in ("last", "both") else last
    return head + [Hop(s) for s in range(middle_from, middle_to)] + tail
