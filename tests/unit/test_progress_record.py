"""The progress record a peer publishes for the dashboard: round trip, and refusal of anything
a hostile peer could publish instead."""

from __future__ import annotations

import dataclasses
import json

import pytest

from swarmd.node.metrics import Metrics
from swarmd.node.training.progress import TrainStats
from swarmd.node.training.progress_publish import PeerFacts, make_record, progress_ttl
from swarmd.node.training.progress_record import (
    MAX_RECORD_BYTES,
    ProgressRecord,
    ProgressRecordError,
)

GOOD = ProgressRecord(
    step=120,
    round=3,
    loss=2.5,
    val_loss=2.75,
    tokens_per_s=1234.5,
    device="cpu",
    name="alice's box",
    sent_bytes=10_000,
    received_bytes=20_000,
    group_size=3,
    last_outer="averaged",
    algo="diloco",
    params=1000,
)


def _raw(**changes: object) -> bytes:
    values = {**dataclasses.asdict(GOOD), **changes}
    return json.dumps(values).encode()


def test_round_trip() -> None:
    assert ProgressRecord.from_bytes(GOOD.to_bytes()) == GOOD
    assert len(GOOD.to_bytes()) < MAX_RECORD_BYTES // 2


def test_unknown_fields_are_ignored_missing_ones_refused() -> None:
    assert ProgressRecord.from_bytes(_raw(newer_field=[1, 2])) == GOOD
    values = dataclasses.asdict(GOOD)
    del values["loss"]
    with pytest.raises(ProgressRecordError, match="lacks loss"):
        ProgressRecord.from_bytes(json.dumps(values).encode())


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b"[1, 2]",
        b"{" * 5000,
        _raw(loss=float("nan")),
        _raw(val_loss=float("inf")),
        _raw(tokens_per_s=-1),
        _raw(tokens_per_s="fast"),
        _raw(step=-1),
        _raw(step=True),
        _raw(step=1.5),
        _raw(round=1 << 70),
        _raw(group_size=1 << 20),
        _raw(name="x" * 65),
        _raw(name=["<script>"]),
        _raw(device="cpu\x1b[2J"),
        _raw(algo="a\nb"),
        _raw(last_outer=None),
        b'{"name": "' + b"y" * 2000 + b'"}',
    ],
)
def test_malformed_records_are_refused(raw: bytes) -> None:
    with pytest.raises(ProgressRecordError):
        ProgressRecord.from_bytes(raw)


def test_markup_is_data_not_refused() -> None:
    """Markup is printable text: the record carries it; the page inserts it as text."""
    record = ProgressRecord.from_bytes(_raw(name="<script>alert(1)</script>"))
    assert record.name == "<script>alert(1)</script>"


def test_make_record_from_a_fresh_peer() -> None:
    """Before the first step the loss is NaN in TrainStats and None in the record."""
    facts = PeerFacts(run="r", algo="demo", device="cpu", name="")
    record = make_record(facts, TrainStats(), Metrics(), tokens_per_s=0.0)
    assert record.loss is None and record.val_loss is None
    assert ProgressRecord.from_bytes(record.to_bytes()) == record
    assert progress_ttl(1.0) == 15.0 and progress_ttl(10.0) == 30.0
