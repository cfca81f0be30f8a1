"""Which workloads this machine's own user allowed: the only ones a run config may name.

A run config comes from the network. It names its model and data, but those names are never
imported or opened as they stand: a name counts only if it is a built-in, an installed
workload (an entry point in the ``swarmd.workloads`` group, which the user installed with
pip), or exactly what the user passed on their own command line (``--model``, ``--data``).
Otherwise a run created with ``model = "os:abort"`` killed every joiner, and one whose data
was a path made each joiner train on that file of its own disk.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarmd.workloads.registry import (
    BUILTIN_MODELS,
    ENTRY_POINT_GROUP,
    ModelLoadError,
    installed_models,
)

BUILTIN_DATA = ("builtin", "stdlib")


class WorkloadNotAllowed(ModelLoadError):
    """A run names a model or data source this peer's user has not allowed."""


@dataclass(frozen=True)
class AllowedWorkloads:
    """What this peer's user named themselves (command line, or the run file they created)."""

    models: tuple[str, ...] = ()
    data: tuple[str, ...] = ()

    def with_own_run(self, model: str, data: str) -> AllowedWorkloads:
        """The creator wrote the run file on their own machine: its names are theirs."""
        return AllowedWorkloads((*self.models, model), (*self.data, data))

    def check_model(self, name: str) -> None:
        """Raises WorkloadNotAllowed unless the model a run config names may be loaded here."""
        if name in BUILTIN_MODELS or name in self.models or name in installed_models():
            return
        raise WorkloadNotAllowed(
            f"the run names model {name!r}, which this peer was not told to trust: swarmd "
            "only runs built-in models, installed ones (entry points in the "
            f"{ENTRY_POINT_GROUP!r} group) and the one given by --model on its own command "
            f"line. If you trust this run's creator with your machine, join with --model {name}"
        )

    def check_data(self, name: str) -> None:
        """Raises WorkloadNotAllowed unless the data a run config names may be opened here."""
        if name in BUILTIN_DATA or name in self.data:
            return
        raise WorkloadNotAllowed(
            f"the run trains on data {name!r}, which this peer does not open on the run's "
            "word: swarmd only reads the built-in corpus or what --data names on its own "
            f"command line. If you hold that data, join with --data {name}"
        )
