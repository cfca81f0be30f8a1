"""The check every timing dataclass shares: each field a number of seconds, more than zero
and less than a day (a zero wait spins, a negative one never ends a loop, and a day-long
one is a unit mistake)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

#: Longest any protocol timing may be.
MAX_SECONDS = 86400.0


def check_seconds(timings: Any, what: str) -> None:
    """Raises ValueError naming the first field of the dataclass ``timings`` outside
    (0, MAX_SECONDS); ``what`` says whose timing it is ("swarm timing")."""
    for f in fields(timings):
        value = getattr(timings, f.name)
        if not 0 < value < MAX_SECONDS:
            raise ValueError(f"{what} {f.name} must be in (0, {MAX_SECONDS:g}) s, got {value}")
