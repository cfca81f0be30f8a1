"""The shared state's timings (sharedstate.py, runend.py): part of node/timing.py's profile."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StateTimings:
    #: How long a state advert lives in the DHT without a newer round refreshing it.
    advert_ttl_s: float = 120.0
    #: The whole download of a group's state, from every donor together.
    sync_deadline_s: float = 120.0
    #: How long a peer whose last round was its own waits for the other live peers' adverts
    #: of that round before it decides whose state to follow (`SharedState._await_adverts_of`),
    #: and how often it looks.
    lone_wait_s: float = 10.0
    lone_poll_s: float = 0.2
    #: Longest a peer at the run's end waits for the others to end on its state (runend.py):
    #: a sat-out peer's last round waits up to `lone_wait_s` for the roster's adverts before
    #: it settles, and a peer that then takes the majority's state downloads it from peers
    #: that must still be there.
    end_wait_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("advert_ttl_s", "sync_deadline_s", "lone_wait_s", "lone_poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"StateTimings.{name} must be positive")
        if not self.lone_poll_s < self.lone_wait_s < self.end_wait_s:
            raise ValueError(
                "need lone_poll_s < lone_wait_s < end_wait_s: a peer at the run's end waits "
                "for peers that may still be waiting lone_wait_s for the last round's adverts "
                f"(got {self.lone_poll_s}, {self.lone_wait_s}, {self.end_wait_s})"
            )
