"""The frontier benchmark's bookkeeping: points, the Pareto set, the last line's figures."""

from __future__ import annotations

import argparse
import math

import pytest

from benchmarks.frontier import DEFAULT_POINTS, QUICK_POINTS, Point, best_gap, known_ddp, pareto


def test_points_parse_into_run_options() -> None:
    p = Point.parse("topk:0.015625:2:10")
    assert p.codec == "topk" and p.inner_steps == 10 and p.name == "topk:0.015625:2:10"
    a = p.namespace(argparse.Namespace(codec="int8", inner_steps=50, topk_density=0.5, seed=3))
    assert (a.codec, a.inner_steps, a.topk_density, a.topk_bits, a.seed) == (
        "topk", 10, 0.015625, 2, 3
    )  # fmt: skip
    assert Point.parse("lowrank:16:25").options == (("lowrank_rank", 16),)
    for bad in ("int8:4", "topk:x:2:10", "fp32:1:2", ""):
        with pytest.raises(SystemExit):
            Point.parse(bad)
    assert all(Point.parse(t) for t in (DEFAULT_POINTS + "," + QUICK_POINTS).split(","))


def test_pareto_and_best_gap_read_the_table_right() -> None:
    a, b, c, d = (Point.parse(t) for t in ("int8:4:25", "int8:4:50", "topk:0.1:2:10", "int8:4:100"))
    rows = [(a, 0.05, 200.0), (b, 0.10, 430.0), (c, 0.12, 2500.0), (d, 0.15, 400.0)]
    # d is beaten by b (smaller gap, more bytes saved); the rest trade one for the other.
    assert pareto(rows) == {a.name, b.name, c.name}
    assert best_gap(rows, 400) == 0.10 and best_gap(rows, 2000) == 0.12
    assert math.isnan(best_gap(rows, 10_000))


def test_known_ddp_rows_parse_and_bad_ones_fail() -> None:
    rows = known_ddp("1=1.6177@4791.4,2=1.6367@4791.4")
    assert set(rows) == {1, 2}
    assert rows[1].val_loss == 1.6177 and rows[2].sent_per_peer == 4791.4 * 2**20
    assert known_ddp("") == {}
    for bad in ("1=1.6", "x=1@2", "1=1@2@3"):
        with pytest.raises(SystemExit):
            known_ddp(bad)
