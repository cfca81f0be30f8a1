"""Runs a chaos schedule against real processes and records everything as JSONL.

The harness starts a `swarmd dht` bootstrap node and N `swarmd join` peers (JSON event output),
each peer on its own loopback host 127.0.0.(10+i) with its own state directory and its own
fault plan file (``SWARMD_FAULTS``, see swarmd/protocol/faults.py). Once every peer trains, it
applies the schedule's faults at their times: signals for kills and pauses, plan files for
partitions, latency/loss, bandwidth and clock skew. A killed peer is restarted after its
down time from the same state directory, so it must resume. At the end every process is
asked to leave (SIGTERM) and must exit 0.

Everything observed goes to ``chaos.jsonl``, one record per line (see invariants.py for the
record types): the faults as applied, every JSON event of every peer, spawns, exits, and any
traceback found in a process's stderr (kept whole in logs/).

Concurrency is one trio run: a task per child stream, one per pending heal.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import trio

from swarmd.node.chaos import byzantine
from swarmd.node.chaos import swarm as chaos_swarm
from swarmd.node.chaos.schedule import BYZANTINE, KILL_STAGE, FaultEvent, Schedule
from swarmd.protocol.faults import ENV_VAR, FaultPlan

RUN_NAME = "chaos"
BOOTSTRAP = -1

#: A model small enough that six peers train on two shared cores, big enough to learn.
CHAOS_RUN = """\
n_layer = {n_layer}
n_head = 2
n_embd = 64
block_size = 32
batch_size = 8
inner_steps = {inner_steps}
inner_lr = 0.003
outer_momentum = 0.5
codec = "int8"
min_group_size = {min_group_size}
algo = "{algo}"
"""


@dataclass(frozen=True)
class HarnessOptions:
    peers: int
    duration_s: float
    out_dir: Path
    schedule: Schedule
    inner_steps: int = 10
    algo: str = "diloco"
    min_group_size: int = 2
    #: How long startup (imports, DHT bootstrap, first validation) may take before giving up.
    startup_timeout_s: float = 300.0
    #: How long a peer may take to leave after SIGTERM before it is SIGKILLed (a failure).
    stop_timeout_s: float = 90.0

    def __post_init__(self) -> None:
        if self.peers < 2:
            raise ValueError("chaos needs at least 2 peers")
        if self.peers > 200:
            raise ValueError("at most 200 peers (one loopback host each)")
        if not self.duration_s > 0 or self.inner_steps < 1:
            raise ValueError("duration_s > 0 and inner_steps >= 1")


@dataclass
class Slot:
    """One peer position: its host, files, and the process currently running it."""

    index: int
    host: str
    state_dir: Path
    plan_path: Path
    log_path: Path
    process: trio.Process | None = None
    incarnation: int = -1
    #: Current faults by source, combined into the plan file.
    network: FaultPlan = field(default_factory=FaultPlan)
    blocked: frozenset[str] = frozenset()

    @property
    def name(self) -> str:
        return "bootstrap" if self.index == BOOTSTRAP else f"peer{self.index}"


class Recorder:
    """Appends records to the JSONL file as they happen (a crash of the harness keeps them)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._t0 = time.monotonic()
        self._fh: IO[str] = open(path, "w")  # noqa: SIM115 - closed by close()

    def now(self) -> float:
        return time.monotonic() - self._t0

    def record(self, type_: str, **fields: Any) -> dict[str, Any]:
        rec = {"t": round(self.now(), 3), "type": type_, **fields}
        self.records.append(rec)
        self._fh.write(json.dumps(rec) + "\n")
        self._fh.flush()
        return rec

    def close(self) -> None:
        self._fh.close()


async def _lines(stream: trio.abc.ReceiveStream) -> AsyncIterator[str]:
    buf = bytearray()
    while chunk := await stream.receive_some(1 << 16):
        buf += chunk
        while (i := buf.find(b"\n")) >= 0:
            yield buf[:i].decode(errors="replace")
            del buf[: i + 1]
    if buf:
        yield buf.decode(errors="replace")


def _starts_log_line(line: str) -> bool:
    """Python logging lines here begin with an ISO date (see cli.main's format)."""
    return len(line) > 10 and line[:2] == "20" and line[4] == "-" and line[7] == "-"


class Harness:
    def __init__(self, options: HarnessOptions) -> None:
        self.opts = options
        out = options.out_dir
        for sub in ("state", "faults", "logs"):
            (out / sub).mkdir(parents=True, exist_ok=True)
        self.rec = Recorder(out / "chaos.jsonl")
        self.slots = [self._slot(i) for i in range(options.peers)]
        self.boot = self._slot(BOOTSTRAP)
        self.boot_address = ""
        self.run_file = out / "run.toml"
        swarm = options.algo == "swarm"
        #: SWARM: each slot's role (stage server or trainer); None for other algorithms.
        self.roles = chaos_swarm.roles(options.peers) if swarm else None
        self.run_file.write_text(
            CHAOS_RUN.format(
                inner_steps=options.inner_steps,
                min_group_size=options.min_group_size,
                algo=options.algo,
                n_layer=chaos_swarm.STAGES if swarm else 1,
            )
            + (chaos_swarm.SWARM_RUN_EXTRA if swarm else "")
        )
        self.training = trio.Event()
        self.boot_ready = trio.Event()
        self.first_training = trio.Event()
        #: Per peer: set once it printed its listening address (it has imported everything).
        self.joined = [trio.Event() for _ in range(options.peers)]
        self.startup_failed = ""
        self._startup_scope: trio.CancelScope | None = None
        self._trained: set[int] = set()
        self.stopping = False
        self.faults_applied = 0

    def _slot(self, index: int) -> Slot:
        out, name = self.opts.out_dir, "bootstrap" if index == BOOTSTRAP else f"peer{index}"
        host = "127.0.0.2" if index == BOOTSTRAP else f"127.0.0.{10 + index}"
        slot = Slot(index, host, out / "state" / name, out / "faults" / f"{name}.json",
                    out / "logs" / f"{name}.log")  # fmt: skip
        FaultPlan().write(slot.plan_path)
        return slot

    # -- processes ---------------------------------------------------------------------------

    async def _spawn(
        self, nursery: trio.Nursery, slot: Slot, args: list[str], lie: str = ""
    ) -> None:
        """Starts ``slot``'s process: `swarmd` with ``args``, or the Byzantine peer telling
        ``lie`` (chaos/byzantine.py, started by cli/liar.py) with the same arguments."""
        env = {**os.environ, ENV_VAR: str(slot.plan_path), "PYTHONUNBUFFERED": "1"}
        module = "swarmd.node.cli"
        if lie:
            env[byzantine.ENV_VAR], module = lie, "swarmd.node.cli.liar"
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        slot.process = proc
        slot.incarnation += 1
        self.rec.record(
            "spawn", peer=slot.index, pid=proc.pid, incarnation=slot.incarnation, lie=lie
        )
        nursery.start_soon(self._read_events, slot, proc)
        nursery.start_soon(self._read_log, slot, proc)
        nursery.start_soon(self._reap, slot, proc)

    async def _read_events(self, slot: Slot, proc: trio.Process) -> None:
        assert proc.stdout is not None
        async for line in _lines(proc.stdout):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if not isinstance(event, dict) or "event" not in event:
                continue
            kind = event.pop("event")
            event.pop("t", None)
            self.rec.record("peer", peer=slot.index, event=kind, **event)
            if kind == "listening" and slot.index == BOOTSTRAP:
                self.boot_address = str(event["address"])
                self.boot_ready.set()
            elif kind == "listening":
                self.joined[slot.index].set()
            if kind == "training" and slot.index != BOOTSTRAP:
                if slot.index == 0:
                    self.first_training.set()
                self._trained.add(slot.index)
                if len(self._trained) == self.opts.peers:
                    self.training.set()

    async def _read_log(self, slot: Slot, proc: trio.Process) -> None:
        """Keeps stderr in the slot's log file and records every traceback found in it."""
        assert proc.stderr is not None
        block: list[str] | None = None
        with open(slot.log_path, "a") as fh:
            fh.write(f"==== {slot.name} incarnation {slot.incarnation} pid {proc.pid}\n")
            async for line in _lines(proc.stderr):
                fh.write(line + "\n")
                fh.flush()
                if block is not None and (_starts_log_line(line) or len(block) > 400):
                    self.rec.record("exception", peer=slot.index, text="\n".join(block))
                    block = None
                if "Traceback (most recent call last)" in line and block is None:
                    block = []
                if block is not None:
                    block.append(line)
        if block is not None:
            self.rec.record("exception", peer=slot.index, text="\n".join(block))

    async def _reap(self, slot: Slot, proc: trio.Process) -> None:
        code = await proc.wait()
        self.rec.record("exit", peer=slot.index, code=code, pid=proc.pid)
        if not self.training.is_set() and not self.startup_failed and self._startup_scope:
            self.startup_failed = f"{slot.name} exited with code {code} during startup"
            self._startup_scope.cancel()
        if slot.process is proc:
            slot.process = None

    def _join_args(self, slot: Slot, create: bool) -> list[str]:
        args = ["join", "--run", RUN_NAME, "--peers", self.boot_address,
                "--listen", f"{slot.host}:0", "--log-format", "json",
                "--state-dir", str(slot.state_dir), "--progress-interval", "5",
                "--join-timeout", "120"]  # fmt: skip
        if create:
            args += ["--create-run", str(self.run_file)]
        if self.roles is not None:
            args += self.roles[slot.index].join_args()
        return args

    # -- faults ------------------------------------------------------------------------------

    def _write_plan(self, slot: Slot) -> None:
        n = slot.network
        plan = FaultPlan(
            latency_ms=n.latency_ms,
            jitter_ms=n.jitter_ms,
            loss=n.loss,
            bandwidth_bytes_s=n.bandwidth_bytes_s,
            clock_skew_s=n.clock_skew_s,
            blocked=slot.blocked,
        )
        plan.write(slot.plan_path)

    def _signal(self, slot: Slot, signum: signal.Signals) -> None:
        proc = slot.process
        if proc is not None and proc.returncode is None:
            proc.send_signal(signum)

    def _network(self, event: FaultEvent) -> FaultPlan:
        if event.kind == "latency":
            return FaultPlan(
                latency_ms=event.latency_ms, jitter_ms=event.jitter_ms, loss=event.loss
            )
        if event.kind == "bandwidth":
            return FaultPlan(bandwidth_bytes_s=event.bandwidth_bytes_s)
        return FaultPlan(clock_skew_s=event.clock_skew_s)

    def _apply(self, event: FaultEvent) -> None:
        victims = [self.slots[i] for i in event.peers]
        self.faults_applied += 1
        self.rec.record("fault", **event.to_dict())
        if event.kind in ("kill", KILL_STAGE):
            for s in victims:
                self._signal(s, signal.SIGKILL)
        elif event.kind == BYZANTINE:
            pass  # _swap, which waits for the corpse
        elif event.kind == "pause":
            for s in victims:
                self._signal(s, signal.SIGSTOP)
        elif event.kind == "partition":
            minority = set(event.peers)
            cut = frozenset(s.host for s in victims)
            rest = frozenset(s.host for s in self.slots if s.index not in minority)
            for s in self.slots:
                s.blocked = rest | {self.boot.host} if s.index in minority else cut
                self._write_plan(s)
            # The bootstrap DHT node sits on the majority side.
            self.boot.blocked = cut
            self._write_plan(self.boot)
        else:
            for s in victims:
                s.network = self._network(event)
                self._write_plan(s)

    async def _swap(self, nursery: trio.Nursery, event: FaultEvent, lie: str) -> None:
        """A Byzantine fault: the peer is SIGKILLed and started again from its own state, as
        the liar (``lie``), or, at the heal, as itself."""
        for i in event.peers:
            slot = self.slots[i]
            self._signal(slot, signal.SIGKILL)
            with trio.move_on_after(10):
                while slot.process is not None:  # until _reap has recorded the exit
                    await trio.sleep(0.05)
            await self._spawn(nursery, slot, self._join_args(slot, create=False), lie)

    async def _heal(self, nursery: trio.Nursery, event: FaultEvent) -> None:
        await trio.sleep(event.duration_s)
        if self.stopping:
            return
        self.rec.record("heal", kind=event.kind, peers=list(event.peers))
        if event.kind == BYZANTINE:
            await self._swap(nursery, event, "")
        elif event.kind in ("kill", KILL_STAGE):
            for i in event.peers:
                slot = self.slots[i]
                if slot.process is not None:  # not yet reaped: wait for the corpse
                    with trio.move_on_after(10):
                        await slot.process.wait()
                if event.kind == KILL_STAGE:  # a new machine: no saved state, a new identity
                    slot.state_dir = slot.state_dir.with_name(f"{slot.name}-{slot.incarnation + 1}")
                await self._spawn(nursery, slot, self._join_args(slot, create=False))
        elif event.kind == "pause":
            for i in event.peers:
                self._signal(self.slots[i], signal.SIGCONT)
        elif event.kind == "partition":
            for s in [*self.slots, self.boot]:
                s.blocked = frozenset()
                self._write_plan(s)
        else:
            for i in event.peers:
                self.slots[i].network = FaultPlan()
                self._write_plan(self.slots[i])

    # -- the run -----------------------------------------------------------------------------

    async def _stop(self, slot: Slot) -> None:
        proc = slot.process
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(self.opts.stop_timeout_s):
            await proc.wait()
            return
        proc.kill()

    async def run(self) -> bool:
        """Runs the whole thing; False if startup failed (the records say why)."""
        opts = self.opts
        ok = True
        self.rec.record(
            "start",
            peers=opts.peers,
            duration_s=opts.duration_s,
            min_group_size=opts.min_group_size,
            inner_steps=opts.inner_steps,
            algo=opts.algo,
            seed=opts.schedule.seed,
            schedule=[e.to_dict() for e in opts.schedule.events],
        )
        try:
            async with trio.open_nursery() as nursery:
                try:
                    ok = await self._main(nursery)
                finally:
                    self.stopping = True
                    self.rec.record("stop")
                    with trio.CancelScope(shield=True):
                        async with trio.open_nursery() as stoppers:
                            for s in self.slots:
                                stoppers.start_soon(self._stop, s)
                        await self._stop(self.boot)
        finally:
            self.rec.close()
        return ok

    async def _main(self, nursery: trio.Nursery) -> bool:
        opts = self.opts
        with trio.move_on_after(opts.startup_timeout_s) as startup:
            self._startup_scope = startup
            await self._spawn(nursery, self.boot, ["dht", "--listen", f"{self.boot.host}:0",
                              "--state-dir", str(self.boot.state_dir)])  # fmt: skip
            await self.boot_ready.wait()
            # The run's creator first; the others one by one after it trains. Six processes
            # importing torch at once on a small machine starve each other's event loops
            # past the DHT's bootstrap deadline.
            first = self.slots[0]
            await self._spawn(nursery, first, self._join_args(first, create=True))
            await self.first_training.wait()
            for slot in self.slots[1:]:
                await self._spawn(nursery, slot, self._join_args(slot, create=False))
                with trio.move_on_after(3.0):
                    await self.joined[slot.index].wait()
            await self.training.wait()
        if startup.cancelled_caught or self.startup_failed:
            self.rec.record(
                "startup_failed",
                reason=self.startup_failed or f"not all peers trained in {opts.startup_timeout_s}s",
            )
            return False
        t_ready = trio.current_time()
        self.rec.record("chaos_begins")
        for event in opts.schedule.events:
            await trio.sleep_until(t_ready + event.at_s)
            self._apply(event)
            if event.kind == BYZANTINE:
                await self._swap(nursery, event, event.lie)
            nursery.start_soon(self._heal, nursery, event)
        await trio.sleep_until(t_ready + opts.duration_s)
        return True


def expected_runtime_s(options: HarnessOptions) -> float:
    """Roughly how long a run takes: startup, the schedule, and the final stop."""
    return options.duration_s + 60.0 + min(options.stop_timeout_s, 30.0)


def fmt_duration(seconds: float) -> str:
    return f"{math.floor(seconds / 60)}m{seconds % 60:02.0f}s"
