"""Client-mode members (issue 27): peers nobody can dial, which announce an address where
nothing listens, so that any call made to them fails."""

from __future__ import annotations

#: Nothing listens on port 1 of loopback: a dial there is refused at once.
UNREACHABLE = "127.0.0.1:1"
