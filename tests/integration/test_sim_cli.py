"""`swarmd sim` as a user runs it: two processes, one seed, the same log hash; a sweep's
report; a bad scenario file is a usage error that names the key."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.harness.processes import run_command, swarmd_cmd

SCENARIO = """\
kind = "dht"
nodes = 30
gets = 20
killed = 0.3
seed = 7

[network]
rtt_min_ms = 20
rtt_max_ms = 200
"""


def sim(*args: str) -> subprocess.CompletedProcess[str]:
    return run_command(swarmd_cmd("sim", *args), timeout=300)


def figures(done: subprocess.CompletedProcess[str]) -> dict[str, str]:
    last = done.stdout.strip().splitlines()[-1]
    return dict(item.split("=", 1) for item in last.split())


def test_two_runs_of_one_seed_print_the_same_log_hash(tmp_path: Path) -> None:
    scenario = tmp_path / "dht.toml"
    scenario.write_text(SCENARIO)
    first, again = sim(str(scenario), "--quiet"), sim(str(scenario), "--quiet")
    assert first.returncode == 0 and again.returncode == 0, first.stderr + again.stderr
    one, two = figures(first), figures(again)
    assert one["log_hash"] == two["log_hash"] and len(one["log_hash"]) == 32
    assert one["seeds"] == "1" and one["failed"] == "0"
    assert float(one["dht_success"]) >= 0.99


def test_a_sweep_reports_every_seed_and_writes_them(tmp_path: Path) -> None:
    scenario = tmp_path / "dht.toml"
    scenario.write_text(SCENARIO)
    done = sim(str(scenario), "--seed", "3", "--sweep", "2", "--out", str(tmp_path / "o"))
    assert done.returncode == 0, done.stderr
    assert [line.split(":")[0] for line in done.stdout.splitlines()[:2]] == ["seed 3", "seed 4"]
    assert "joining them over 60 virtual seconds" in done.stderr  # progress on stderr
    rows = (tmp_path / "o" / "sim.jsonl").read_text().splitlines()
    assert len(rows) == 2 and '"seed": 4' in rows[1]
    assert figures(done)["seeds"] == "2"


def test_a_bad_scenario_is_a_usage_error_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("nodes = 10\nbogus = 1\n")
    done = sim(str(bad))
    assert done.returncode == 2 and "unknown key(s) bogus" in done.stderr
    bad.write_text('kind = "petals"\n')
    done = sim(str(bad))
    assert done.returncode == 2 and "not simulated yet" in done.stderr
    bad.write_text('kind = "swarm"\n[swarm]\nstages = 0\n')
    done = sim(str(bad))
    assert done.returncode == 2 and "[swarm]" in done.stderr and "swarm_stages" in done.stderr
    bad.write_text("[network]\nloss = 2\n")
    done = sim(str(bad))
    assert done.returncode == 2 and "[network]" in done.stderr
    done = sim(str(tmp_path / "missing.toml"))
    assert done.returncode == 2 and "cannot read" in done.stderr


def test_a_sweep_names_each_failing_seed_and_what_it_broke(tmp_path: Path) -> None:
    # Three peers in groups of at most two: one is alone every round, whatever the design,
    # so an invariant of nobody alone fails on every seed.
    scenario = tmp_path / "mm.toml"
    scenario.write_text(
        'kind = "matchmaking"\npeers = 3\nrounds = 1\njoin_window_s = 5\n'
        "[matchmaking]\ntarget_group_size = 2\n[invariants]\nmax_alone_share = 0\n"
    )
    done = sim(str(scenario), "--seed", "1", "--sweep", "2", "--quiet")
    assert done.returncode == 1, done.stderr
    assert "failing seeds (replay with --seed N): 1 2" in done.stdout
    assert "of peers alone a round > 0.0%" in done.stdout
    last = figures(done)
    assert last["failed"] == "2" and float(last["mm_alone_share"]) >= 0.333


def test_a_diloco_scenario_with_a_scheduled_liar_reports_its_bans(tmp_path: Path) -> None:
    scenario = tmp_path / "diloco.toml"
    scenario.write_text(
        'kind = "diloco"\npeers = 6\nrounds = 2\nparams = 1000\njoin_window_s = 5\n'
        "[matchmaking]\ntarget_group_size = 6\n"
        '[[faults]]\nat_round = 1\nkind = "liar"\nshare = 0.1\nlie = "weight"\n'
        "[invariants]\nmin_averaged_share = 0.8\n"
    )
    done = sim(str(scenario), "--quiet")
    assert done.returncode == 0, done.stdout + done.stderr
    last = figures(done)
    # Every honest peer in the liar's group bans it (test_sim_rounds.py checks who); a peer
    # that matchmaking left alone that round never saw it.
    assert last["diloco_peers"] == "6" and 1 <= int(last["diloco_bans"]) <= 5
    assert float(last["diloco_averaged_share"]) >= 0.8
