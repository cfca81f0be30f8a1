"""User-space fault injection for the transport: latency, loss, bandwidth, partitions, clock skew.

The kernel here has no ``netem``, and a chaos test must still see slow, lossy, partitioned and
badly-clocked peers. So the transport (rpc.py) asks this module, at a few points, what to do to
the call at hand. A peer's faults come from a JSON file named by the environment variable
``SWARMD_FAULTS``; a chaos harness rewrites that file (atomically: temp file + rename) and the
peer notices within ~0.2 s, without a restart and without any control RPC (which a partition
would cut). Without the variable, ``from_env()`` returns None and rpc.py pays one ``is None``
check per call.

The file holds one object, every key optional::

    {"latency_ms": 50, "jitter_ms": 10, "loss": 0.05, "bandwidth_bytes_s": 1000000,
     "isolated": false, "blocked": ["127.0.0.1:7001"], "clock_skew_s": 12.5}

What each one does (see rpc.py for where it is consulted):

- latency/jitter: every outgoing call waits latency ± jitter (uniform) before it is sent.
- loss: an outgoing call fails with UNAVAILABLE with this probability (a lost connection;
  gRPC retries nothing for us, so this is what a lossy path looks like to the caller).
- bandwidth: bytes this peer sends (request bodies, tensor-stream frames both ways) are paced
  to this many bytes per second, shared by all calls, like one uplink.
- blocked: outgoing calls to these addresses ("host:port", or a bare host: every port of it)
  fail with UNAVAILABLE; a harness blocks both directions of a partition by writing each
  side's file (peers on distinct 127.0.0.x hosts keep their block across restarts).
- isolated: every outgoing call fails and every incoming call is refused: a host off the net.
- clock_skew_s: this peer's wall clock is off by this much: its signed request timestamps and
  its replay guard's idea of "now" both move, so the receivers' skew bound is exercised.
- step_delay_s: each of this peer's inner training steps takes this much longer, a slower GPU
  (volunteers' speeds differ several times over; peers on one test machine do not). The
  training loop (algorithms/loop.py) reads it, not the transport.
- round_overrun_s: each of this peer's SWARM stage rounds takes this much longer, a device
  busy past its period (under load a server's round overruns, and it meets its stage a
  boundary late). The stage server (algorithms/swarm/server_role.py) reads it.

This module imports no grpc: it decides, rpc.py enforces.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

log = logging.getLogger("swarmd.faults")

ENV_VAR = "SWARMD_FAULTS"
#: How often the plan file is stat()ed at most: cheap enough per call, quick enough for chaos.
RELOAD_INTERVAL_S = 0.2

_KEYS = {
    "latency_ms",
    "jitter_ms",
    "loss",
    "bandwidth_bytes_s",
    "isolated",
    "blocked",
    "clock_skew_s",
    "step_delay_s",
    "round_overrun_s",
}


class FaultPlanError(ValueError):
    """A fault plan file is malformed; the message names the field."""


@dataclass(frozen=True)
class FaultPlan:
    """The faults one peer suffers right now. The default plan is a healthy network."""

    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    #: Bytes per second this peer may send; None for unlimited.
    bandwidth_bytes_s: float | None = None
    isolated: bool = False
    #: Addresses ("host:port", or a bare host for all its ports) this peer cannot reach.
    blocked: frozenset[str] = field(default_factory=frozenset)
    clock_skew_s: float = 0.0
    step_delay_s: float = 0.0
    round_overrun_s: float = 0.0

    def __post_init__(self) -> None:
        delays = ("step_delay_s", "round_overrun_s")
        for name in ("latency_ms", "jitter_ms", "clock_skew_s", "loss", *delays):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise FaultPlanError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise FaultPlanError(f"{name} must be finite, got {value!r}")
        for name in ("latency_ms", "jitter_ms", *delays):
            if getattr(self, name) < 0:
                raise FaultPlanError(f"{name} must be >= 0")
        if self.jitter_ms > self.latency_ms:
            raise FaultPlanError("jitter_ms must not exceed latency_ms (no negative delays)")
        if not 0.0 <= self.loss <= 1.0:
            raise FaultPlanError(f"loss is a probability in [0, 1], got {self.loss}")
        bw = self.bandwidth_bytes_s
        if bw is not None and (
            isinstance(bw, bool) or not isinstance(bw, int | float) or not bw > 0
        ):
            raise FaultPlanError(f"bandwidth_bytes_s must be a positive number, got {bw!r}")
        if not isinstance(self.isolated, bool):
            raise FaultPlanError(f"isolated must be true or false, got {self.isolated!r}")
        if not isinstance(self.blocked, frozenset) or not all(
            isinstance(a, str) and a for a in self.blocked
        ):
            raise FaultPlanError("blocked must be a set of 'host:port' strings")

    @classmethod
    def from_dict(cls, data: Any) -> FaultPlan:
        if not isinstance(data, dict):
            raise FaultPlanError("a fault plan is a JSON object")
        unknown = set(data) - _KEYS
        if unknown:
            raise FaultPlanError(f"unknown fault plan keys: {sorted(unknown)}")
        blocked = data.get("blocked", [])
        if not isinstance(blocked, list):
            raise FaultPlanError("blocked must be a list of 'host:port' strings")
        fields = {k: v for k, v in data.items() if k != "blocked"}
        try:
            return cls(blocked=frozenset(blocked), **fields)
        except TypeError as exc:  # e.g. an unhashable entry in blocked
            raise FaultPlanError(str(exc)) from None

    @classmethod
    def from_json(cls, text: str | bytes) -> FaultPlan:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise FaultPlanError(f"fault plan is not JSON: {exc}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """The non-default fields only, so a written plan reads as the faults it holds."""
        out: dict[str, Any] = {}
        default = FaultPlan()
        for name in _KEYS:
            value = getattr(self, name)
            if value != getattr(default, name):
                out[name] = sorted(value) if name == "blocked" else value
        return out

    def write(self, path: Path) -> None:
        """Atomically replaces ``path`` (a reader sees the old plan or the new, never half)."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), sort_keys=True))
        os.replace(tmp, path)

    @property
    def healthy(self) -> bool:
        return self == FaultPlan()


class FaultInjector:
    """The live plan of one process, re-read from its file when the file changes.

    Thread-safe: the trio thread (outgoing calls) and gRPC's threads (incoming calls, stream
    frames) all consult it.
    """

    def __init__(
        self,
        path: Path,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._rng = rng or random.Random()
        self._clock = clock
        self._lock = threading.Lock()
        self._plan = FaultPlan()
        self._stamp: tuple[int, int, int] | None = None
        self._checked = -math.inf
        #: Pacing of sent bytes: the monotonic time at which the "uplink" is free again.
        self._free_at = 0.0

    # -- the plan ----------------------------------------------------------------------------

    def plan(self) -> FaultPlan:
        """The current plan; stat()s the file at most every RELOAD_INTERVAL_S."""
        now = self._clock()
        if now - self._checked < RELOAD_INTERVAL_S:
            return self._plan
        with self._lock:
            if now - self._checked < RELOAD_INTERVAL_S:
                return self._plan
            self._checked = now
            self._reload()
            return self._plan

    def _reload(self) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._stamp, self._plan = None, FaultPlan()
            return
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        try:
            plan = FaultPlan.from_json(self.path.read_bytes())
        except (OSError, FaultPlanError) as exc:
            # Keep the last good plan: a half-written file (a careless writer) must not heal
            # a partition for a moment.
            log.warning("ignoring fault plan %s: %s", self.path, exc)
            return
        self._stamp = stamp
        if plan != self._plan:
            log.info("fault plan now %s", json.dumps(plan.to_dict(), sort_keys=True))
        self._plan = plan

    # -- what rpc.py asks ----------------------------------------------------------------------

    async def outgoing(self, address: str, nbytes: int = 0) -> str | None:
        """Before an outgoing call to ``address``: waits the injected latency and the pacing of
        ``nbytes``, and returns why the call must fail (UNAVAILABLE), or None to let it go."""
        plan = self.plan()
        if plan.isolated:
            return "fault injection: this peer is isolated from the network"
        if plan.blocked and (address in plan.blocked or address.rpartition(":")[0] in plan.blocked):
            return f"fault injection: {address} is partitioned from this peer"
        if plan.loss and self._rng.random() < plan.loss:
            return "fault injection: connection lost"
        delay = 0.0
        if plan.latency_ms:
            jitter = self._rng.uniform(-plan.jitter_ms, plan.jitter_ms) if plan.jitter_ms else 0.0
            delay += (plan.latency_ms + jitter) / 1000.0
        if nbytes and plan.bandwidth_bytes_s is not None:
            delay += self._reserve(nbytes, plan.bandwidth_bytes_s)
        if delay > 0:
            await trio.sleep(delay)
        return None

    def incoming(self) -> str | None:
        """For an incoming call (gRPC thread): why to refuse it (UNAVAILABLE), or None."""
        if self.plan().isolated:
            return "fault injection: this peer is isolated from the network"
        return None

    def pace(self, nbytes: int) -> None:
        """Blocks the calling (gRPC) thread until ``nbytes`` more may be sent."""
        bw = self.plan().bandwidth_bytes_s
        if bw is not None:
            delay = self._reserve(nbytes, bw)
            if delay > 0:
                time.sleep(delay)

    async def pace_async(self, nbytes: int) -> None:
        """``pace`` for a sender in the trio thread (the bulk data plane): sleeps, not blocks."""
        bw = self.plan().bandwidth_bytes_s
        if bw is not None:
            delay = self._reserve(nbytes, bw)
            if delay > 0:
                await trio.sleep(delay)

    def _reserve(self, nbytes: int, bytes_per_s: float) -> float:
        """Books ``nbytes`` on the shared uplink; returns how long the caller must wait."""
        with self._lock:
            now = self._clock()
            start = max(now, self._free_at)
            self._free_at = start + nbytes / bytes_per_s
            return self._free_at - now

    def wall_clock(self) -> float:
        """``time.time()`` as this (possibly skewed) peer sees it."""
        return time.time() + self.plan().clock_skew_s


_injectors: dict[str, FaultInjector] = {}
_injectors_lock = threading.Lock()


def from_env() -> FaultInjector | None:
    """The process's injector if ``SWARMD_FAULTS`` names a plan file, else None (no faults).

    One injector per file and process, so a peer's client and server share one uplink budget.
    """
    path = os.environ.get(ENV_VAR)
    if not path:
        return None
    with _injectors_lock:
        injector = _injectors.get(path)
        if injector is None:
            injector = _injectors[path] = FaultInjector(Path(path))
        return injector
