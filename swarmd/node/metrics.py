"""Prometheus metrics of one daemon, on its own registry (never the process-global one).

Label sets are bounded: methods and status codes, never peer ids, so a churning swarm cannot
blow up the time-series count.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest

import swarmd

# `*_created` series double the output and no dashboard of ours reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass(frozen=True)
class TrainingFigures:
    """A training peer's figures at one scrape (TrainStats.figures makes them)."""

    step: int = 0
    round: int = 0
    loss: float = float("nan")
    val_loss: float = float("nan")
    group_size: int = 0
    tokens: int = 0
    wait_s: float = 0.0
    outcomes: Mapping[str, int] = field(default_factory=dict)


class _TrainingCollector:
    """Reads the trainer's figures when Prometheus scrapes, so the training loop updates
    nothing of Prometheus's (it already keeps TrainStats for its progress line)."""

    def __init__(self, read: Callable[[], TrainingFigures]) -> None:
        self.read = read

    def describe(self) -> Iterator[Any]:
        return self._families(TrainingFigures())

    def collect(self) -> Iterator[Any]:
        return self._families(self.read())

    @staticmethod
    def _families(f: TrainingFigures) -> Iterator[Any]:
        gauges = (
            ("step", "Inner steps this peer has taken", f.step),
            ("outer_round", "The outer round this peer reached", f.round),
            ("loss", "Training loss of the last inner step (NaN before the first)", f.loss),
            ("validation_loss", "Validation loss after the last outer round", f.val_loss),
            ("group_size", "Peers in the last outer round's group (1: alone)", f.group_size),
        )
        for name, text, value in gauges:
            yield GaugeMetricFamily(f"swarmd_training_{name}", text, value=value)
        yield CounterMetricFamily(
            "swarmd_training_tokens", "Tokens this peer trained on", value=f.tokens
        )
        yield CounterMetricFamily(
            "swarmd_training_network_wait_seconds",
            "Seconds the trainer waited for the network (matchmaking, averaging, state sync)",
            value=f.wait_s,
        )
        rounds = CounterMetricFamily(
            "swarmd_training_outer_rounds",
            "Outer rounds (or streaming fragment rounds) finished, by outcome",
            labels=["outcome"],
        )
        for outcome, count in sorted(f.outcomes.items()):
            rounds.add_metric([outcome], count)
        yield rounds


class Metrics:
    """The daemon's metrics; also the transport's RpcObserver."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.build_info = Gauge(
            "swarmd_build_info", "swarmd version (always 1)", ["version"], registry=self.registry
        )
        self.build_info.labels(version=swarmd.__version__).set(1)
        #: Plain totals of the byte counters, for progress lines (no registry round trip).
        self.sent_total = 0
        self.received_total = 0
        #: Bytes sent by RPC method path (both ends' share: requests we made, answers we
        #: served), so a benchmark can say where the bytes beyond the payload went.
        self.sent_by_method: dict[str, int] = {}
        self.rpc_requests = Counter(
            "swarmd_rpc_requests",
            "RPCs served by this peer, by method and gRPC status code",
            ["method", "code"],
            registry=self.registry,
        )
        self.rpc_limited = Counter(
            "swarmd_rpc_rate_limited",
            "Calls refused RESOURCE_EXHAUSTED by a rate limit, by the key that ran dry",
            ["scope"],
            registry=self.registry,
        )
        self.rpc_duration = Histogram(
            "swarmd_rpc_duration_seconds",
            "Time to serve one RPC, including reading its request stream",
            ["method"],
            buckets=_DURATION_BUCKETS,
            registry=self.registry,
        )
        self.sent_bytes = Counter(
            "swarmd_sent_bytes",
            "Bytes sent over RPCs (bodies, tensor frames, signed headers), by method",
            ["method"],
            registry=self.registry,
        )
        self.received_bytes = Counter(
            "swarmd_received_bytes",
            "Bytes received over RPCs (bodies and tensor frames), by method",
            ["method"],
            registry=self.registry,
        )

        self.averaging_rounds = Counter(
            "swarmd_averaging_rounds",
            "All-reduce rounds by outcome: ok, degraded (peers dropped), failed (parts kept local)",
            ["outcome"],
            registry=self.registry,
        )
        self.averaging_duration = Histogram(
            "swarmd_averaging_round_duration_seconds",
            "Wall time of one all-reduce round, matchmaking excluded",
            buckets=_DURATION_BUCKETS,
            registry=self.registry,
        )
        self.averaging_dropped = Counter(
            "swarmd_averaging_peers_dropped",
            "Members left out of a round's average (died, stalled or sent bad data)",
            registry=self.registry,
        )
        self.averaging_bytes = Counter(
            "swarmd_averaging_bytes",
            "All-reduce payload bytes by direction and codec",
            ["direction", "codec"],
            registry=self.registry,
        )

        self.bans = Counter(
            "swarmd_peer_bans",
            "Peers this one banned, by what they sent (bans.py: never for a network fault)",
            ["offence"],
            registry=self.registry,
        )
        self.banned_peers = Gauge(
            "swarmd_banned_peers", "Peers this one refuses right now", registry=self.registry
        )

        self._add_gather_metrics()
        self._add_swarm_metrics()

    def on_ban(self, offence: str) -> None:
        self.bans.labels(offence=offence).inc()

    def watch_bans(self, active: Callable[[], int]) -> None:
        self.banned_peers.set_function(active)

    def _add_swarm_metrics(self) -> None:
        self.stage_recoveries = Counter(
            "swarmd_stage_recoveries",
            "SWARM stages this peer rebuilt after every server of them was lost, by method",
            ["method"],
            registry=self.registry,
        )

    def _add_gather_metrics(self) -> None:
        """DeMo's exchange (algorithms/demo/gather.py): steps by outcome, their time, drops."""
        self.gather_steps = Counter(
            "swarmd_gather_steps",
            "DeMo exchange steps by outcome: complete (every member heard), late (some not)",
            ["outcome"],
            registry=self.registry,
        )
        self.gather_duration = Histogram(
            "swarmd_gather_step_duration_seconds",
            "Wall time of one DeMo exchange step, until every member was heard or the deadline",
            buckets=_DURATION_BUCKETS,
            registry=self.registry,
        )
        self.gather_dropped = Counter(
            "swarmd_gather_members_dropped",
            "Members dropped from a DeMo group (late twice running, or they dropped us)",
            registry=self.registry,
        )

    def on_gather(self, late: int, duration_s: float, dropped: int) -> None:
        self.gather_steps.labels(outcome="late" if late else "complete").inc()
        self.gather_duration.observe(duration_s)
        if dropped:
            self.gather_dropped.inc(dropped)

    def watch_training(self, read: Callable[[], TrainingFigures]) -> None:
        """Exports a training peer's figures (swarmd_training_*), read at each scrape."""
        self.registry.register(_TrainingCollector(read))

    def on_round(self, outcome: str, duration_s: float, dropped: int) -> None:
        self.averaging_rounds.labels(outcome=outcome).inc()
        self.averaging_duration.observe(duration_s)
        if dropped:
            self.averaging_dropped.inc(dropped)

    def on_averaging_bytes(self, direction: str, codec: str, nbytes: int) -> None:
        self.averaging_bytes.labels(direction=direction, codec=codec).inc(nbytes)

    def on_served(self, method: str, code: str, duration_s: float) -> None:
        self.rpc_requests.labels(method=method, code=code).inc()
        self.rpc_duration.labels(method=method).observe(duration_s)

    def on_limited(self, scope: str) -> None:
        self.rpc_limited.labels(scope=scope).inc()

    def on_bytes(self, method: str, sent: int, received: int) -> None:
        self.sent_total += sent
        self.received_total += received
        if sent:
            self.sent_by_method[method] = self.sent_by_method.get(method, 0) + sent
            self.sent_bytes.labels(method=method).inc(sent)
        if received:
            self.received_bytes.labels(method=method).inc(received)

    def sent_since(self, before: dict[str, int]) -> dict[str, int]:
        """Bytes sent by method (its last path component) since ``before`` (a copy of
        `sent_by_method`), methods with none left out."""
        out: dict[str, int] = {}
        for method, total in self.sent_by_method.items():
            delta = total - before.get(method, 0)
            if delta:
                name = method.rsplit("/", 1)[-1]
                out[name] = out.get(name, 0) + delta
        return out

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))


class MetricsServer:
    """The HTTP endpoint for Prometheus; runs on its own thread, like prometheus-client's."""

    def __init__(self, metrics: Metrics, host: str, port: int) -> None:
        self._server: WSGIServer
        self._thread: threading.Thread
        self._server, self._thread = start_http_server(port, addr=host, registry=metrics.registry)
        self.port: int = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
