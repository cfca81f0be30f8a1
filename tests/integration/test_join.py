"""`swarmd join` as real processes: a run trains and agrees, survives a crash, leaves cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import trio

import swarmd
from swarmd.node.dht import open_dht
from swarmd.node.peer.runconfig import CONFIG_TTL_S, RunConfig, config_key
from swarmd.protocol.identity import Identity
from tests.harness.join import events_until_exit, join_cmd, start_bootstrap, wait_for
from tests.harness.processes import ProcessGroup, run_command, swarmd_cmd
from tests.harness.runs import TINY_RUN


@pytest.mark.parametrize("codec", ["int8", "topk", "lowrank"])
def test_three_peers_train_and_end_identical(
    processes: ProcessGroup, tmp_path: Path, codec: str
) -> None:
    # A group needs all three: with min_group_size = 2 the first two peers up can finish the
    # whole run (6 rounds of this tiny model take ~1 s) before the third one has started
    # training (seen in CI: it started 1.4 s after the others and then trained alone).
    run = TINY_RUN.replace("min_group_size = 2", "min_group_size = 3")
    (tmp_path / "run.toml").write_text(f'{run}codec = "{codec}"\n')
    boot = start_bootstrap(processes, tmp_path)
    # All three start together (the others wait for the creator's config in the DHT), so no
    # peer is left to train alone while the others are still importing torch.
    creator, *others = processes.start_many(
        [
            join_cmd(tmp_path, "p0", boot, "--create-run", str(tmp_path / "run.toml")),
            join_cmd(tmp_path, "p1", boot),
            join_cmd(tmp_path, "p2", boot),
        ]
    )
    runs = [events_until_exit(p) for p in [creator, *others]]
    for i, events in enumerate(runs):
        print(
            f"p{i}:",
            [
                (e["event"], e.get("round"), e.get("group_size"), round(e.get("val_loss") or 0, 2))
                for e in events
            ],
        )
    assert all(p.process.returncode == 0 for p in [creator, *others])
    for events in runs:
        # Round 0 is the seeded init every peer builds itself: nobody downloads it.
        assert not [e for e in events if e["event"] == "state_synced" and e["round"] == 0]
        outer = [e for e in events if e["event"] == "outer_step"]
        assert len(outer) >= 3, events
        assert any(e["status"] == "averaged" and e["group_size"] == 3 for e in outer)
        # Counted by the transport while the round ran: at least the int8 reduce-scatter, 2/3
        # of a byte per parameter in a group of 3 (the all-gather's parts are pulled by the
        # others, and slower peers may pull after this peer's round ended: seen in CI).
        params = next(e["params"] for e in events if e["event"] == "training")
        full_rounds = [e for e in outer if e["group_size"] == 3 and e["dropped"] == 0]
        if codec == "int8":
            assert all(e["sync_bytes"] >= 0.66 * params for e in full_rounds), full_rounds
        start = next(e["val_loss"] for e in events if e["event"] == "validation")
        assert outer[-1]["val_loss"] < start
    # After every outer step all three averaged, every peer holds the same global state.
    full: dict[int, set[str]] = {}
    for events in runs:
        for e in events:
            if e["event"] == "outer_step" and e["group_size"] == 3 and e["dropped"] == 0:
                full.setdefault(e["round"], set()).add(e["state_hash"])
    assert full and all(len(hashes) == 1 for hashes in full.values()), full


def test_rounds_bounded_in_time_keep_a_slow_peer_with_the_fast_ones(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """`inner_seconds`: p2 has a slower GPU (0.1 s more a step, a chaos plan's
    `step_delay_s`). Each round ends after 1 s of inner steps, long before H = 5,000, on all
    three: p2 runs a fraction of the others' steps, and every round of the three averages
    their different numbers of steps into one state; the run ends at total_steps (3 rounds
    on the run's clock)."""
    run = TINY_RUN.replace("min_group_size = 2", "min_group_size = 3").replace(
        "inner_steps = 5", "inner_steps = 5000\ninner_seconds = 1.0\ntotal_steps = 15000"
    )
    (tmp_path / "run.toml").write_text(run)
    plan = tmp_path / "slow.json"
    plan.write_text(json.dumps({"step_delay_s": 0.1}))
    boot = start_bootstrap(processes, tmp_path)
    peers = processes.start_many(
        [
            join_cmd(tmp_path, "p0", boot, "--create-run", str(tmp_path / "run.toml"), steps=None),
            join_cmd(tmp_path, "p1", boot, steps=None),
            ["env", f"SWARMD_FAULTS={plan}", *join_cmd(tmp_path, "p2", boot, steps=None)],
        ]
    )
    runs = [events_until_exit(p) for p in peers]
    outer = [[e for e in events if e["event"] == "outer_step"] for events in runs]
    assert all(p.process.returncode == 0 for p in peers), outer
    hashes: dict[int, set[str]] = {}
    for mine in outer:
        assert mine and mine[-1]["round"] == 3, mine  # the run's end: 3 rounds of H
        # (A peer whose partners ended the run and left before it had every part of the last
        # round ends apart, then takes their state: a `synced` step, runend.py.)
        assert all(0 < e["inner_steps"] < 5000 for e in mine if "inner_steps" in e), mine
        for e in mine:
            if e["group_size"] == 3 and e["dropped"] == 0:
                hashes.setdefault(e["round"], set()).add(e["state_hash"])
    assert hashes and all(len(h) == 1 for h in hashes.values()), (hashes, outer)
    # Within one second the slow peer ran at most 10 steps, the others several times more.
    slow = {e["round"]: e["inner_steps"] for e in outer[2] if e["status"] == "averaged"}
    fast = [
        (e["round"], e["inner_steps"])
        for m in outer[:2]
        for e in m
        if e["status"] == "averaged" and e["round"] in slow
    ]
    assert fast and all(slow[r] <= 10 and 2 * slow[r] < n for r, n in fast), (slow, fast)


def test_demo_kills_a_peer_adds_one_and_survivors_agree(tmp_path: Path) -> None:
    """The README's first command, shortened: real processes, churn, and its own checks; its
    dashboard shows the run's peers while it runs."""
    out = tmp_path / "demo.out"
    with open(out, "w") as stdout:
        demo = subprocess.Popen(
            swarmd_cmd(
                "demo", "--duration", "45", "--inner-steps", "10", "--dashboard", "127.0.0.1:0"
            ),
            stdout=stdout,
            stderr=subprocess.STDOUT,
            text=True,
            # Its own process group, so that a failure here takes the demo's bootstrap,
            # dashboard and peers down with it (demo.kill() alone left them running).
            start_new_session=True,
        )
    try:
        peers_seen = _dashboard_peers_while_running(out, demo)
        assert demo.wait(timeout=400) == 0, out.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(demo.pid, signal.SIGKILL)
        demo.wait(timeout=10)
    text = out.read_text()
    assert peers_seen >= 3, text
    assert "killed peer1" in text
    assert "joined (group start" in text
    assert "states after averaged rounds: identical" in text
    assert "result: loss fell and the survivors agree" in text


def _dashboard_peers_while_running(out: Path, demo: subprocess.Popen[str]) -> int:
    """The most live peers the demo's dashboard (its URL read from the demo's output) showed
    in its JSON API before the demo ended (stops asking once it showed 3)."""
    url, most = None, 0
    while demo.poll() is None and most < 3:
        time.sleep(0.5)
        lines = [line for line in out.read_text().splitlines() if line.startswith("dashboard: ")]
        url = url or (lines[0].split()[1] if lines else None)
        if url is not None:
            with urllib.request.urlopen(url + "api/run", timeout=10) as response:
                most = max(most, json.loads(response.read())["live_peers"])
    return most


def test_crashed_peer_resumes_from_its_saved_state(processes: ProcessGroup, tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(TINY_RUN.replace("min_group_size = 2", "min_group_size = 1"))
    boot = start_bootstrap(processes, tmp_path)
    cmd = join_cmd(tmp_path, "p0", boot, "--create-run", str(tmp_path / "run.toml"), steps=10**6)
    first = processes.start(cmd)
    done = wait_for(first, "outer_step")
    wait_for(first, "outer_step")  # two rounds saved
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(timeout=10)
    assert (tmp_path / "p0" / "state.pt").exists()
    again = processes.start(cmd)
    resumed = wait_for(again, "resumed")
    assert resumed["round"] >= done["round"]
    after = wait_for(again, "outer_step")
    assert after["round"] == resumed["round"] + 1


def test_sigterm_leaves_cleanly_and_saves(processes: ProcessGroup, tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(TINY_RUN.replace("min_group_size = 2", "min_group_size = 1"))
    boot = start_bootstrap(processes, tmp_path)
    peer = processes.start(
        join_cmd(tmp_path, "p0", boot, "--create-run", str(tmp_path / "run.toml"), steps=10**6)
    )
    wait_for(peer, "outer_step")
    peer.process.send_signal(signal.SIGTERM)
    events = events_until_exit(peer, timeout=30)
    assert peer.process.returncode == 0
    kinds = [e["event"] for e in events]
    assert "leaving" in kinds and "stopped" in kinds
    assert (tmp_path / "p0" / "state.pt").exists()
    assert not list((tmp_path / "p0").glob(".state.pt.*"))  # no torn temp files


def test_sigterm_while_waiting_for_a_group_leaves_without_a_lone_round(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """A peer whose partner left waits out the 10 s gather window every round (its
    min_group_size is 2), then steps alone. Told to leave in that wait, it must neither sit the
    window out nor step alone on its way out (it did both: 10 s, then a "local" round)."""
    (tmp_path / "run.toml").write_text(TINY_RUN)
    boot = start_bootstrap(processes, tmp_path)
    stays = processes.start(
        join_cmd(tmp_path, "p0", boot, "--create-run", str(tmp_path / "run.toml"), steps=10**6)
    )
    goes = processes.start(join_cmd(tmp_path, "p1", boot, steps=10**6))
    for peer in (stays, goes):
        assert wait_for(peer, "outer_step")["status"] == "averaged"
    goes.process.send_signal(signal.SIGTERM)
    events_until_exit(goes, timeout=60)
    while wait_for(stays, "outer_step", timeout=60)["status"] != "local":
        pass  # its first round without p1 (which it waited the window out for)
    time.sleep(2.0)  # its next 5 inner steps take well under a second: it is gathering now
    stays.process.send_signal(signal.SIGTERM)
    events = events_until_exit(stays, timeout=60)
    assert stays.process.returncode == 0
    kinds = [e["event"] for e in events]
    after = kinds[kinds.index("leaving") :]
    assert "outer_step" not in after and after[-1] == "stopped", kinds
    leaving, stopped = events[kinds.index("leaving")], events[-1]
    assert stopped["time"] - leaving["time"] < 5.0, (leaving, stopped)  # half the window


def test_unknown_run_is_a_clear_error(processes: ProcessGroup, tmp_path: Path) -> None:
    boot = start_bootstrap(processes, tmp_path)
    peer = processes.start(join_cmd(tmp_path, "p0", boot, "--join-timeout", "2"))
    peer.process.wait(timeout=60)
    assert peer.process.returncode == 2
    time.sleep(0.2)
    assert "no run named 't'" in "".join(peer.stderr_tail)


def test_a_run_made_by_another_swarmd_version_is_refused(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """A properly signed config in the real DHT, but from another version: no training."""
    boot = start_bootstrap(processes, tmp_path)
    raw = json.loads(RunConfig(name="t").to_json())
    raw["version"] = "0.0.1"

    async def publish() -> int:
        identity = Identity.load_or_create(tmp_path / "creator")
        async with open_dht(identity, bootstrap=[boot]) as (node, _server):
            return await node.store(
                config_key("t"),
                json.dumps(raw).encode(),
                node.now() + CONFIG_TTL_S,
                str(identity.peer_id),  # the creator's own entry (runrecord.py)
            )

    # This node and the bootstrap node: the bootstrap keeps it after this node leaves.
    assert trio.run(publish) >= 2
    peer = processes.start(join_cmd(tmp_path, "p0", boot, "--join-timeout", "20"))
    peer.process.wait(timeout=60)
    assert peer.process.returncode == 2
    time.sleep(0.2)  # the stderr pump
    stderr = "".join(peer.stderr_tail)
    assert f"created with swarmd 0.0.1, this is swarmd {swarmd.__version__}" in stderr
    assert not (tmp_path / "p0" / "state.pt").exists()


def test_a_data_shard_beyond_the_runs_shards_is_refused(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    (tmp_path / "run.toml").write_text(TINY_RUN + "data_shards = 4\n")
    boot = start_bootstrap(processes, tmp_path)
    peer = processes.start(
        join_cmd(
            tmp_path, "p0", boot, "--create-run", str(tmp_path / "run.toml"), "--data-shard", "5"
        )
    )
    peer.process.wait(timeout=60)
    assert peer.process.returncode == 2
    time.sleep(0.2)
    assert "--data-shard 5: run 't' cuts its data into 4 shards (0 to 3)" in "".join(
        peer.stderr_tail
    )


def test_no_bootstrap_answer_exits_3(processes: ProcessGroup, tmp_path: Path) -> None:
    peer = processes.start(join_cmd(tmp_path, "p0", "127.0.0.1:9"))
    peer.process.wait(timeout=60)
    assert peer.process.returncode == 3
    time.sleep(0.2)
    assert "no bootstrap peer answered" in "".join(peer.stderr_tail)


def test_status_reports_config_peers_and_round(processes: ProcessGroup, tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(TINY_RUN.replace("min_group_size = 2", "min_group_size = 1"))
    boot = start_bootstrap(processes, tmp_path)
    peer = processes.start(
        join_cmd(tmp_path, "p0", boot, "--create-run", str(tmp_path / "run.toml"), steps=10**6)
    )
    created = wait_for(peer, "run_created")
    step = wait_for(peer, "outer_step")
    done = run_command(swarmd_cmd("status", "--run", "t", "--peers", boot, "--json"), timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["config"]["hash"] == created["config_hash"]
    assert [p["peer_id"] for p in report["peers"]] == [peer.info["peer_id"]]
    assert report["round"] >= step["round"]
    text = run_command(swarmd_cmd("status", "--run", "t", "--peers", boot), timeout=60)
    assert "live peers: 1" in text.stdout and "current outer round:" in text.stdout
    unknown = run_command(swarmd_cmd("status", "--run", "nope", "--peers", boot), timeout=60)
    assert unknown.returncode == 1 and "no configuration" in unknown.stdout


def test_user_model_from_the_run_config(processes: ProcessGroup, tmp_path: Path) -> None:
    run = TINY_RUN.replace("min_group_size = 2", "min_group_size = 1")
    (tmp_path / "run.toml").write_text(run + 'model = "tests.harness.user_model:bigram"\n')
    boot = start_bootstrap(processes, tmp_path)
    peer = processes.start(
        join_cmd(tmp_path, "p0", boot, "--create-run", str(tmp_path / "run.toml"), steps=10)
    )
    events = events_until_exit(peer)
    assert peer.process.returncode == 0
    training = next(e for e in events if e["event"] == "training")
    assert training["params"] == 256 * 256  # the bigram table, not the built-in GPT
    assert [e["round"] for e in events if e["event"] == "outer_step"] == [1, 2]
    (tmp_path / "bad.toml").write_text(run + 'model = "no_such_module:f"\n')
    bad = processes.start(
        join_cmd(tmp_path, "p1", boot, "--create-run", str(tmp_path / "bad.toml"), "--run", "b")
    )
    bad.process.wait(timeout=60)
    assert bad.process.returncode == 2
    time.sleep(0.2)
    assert "no_such_module" in "".join(bad.stderr_tail)
