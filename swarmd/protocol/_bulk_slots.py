"""Who may hold one of the bulk listener's connection slots, and who gives one up.

Forty idle TCP connections once held every slot of a peer's bulk listener: each waited out
the header deadline and was reopened as soon as it closed, and honest calls met "bulk server
busy" (a group of three took 5.6x longer per round). So a connection that has not yet sent
its request header counts as idle: when the listener is full, a newcomer takes the oldest
idle connection's slot (that connection is closed) rather than being refused, and no single
source address may hold more than ``per_address`` slots at once, idle or not. An attacker
then holds at most its per-address share, and only until honest traffic needs the slots.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import trio


@dataclass
class Slot:
    address: str
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    #: Until its request header is read: a connection that may be evicted.
    idle: bool = True
    opened: float = field(default_factory=time.monotonic)
    number: int = 0


class Slots:
    def __init__(self, total: int, per_address: int) -> None:
        if total < 1 or per_address < 1:
            raise ValueError("total and per_address must be >= 1")
        self.total = total
        self.per_address = per_address
        self._open: dict[int, Slot] = {}
        self._numbers = itertools.count()
        #: Connections closed to make room, and refused outright: for tests and metrics.
        self.evicted = 0
        self.refused = 0

    def admit(self, address: str) -> Slot | None:
        """A slot for a new connection from ``address``, or None (refuse it as busy)."""
        if sum(1 for s in self._open.values() if s.address == address) >= self.per_address:
            self.refused += 1
            return None
        if len(self._open) >= self.total:
            idle = [s for s in self._open.values() if s.idle]
            if not idle:
                self.refused += 1
                return None
            oldest = min(idle, key=lambda s: s.opened)
            oldest.scope.cancel()
            self.release(oldest)
            self.evicted += 1
        slot = Slot(address, number=next(self._numbers))
        self._open[slot.number] = slot
        return slot

    def release(self, slot: Slot) -> None:
        """Idempotent: an evicted connection releases its slot again as it unwinds."""
        self._open.pop(slot.number, None)

    def __len__(self) -> int:
        return len(self._open)
