"""Shared fixtures: real peer processes on loopback with OS-chosen ports, always cleaned up."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness.processes import ProcessGroup


@pytest.fixture
def processes() -> Iterator[ProcessGroup]:
    group = ProcessGroup()
    try:
        yield group
    finally:
        group.close()
