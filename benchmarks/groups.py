"""One model from many groups (issue 46): real `swarmd join` processes on loopback, the tiny
built-in model, 150 steps a peer (H = 5), N peers with groups of T against one group of N.
`--grouping grid` (the run config's default) averages on the grid (averaging/grid.py,
`average_grid` in algorithms/loop.py); `flat` cuts groups from whoever announced, as every
run did before.

    python benchmarks/groups.py [--peers 6] [--target 2] [--steps 150] [--grouping grid]
                                [--end run|peer] [--kill-creator] [--sim-peers 0]

Each case starts a bootstrap node and N peers at once (the first creates the run) and reads
their JSON events until they exit. `--end run` (the default) ends the run at its
`total_steps = STEPS` (every peer stops once the run's state reaches it, late joiners too);
`--end peer` gives each peer `--max-steps STEPS` of its own instead, as before 2026-11-29.
Reported per case: wall time until the last peer exits; lone rounds (an outer step with no
partner while 2+ peers were live); carried rounds (no group's mean came, so the peer kept the
round's state and carried its steps into the next: DiLoCo.carry); states per round (the
distinct state hashes the peers' outer steps of one round ended on, the most over rounds, and
the mean); the final validation loss of each peer. `--kill-creator` kills the run's creator
at the run's midpoint (its 15th outer step) in the grouped case.

`--sim-peers K` adds the simulated case (sim/rounds.py, grid grouping, target 16, 5 % churn,
10 stallers, 3 rounds of 50 virtual s, speeds log-normal sigma 0.5) and its figures against
one flat group of everybody.

Last line: lone_rounds= wall_ratio= loss_ratio= states_per_round= loss_spread= wall_s=
one_group_wall_s= [sim_spread= sim_useful_ratio= sim_loss_ratio= sim_wall_s=]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness.join import join_cmd, start_bootstrap
from tests.harness.processes import Proc, ProcessGroup
from tests.harness.runs import TINY_RUN

Events = list[dict[str, Any]]


def run_case(
    peers: int,
    target: int,
    steps: int,
    grouping: str,
    kill_creator: bool,
    timeout: float,
    end: str = "run",
) -> tuple[float, list[Events]]:
    """Wall seconds until every peer exited, and each peer's events."""
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        run = TINY_RUN + f'target_group_size = {target}\ngrouping = "{grouping}"\n'
        run += f"total_steps = {steps}\n" if end == "run" else ""
        (tmp / "run.toml").write_text(run)
        processes = ProcessGroup()
        try:
            boot = start_bootstrap(processes, tmp)
            cmds = [
                join_cmd(tmp, f"p{i}", boot, *(("--create-run", str(tmp / "run.toml")) * (i == 0)),
                         steps=steps if end == "peer" else None)
                for i in range(peers)
            ]  # fmt: skip
            t0 = time.monotonic()
            procs = processes.start_many(cmds)
            events = _collect(procs, timeout, kill_at=steps // 10 if kill_creator else None)
            return time.monotonic() - t0, events
        finally:
            processes.close()


def _collect(procs: list[Proc], timeout: float, kill_at: int | None) -> list[Events]:
    """Every peer's events until all exited; the creator (procs[0]) killed after its
    ``kill_at``-th outer step."""
    out: list[Events] = [[] for _ in procs]
    deadline = time.monotonic() + timeout
    live = set(range(len(procs)))
    while live and time.monotonic() < deadline:
        for i in sorted(live):
            try:
                event = procs[i].receive(timeout=0.05)
            except AssertionError:
                if procs[i].process.poll() is not None:
                    live.discard(i)
                continue
            out[i].append(event)
            outer = sum(e["event"] == "outer_step" for e in out[i])
            if i == 0 and kill_at is not None and outer >= kill_at:
                procs[0].process.kill()
                live.discard(0)
                print(f"  killed the creator after its outer step {outer}", flush=True)
    return out


def figures(events: list[Events], killed: bool = False) -> dict[str, float]:
    """The case's figures; final losses only of the peers that ran to the end (``killed``:
    the creator, events[0], did not)."""
    steps = [e for ev in events for e in ev if e["event"] == "outer_step"]
    # A carried round (no group's mean came: nothing applied, the state kept) is not lone.
    lone = sum(
        1 for e in steps
        if e.get("group_size", 0) == 1 and e.get("live_peers", 1) >= 2
        and e["status"] != "carried"
    )  # fmt: skip
    carried = sum(1 for e in steps if e["status"] == "carried")
    by_round: dict[int, set[str]] = {}
    for e in steps:
        by_round.setdefault(e["round"], set()).add(e["state_hash"])
    states = [len(h) for h in by_round.values()] or [0]
    finals = [
        next(e["val_loss"] for e in reversed(ev) if e["event"] == "outer_step")
        for ev in events[1 if killed else 0 :]
        if any(e["event"] == "outer_step" for e in ev)
    ]
    return {
        "lone_rounds": lone,
        "carried_rounds": carried,
        "peer_rounds": len(steps),
        "states_max": max(states),
        "states_mean": statistics.mean(states),
        "final_loss": statistics.mean(finals),
        "loss_spread": (max(finals) - min(finals)) / statistics.mean(finals),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=6)
    parser.add_argument("--target", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--grouping", choices=("grid", "flat"), default="grid")
    parser.add_argument("--end", choices=("run", "peer"), default="run")
    parser.add_argument("--kill-creator", action="store_true")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--sim-peers", type=int, default=0)
    args = parser.parse_args()
    out: dict[str, str] = {}
    cases = (
        ("one group", args.peers, "flat", False),
        (f"groups of {args.target}", args.target, args.grouping, args.kill_creator),
    )
    results = {}
    for label, target, grouping, kill in cases:
        print(f"{label}: {args.peers} peers, target {target}, {grouping}", flush=True)
        wall, events = run_case(
            args.peers, target, args.steps, grouping, kill, args.timeout, args.end
        )
        f = figures(events, killed=kill)
        results[label] = (wall, f)
        print(
            f"  {wall:.0f}s wall, {f['lone_rounds']} lone and {f['carried_rounds']} carried "
            f"of {f['peer_rounds']} peer-rounds, "
            f"states per round max {f['states_max']} mean {f['states_mean']:.2f}, final loss "
            f"{f['final_loss']:.4f} (spread {f['loss_spread']:.2%})",
            flush=True,
        )
    (w1, f1), (w2, f2) = results.values()
    out |= {
        "lone_rounds": str(f2["lone_rounds"]),
        "wall_ratio": f"{w2 / w1:.3f}",
        "loss_ratio": f"{f2['final_loss'] / f1['final_loss']:.4f}",
        "states_per_round": f"{f2['states_mean']:.2f}",
        "loss_spread": f"{f2['loss_spread']:.4f}",
        "wall_s": f"{w2:.1f}",
        "one_group_wall_s": f"{w1:.1f}",
    }
    if args.sim_peers:
        out |= simulated(args.sim_peers)
    print(" ".join(f"{k}={v}" for k, v in out.items()))


def simulated(peers: int) -> dict[str, str]:
    from swarmd.node.averaging.matchmaking import MatchmakingConfig
    from swarmd.node.sim.rounds import RoundsScenario, run_rounds
    from swarmd.node.sim.scenario import rounds_figures, rounds_summary

    # Rounds of 50 virtual s (the run's `inner_seconds`; H = 2,000 caps only the fastest), as
    # deploy/sim/grid100.toml. Before 2026-11-30 rounds were H = 50 steps of 0.1 s: a roll
    # window as long as the steps, and slower peers that came after it closed (grid100 at
    # H = 50: 89% of peer-rounds averaged, 31% of the time useful).
    scenario = RoundsScenario(
        peers=peers, rounds=3, params=100_000, churn=0.05, stallers=10, grouping="grid",
        matchmaking=MatchmakingConfig(target_group_size=16),
        inner_steps=2000, step_s=0.1, inner_s=50.0,
    )  # fmt: skip
    print(
        f"simulated: {peers} peers (speeds sigma 0.5), grid, target 16, rounds of 50 virtual s,"
        " 5% churn, 10 stallers",
        flush=True,
    )
    r = run_rounds(scenario, lambda line: print(f"  {line}", flush=True))
    print(f"  {rounds_summary(r)}", flush=True)
    f = rounds_figures(r)
    return {
        "sim_spread": f["diloco_spread"],
        "sim_useful_ratio": f["diloco_useful_ratio"],
        "sim_loss_ratio": f["diloco_loss_ratio"],
        "sim_wall_s": f["diloco_wall_s"],
    }


if __name__ == "__main__":
    main()
