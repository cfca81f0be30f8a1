"""The receive budget: memory promised to incoming tensors, per sender and in total."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from swarmd.protocol._receive_budget import ReceiveBudget
from swarmd.protocol.calls import RpcError, StatusCode


def _run(fn: object) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))  # type: ignore[arg-type]


def test_books_balance_and_release_is_idempotent() -> None:
    async def main() -> None:
        budget = ReceiveBudget(total=100, per_sender=60, wait_s=1.0)
        a = await budget.reserve("a", 40)
        b = await budget.reserve("b", 50)
        assert (budget.held, budget.held_by("a"), budget.held_by("b")) == (90, 40, 50)
        a.release()
        a.release()  # a second release (a finally after an error path) changes nothing
        assert (budget.held, budget.held_by("a")) == (50, 0)
        await trio.to_thread.run_sync(b.release)  # gRPC's threads release too
        assert budget.held == 0

    _run(main)


def test_one_sender_cannot_take_more_than_its_share() -> None:
    async def main() -> None:
        budget = ReceiveBudget(total=1000, per_sender=100, wait_s=5.0)
        await budget.reserve("greedy", 80)
        start = trio.current_time()
        with pytest.raises(RpcError) as err:
            await budget.reserve("greedy", 30)
        assert err.value.code is StatusCode.RESOURCE_EXHAUSTED
        assert trio.current_time() - start == pytest.approx(5.0, abs=0.1)  # it waited first
        honest = await budget.reserve("honest", 100)  # others are not held up by it
        assert honest.nbytes == 100 and budget.held == 180

    _run(main)


def test_a_tensor_larger_than_a_share_is_refused_without_waiting() -> None:
    async def main() -> None:
        budget = ReceiveBudget(total=1000, per_sender=100, wait_s=30.0)
        start = trio.current_time()
        with pytest.raises(RpcError) as err:
            await budget.reserve("x", 101)
        assert err.value.code is StatusCode.RESOURCE_EXHAUSTED
        assert trio.current_time() == start
        assert budget.held == 0

    _run(main)


def test_a_waiting_call_gets_room_when_another_finishes() -> None:
    async def main() -> None:
        budget = ReceiveBudget(total=100, per_sender=100, wait_s=10.0)
        first = await budget.reserve("a", 70)
        got_at: list[float] = []

        async def second() -> None:
            await budget.reserve("b", 50)
            got_at.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(second)
            await trio.sleep(2.0)
            assert not got_at  # no room yet: 70 + 50 > 100
            first.release()
        assert got_at and 2.0 <= got_at[0] < 2.1
        assert budget.held == 50

    _run(main)


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError):
        ReceiveBudget(total=10, per_sender=20, wait_s=1.0)
    with pytest.raises(ValueError):
        ReceiveBudget(total=10, per_sender=0, wait_s=1.0)
    with pytest.raises(ValueError):
        ReceiveBudget(total=10, per_sender=5, wait_s=-1.0)
