"""A run's end (RunConfig.total_steps): the peers that reach it leave on one state.

Every peer stops once the state it holds reaches the run's last round, but the last round
can end differently for different peers: one whose grid group was whole averaged, the
others, whose groups fell short, carried the round (DiLoCo.carry), and the run ended on two
states (seen: 6 peers in groups of 2, one averaged and five carried, final losses 5.9%
apart). Before it leaves, a peer waits until every live peer advertises a state of the last
round (every live peer it met: a staller advertises nothing); while they differ, the one
more peers hold is taken (`SharedState.catch_up`, the rule every peer applies alike), and a
peer stays, serving its state, until all of them advertise one state, at most `end_wait_s`
(StateTimings)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from swarmd.node.peer.sharedstate import SharedState

log = logging.getLogger("swarmd.daemon")


async def leave_on_one_state(state: SharedState, took: Callable[[], Awaitable[None]]) -> bool:
    """Waits until every live peer advertises one state of this peer's round, taking the
    majority's state if this one's differs (then ``took()`` publishes and reports it); True
    if all did within `end_wait_s`."""
    age, timings = state.opt.age, state.timings
    with trio.move_on_after(timings.end_wait_s):
        while True:
            # Of the live peers, those it met: an identity that heartbeats and never joins
            # (a staller) advertises no state, and would hold every peer here `end_wait_s`.
            # Nor one banned since this one met it: `adverts` shows nothing of it.
            live = await state.awaited(state.met)
            final = {a.owner: a.state_hash for a in await state.adverts() if a.round >= age}
            if live <= final.keys():
                if set(final.values()) <= {state.last_hash}:
                    return True
                if await state.catch_up():
                    log.info("the run's end: took the state most of its peers hold")
                    await took()
            await trio.sleep(timings.lone_poll_s)
    log.warning(
        "the run's end: its peers did not all advertise one state within %ss", timings.end_wait_s
    )
    return False


__all__ = ["leave_on_one_state"]
