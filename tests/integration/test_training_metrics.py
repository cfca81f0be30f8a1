"""A training peer's `--metrics`: the swarmd_training_* families of a real peer pass `promtool
check metrics` (Debian's `prometheus`, which deploy/setup-test-tools.sh installs),
and every query of deploy/grafana/swarmd.json names a metric a peer exports."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path

from tests.harness.join import wait_for
from tests.harness.processes import ROOT, ProcessGroup, swarmd_cmd
from tests.harness.runs import TINY_RUN

PROMTOOL = "/usr/bin/promtool"


def promtool_check(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )


def exported_names(text: str) -> set[str]:
    """Every series name the exposition can hold: each family's, and a histogram's parts."""
    names: set[str] = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        names.add(name)
        if kind == "histogram":
            names.update(f"{name}_{part}" for part in ("bucket", "sum", "count"))
    return names


def test_a_training_peer_exports_lint_clean_training_metrics(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    (tmp_path / "run.toml").write_text(TINY_RUN.replace("min_group_size = 2", "min_group_size = 1"))
    boot = processes.start(swarmd_cmd("dht", "--state-dir", str(tmp_path / "boot"))).address
    args = ["join", "--run", "t", "--peers", boot, "--log-format", "json"]
    args += ["--state-dir", str(tmp_path / "p0"), "--create-run", str(tmp_path / "run.toml")]
    peer = processes.start(swarmd_cmd(*args, "--metrics", "127.0.0.1:0"))
    wait_for(peer, "outer_step")
    wait_for(peer, "outer_step")
    url = f"http://127.0.0.1:{peer.info['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()

    lint = promtool_check(text)
    assert lint.returncode == 0 and not lint.stdout.strip(), lint.stdout + lint.stderr
    values = dict(re.findall(r"^(swarmd_training_\S+) (\S+)$", text, re.MULTILINE))
    assert float(values["swarmd_training_step"]) >= 10
    assert float(values["swarmd_training_outer_round"]) >= 2
    assert float(values["swarmd_training_tokens_total"]) >= 10 * 4 * 32
    assert 0 < float(values["swarmd_training_validation_loss"]) < 20
    rounds = [float(v) for k, v in values.items() if k.startswith("swarmd_training_outer_rounds")]
    assert sum(rounds) >= 2

    exported = exported_names(text)
    grafana = json.loads((ROOT / "deploy" / "grafana" / "swarmd.json").read_text())
    queries = [t["expr"] for p in grafana["panels"] for t in p["targets"]]
    named = {n for q in queries for n in re.findall(r"\bswarmd_[a-z0-9_]+", q)}
    assert len(named) >= 10 and named <= exported, named - exported


def test_promtool_refuses_what_breaks_the_naming_rules() -> None:
    """The lint is live: a counter without _total is reported."""
    lint = promtool_check("# HELP bad_counter x\n# TYPE bad_counter counter\nbad_counter 1\n")
    assert 'counter metrics should have "_total" suffix' in lint.stdout + lint.stderr


def test_prometheus_config_scrapes_the_compose_peers_metrics_port() -> None:
    """deploy/prometheus.yml is valid, and scrapes the port the compose file's peers serve
    their metrics on (a mismatch would scrape nothing, silently)."""
    config = ROOT / "deploy" / "prometheus.yml"
    check = subprocess.run(
        [PROMTOOL, "check", "config", str(config)], capture_output=True, text=True, timeout=30
    )
    assert check.returncode == 0, check.stdout + check.stderr
    ports = re.findall(r"^\s+port: (\d+)$", config.read_text(), re.MULTILINE)
    compose = (ROOT / "deploy" / "docker-compose.yml").read_text()
    served = re.findall(r"- --metrics\n\s+- 0\.0\.0\.0:(\d+)\n", compose)
    assert ports == ["9400"] and served == ["9400", "9400"]  # the creator and the workers
