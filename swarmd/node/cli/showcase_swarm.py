"""`swarmd demo --algo swarm`: a small SWARM pipeline on this machine, unbalanced on purpose.

A `swarmd dht` bootstrap, stage servers and trainers, all `swarmd join` processes on loopback.
The model is cut into 2 stages; 3 servers start on stage 0 and 1 on stage 1, and stage 1's
server is slowed (`--slowdown 3`, an emulated slower GPU), so stage 1 is the bottleneck and a
server of stage 0 moves there (it downloads stage 1's state first). Midway one stage-0 server
is SIGKILLed: the trainers retry its calls on the others. The summary is read from the peers'
own JSON events: loss at the last stage, micro-batches trained, retries, moves, and whether
each stage's servers held identical states after every round they averaged together. A
`swarmd dashboard` shows the run, its stages included, while it lasts (its URL is printed).
"""

from __future__ import annotations

import signal
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from swarmd.node.cli.showcase import start_dashboard
from swarmd.node.runtime.children import EventChild, stop_all

SWARM_RUN = """\
n_layer = 2
n_head = 4
n_embd = 128
block_size = 64
batch_size = 8
inner_lr = 0.002
algo = "swarm"
swarm_stages = 2
swarm_round_s = 3.0
swarm_rebalance_s = 10.0
"""


def _say(text: str) -> None:
    print(text, flush=True)


def run_swarm_demo(
    duration_s: float = 150.0, trainers: int = 2, dashboard: str | None = "127.0.0.1:8080"
) -> int:
    _say(
        f"swarmd demo: a real SWARM pipeline on this machine for ~{duration_s:.0f}s: the model "
        "cut into 2 stages,\n4 stage servers (3 on stage 0, 1 slowed 3x on stage 1: the "
        f"bottleneck) and {trainers} trainers,\nall `swarmd join` processes on loopback.\n"
    )
    started: list[EventChild] = []
    with tempfile.TemporaryDirectory(prefix="swarmd-demo-") as tmp:
        root = Path(tmp)
        (root / "run.toml").write_text(SWARM_RUN)

        def spawn(name: str, args: list[str]) -> EventChild:
            child = EventChild.spawn(name, [sys.executable, "-m", "swarmd.node.cli", *args], root)
            started.append(child)
            return child

        try:
            boot = spawn("bootstrap", ["dht", "--state-dir", str(root / "boot")])
            address = boot.first("listening", 30)["address"]
            board = start_dashboard(address, dashboard, root) if dashboard else None
            started += [board] if board else []

            def join(name: str, *extra: str, seconds: float = duration_s) -> EventChild:
                return spawn(
                    name,
                    ["join", "--run", "demo", "--peers", address, "--log-format", "json",
                     "--state-dir", str(root / name), "--duration", f"{seconds:.0f}",
                     *extra],
                )  # fmt: skip

            # Servers outlive the trainers (which start once the servers are up).
            serve_s = duration_s + 60

            create = ("--create-run", str(root / "run.toml"))
            servers = [
                join("server0", "--role", "server", "--stage", "0", *create, seconds=serve_s),
                join("server1", "--role", "server", "--stage", "0", seconds=serve_s),
                join("server2", "--role", "server", "--stage", "0", seconds=serve_s),
                join(
                    "server3",
                    "--role",
                    "server",
                    "--stage",
                    "1",
                    "--slowdown",
                    "3",
                    seconds=serve_s,
                ),
            ]
            for s in servers:
                s.first("stage", 120)
            _say("4 stage servers up; starting trainers...")
            t0 = time.monotonic()
            crew = [join(f"trainer{i}", "--role", "trainer") for i in range(trainers)]
            victim = servers[2]
            time.sleep(max(0.0, duration_s * 0.4))
            victim.process.send_signal(signal.SIGKILL)
            _say(f"[{time.monotonic() - t0:5.0f}s] killed {victim.name} (SIGKILL, no goodbye)")
            for p in crew:
                p.process.wait(timeout=duration_s + 120)
            # The servers' last round is in once the trainers are done: stop them now.
            time.sleep(2 * 3.0)
            stop_all((s.process for s in servers if s is not victim), timeout=15)
        finally:
            stop_all((p.process for p in started), timeout=15)
        return _summary([s for s in servers if s is not victim], victim, crew)


def _summary(servers: list[EventChild], victim: EventChild, trainers: list[EventChild]) -> int:
    rounds = [e for s in servers for e in s.events if e.get("event") == "stage_round"]
    losses = [e["loss"] for e in sorted(rounds, key=lambda e: e["time"]) if e.get("loss")]
    moves = [e for s in servers for e in s.events if e.get("event") == "rebalance"]
    done = [e for t in trainers for e in t.events if e.get("event") == "trainer_done"]
    retries = sum(e["retries"] for e in done)
    # Servers that averaged together in a round must hold the same stage state after it.
    states: dict[tuple[int, int], set[str]] = defaultdict(set)
    for e in rounds:
        if e["group_size"] >= 2 and not e["dropped"]:
            states[(e["stage"], e["round"])].add(e["state_hash"])
    agree = bool(states) and all(len(h) == 1 for h in states.values())
    _say("\n== summary ==")
    _say(
        f"micro-batches trained: {sum(e['micro_batches'] for e in done)} by {len(done)} "
        f"trainers ({retries} hops retried on another server)"
    )
    if losses:
        head, tail = losses[: max(1, len(losses) // 5)], losses[-max(1, len(losses) // 5) :]
        _say(
            f"last stage's training loss: {sum(head) / len(head):.3f} in the first rounds -> "
            f"{sum(tail) / len(tail):.3f} in the last"
        )
    for m in moves:
        _say(
            f"rebalanced: a server moved stage {m['source']} -> {m['target']} (slowest stage "
            f"{m['before']:.1f} -> {m['after']:.1f} micro-batches/s)"
        )
    if not moves:
        _say("rebalanced: no server moved")
    _say(f"peers left: {victim.name} (killed); trainers retried its calls elsewhere")
    _say(
        f"stage states after averaged rounds: {'identical' if agree else 'DIFFERENT'} across "
        f"each stage's servers ({len(states)} rounds compared)"
    )
    fell = len(losses) >= 4 and _mean(losses[-3:]) < _mean(losses[:3])
    ok = agree and fell and len(done) == len(trainers)
    _say(f"\nresult: {'loss fell and each stage agrees' if ok else 'CHECK FAILED'}")
    return 0 if ok else 1


def _mean(values: list[float]) -> float:
    return float(sum(values)) / len(values)
