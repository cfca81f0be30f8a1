"""SWARM (the pipeline algorithm) as real `swarmd join` processes: stage servers, trainers,
and a pipeline of three stages, each with one server, ready to train."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.harness.join import join_cmd, start_bootstrap, wait_for
from tests.harness.processes import Proc, ProcessGroup

#: How long a stage server may take to start and to take its stage (torch's import, several
#: processes starting at once on a busy machine).
STAGE_START_S = 120.0


def stage_server_cmd(tmp: Path, name: str, boot: str, stage: int, *extra: str) -> list[str]:
    """A server of `stage` that serves until stopped."""
    return join_cmd(
        tmp, name, boot, "--role", "server", "--stage", str(stage), *extra, steps=1_000_000
    )


def trainer_cmd(tmp: Path, name: str, boot: str, steps: int, *extra: str) -> list[str]:
    """A trainer that sends `steps` micro-batches through the pipeline, then exits."""
    return join_cmd(tmp, name, boot, "--role", "trainer", *extra, steps=steps)


def start_three_stages(processes: ProcessGroup, tmp_path: Path, run: str) -> tuple[str, list[Proc]]:
    """A bootstrap, a server on each of 3 stages (the first creates `run`), serving; then a
    trainer. Returns the bootstrap address and [s0, s1, s2, trainer]."""
    (tmp_path / "run.toml").write_text(run)
    boot = start_bootstrap(processes, tmp_path)
    create = ("--create-run", str(tmp_path / "run.toml"))
    servers = processes.start_many(
        [
            stage_server_cmd(tmp_path, "s0", boot, 0, *create),
            stage_server_cmd(tmp_path, "s1", boot, 1),
            stage_server_cmd(tmp_path, "s2", boot, 2),
        ],
        timeout=STAGE_START_S,
    )
    for s in servers:
        wait_for(s, "stage", timeout=STAGE_START_S)
    (trainer,) = processes.start_many([trainer_cmd(tmp_path, "t", boot, 1_000_000)])
    return boot, [*servers, trainer]


def trained_round(proc: Proc, timeout: float = 60) -> dict[str, Any]:
    """The server's next `stage_round` event that applied micro-batches."""
    while (e := proc.receive(timeout=timeout))["event"] != "stage_round" or not e["micro_batches"]:
        pass
    return e
