"""The dashboard's page in a real browser: Debian's headless Chromium driven by Selenium
(deploy/setup-test-tools.sh installs both), against real processes on loopback.

- a real 3-peer run: the table shows 3 live rows, the loss chart has points, a SIGKILLed peer
  is marked gone within the heartbeat's bound, and the page keeps updating without a reload;
  a screenshot is saved in the test's tmp dir;
- hostile published values: markup shows as text and never runs.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from swarmd.node.peer.membership import MembershipTimings
from tests.harness.hostile_publisher import SCRIPT, XSS
from tests.harness.processes import HARNESS, ProcessGroup, swarmd_cmd
from tests.harness.runs import TINY_RUN

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1100")
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium'}")
    service = Service(CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()


def until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"{what}: not within {timeout}s (last: {last!r})")


def rows(driver: webdriver.Chrome) -> dict[str, str]:
    """peer id -> the row's class ("peer live" / "peer gone")."""
    found = driver.execute_script(
        "return [...document.querySelectorAll('#peers tbody tr')]"
        ".map(r => [r.dataset.peerId, r.className]);"
    )
    return dict(found)


def start_dashboard(processes: ProcessGroup, boot: str, run: str) -> str:
    args = ("--peers", boot, "--listen", "127.0.0.1:0", "--poll", "0.5")
    proc = processes.start(swarmd_cmd("dashboard", "--run", run, *args))
    return str(proc.info["url"])


def test_live_run_in_a_browser(
    processes: ProcessGroup, tmp_path: Path, browser: webdriver.Chrome
) -> None:
    (tmp_path / "run.toml").write_text(TINY_RUN)
    boot = processes.start(swarmd_cmd("dht", "--state-dir", str(tmp_path / "boot"))).address
    common = ("--run", "t", "--peers", boot, "--log-format", "json", "--duration", "600")
    common += ("--progress-interval", "1")
    create = ("--create-run", str(tmp_path / "run.toml"))
    peers = processes.start_many(
        [
            swarmd_cmd(
                "join",
                *common,
                "--state-dir",
                str(tmp_path / f"p{i}"),
                "--public-name",
                f"peer {i}",
                *(create if i == 0 else ()),
            )
            for i in range(3)
        ],
        timeout=90,
    )
    browser.get(start_dashboard(processes, boot, "t"))
    ids = [str(p.info["peer_id"]) for p in peers]
    until(lambda: [rows(browser).get(i) for i in ids] == ["peer live"] * 3, 90, "3 live rows")
    loss_points = (
        "const c = window.swarmdDashboard.charts.loss; if (!c) return 0;"
        "return c.plot.data.slice(1).flat().filter(v => v !== null && v !== undefined).length;"
    )
    until(lambda: browser.execute_script(loss_points) >= 6, 90, "loss points of 2 rounds")
    # Bytes a step against data-parallel: both series drawn, the peers' far below (DiLoCo
    # with int8 parts syncs every 5 steps here), the ratio shown in the run's facts.
    bytes_series = (
        "const c = window.swarmdDashboard.charts.bytes; if (!c) return [];"
        "return c.plot.data.slice(1);"
    )
    until(lambda: len(browser.execute_script(bytes_series)[0]) >= 2, 60, "bytes points")
    peers_bytes, ddp = browser.execute_script(bytes_series)
    assert 0 < peers_bytes[-1] < ddp[-1], (peers_bytes, ddp)
    until(lambda: "fewer" in browser.find_element(By.ID, "bytes-ratio").text, 10, "bytes ratio")
    assert "peer 1" in browser.find_element(By.CSS_SELECTOR, "#peers tbody").text

    browser.execute_script("window.__notReloaded = true;")
    updates = browser.execute_script("return window.swarmdDashboard.updates;")
    os.kill(peers[2].pid, signal.SIGKILL)
    killed = time.monotonic()
    until(
        lambda: rows(browser).get(ids[2]) == "peer gone",
        MembershipTimings().heartbeat_ttl_s + 15,
        "marked gone",
    )
    gone_after = time.monotonic() - killed
    assert [rows(browser)[i] for i in ids[:2]] == ["peer live"] * 2
    assert browser.execute_script("return window.__notReloaded === true;")
    assert browser.execute_script("return window.swarmdDashboard.updates;") > updates
    events = browser.find_element(By.ID, "events").text
    assert "peer 2" in events and "left" in events
    screenshot = tmp_path / "dashboard.png"
    assert browser.save_screenshot(str(screenshot)) and screenshot.stat().st_size > 10_000
    print(f"peer marked gone {gone_after:.1f}s after SIGKILL; screenshot {screenshot}")


def test_hostile_values_are_text_in_a_browser(
    processes: ProcessGroup, tmp_path: Path, browser: webdriver.Chrome
) -> None:
    boot = processes.start(swarmd_cmd("dht", "--state-dir", str(tmp_path / "boot"))).address
    script = HARNESS / "hostile_publisher.py"
    publisher = processes.start([sys.executable, str(script), boot], timeout=60)
    browser.get(start_dashboard(processes, boot, "evil"))
    until(lambda: len(rows(browser)) == 3, 30, "3 rows")
    markup = str(publisher.info["markup"])
    # Read in one script call: the table's rows are replaced at every refresh.
    row_text = f"return document.querySelector('tr[data-peer-id=\"{markup}\"]').innerText;"
    text = until(lambda: (t := browser.execute_script(row_text)) and SCRIPT in t and t, 10, "name")
    assert "<b>cpu</b>" in text
    assert browser.find_element(By.ID, "algo").text == XSS
    assert browser.find_element(By.ID, "model").text.startswith(SCRIPT)
    assert "malformed value(s) refused" in browser.find_element(By.ID, "status").text
    # Nothing published became an element or ran.
    assert browser.execute_script("return window.__xss === undefined;")
    assert browser.find_elements(By.CSS_SELECTOR, "main img, header img, main b, main script") == []


def stage_rows(driver: webdriver.Chrome) -> list[list[str]]:
    """The stages table: [class, stage cell, servers cell] per row."""
    found: list[list[str]] = driver.execute_script(
        "return [...document.querySelectorAll('#stages tbody tr')]"
        ".map(r => [r.className, r.cells[0].textContent, r.cells[2].textContent]);"
    )
    return found


# Slow tier; default suite: a live run in a browser and hostile values as text (above).
@pytest.mark.slow
def test_swarm_stages_in_a_browser(
    processes: ProcessGroup, tmp_path: Path, browser: webdriver.Chrome
) -> None:
    """A SWARM run's stages: one server each and a trainer, then stage 1's server is
    SIGKILLed: the table shows stage 1 with no server as the bottleneck, and the events say
    so; a new server takes the lost stage and its recovery is listed (its own notice)."""
    run = TINY_RUN.replace("n_layer = 1", "n_layer = 2") + 'algo = "swarm"\nswarm_stages = 2\n'
    (tmp_path / "run.toml").write_text(run)
    boot = processes.start(swarmd_cmd("dht", "--state-dir", str(tmp_path / "boot"))).address
    common = ("--run", "s", "--peers", boot, "--log-format", "json", "--duration", "600")
    create = ("--create-run", str(tmp_path / "run.toml"))

    def server(name: str, stage: int, *extra: str) -> list[str]:
        return swarmd_cmd(
            "join", *common, "--state-dir", str(tmp_path / name), "--role", "server",
            "--stage", str(stage), "--progress-interval", "1", *extra,
        )  # fmt: skip

    servers = processes.start_many([server("s0", 0, *create), server("s1", 1)], timeout=90)
    processes.start_many(
        [swarmd_cmd("join", *common, "--state-dir", str(tmp_path / "t"), "--role", "trainer")],
        timeout=90,
    )
    browser.get(start_dashboard(processes, boot, "s"))

    def served() -> bool:
        found = stage_rows(browser)
        return len(found) == 2 and all("none" not in r[2] for r in found)

    until(served, 90, "2 stages, each served")
    # The run has trained (stage 0 stepped on a gradient) before its last stage is lost.
    while not (
        (e := servers[0].receive(timeout=90))["event"] == "stage_round" and e["micro_batches"]
    ):
        pass
    os.kill(servers[1].pid, signal.SIGKILL)
    # The dead server's record lapses (12 s) and stage 1 shows unserved, the bottleneck.
    until(
        lambda: (
            stage_rows(browser)[1][0] == "stage bottleneck" and "none" in stage_rows(browser)[1][2]
        ),
        40,
        "stage 1 unserved",
    )
    assert "stage 1 has no server" in browser.find_element(By.ID, "events").text
    processes.start_many([server("s1b", 1)], timeout=90)
    until(
        lambda: "stage 1 lost" in browser.find_element(By.ID, "recoveries").text,
        60,
        "the recovery listed",
    )
    assert "stage 1 is served again" in browser.find_element(By.ID, "events").text
    screenshot = tmp_path / "stages.png"
    assert browser.save_screenshot(str(screenshot)) and screenshot.stat().st_size > 10_000
