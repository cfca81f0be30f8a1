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

__all__ = [
    "AverageFn",
    "Averaged",
    "DiLoCo",
    "DiLoCoConfig",
    "OuterStepReport",
    "flatten",
    "unflatten_into",
    "views",
]
