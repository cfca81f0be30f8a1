"""Checking what a stage server answers: a trainer asks a sample of its hops again of a second
server of the stage and compares (SWARM's and Petals' threat discussions: redundant
computation; BTARD's validators do it for gradients).

Servers of one stage hold the same parameters within a stage round (they average their
gradients and step together at each boundary), so two honest answers to one call computed in
the same round differ by the activations' wire rounding (fp16: ~1e-3 relative). Each answer's
ack names the round and the published stage state that computed it (no state while a step
or a download has changed the parameters and the new state is not published yet), and only
answers of one state are compared: answers a step apart differed by 0.6-0.75 (a Last's input
gradient, the tiny model at the test's learning rate), and by round alone an honest server of
a stage split under load (same round, another state) was named a liar. A lying answer
(x(-20), a sign flip, noise, another input's) differs by about its whole size. When two answers
disagree a third server of the stage decides: the one unlike the other two is distrusted by
this trainer for `DISTRUST_S` (never called, never a fallback) and the event says who, with
the distance. Two servers and no third, or three that all disagree: said (`stage_disagree`),
and the hop goes on with the first answer; nobody can tell which lied.

Backward and Last apply the micro-batch's gradients at the server, and a micro-batch is
applied exactly once wherever it goes (trainer.py): their second and third opinions are the
Check calls, computed the same way and applied nowhere. A stage-0 Backward answers nothing
(its input is token ids) and is not checked. What a server does with its own gradients (the
stage's averaging) is not what this checks. A liar that also misreports its state is never
compared (the stage directory's rounds could expose it; not done), and one whose answers
stay within `TOLERANCE` of honest ones passes.
"""

from __future__ import annotations

import torch

#: Two answers agree when they differ by at most this share of the larger one's norm: a
#: sign flip is 2 apart, x(-20) 1.05, x2 0.5; honest servers a step or two apart, well
#: under it. A liar that scales its answers by less than 2 (or adds less noise) passes.
TOLERANCE = 0.5
#: How long a server caught lying is left out of this trainer's routing.
DISTRUST_S = 1800.0


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """How far two answers are apart: the norm of their difference over the larger norm (inf
    for answers of different shapes)."""
    if a.shape != b.shape:
        return float("inf")
    a64, b64 = a.double(), b.double()
    scale = max(float(a64.norm()), float(b64.norm()), 1e-30)
    return float((a64 - b64).norm()) / scale


def distance_all(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest distance between two answers' tensors, pair by pair (a Last's loss and
    gradient); inf if they hold different numbers of tensors."""
    if len(a) != len(b):
        return float("inf")
    return max((distance(x, y) for x, y in zip(a, b, strict=True)), default=0.0)


def agree_all(a: list[torch.Tensor], b: list[torch.Tensor], tolerance: float = TOLERANCE) -> bool:
    return distance_all(a, b) <= tolerance


def odd_one_out(
    first: list[torch.Tensor],
    second: list[torch.Tensor],
    third: list[torch.Tensor],
    tolerance: float = TOLERANCE,
) -> int | None:
    """Of two answers that disagree, the one a third answer does not back: 0 (the first) or
    1 (the second); None when the third agrees with both or with neither."""
    with_first = agree_all(third, first, tolerance)
    with_second = agree_all(third, second, tolerance)
    if with_first == with_second:
        return None
    return 1 if with_first else 0
