"""Exceptions of the wire layer; each carries a message meant for a human reading a log."""

from __future__ import annotations


class ProtocolError(ValueError):
    """Something received from the network is malformed; the caller refuses it."""


class FramingError(ProtocolError):
    """A tensor header, frame or stream does not describe a valid, acceptable tensor."""


class AuthError(ProtocolError):
    """A request's signed header is missing, forged, replayed or from a skewed clock."""


class MalformedHeader(AuthError):
    """A signed header field that does not even parse (a 400-digit timestamp): the request is
    malformed (INVALID_ARGUMENT) before it is unauthenticated."""


class IdentityError(Exception):
    """The local identity key cannot be created or loaded safely."""


class ListenError(OSError):
    """This peer cannot listen where it was told to (the port is taken, the host not local)."""
