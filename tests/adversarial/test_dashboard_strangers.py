"""Throwaway identities claiming huge rounds do not take the dashboard over (issue 47, item 6).

Before: 60 identities publishing progress records and state adverts with self-declared rounds
up to 2^63 - 1 set the run's displayed round to 9223372036854775807, evicted the honest points
from the loss chart, made the honest peers' agreeing states show as "differs" and filled all
200 event slots. Real `swarmd dht` and `swarmd dashboard` processes; the records are signed
and stored as a peer would (tests/harness/hostile_publisher.py, "strangers").
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.harness.hostile_publisher import HONEST_ROUND, STRANGERS
from tests.harness.processes import HARNESS, ProcessGroup, swarmd_cmd


def get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: dict[str, Any] = json.loads(response.read())
        return body


def test_throwaway_identities_claiming_huge_rounds_leave_the_page_to_the_honest_peers(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    boot = processes.start(swarmd_cmd("dht", "--state-dir", str(tmp_path / "boot"))).address
    script = HARNESS / "hostile_publisher.py"
    publisher = processes.start([sys.executable, str(script), boot, "strangers"], timeout=90)
    honest = set(publisher.info["honest"])
    (dashboard,) = processes.start_many(
        [swarmd_cmd("dashboard", "--run", "strangers", "--peers", boot, "--listen",
                    "127.0.0.1:0", "--poll", "0.5")]
    )  # fmt: skip
    url = str(dashboard.info["url"])
    deadline, run = time.monotonic() + 60, get(url + "api/run")
    while run["live_peers"] < 3 + STRANGERS and time.monotonic() < deadline:
        time.sleep(0.3)
        run = get(url + "api/run")
    assert run["live_peers"] == 3 + STRANGERS, run
    # The round the creator advertises, not the largest anyone claims.
    assert run["round"] == HONEST_ROUND, run
    peers = {row["peer_id"]: row for row in get(url + "api/peers")["peers"]}
    assert all(peers[p]["state_agrees"] for p in honest), [peers[p] for p in honest]
    assert sum(row["state_agrees"] is True for row in peers.values()) == len(honest)
    # The loss chart is the honest peers' round.
    loss = get(url + "api/history")["loss"]
    assert loss["rounds"] == [HONEST_ROUND], loss["rounds"][:5]
    assert {s["peer_id"] for s in loss["series"]} == honest
    # The joins of a poll fold into one event past eight.
    events = get(url + "api/events")["events"]
    joined = [e for e in events if e["kind"] == "joined"]
    assert len(joined) <= 9 and len(events) < 20, events
