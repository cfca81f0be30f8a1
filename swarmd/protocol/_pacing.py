"""Calls a peer's rate limit refused, made again after the wait the refusal names.

The refusal comes before the peer ran anything of the call (`_rpc_server._check_rate`), so
making it again is safe for every method. Failing it instead, a member of a fast run (the
tests' 2-peer runs average every 50 ms) lost a part of an all-reduce to its reducer's limit,
and the two members' states split (CI: test_run_access).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from swarmd.protocol._rpc_config import TransportConfig
from swarmd.protocol.calls import RpcError, retry_after

T = TypeVar("T")


async def paced(
    seconds: float, config: TransportConfig, call: Callable[[float], Awaitable[T]]
) -> T:
    """``call`` (given the seconds it has left of ``seconds``), made again after each wait a
    rate limit names, as often as the one deadline allows.

    Each wait is stretched by up to half at random: calls refused together would otherwise
    come back together, and all but one be refused again (seen: three calls in flight against
    a 20/s limit, one refused nine times running). A wait beyond `max_rate_limit_wait_s` is
    not honoured (a peer cannot park this one's calls by naming long waits): the refusal is
    raised, as it is with `rate_limit_retry` off."""
    end = trio.current_time() + seconds
    while True:
        try:
            return await call(end - trio.current_time())
        except RpcError as exc:
            wait = retry_after(exc)
            if wait is None or not config.rate_limit_retry:
                raise
            wait *= 1 + 0.5 * random.random()
            if wait > config.max_rate_limit_wait_s or wait >= end - trio.current_time():
                raise
        await trio.sleep(wait)
