"""The reducer's validation and aggregation, without the network."""

from __future__ import annotations

import math

import pytest
import torch

from swarmd.node.averaging.reduction import (
    ReductionConfig,
    aggregate,
    check_contribution,
    clip_weights,
    norm_outliers,
    opposed_outliers,
    weight_outliers,
)


def test_weighted_mean_is_correctly_rounded_in_any_order() -> None:
    xs = [torch.randn(10_000) for _ in range(5)]
    ws = [1.0, 7.0, 0.5, 3.0, 2.5]
    truth = (sum(x.double() * w for x, w in zip(xs, ws, strict=True)) / sum(ws)).float()
    assert torch.equal(aggregate(xs, ws, ReductionConfig()), truth)
    assert torch.equal(aggregate(xs[::-1], ws[::-1], ReductionConfig()), truth)


@pytest.mark.parametrize("ws", [[1.0, 1.0, 1.0, 1.0], [0.25, 0.25], [3.0, 5.0], [2.0, 1.0, 1.0]])
def test_weighted_mean_power_of_two_totals_are_exact_too(ws: list[float]) -> None:
    """A power-of-two total is divided by multiplying with its inverse (exact in float64);
    a first weight of 1 skips the multiplication. Both must leave the result unchanged."""
    xs = [torch.randn(70_000) * 1e3 for _ in ws]
    truth = (sum(x.double() * w for x, w in zip(xs, ws, strict=True)) / sum(ws)).float()
    assert torch.equal(aggregate(xs, ws, ReductionConfig()), truth)


def test_inexact_mean_for_lossy_parts_is_within_float32_rounding() -> None:
    """exact=False (int8 parts) sums in float32: within a few float32 ulps of the true mean."""
    xs = [torch.randn(70_000) for _ in range(4)]
    ws = [1.0, 7.0, 0.5, 3.0]
    truth = sum(x.double() * w for x, w in zip(xs, ws, strict=True)) / sum(ws)
    got = aggregate(xs, ws, ReductionConfig(), exact=False)
    assert got.dtype == torch.float32 and got.shape == (70_000,)
    scale = max(float(x.abs().max()) for x in xs)
    assert float((got.double() - truth).abs().max()) <= 4 * scale * 2.0**-24
    assert not torch.equal(got, truth.float())  # it really is the cheaper, inexact sum


@pytest.mark.parametrize("exact", [True, False])
def test_mean_into_out_is_the_same_mean(exact: bool) -> None:
    xs = [torch.randn(70_001) for _ in range(3)]
    ws = [1.0, 2.0, 3.0]
    out = torch.full((70_001,), math.nan)
    got = aggregate(xs, ws, ReductionConfig(), exact=exact, out=out)
    assert got is out and torch.equal(out, aggregate(xs, ws, ReductionConfig(), exact=exact))
    for bad in (torch.empty(70_000), torch.empty(70_001, dtype=torch.float64)):
        with pytest.raises(ValueError, match="out must be"):
            aggregate(xs, ws, ReductionConfig(), exact=exact, out=bad)


def test_trimmed_mean_ignores_one_extreme_peer() -> None:
    honest = [torch.full((100,), float(v)) for v in (1.0, 2.0, 3.0, 4.0)]
    liar = torch.full((100,), 1e9)
    cfg = ReductionConfig(aggregation="trimmed_mean", trim_fraction=0.2)
    out = aggregate([*honest, liar], [1.0] * 5, cfg)
    assert torch.allclose(out, torch.full((100,), 3.0))  # drops 1.0 and 1e9, means 2, 3, 4


def test_centered_clip_bounds_a_liars_pull() -> None:
    honest = [torch.randn(1000) * 0.01 + 1.0 for _ in range(6)]
    liar = torch.full((1000,), 1e6)
    cfg = ReductionConfig(aggregation="centered_clip")
    out = aggregate([*honest, liar], [1.0] * 7, cfg)
    plain = aggregate([*honest, liar], [1.0] * 7, ReductionConfig())
    assert float((out - 1.0).abs().max()) < 0.5
    assert float((plain - 1.0).abs().max()) > 1e5


def test_check_contribution() -> None:
    assert check_contribution(torch.zeros(4), 4) is None
    assert "shape" in str(check_contribution(torch.zeros(5), 4))
    assert "shape" in str(check_contribution(torch.zeros(2, 2), 4))
    assert "dtype" in str(check_contribution(torch.zeros(4, dtype=torch.float64), 4))
    nan, inf = torch.tensor([0.0, math.nan, 0, 0]), torch.tensor([0.0, -math.inf, 0, 0])
    assert check_contribution(nan, 4) is None  # form only: values are screened by norm
    assert norm_outliers({0: nan, 1: inf, 2: torch.ones(4)}, ReductionConfig()) == {
        0: "non-finite values",
        1: "non-finite values",
    }


def test_norm_outliers() -> None:
    values = {i: torch.randn(1000) for i in range(4)}
    assert norm_outliers(values, ReductionConfig()) == {}
    values[2] = values[2] * 1000
    assert set(norm_outliers(values, ReductionConfig())) == {2}
    # Two contributions give no majority to compare against: only the absolute bound applies.
    pair = {0: torch.ones(4), 1: torch.ones(4) * 1e6}
    assert norm_outliers(pair, ReductionConfig()) == {}
    assert set(norm_outliers(pair, ReductionConfig(max_norm=10.0))) == {1}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"aggregation": "median"},
        {"trim_fraction": 0.5},
        {"norm_outlier_factor": 1.0},
        {"max_norm": 0.0},
        {"clip_iterations": 0},
    ],
)
def test_config_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ReductionConfig(**kwargs)  # type: ignore[arg-type]


def test_in_a_pair_the_reducers_own_contribution_bounds_the_other() -> None:
    pair = {0: torch.ones(4), 1: torch.ones(4) * 100}
    assert set(norm_outliers(pair, ReductionConfig(), own=0)) == {1}
    assert norm_outliers(pair, ReductionConfig(), own=1) == {}  # smaller than own: fine
    assert norm_outliers({0: torch.ones(4), 1: torch.ones(4) * 5}, ReductionConfig(), own=0) == {}


def test_declared_weights_are_bounded() -> None:
    config = ReductionConfig(max_weight=1000.0)
    assert weight_outliers({0: 400.0, 1: 400.0}, config) == {}
    assert set(weight_outliers({0: 400.0, 1: 1e9}, config)) == {1}  # a pair: the run's bound
    assert weight_outliers({0: 400.0, 1: 380.0, 2: 1e9}, ReductionConfig()) == {}  # no bound


def test_a_weight_far_above_the_median_counts_as_the_runs_multiple_of_it() -> None:
    """Clipped, not dropped: with rounds bounded in time a fast honest peer declares several
    times the median (a liar gains no more than 4 x the median either way)."""
    config = ReductionConfig()
    assert clip_weights({0: 400.0, 1: 380.0, 2: 1e9}, config) == {0: 400.0, 1: 380.0, 2: 1600.0}
    assert clip_weights({0: 400.0, 1: 380.0, 2: 1500.0}, config)[2] == 1500.0
    assert clip_weights({0: 1.0, 1: 1e9}, config) == {0: 1.0, 1: 1e9}  # a pair: no median
    values = [torch.full((4,), 1.0), torch.full((4,), 1.0), torch.full((4,), 10.0)]
    weights = list(clip_weights({0: 1.0, 1: 1.0, 2: 100.0}, config).values())
    assert torch.allclose(aggregate(values, weights, config), torch.full((4,), 7.0))


def test_a_contribution_opposed_to_most_others_is_dropped_only_with_a_majority() -> None:
    on = ReductionConfig(drop_opposed=True)
    a = torch.tensor([1.0, 2.0, 0.5])
    agree = {0: a, 1: a * 2, 2: a * 0.5, 3: -a * 3}
    assert set(opposed_outliers(agree, on)) == {3}
    assert "opposed to 3 of the other 3" in opposed_outliers(agree, on)[3]
    assert opposed_outliers(agree, ReductionConfig()) == {}  # off unless the run asks
    assert opposed_outliers({0: a, 1: -a}, on) == {}  # a pair: no majority
    assert opposed_outliers({0: a, 1: a, 2: -a, 3: -a}, on) == {}  # two camps: no majority
    # Against one of the three others (not more than half): kept.
    b = torch.tensor([0.0, 0.0, 1.0])
    assert opposed_outliers({0: a, 1: a, 2: b, 3: a - 3 * b}, on) == {}
