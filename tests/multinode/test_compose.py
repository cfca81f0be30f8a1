"""The Docker deployment end to end, as a user runs it.

deploy/Dockerfile's image and deploy/docker-compose.yml: a DHT bootstrap, the run's creator and
two workers (three trainers) on an internal network, started only once the bootstrap's
grpc.health.v1 check passes. A worker is SIGKILLed (`docker kill`): the others must go on
training. Started again, it must come back as the same peer (identity and state on its volume),
take up the run, and end up holding exactly the parameters the others hold after a round all
three averaged.

Needs docker: deploy/setup-docker.sh installs it, starts dockerd and builds the base image.
Without it these tests fail and say what is missing (CI runs them; they are not optional).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.harness import docker_compose as ch

IMAGE = os.environ.get("SWARMD_TEST_IMAGE", "swarmd:compose-test")
RUN = "composetest"

# Image build (a cache hit after setup-docker.sh, minutes without) plus about two minutes of
# training on a loaded two-core machine.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def docker() -> list[str]:
    """The compose command; fails (does not skip) with what is missing."""
    problem = ch.missing_docker()
    if problem is not None:
        pytest.fail(f"docker is not usable: {problem}", pytrace=False)
    command = ch.compose_command()
    assert command is not None
    return command


@pytest.fixture(scope="module")
def image(docker: list[str]) -> str:
    start = time.monotonic()
    ch.build_image(IMAGE)
    print(f"image build: {time.monotonic() - start:.1f}s")
    return IMAGE


@pytest.fixture
def peers(docker: list[str], image: str) -> Iterator[ch.Compose]:
    ch.remove_leftovers(docker)
    compose = ch.Compose(docker, ch.project_name(), {"SWARMD_IMAGE": image, "SWARMD_RUN": RUN})
    try:
        # Returns once the bootstrap is healthy and the others are started (depends_on).
        start = time.monotonic()
        compose("up", "-d", "--no-build", "--scale", "worker=2", timeout=300)
        print(
            f"compose up (bootstrap healthy, the others started): {time.monotonic() - start:.1f}s"
        )
        yield compose
    finally:
        # Shown by pytest only when the test failed.
        print(compose("logs", "--no-color", "--tail", "60", check=False))
        compose.down()


def outer_steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == "outer_step"]


def test_worker_killed_others_go_on_restarted_it_resumes_and_agrees(peers: ch.Compose) -> None:
    (bootstrap,) = peers.containers("bootstrap")
    assert ch.inspect(bootstrap, "{{.State.Health.Status}}") == "healthy"
    # Test traffic stays on this machine: the peers' network has no way out.
    assert ch.inspect(f"{peers.project}_swarm", "{{.Internal}}") == "true"
    trainers = peers.containers("creator") + peers.containers("worker")
    assert len(trainers) == 3
    victim, survivors = trainers[-1], trainers[:-1]
    names = {c: ch.inspect(c, "{{.Name}}").lstrip("/") for c in [bootstrap, *trainers]}

    def explain() -> str:
        parts = []
        for c in trainers:
            events, stderr = ch.logs(c)
            brief = [
                (e["event"], e.get("round"), e.get("status"), e.get("group_size")) for e in events
            ]
            parts.append(f"== {names[c]}: {brief[-25:]}\nstderr tail:\n{stderr[-1500:]}")
        return "\n".join(parts)

    def averaged(c: str, after: int = 0) -> int:
        events = ch.logs(c)[0][after:]
        return sum(e["status"] == "averaged" for e in outer_steps(events))

    # 1. The run trains: every trainer has averaged with others twice.
    ch.wait_until(
        "every trainer averages twice",
        lambda: all(averaged(c) >= 2 for c in trainers),
        240,
        explain,
    )

    # 2. SIGKILL one worker; the two others go on averaging without it. (A peer may have
    # been restarted already: under load its first bootstrap call can time out, it exits 3,
    # and the restart policy starts it again, as it would for a user.)
    before_kill, _ = ch.logs(victim)
    peer_id = [e for e in before_kill if e["event"] == "listening"][-1]["peer_id"]
    restarts = {c: ch.inspect(c, "{{.RestartCount}}") for c in [bootstrap, *survivors]}
    ch.run(["docker", "kill", victim])
    ch.wait_until(
        "the killed worker is down",
        lambda: ch.inspect(victim, "{{.State.Running}}") == "false",
        30,
        explain,
    )
    seen = {c: len(ch.logs(c)[0]) for c in survivors}
    down_at = time.time()
    ch.wait_until(
        "the survivors average twice more without the killed worker",
        lambda: all(averaged(c, after=seen[c]) >= 2 for c in survivors),
        180,
        explain,
    )
    # `docker kill` is a user's stop: restart: unless-stopped did not bring it back.
    assert ch.inspect(victim, "{{.State.Running}}") == "false"
    for c in survivors:
        new = outer_steps(ch.logs(c)[0][seen[c] :])
        # Rounds that began after the victim was down average without it. (One in flight at
        # the kill may count it, dropped or not: a victim killed after it had sent its parts
        # and served its own was counted, seen in CI under load.)
        began = [e for e in new if e["time"] - e["seconds"] >= down_at]
        contributed = [e["group_size"] - e["dropped"] for e in began if e["status"] == "averaged"]
        assert contributed and all(n <= 2 for n in contributed), new

    # 3. Started again, it is the same peer (its volume kept the key) and takes up the run
    # from the saved state or, since the run went on, the group's newer one.
    killed_at = len(ch.logs(victim)[0])
    ch.run(["docker", "start", victim])

    def after_restart() -> list[dict[str, Any]]:
        return ch.logs(victim)[0][killed_at:]

    ch.wait_until(
        "the restarted worker starts training",
        lambda: any(e["event"] == "training" for e in after_restart()),
        180,
        explain,
    )
    events = after_restart()
    print("restarted worker:", [(e["event"], e.get("round"), e.get("origin")) for e in events])
    assert [e["peer_id"] for e in events if e["event"] == "listening"] == [peer_id], events
    (training,) = [e for e in events if e["event"] == "training"]
    assert training["origin"] != "fresh", events
    assert any(e["event"] in ("resumed", "state_synced") for e in events), events

    # 4. It converges: a round that all three averaged together leaves all three with the
    # same state (hash of parameters and optimizer state).
    def common_round() -> int | None:
        hashes: dict[int, dict[str, str]] = {}
        for c in trainers:
            events = after_restart() if c == victim else ch.logs(c)[0]
            for e in outer_steps(events):
                if e["status"] == "averaged" and e["group_size"] == 3 and e["dropped"] == 0:
                    hashes.setdefault(e["round"], {})[c] = e["state_hash"]
        full = [r for r, by in hashes.items() if len(by) == 3]
        for r in full:
            assert len(set(hashes[r].values())) == 1, (r, hashes[r])
        return max(full, default=None)

    ch.wait_until(
        "the restarted worker averages with both others",
        lambda: common_round() is not None,
        180,
        explain,
    )
    print("first round all three averaged after the restart, with one state:", common_round())

    # The others did not crash (and get restarted behind the test's back) while a peer of
    # theirs died and came back.
    for c in [bootstrap, *survivors]:
        assert ch.inspect(c, "{{.RestartCount}}") == restarts[c], names[c]
    # Every peer passes its HEALTHCHECK (grpc.health.v1); a trainer's first probe comes 15 s
    # after its start, so the restarted one is given time.
    ch.wait_until(
        "every peer is healthy",
        lambda: all(
            ch.inspect(c, "{{.State.Health.Status}}") == "healthy" for c in [bootstrap, *trainers]
        ),
        90,
        lambda: "\n".join(
            f"{names[c]}: {ch.inspect(c, '{{json .State.Health}}')}" for c in [bootstrap, *trainers]
        ),
    )
    for c in trainers:
        assert "Traceback" not in ch.logs(c)[1], explain()
