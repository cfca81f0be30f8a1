"""`swarmd sim SCENARIO.toml`: scenario files, their invariants, and seed sweeps.

A scenario file names its ``kind`` and sets that kind's fields (DhtScenario's or
MatchScenario's) at top level, with tables for the parts: ``[network]`` (NetworkConfig, RTTs
in milliseconds), ``[matchmaking]`` (MatchmakingConfig) and ``[invariants]``. A sweep runs
seeds S, S+1, ..., S+K-1 and hands back each failing seed with the invariant it broke:
`swarmd sim FILE --seed N` then replays that run exactly (TigerBeetle's VOPR does the same
for its cluster).

Kinds so far: ``dht`` (store, kill, read), ``matchmaking`` (rounds of group formation),
``diloco`` (DiLoCo on a synthetic quadratic: inner steps charged as virtual time, group
formation, the real all-reduce and outer step each round, churn, stallers, liars) and
``swarm`` (SWARM pipelines: the real trainer routing and server rebalancing against modelled
stage servers, with preemption; a ``[swarm]`` table sets SwarmConfig) and ``peers`` (real
`swarmd join` peers with the run's real model: the whole lifecycle, state sync and catch-up,
with kills, leaves, joins, cuts and heals at virtual times; a ``[run]`` table is the run
config).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmd.node.algorithms.swarm.config import SwarmConfig
from swarmd.node.averaging.matchmaking import MatchmakingConfig
from swarmd.node.sim.dht import DhtScenario, run_dht
from swarmd.node.sim.matchmaking import MatchScenario, run_matchmaking
from swarmd.node.sim.network import NetworkConfig
from swarmd.node.sim.peer_run import PeerChurn, PeersReport, PeersScenario, run_peers
from swarmd.node.sim.rounds import RoundsReport, RoundsScenario, run_rounds
from swarmd.node.sim.swarm import run_swarm
from swarmd.node.sim.swarm_spec import SwarmReport, SwarmScenario

KINDS = ("dht", "matchmaking", "diloco", "swarm", "peers")

Progress = Callable[[str], None]


class ScenarioError(ValueError):
    """A scenario file that cannot be run; the message says which key and why."""


@dataclass(frozen=True)
class DhtInvariants:
    """What every run of a DHT scenario must show, whatever its seed."""

    min_success: float = 0.99
    max_median_hops: float = 4.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_success <= 1:
            raise ValueError("invariants.min_success is a share between 0 and 1")
        if not self.max_median_hops >= 1:
            raise ValueError("invariants.max_median_hops must be at least 1")


@dataclass(frozen=True)
class MatchInvariants:
    """What every run of a matchmaking scenario must show. ``max_alone_share``: the largest
    share of peers, averaged over rounds, that may get no group (1.0: not checked)."""

    max_alone_share: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.max_alone_share <= 1:
            raise ValueError("invariants.max_alone_share is a share between 0 and 1")


@dataclass(frozen=True)
class RoundsInvariants:
    """What every run of a diloco scenario must show: at least ``min_averaged_share`` of the
    peer-rounds averaged in a group of two or more; the honest states' spread after the last
    round at most ``max_spread`` (relative RMS; 0: one state line); their loss at most
    ``max_loss_ratio`` times that of one group of everybody (inf: not checked)."""

    min_averaged_share: float = 0.0
    max_spread: float = math.inf
    max_loss_ratio: float = math.inf

    def __post_init__(self) -> None:
        if not 0 <= self.min_averaged_share <= 1:
            raise ValueError("invariants.min_averaged_share is a share between 0 and 1")
        if not (self.max_spread >= 0 and self.max_loss_ratio >= 1):
            raise ValueError("invariants.max_spread >= 0 and max_loss_ratio >= 1 are required")


@dataclass(frozen=True)
class SwarmInvariants:
    """What every run of a swarm scenario must show: at least ``min_efficiency`` of the ideal
    pipeline throughput, and at most ``max_failed`` micro-batches given up."""

    min_efficiency: float = 0.0
    max_failed: int = 1 << 62
    #: The most measured micro-batches a liar may have answered a call of.
    max_poisoned: int = 1 << 62

    def __post_init__(self) -> None:
        if not 0 <= self.min_efficiency <= 1:
            raise ValueError("invariants.min_efficiency is a share between 0 and 1")
        if self.max_failed < 0 or self.max_poisoned < 0:
            raise ValueError("invariants.max_failed and max_poisoned must be >= 0")


@dataclass(frozen=True)
class PeersInvariants:
    """What every run of a peers scenario must show: the living peers hold one state at the
    last round all of them reached (``one_state``), at least ``min_averaged_share`` of the
    outer steps were averaged in a group, and no peer's lifecycle raised."""

    one_state: bool = True
    min_averaged_share: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_averaged_share <= 1:
            raise ValueError("invariants.min_averaged_share is a share between 0 and 1")


@dataclass(frozen=True)
class Outcome:
    """One seed's run: a line for people, figures for the last line, what broke."""

    seed: int
    summary: str
    figures: dict[str, str]
    log_hash: str
    broken: list[str]
    row: dict[str, Any]


@dataclass(frozen=True)
class Scenario:
    spec: DhtScenario | MatchScenario | RoundsScenario | SwarmScenario | PeersScenario
    invariants: (
        DhtInvariants | MatchInvariants | RoundsInvariants | SwarmInvariants | PeersInvariants
    )

    def run(self, seed: int, progress: Progress | None = None) -> Outcome:
        spec = dataclasses.replace(self.spec, seed=seed)
        if isinstance(spec, DhtScenario):
            assert isinstance(self.invariants, DhtInvariants)
            return _dht_outcome(spec, self.invariants, progress)
        if isinstance(spec, RoundsScenario):
            assert isinstance(self.invariants, RoundsInvariants)
            return _rounds_outcome(spec, self.invariants, progress)
        if isinstance(spec, SwarmScenario):
            assert isinstance(self.invariants, SwarmInvariants)
            return _swarm_outcome(spec, self.invariants, progress)
        if isinstance(spec, PeersScenario):
            assert isinstance(self.invariants, PeersInvariants)
            return _peers_outcome(spec, self.invariants, progress)
        assert isinstance(self.invariants, MatchInvariants)
        return _match_outcome(spec, self.invariants, progress)


def _dht_outcome(spec: DhtScenario, rules: DhtInvariants, progress: Progress | None) -> Outcome:
    r = run_dht(spec, progress)
    broken = []
    if r.success < rules.min_success:
        broken.append(
            f"success {r.success:.4f} < {rules.min_success} ({r.gets - r.found} of {r.gets} "
            "gets failed)"
        )
    if not r.median_hops <= rules.max_median_hops:
        broken.append(f"median hops {r.median_hops:g} > {rules.max_median_hops:g}")
    summary = (
        f"{r.found}/{r.gets} gets found, median hops {r.median_hops:g}, p90 {r.p90_hops:g}, "
        f"{r.calls} calls, {r.virtual_s:.0f}s virtual in {r.wall_s:.1f}s"
    )
    figures = {"dht_success": f"{r.success:.4f}", "dht_median_hops": f"{r.median_hops:g}"}
    return Outcome(spec.seed, summary, figures, r.log_hash, broken, dataclasses.asdict(r))


def _match_outcome(
    spec: MatchScenario, rules: MatchInvariants, progress: Progress | None
) -> Outcome:
    r = run_matchmaking(spec, progress)
    broken = []
    inconsistent = sum(f.inconsistent for f in r.rounds)
    if inconsistent:
        broken.append(f"{inconsistent} peer(s) held a group record that disagrees with others")
    alone_share = r.mean_alone / r.peers
    if alone_share > rules.max_alone_share:
        broken.append(f"{alone_share:.1%} of peers alone a round > {rules.max_alone_share:.1%}")
    summary = (
        f"{r.peers} peers, target {spec.matchmaking.target_group_size}: "
        f"{r.mean_groups:.1f} groups and {r.mean_alone:.1f} peers alone a round, "
        f"{r.calls} calls, {r.virtual_s:.0f}s virtual in {r.wall_s:.1f}s"
    )
    figures = {
        "mm_groups": f"{r.mean_groups:.2f}",
        "mm_alone_share": f"{alone_share:.4f}",
        "mm_median_form_s": f"{max(f.median_form_s for f in r.rounds):.2f}",
    }
    return Outcome(spec.seed, summary, figures, r.log_hash, broken, dataclasses.asdict(r))


def _rounds_outcome(
    spec: RoundsScenario, rules: RoundsInvariants, progress: Progress | None
) -> Outcome:
    r = run_rounds(spec, progress)
    broken = []
    if r.averaged_share < rules.min_averaged_share:
        broken.append(
            f"{r.averaged_share:.1%} of peer-rounds averaged < {rules.min_averaged_share:.1%}"
        )
    if not r.spread <= rules.max_spread:
        broken.append(f"states spread {r.spread:.3g} apart > {rules.max_spread:g}")
    if not r.loss_ratio <= rules.max_loss_ratio:
        broken.append(f"loss {r.loss_ratio:.4f}x one group's > {rules.max_loss_ratio:g}x")
    row = {k: v for k, v in dataclasses.asdict(r).items() if k != "records"}
    return Outcome(spec.seed, rounds_summary(r), rounds_figures(r), r.log_hash, broken, row)


def _swarm_outcome(
    spec: SwarmScenario, rules: SwarmInvariants, progress: Progress | None
) -> Outcome:
    r = run_swarm(spec, progress)
    broken = []
    if not r.efficiency >= rules.min_efficiency:
        broken.append(f"efficiency {r.efficiency:.4f} < {rules.min_efficiency}")
    if r.failed > rules.max_failed:
        broken.append(f"{r.failed} micro-batches given up > {rules.max_failed}")
    if r.poisoned > rules.max_poisoned:
        broken.append(f"{r.poisoned} micro-batches answered by a liar > {rules.max_poisoned}")
    row = dataclasses.asdict(r) | {"efficiency": r.efficiency}
    return Outcome(spec.seed, swarm_summary(r), swarm_figures(r), r.log_hash, broken, row)


def _peers_outcome(
    spec: PeersScenario, rules: PeersInvariants, progress: Progress | None
) -> Outcome:
    r = run_peers(spec, progress)
    broken = [f"{name} raised {error}" for name, error in r.errors.items()]
    if rules.one_state and r.end_states != 1:
        broken.append(f"the living peers hold {r.end_states} states at round {r.common_round}")
    if r.averaged_share < rules.min_averaged_share:
        broken.append(
            f"{r.averaged_share:.1%} of outer steps averaged < {rules.min_averaged_share:.1%}"
        )
    return Outcome(
        spec.seed, peers_summary(r), peers_figures(r), r.log_hash, broken, dataclasses.asdict(r)
    )


def peers_summary(r: PeersReport) -> str:
    return (
        f"{r.peers} peers, {r.joined} joined, {r.killed} killed: {r.outer_steps} outer steps, "
        f"{r.averaged_share:.1%} averaged, {r.end_states} state(s) at round {r.common_round}, "
        f"{r.calls} calls, {r.virtual_s:.0f}s virtual in {r.wall_s:.1f}s"
    )


def peers_figures(r: PeersReport) -> dict[str, str]:
    return {
        "peers_outer_steps": str(r.outer_steps),
        "peers_averaged_share": f"{r.averaged_share:.4f}",
        "peers_common_round": str(r.common_round),
        "peers_end_states": str(r.end_states),
        "peers_wall_s": f"{r.wall_s:.1f}",
    }


def swarm_summary(r: SwarmReport) -> str:
    return (
        f"{r.stages} stages, {r.servers} servers, {r.trainers} trainers: {r.done} micro-batches "
        f"of an ideal {r.ideal:.0f} ({r.efficiency:.1%}), {r.moves} moves, {r.preempted} "
        f"preempted, {r.failed} given up, {r.retries} retried hops, median latency "
        f"{r.latency_s:.1f}s, stage totals at the end {r.stage_balance} of their mean, "
        f"busy {r.busy}, {r.audits} audits, {r.liars} liars caught {r.caught} times, "
        f"{r.poisoned} micro-batches answered by a liar, {r.wall_s:.1f}s wall"
    )


def swarm_figures(r: SwarmReport, prefix: str = "swarm") -> dict[str, str]:
    """A swarm run's ``key=value`` figures (swarmd sim's and benchmarks/sim.py's)."""
    return {
        f"{prefix}_efficiency": f"{r.efficiency:.4f}",
        f"{prefix}_moves": str(r.moves),
        f"{prefix}_failed": str(r.failed),
        f"{prefix}_poisoned": str(r.poisoned),
        f"{prefix}_latency_s": f"{r.latency_s:.2f}",
        f"{prefix}_wall_s": f"{r.wall_s:.1f}",
    }


def rounds_summary(r: RoundsReport) -> str:
    return (
        f"{r.peers} peers, {r.rounds} rounds, {r.replaced} replaced, {r.bans} bans: "
        f"{r.averaged_share:.1%} of peer-rounds averaged, mean group {r.mean_group:.1f}, "
        f"groups formed in {r.median_form_s:.1f}s (median, virtual), states spread "
        f"{r.spread:.3g}, loss {r.loss_ratio:.4f}x one group's, {r.useful_ratio:.1%} of the "
        f"peers' time useful, {r.bytes_per_peer_round / 1e3:.0f} kB a peer-round, "
        f"{r.calls} calls ({r.limited} refused by a rate limit, then made again), "
        f"{r.virtual_s:.0f}s virtual in {r.wall_s:.1f}s"
    )


def rounds_figures(r: RoundsReport) -> dict[str, str]:
    """A diloco run's ``key=value`` figures (swarmd sim's and benchmarks/sim.py's)."""
    return {
        "diloco_peers": str(r.peers),
        "diloco_rounds": str(r.rounds),
        "diloco_averaged_share": f"{r.averaged_share:.4f}",
        "diloco_form_s": f"{r.median_form_s:.2f}",
        "diloco_spread": f"{r.spread:.3g}",
        "diloco_loss_ratio": f"{r.loss_ratio:.4f}",
        "diloco_useful_ratio": f"{r.useful_ratio:.4f}",
        "diloco_bytes_per_peer_round": f"{r.bytes_per_peer_round:.0f}",
        "diloco_wall_s": f"{r.wall_s:.1f}",
        "diloco_bans": str(r.bans),
        "diloco_rate_limited": str(r.limited),
    }


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
        return Scenario(DhtScenario(), DhtInvariants())
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
    data["network"] = _build(NetworkConfig, network, f"{path} [network]")
    rules_table = data.pop("invariants", {})
    if kind == "swarm":
        data["swarm"] = _build(SwarmConfig, data.pop("swarm", {}), f"{path} [swarm]")
        rules = _build(SwarmInvariants, rules_table, f"{path} [invariants]")
        return Scenario(_build(SwarmScenario, data, str(path)), rules)
    if kind == "peers":
        data["churn"] = _build(PeerChurn, data.pop("churn", {}), f"{path} [churn]")
        rules = _build(PeersInvariants, rules_table, f"{path} [invariants]")
        return Scenario(_build(PeersScenario, data, str(path)), rules)
    if kind == "dht":
        rules = _build(DhtInvariants, rules_table, f"{path} [invariants]")
        return Scenario(_build(DhtScenario, data, str(path)), rules)
    mm = _build(MatchmakingConfig, data.pop("matchmaking", {}), f"{path} [matchmaking]")
    data["matchmaking"] = mm
    if kind == "diloco":
        rules = _build(RoundsInvariants, rules_table, f"{path} [invariants]")
        return Scenario(_build(RoundsScenario, data, str(path)), rules)
    rules = _build(MatchInvariants, rules_table, f"{path} [invariants]")
    return Scenario(_build(MatchScenario, data, str(path)), rules)


def sweep(
    scenario: Scenario, first_seed: int, count: int, progress: Progress | None = None
) -> Iterator[Outcome]:
    """Runs seeds first_seed .. first_seed+count-1, one outcome each."""
    for seed in range(first_seed, first_seed + count):
        yield scenario.run(seed, progress)
