"""The bulk listener's connection slots: per-address caps, and idle connections give way."""

from __future__ import annotations

import pytest
import trio

from swarmd.protocol._bulk_slots import Slots


def test_one_address_holds_at_most_its_share() -> None:
    slots = Slots(total=10, per_address=3)
    held = [slots.admit("10.0.0.9") for _ in range(3)]
    assert all(held)
    assert slots.admit("10.0.0.9") is None and slots.refused == 1
    assert slots.admit("10.0.0.1") is not None  # others are not affected
    first = held[0]
    assert first is not None
    slots.release(first)
    assert slots.admit("10.0.0.9") is not None


def test_a_full_listener_closes_its_oldest_idle_connection_for_a_newcomer() -> None:
    trio.run(_full_listener)  # cancelling a scope takes a trio run


async def _full_listener() -> None:
    slots = Slots(total=3, per_address=3)
    a, b, c = (slots.admit(f"10.0.0.{i}") for i in range(3))
    assert a is not None and b is not None and c is not None
    a.idle = False  # a has sent its request: it is working, not idle
    newcomer = slots.admit("10.0.0.7")
    assert newcomer is not None
    assert b.scope.cancel_called and not a.scope.cancel_called and not c.scope.cancel_called
    assert slots.evicted == 1 and len(slots) == 3
    slots.release(b)  # the evicted connection releases again as it unwinds: no double count
    assert len(slots) == 3
    for slot in (c, newcomer):
        slot.idle = False
    assert slots.admit("10.0.0.8") is None  # nobody idle: busy


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError):
        Slots(total=0, per_address=1)
    with pytest.raises(ValueError):
        Slots(total=1, per_address=0)
