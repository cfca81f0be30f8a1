"""What every `swarmd` sub-command shares: exit codes, the one-line error, option types.

The types raise `argparse.ArgumentTypeError` with a readable reason, so a bad value reads the
same whether it came from the command line or from a TOML / SWARMD_* overlay (overlay.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from swarmd.protocol.address import Address, parse_address
from swarmd.protocol.identity import PeerId
from swarmd.protocol.rpc import RateLimits

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3


class CliError(Exception):
    """A failure to report as one line, with an exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.code = code


def default_state_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "swarmd"


def usage(parser: argparse.ArgumentParser) -> int:
    """A command group run without its action: the help, as a usage error."""
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def address(text: str) -> Address:
    try:
        return parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def listen_address(text: str) -> Address:
    try:
        return parse_address(text, allow_port_zero=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def address_list(text: str) -> tuple[str, ...]:
    """Comma-separated HOST:PORTs, each checked now but kept as text for the daemon."""
    items = [t for t in (part.strip() for part in text.split(",")) if t]
    for item in items:
        address(item)
    return tuple(items)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def rate(text: str) -> tuple[float, float]:
    """RATE/BURST (requests per second, and how many at once): "200/1000"; RATE alone
    allows a burst of five seconds' worth."""
    head, _, tail = text.partition("/")
    try:
        value = float(head)
        burst = float(tail) if tail else 5 * value
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not RATE or RATE/BURST") from None
    if not (value >= 1 and burst >= 1):
        raise argparse.ArgumentTypeError(f"rate and burst must be >= 1, got {text!r}")
    return value, burst


def add_rate_limits(p: argparse.ArgumentParser) -> None:
    d = RateLimits()
    p.add_argument(
        "--peer-rate-limit",
        type=rate,
        default=(d.per_peer_rate, d.per_peer_burst),
        metavar="RATE/BURST",
        help="requests per second this peer answers from one peer id, and the burst "
        f"(default: {d.per_peer_rate:g}/{d.per_peer_burst:g}); beyond it RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--address-rate-limit",
        type=rate,
        default=(d.per_address_rate, d.per_address_burst),
        metavar="RATE/BURST",
        help="the same per source address, all its peer ids together "
        f"(default: {d.per_address_rate:g}/{d.per_address_burst:g})",
    )


def rate_limits(args: argparse.Namespace) -> RateLimits:
    """The --peer-rate-limit and --address-rate-limit pair, checked together."""
    (peer, peer_burst), (addr, addr_burst) = args.peer_rate_limit, args.address_rate_limit
    try:
        return RateLimits(
            per_peer_rate=peer,
            per_peer_burst=peer_burst,
            per_address_rate=addr,
            per_address_burst=addr_burst,
        )
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


def add_state_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state-dir",
        type=Path,
        default=default_state_dir(),
        help="directory for this peer's identity key, state and logs "
        "(default: %(default)s; env SWARMD_STATE_DIR)",
    )


def add_listen(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--listen",
        type=listen_address,
        default=Address("127.0.0.1", 0),
        help="HOST:PORT to listen on; port 0 lets the OS choose (default: 127.0.0.1:0)",
    )


def add_metrics(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics",
        type=listen_address,
        default=None,
        help="serve Prometheus metrics on HOST:PORT",
    )


def peer_id(text: str) -> PeerId:
    try:
        return PeerId.from_string(text.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
