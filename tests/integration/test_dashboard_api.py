"""`swarmd dashboard`'s JSON API as processes on loopback: a DHT with no run, a run with no
peer, an impostor's second config, and hostile published values (markup kept as text, NaN and
over-long values refused), read by real dashboard processes from a real DHT."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.harness.hostile_publisher import SCRIPT, XSS
from tests.harness.processes import HARNESS, Proc, ProcessGroup, swarmd_cmd


def get(url: str) -> tuple[dict[str, Any], dict[str, str]]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read()), dict(response.headers)


def until(check: Callable[[], Any], timeout: float = 30.0) -> Any:
    """check()'s first truthy result, polled; an AssertionError with the last one if none."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout}s; last: {last!r}")


def start_dashboards(processes: ProcessGroup, boot: str, runs: list[str]) -> dict[str, str]:
    args = ("--peers", boot, "--listen", "127.0.0.1:0", "--poll", "0.5")
    procs = processes.start_many([swarmd_cmd("dashboard", "--run", run, *args) for run in runs])
    return {run: str(proc.info["url"]) for run, proc in zip(runs, procs, strict=True)}


def start_world(processes: ProcessGroup, tmp: Path) -> tuple[str, Proc]:
    boot = processes.start(swarmd_cmd("dht", "--state-dir", str(tmp / "boot"))).address
    script = HARNESS / "hostile_publisher.py"
    publisher = processes.start([sys.executable, str(script), boot], timeout=60)
    return boot, publisher


def test_api_no_run_empty_run_impostor_and_hostile_values(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    boot, publisher = start_world(processes, tmp_path)
    urls = start_dashboards(processes, boot, ["absent", "empty", "twins", "evil"])

    # A DHT with no such run: the API answers, says so, and keeps polling.
    run = until(lambda: (r := get(urls["absent"] + "api/run")[0])["polls"] >= 2 and r)
    assert run["found"] is False and run["config"] is None and run["live_peers"] == 0
    assert get(urls["absent"] + "api/peers")[0]["peers"] == []
    history = get(urls["absent"] + "api/history")[0]
    assert history["loss"] == {"rounds": [], "series": []}

    # A run with a config and no peer.
    run = until(lambda: (r := get(urls["empty"] + "api/run")[0])["found"] and r)
    assert run["config"]["algo"] == "diloco" and run["config"]["n_layer"] == 2
    assert run["live_peers"] == 0 and run["round"] is None
    assert 0 <= run["config"]["age_s"] < 120

    # Two keys claim one run: no config is shown, and the page says why.
    run = until(lambda: (r := get(urls["twins"] + "api/run")[0])["error"] and r)
    assert run["found"] is False and "2 keys publish a config" in run["error"]

    _check_hostile(urls["evil"], publisher)


def _check_hostile(url: str, publisher: Proc) -> None:
    run = until(lambda: (r := get(url + "api/run")[0])["live_peers"] == 3 and r)
    config = run["config"]
    # Markup is text, returned as published; wrong types are left out, not coerced.
    assert config["algo"] == XSS and config["model"] == SCRIPT
    assert "n_layer" not in config and "n_embd" not in config and "n_head" not in config
    assert "version" not in config  # 300 characters: over the shown limit
    run = until(lambda: (r := get(url + "api/run")[0])["refused_values"] >= 2 and r)
    assert run["refused_values"] == 2  # the NaN record and the 5000-character name

    peers, headers = get(url + "api/peers")
    assert headers["content-type"] == "application/json"
    assert headers["x-content-type-options"] == "nosniff"
    rows = {row["peer_id"]: row for row in peers["peers"]}
    markup = rows[str(publisher.info["markup"])]
    assert markup["name"] == SCRIPT and markup["device"] == "<b>cpu</b>"
    assert markup["address"] == XSS and markup["loss"] == 2.5 and markup["live"] is True
    for refused in ("nan", "long"):  # live (heartbeat), but what they published is not shown
        row = rows[str(publisher.info[refused])]
        assert row["live"] is True and row["loss"] is None and row["name"] == ""

    with urllib.request.urlopen(url, timeout=10) as response:
        page = response.read().decode()
        policy = response.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "unsafe-inline" not in policy.split("style-src")[0]
    assert '<table id="peers">' in page
