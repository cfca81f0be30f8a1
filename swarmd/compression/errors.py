"""The one exception every codec raises for bad input.

Receivers decode bytes from untrusted peers; a single exception type (a ValueError, so
generic validation code keeps working) lets the network layer ban a peer on any codec
failure without catching a zoo of torch/zstd/struct errors.
"""

from __future__ import annotations


class CompressionError(ValueError):
    """Malformed, inconsistent, oversized or non-finite data given to a codec."""
