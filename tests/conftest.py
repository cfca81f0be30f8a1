"""Shared fixtures: real peer processes on loopback with OS-chosen ports, always cleaned up."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.harness.processes import ProcessGroup


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread in the test process, as in every peer process (`run_join`). Two
    workers share the two cores; a second intra-op thread only spins against the other
    worker: the 48-peer grid simulation took 56 s with two threads beside another process
    and 36 s with one. Four modules each set it in a fixture, so whether a worker's later
    tests ran on one thread or two depended on which tests it had run before."""
    torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`-n 2 --dist loadgroup`, docs/architecture.md "Tiers") the
    multi-host tests share one worker and run one at a time: they make namespaces, bridges
    and compose projects on the machine itself, and each sizes its shaped links for a
    machine that is not also running another host test.

    The simulator's tests go first. xdist hands out tests in this order as workers free up,
    and in collection order `tests/unit/test_sim_*.py` (CPU-bound, up to a minute each)
    came near the end, where one worker ran them while the other had nothing left."""
    for item in items:
        if "tests/multinode/" in item.nodeid:
            item.add_marker(pytest.mark.xdist_group("hosts"))
    items.sort(key=lambda item: "/test_sim_" not in item.nodeid)


@pytest.fixture
def processes() -> Iterator[ProcessGroup]:
    group = ProcessGroup()
    try:
        yield group
    finally:
        group.close()
