"""Optimisers (DiLoCo, streaming DiLoCo, DeMo): pure torch, no I/O.

They take an averaging function and never touch the network.
"""

from swarmd.optim.diloco import (
    Averaged,
    AverageFn,
    DiLoCo,
    DiLoCoConfig,
    OuterStepReport,
)
from swarmd.optim.flat import flatten, unflatten_into, views
from swarmd.optim.streaming import (
    FragmentReport,
    FragmentRound,
    StreamingConfig,
    StreamingDiLoCo,
)

__all__ = [
    "AverageFn",
    "Averaged",
    "DiLoCo",
    "DiLoCoConfig",
    "FragmentReport",
    "FragmentRound",
    "OuterStepReport",
    "StreamingConfig",
    "StreamingDiLoCo",
    "flatten",
    "unflatten_into",
    "views",
]
