"""Memory a server has promised to tensors on their way in, bounded per sender and in total.

Why it exists: a tensor stream's buffer is allocated whole when its header arrives, before the
first payload byte, so what a sender declares is memory the server commits at once. Issue 31
measured three 1.5 GiB declarations taking a peer from 0.7 to 4.7 GB. The method's own check
(``Method.admit``: is this the part you were asked for, is it the size it should be?) refuses
strangers; this budget bounds what the senders it admits may hold at once, so a member that
sends many tensors together (or many members at once) makes calls wait, not the peer swap.

A call that finds no room waits for it (honest bursts: every member sending its part to one
reducer at the same moment), up to ``wait_s``; then it is RESOURCE_EXHAUSTED. Reservations are
released from gRPC's threads as well as trio's, so the books are kept under a lock and waiting
polls (it only happens under pressure).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import trio

from swarmd.protocol.calls import RpcError, StatusCode

#: How often a waiting reservation looks for room again.
_POLL_S = 0.02


@dataclass
class Reservation:
    """Bytes promised to one incoming tensor; give them back with ``release`` (idempotent)."""

    budget: ReceiveBudget
    sender: str
    nbytes: int
    released: bool = False

    def release(self) -> None:
        self.budget._give_back(self)


class ReceiveBudget:
    def __init__(self, total: int, per_sender: int, wait_s: float) -> None:
        if not 0 < per_sender <= total or wait_s < 0:
            raise ValueError("ReceiveBudget needs 0 < per_sender <= total and wait_s >= 0")
        self.total = total
        self.per_sender = per_sender
        self.wait_s = wait_s
        self._lock = threading.Lock()
        self._held = 0
        self._by_sender: dict[str, int] = {}

    @property
    def held(self) -> int:
        """Bytes promised to tensors not yet handed to their handlers."""
        return self._held

    def held_by(self, sender: str) -> int:
        return self._by_sender.get(sender, 0)

    def _try(self, sender: str, nbytes: int) -> bool:
        with self._lock:
            mine = self._by_sender.get(sender, 0)
            if self._held + nbytes > self.total or mine + nbytes > self.per_sender:
                return False
            self._held += nbytes
            self._by_sender[sender] = mine + nbytes
            return True

    async def reserve(self, sender: str, nbytes: int) -> Reservation:
        """Room for ``nbytes`` from ``sender`` (a verified peer id, else its address)."""
        if nbytes > self.per_sender:
            raise RpcError(
                StatusCode.RESOURCE_EXHAUSTED,
                f"tensor of {nbytes} B exceeds the {self.per_sender} B one sender may hold",
            )
        with trio.move_on_after(self.wait_s):
            while not self._try(sender, nbytes):
                await trio.sleep(_POLL_S)
            return Reservation(self, sender, nbytes)
        raise RpcError(
            StatusCode.RESOURCE_EXHAUSTED,
            f"no room for {nbytes} B of incoming tensors within {self.wait_s:g} s "
            f"({self._held} B in flight here, {self.held_by(sender)} B of them from this sender)",
        )

    def _give_back(self, reservation: Reservation) -> None:
        with self._lock:
            if reservation.released:
                return
            reservation.released = True
            self._held -= reservation.nbytes
            left = self._by_sender[reservation.sender] - reservation.nbytes
            if left:
                self._by_sender[reservation.sender] = left
            else:
                del self._by_sender[reservation.sender]
