"""`swarmd sim SCENARIO.toml`: a scenario file, its invariants, and seed sweeps.

A scenario is a TOML table named like DhtScenario's fields, plus ``kind`` and a ``[network]``
table (NetworkConfig's fields, RTTs in milliseconds) and an ``[invariants]`` table. A sweep
runs seeds S, S+1, ..., S+K-1 and hands back each failing seed with the invariant it broke:
`swarmd sim FILE --seed N` then replays that run exactly (TigerBeetle's VOPR does the same
for its cluster).

Only ``kind = "dht"`` is simulated so far; training scenarios (DiLoCo groups, SWARM) need
the tensor plane and the training peers on the simulated network.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmd.node.sim.dht import DhtReport, DhtScenario, run_dht
from swarmd.node.sim.network import NetworkConfig

KINDS = ("dht",)


class ScenarioError(ValueError):
    """A scenario file that cannot be run; the message says which key and why."""


@dataclass(frozen=True)
class Invariants:
    """What every run of a DHT scenario must show, whatever its seed."""

    min_success: float = 0.99
    max_median_hops: float = 4.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_success <= 1:
            raise ValueError("invariants.min_success is a share between 0 and 1")
        if not self.max_median_hops >= 1:
            raise ValueError("invariants.max_median_hops must be at least 1")

    def broken(self, report: DhtReport) -> list[str]:
        """Each invariant the run broke, as a sentence; empty when it kept them all."""
        out = []
        if report.success < self.min_success:
            out.append(
                f"success {report.success:.4f} < {self.min_success} "
                f"({report.gets - report.found} of {report.gets} gets failed)"
            )
        if not report.median_hops <= self.max_median_hops:
            out.append(f"median hops {report.median_hops:g} > {self.max_median_hops:g}")
        return out


@dataclass(frozen=True)
class Scenario:
    dht: DhtScenario
    invariants: Invariants


def _build(cls: type[Any], table: dict[str, Any], where: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - names)
    if unknown:
        raise ScenarioError(f"{where}: unknown key(s) {', '.join(unknown)}")
    try:
        return cls(**table)
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"{where}: {exc}") from None


def load_scenario(path: Path | None) -> Scenario:
    """The scenario in ``path`` (None: the built-in default, a 1,000-node DHT)."""
    if path is None:
        return Scenario(DhtScenario(), Invariants())
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ScenarioError(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path} is not valid TOML: {exc}") from None
    kind = data.pop("kind", "dht")
    if kind not in KINDS:
        raise ScenarioError(
            f"{path}: kind {kind!r} is not simulated yet (have: {', '.join(KINDS)})"
        )
    network = dict(data.pop("network", {}))
    for ms in ("rtt_min_ms", "rtt_max_ms"):
        if ms in network:
            network[ms.replace("_ms", "_s")] = network.pop(ms) / 1000
    invariants = _build(Invariants, data.pop("invariants", {}), f"{path} [invariants]")
    data["network"] = _build(NetworkConfig, network, f"{path} [network]")
    return Scenario(_build(DhtScenario, data, str(path)), invariants)


def sweep(
    scenario: Scenario, first_seed: int, count: int, progress: Callable[[str], None] | None = None
) -> Iterator[tuple[int, DhtReport, list[str]]]:
    """Runs seeds first_seed .. first_seed+count-1; yields each with its report and what broke."""
    for seed in range(first_seed, first_seed + count):
        report = run_dht(dataclasses.replace(scenario.dht, seed=seed), progress)
        yield seed, report, scenario.invariants.broken(report)
