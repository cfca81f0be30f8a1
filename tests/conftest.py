"""Shared fixtures: real peer processes on loopback with OS-chosen ports, always cleaned up."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness.processes import ProcessGroup


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`-n 2 --dist loadgroup`, docs/architecture.md "Tiers") the
    multi-host tests share one worker and run one at a time: they make namespaces, bridges
    and compose projects on the machine itself, and each sizes its shaped links for a
    machine that is not also running another host test."""
    for item in items:
        if "tests/multinode/" in item.nodeid:
            item.add_marker(pytest.mark.xdist_group("hosts"))


@pytest.fixture
def processes() -> Iterator[ProcessGroup]:
    group = ProcessGroup()
    try:
        yield group
    finally:
        group.close()
