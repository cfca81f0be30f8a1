"""benchmarks/wan.py's short run: 4 netns hosts, tbf links, the latency fault and a NAT router
all come up, the all-reduce completes in every configuration, and the last line has every key
(the 25M-value figures are the benchmark's, not a test's)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.harness.processes import ROOT


# Slow tier; a benchmark's run; netns hosts and shaped links stay in the default suite
# (test_netns).
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wan_benchmark_short_run_reports_every_figure() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "wan.py"), "--mparams", "0.2", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "degraded" not in done.stdout, done.stdout
    last = done.stdout.strip().splitlines()[-1]
    figures = dict(item.split("=") for item in last.split())
    keys = ["round_s_fp32", "round_s_int8", "bound_s_fp32", "bound_s_int8", "link_efficiency"]
    keys += ["round_s_int8_nat", "bound_s_int8_nat", "nat_cost"]
    assert list(figures) == keys, last
    assert all(float(v) > 0 for v in figures.values()), last
    # Three host sets were made (tags of 6 hex digits; other tests use 8) and all removed.
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    tags = {ln.split()[0].split("-")[1] for ln in left.splitlines() if ln.startswith("swd-")}
    assert not [t for t in tags if len(t) == 6], left
