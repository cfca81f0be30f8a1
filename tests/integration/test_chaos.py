"""`swarmd chaos` end to end: real processes, a kill + restart, a pause and a lossy link.

The short run uses the committed CI schedule (deploy/chaos/ci.json) on three peers; the soak
(`--duration 600`, six peers, seeded faults) is opt-in with ``-m slow``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.harness.processes import ROOT, run_command, swarmd_cmd


def run_chaos(out: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return run_command(swarmd_cmd("chaos", "--out", str(out), *args), timeout=timeout)


def digest(out: Path) -> str:
    """What a failed run's peers did, round by round, and what they logged: CI keeps no
    files, and a liveness race under faults cannot be studied from the report alone. Each
    part keeps its own tail, so a long soak's logs do not push the final rounds out."""
    events = []
    jsonl = out / "chaos.jsonl"
    if jsonl.is_file():
        for line in jsonl.read_text().splitlines():
            r = json.loads(line)
            if r["type"] == "peer" and r["event"] == "outer_step":
                events.append(
                    f"t={r['t']:.1f} peer{r['peer']} round {r['round']} {r['status']} "
                    f"group {r['group_size']} dropped {r['dropped']} wait {r['wait_s']}s "
                    f"{r['state_hash'][:8]}"
                )
            elif r["type"] != "peer" or r["event"] not in ("progress", "validation"):
                events.append(f"t={r['t']:.1f} {line[:160]}")
    logged = [
        f"{log.stem}: {line}"
        for log in sorted((out / "logs").glob("*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if "serving state" not in line
    ]
    return "\n".join(events[-300:] + logged[-150:] + tail_table(jsonl))


def tail_table(jsonl: Path) -> list[str]:
    """Each peer's last rounds on one line, last of all: CI shows only the head and the tail
    of a failure's output, and a split is read off these lines (round, status initial, hash)."""
    if not jsonl.is_file():
        return []
    rows: dict[int, list[str]] = {}
    for line in jsonl.read_text().splitlines():
        r = json.loads(line)
        if r["type"] == "peer" and r["event"] == "outer_step":
            rows.setdefault(r["peer"], []).append(
                f"{r['round']}{r['status'][0]}{r['group_size']}:{r['state_hash'][:4]}"
            )
        elif r["type"] in ("spawn", "exit") and r["peer"] >= 0:
            rows.setdefault(r["peer"], []).append(f"<{r['type']} t={r['t']:.0f}>")
    return ["--- last rounds (round, status, group: hash) ---"] + [
        f"peer{p}: " + " ".join(cells[-16:]) for p, cells in sorted(rows.items())
    ]


def check_outputs(done: subprocess.CompletedProcess[str], out: Path) -> dict[str, str]:
    assert done.returncode == 0, (
        done.stdout[-6000:] + done.stderr[-3000:] + "\n--- digest ---\n" + digest(out)
    )
    last = done.stdout.strip().splitlines()[-1]
    figures = dict(item.split("=", 1) for item in last.split())
    assert set(figures) == {
        "faults", "survived", "invariants_ok", "loss_start", "loss_end", "max_resume_s",
    }  # fmt: skip
    assert figures["invariants_ok"] == "true"
    assert (out / "report.txt").read_text().count("[ok]") == 6
    png = (out / "timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    records = [json.loads(line) for line in (out / "chaos.jsonl").read_text().splitlines()]
    kinds = {r["kind"] for r in records if r["type"] == "fault"}
    assert {r["type"] for r in records} >= {"start", "spawn", "peer", "fault", "heal", "exit"}
    assert kinds, "no fault was applied"
    return figures


@pytest.mark.timeout(420)
def test_short_chaos_run_keeps_every_invariant(tmp_path: Path) -> None:
    out = tmp_path / "chaos"
    schedule = ROOT / "deploy" / "chaos" / "ci.json"
    done = run_chaos(
        out, "--peers", "3", "--duration", "45", "--schedule", str(schedule), timeout=400
    )
    figures = check_outputs(done, out)
    assert figures["faults"] == "3" and figures["survived"] == "3"
    assert float(figures["max_resume_s"]) > 0  # the killed peer came back
    records = [json.loads(line) for line in (out / "chaos.jsonl").read_text().splitlines()]
    restarted = [r for r in records if r["type"] == "spawn" and r["incarnation"] == 1]
    assert [r["peer"] for r in restarted] == [1]
    resumed = [
        r for r in records if r["type"] == "peer" and r["peer"] == 1 and r["event"] == "training"
    ]
    assert len(resumed) == 2 and resumed[1]["origin"] in ("saved", "group")


# Slow tier; default suite: the simulator bans a liar (test_sim_rounds, test_sim_cli) and
# test_poisoned_updates bans one in processes.
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_byzantine_peer_is_banned_and_the_honest_ones_agree(tmp_path: Path) -> None:
    """`swarmd chaos --byzantine`'s fault on a committed schedule (deploy/chaos/byzantine.json):
    peer 2 restarted as a liar declaring 1e9 samples for 40 s, then restarted honest.

    Why 40 s: the swap kills peer 2 wherever it is. Killed while it leads a committed group,
    its partners wait out the all-reduce's deadlines for it (~15 s), and the liar (same id,
    lowest, so leader again) first leads a second group for that round that nobody joins
    (~15 s more) before it meets the others; after a 5 s restart that left a 20 s window no
    round with an honest peer, so no evidence and no ban (seen in 1 of 3 runs on the commit
    before this session's too). The window covers that worst case; issue 46's matchmaking
    work should make a restarted member's round cheaper."""
    out = tmp_path / "chaos"
    schedule = ROOT / "deploy" / "chaos" / "byzantine.json"
    done = run_chaos(
        out, "--peers", "3", "--duration", "60", "--schedule", str(schedule), timeout=400
    )
    assert done.returncode == 0, done.stdout[-6000:] + "\n--- digest ---\n" + digest(out)
    report = (out / "report.txt").read_text()
    assert report.count("[ok]") == 7 and "liars banned" in report, report
    records = [json.loads(line) for line in (out / "chaos.jsonl").read_text().splitlines()]
    lies = [r.get("lie") for r in records if r["type"] == "spawn" and r["peer"] == 2]
    assert lies == ["", "weight", ""]  # honest, the liar, honest again
    liar = next(r["peer_id"] for r in records if r.get("event") == "listening" and r["peer"] == 2)
    banned = [r for r in records if r["type"] == "peer" and r["event"] == "peer_banned"]
    # Banned by an honest peer on its evidence; nobody else banned, nobody by itself.
    assert banned and all(r["peer"] != 2 and r["peer_id"] == liar for r in banned), banned
    assert all(r["offence"] == "bad_weight" for r in banned)


# Slow tier; default suite: the DiLoCo chaos run above and DeMo's own process test
# (test_demo_join).
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_short_chaos_run_of_demo_keeps_every_invariant(tmp_path: Path) -> None:
    """The same faults on a DeMo run: its per-step exchange survives the kill, the lossy link
    and the pause, and the live peers end with one state.

    It once failed 1 run in 4: the paused peer missed one probe, the others took it for gone
    and never probed it again while its heartbeat lived, so it was left out of every group
    (DeMoStrategy now probes such peers again after `gone_recheck_s`); and a member the others
    had dropped waited out deadlines for them (Gatherer now drops a member that refuses us
    as not of its group at once)."""
    out = tmp_path / "chaos"
    schedule = ROOT / "deploy" / "chaos" / "ci.json"
    done = run_chaos(
        out, "--peers", "3", "--duration", "45", "--schedule", str(schedule), "--algo", "demo",
        timeout=400,
    )  # fmt: skip
    figures = check_outputs(done, out)
    assert figures["faults"] == "3" and figures["survived"] == "3"
    records = [json.loads(line) for line in (out / "chaos.jsonl").read_text().splitlines()]
    trained = {r.get("algo") for r in records if r["type"] == "peer" and r["event"] == "training"}
    assert trained == {"demo"}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_soak(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    done = run_chaos(out, "--peers", "6", "--duration", "600", "--seed", "7", timeout=1150)
    check_outputs(done, out)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_swarm_chaos_loses_a_stage_and_rebuilds_it(tmp_path: Path) -> None:
    """`swarmd chaos --algo swarm`: six peers (five stage servers, a trainer) under seeded
    degrading faults; every server of the middle stage is SIGKILLed and new machines take
    it: one rebuilds it (CheckFree), training goes on, the loss recovers. The CI version of
    the lost stage is test_checkfree_join.py (this run takes ~4 minutes)."""
    out = tmp_path / "chaos"
    done = run_chaos(
        out, "--peers", "6", "--duration", "120", "--seed", "1", "--algo", "swarm", timeout=560
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    figures = dict(item.split("=", 1) for item in last.split())
    assert figures["invariants_ok"] == "true" and figures["survived"] == "6"
    assert 0 < float(figures["recovery_s"]) < 60
    assert (out / "report.txt").read_text().count("[ok]") == 5
    records = [json.loads(line) for line in (out / "chaos.jsonl").read_text().splitlines()]
    rebuilt = [r for r in records if r["type"] == "peer" and r["event"] == "stage_recovered"]
    assert [(r["stage"], r["method"]) for r in rebuilt] == [(1, "checkfree")]
