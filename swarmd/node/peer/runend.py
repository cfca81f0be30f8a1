"""A run's end (RunConfig.total_steps): the peers that reach it leave on one state.

Every peer stops once the state it holds reaches the run's last round, but the last round
can end differently for different peers: one whose grid group was whole averaged, the
others, whose groups fell short, carried the round (DiLoCo.carry), and the run ended on two
states (seen: 6 peers in groups of 2, one averaged and five carried, final losses 5.9%
apart). Before it leaves, a peer waits until every live peer advertises a state of the last
round (every live peer it met: a staller advertises nothing); while they differ, the one
more peers hold is taken (`SharedState.catch_up`, the rule every peer applies alike), and a
peer stays, serving its state, until all of them advertise one state, at most END_WAIT_S."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from swarmd.node.peer.sharedstate import LONE_POLL_S, SharedState

log = logging.getLogger("swarmd.daemon")

#: Longest a peer at the run's end waits for the others to end on its state: a sat-out peer's
#: last round waits up to LONE_WAIT_S for the roster's adverts before it settles, and a peer
#: that then takes the majority's state downloads it from peers that must still be there.
END_WAIT_S = 30.0


async def leave_on_one_state(state: SharedState, took: Callable[[], Awaitable[None]]) -> bool:
    """Waits until every live peer advertises one state of this peer's round, taking the
    majority's state if this one's differs (then ``took()`` publishes and reports it); True
    if all did within END_WAIT_S."""
    me = str(state.peer.identity.peer_id)
    age = state.opt.age
    with trio.move_on_after(END_WAIT_S):
        while True:
            # Of the live peers, those it met: an identity that heartbeats and never joins
            # (a staller) advertises no state, and would hold every peer here END_WAIT_S.
            live = {str(p) for p in await state.peer.live.addresses()} & state.met - {me}
            final = {a.owner: a.state_hash for a in await state.adverts() if a.round >= age}
            if live <= final.keys():
                if set(final.values()) <= {state.last_hash}:
                    return True
                if await state.catch_up():
                    log.info("the run's end: took the state most of its peers hold")
                    await took()
            await trio.sleep(LONE_POLL_S)
    log.warning("the run's end: its peers did not all advertise one state within %ss", END_WAIT_S)
    return False


__all__ = ["END_WAIT_S", "leave_on_one_state"]
