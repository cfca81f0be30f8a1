"""One simulated machine (sim/network.py's hosts): who it is, what it serves, its links,
whether it is up, listening or paused, and which host's code is running now."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import trio

from swarmd.protocol import rpc
from swarmd.protocol.identity import Identity, ReplayGuard


@dataclass
class Host:
    """One simulated machine: who it is, what it serves, whether it is up."""

    address: str
    identity: Identity
    guard: ReplayGuard
    methods: dict[str, rpc.Method] = field(default_factory=dict)
    gates: dict[str, rpc.Gate] = field(default_factory=dict)
    up: bool = True
    #: Its server answers; False once the peer's process has exited: calls are refused at
    #: once (a closed port), not left to their deadlines as a dead host's are.
    listening: bool = True
    #: Behind NAT: it can call out, nobody can call it.
    dialable: bool = True
    sent_bytes: int = 0
    received_bytes: int = 0
    up_bytes_s: float = 12.5e6
    down_bytes_s: float = 12.5e6
    #: When the uplink and downlink are next free (virtual time).
    up_free: float = 0.0
    down_free: float = 0.0
    #: How far this host's wall clock is off (NetworkConfig.clock_skew_s).
    skew_s: float = 0.0
    #: Its log records of WARNING and above (sim/peers.py's PeerLogs), with virtual times.
    logs: list[str] = field(default_factory=list)
    #: Its server's rate limits, on virtual time.
    limiter: rpc.RateLimiter = field(
        default_factory=lambda: rpc.RateLimiter(rpc.RateLimits(), clock=trio.current_time)
    )
    #: Set while the host is paused (`SimNetwork.pause`, as SIGSTOP): its calls out, the
    #: answers to them, its handlers and its peer's compute wait in `unpaused`.
    resume: trio.Event | None = None

    async def unpaused(self) -> None:
        """Returns once the host is not paused (at once if it is not)."""
        while self.resume is not None:
            await self.resume.wait()


#: The host whose code is running: a peer's own tasks run on its host, and a handler runs on
#: the callee's host although the caller's task runs it (one process, no threads), so that
#: what it logs, and a lie a scenario gives one host, are that host's.
current_host: contextvars.ContextVar[Host | None] = contextvars.ContextVar("sim_host", default=None)


@contextlib.contextmanager
def on_host(host: Host) -> Iterator[None]:
    token = current_host.set(host)
    try:
        yield
    finally:
        current_host.reset(token)
