"""Turning a trio run's nested exception groups back into the one error a user should see."""

from __future__ import annotations


def innermost(exc: BaseException) -> BaseException:
    """The single error inside nested nursery groups (the group itself if there are several)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
