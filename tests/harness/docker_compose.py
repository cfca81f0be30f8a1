"""Driving docker and docker compose from tests: what is missing, building, containers' events.

Everything goes through the docker CLI (what a user types), never a client library.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
WHEELS = DEPLOY / "wheels"
SETUP = "deploy/setup-docker.sh"

#: No registry is reachable on the test machines, so the base image is built locally by
#: deploy/setup-docker.sh, and the image is built offline from deploy/wheels.
BASE_IMAGE = os.environ.get("SWARMD_BASE_IMAGE", "swarmd-base:local")
PIP_ARGS = os.environ.get("SWARMD_PIP_ARGS", "--no-index")
TORCH = os.environ.get("TORCH", "torch==2.13.0")


def run(
    cmd: list[str], *, timeout: float = 60.0, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs a command; on failure the AssertionError carries its output."""
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
            f"stderr:\n{proc.stderr[-4000:]}"
        )
    return proc


def missing_docker() -> str | None:
    """What stops these tests from using docker, as an instruction; None if nothing does."""
    if shutil.which("docker") is None:
        return f"the docker CLI is not installed (run {SETUP} as root)"
    info = run(["docker", "info", "--format", "{{.ServerVersion}}"], check=False)
    if info.returncode != 0:
        return (
            f"dockerd is not reachable ({info.stderr.strip()[-300:]}); start it "
            f"(run {SETUP} as root)"
        )
    if compose_command() is None:
        return f"neither `docker compose` nor `docker-compose` works (run {SETUP} as root)"
    if run(["docker", "image", "inspect", BASE_IMAGE], check=False).returncode != 0:
        return f"the base image {BASE_IMAGE} does not exist (run {SETUP} as root)"
    if "--no-index" in PIP_ARGS and not list(WHEELS.glob("torch-*.whl")):
        return f"no torch wheel in {WHEELS} for an offline build (run {SETUP} as root)"
    return None


def compose_command() -> list[str] | None:
    """`docker compose` (v2) when the plugin is there, else `docker-compose` (v1)."""
    wanted = os.environ.get("SWARMD_COMPOSE")
    candidates = [wanted.split()] if wanted else [["docker", "compose"], ["docker-compose"]]
    for cmd in candidates:
        if shutil.which(cmd[0]) and run([*cmd, "version"], check=False).returncode == 0:
            return cmd
    return None


def build_image(tag: str) -> None:
    """Builds deploy/Dockerfile the way setup-docker.sh does, so its cache makes this quick."""
    run(
        [
            "docker", "build", "-q", "-f", str(DEPLOY / "Dockerfile"),
            "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "--build-arg", f"PIP_ARGS={PIP_ARGS}",
            "--build-arg", f"TORCH={TORCH}", "-t", tag, str(ROOT),
        ],
        timeout=900,
    )  # fmt: skip


def inspect(container: str, template: str) -> str:
    return run(["docker", "inspect", "--format", template, container]).stdout.strip()


def logs(container: str) -> tuple[list[dict[str, Any]], str]:
    """The container's JSON events (its stdout, over all its runs) and its stderr."""
    proc = run(["docker", "logs", container], timeout=30)
    events = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                # A line cut short by SIGKILL, which the next run of the container (after a
                # restart) continues: keep that run's event, drop the cut one.
                start = line.rfind('{"event"')
                if start > 0:
                    with contextlib.suppress(json.JSONDecodeError):
                        events.append(json.loads(line[start:]))
    return events, proc.stderr


@dataclass
class Compose:
    """One compose project (unique name) from deploy/docker-compose.yml."""

    command: list[str]
    project: str
    env: dict[str, str] = field(default_factory=dict)

    def __call__(self, *args: str, timeout: float = 120.0, check: bool = True) -> str:
        cmd = [*self.command, "-p", self.project, "-f", str(COMPOSE_FILE), *args]
        return run(cmd, timeout=timeout, env=self.env, check=check).stdout

    def containers(self, service: str) -> list[str]:
        """Container ids of a service (stopped ones included), in a stable order."""
        ids = self("ps", "-a", "-q", service).split()
        return sorted(ids, key=lambda c: inspect(c, "{{.Name}}"))

    def down(self) -> None:
        """Removes the containers, network and volumes (named and anonymous)."""
        self("down", "-v", "--remove-orphans", "-t", "5", timeout=180)


PROJECT_PREFIX = "swarmdtest"


def project_name() -> str:
    """This test process's compose project: the pid tells leftovers of dead runs apart."""
    return f"{PROJECT_PREFIX}{os.getpid()}"


def remove_leftovers(command: list[str]) -> None:
    """Takes down projects of earlier test processes that died before their teardown (a
    killed pytest), so their containers do not train on, eating the CPU, forever."""
    out = run(
        ["docker", "ps", "-a", "--format", '{{.Label "com.docker.compose.project"}}'], timeout=30
    ).stdout
    for project in set(out.split()):
        pid = project.removeprefix(PROJECT_PREFIX)
        if project == pid or not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        Compose(command, project).down()


def wait_until(
    what: str, check: Callable[[], bool], timeout: float, explain: Callable[[], str]
) -> None:
    """Polls ``check`` every second; on timeout fails with ``explain()`` (the logs)."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout:.0f}s\n{explain()}")
        time.sleep(1.0)
    print(f"{what}: {time.monotonic() - start:.1f}s")
