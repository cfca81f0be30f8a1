"""The progress record a peer publishes for the dashboard: round trip, and refusal of anything
a hostile peer could publish instead."""

from __future__ import annotations

import dataclasses
import json

import pytest

from swarmd.node.metrics import Metrics
from swarmd.node.peer.progress import Progress, TrainStats
from swarmd.node.peer.progress_publish import PeerFacts, make_record, progress_ttl
from swarmd.node.peer.progress_record import (
    MAX_NOTICE_TEXT,
    MAX_NOTICES,
    MAX_RECORD_BYTES,
    MAX_TEXT,
    Notice,
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
        _raw(in_flight=-1),
        _raw(in_flight="0"),
        _raw(notices={"time": 1.0}),
        _raw(notices=[{"time": 1.0, "kind": "peer_banned"}]),
        _raw(notices=[{"time": 1.0, "kind": "peer_banned", "text": "x", "more": 1}]),
        _raw(notices=[{"time": float("nan"), "kind": "k", "text": "x"}]),
        _raw(notices=[{"time": 1.0, "kind": "k", "text": "x" * (MAX_NOTICE_TEXT + 1)}]),
        _raw(notices=[{"time": 1.0, "kind": "k", "text": "a\x1b[2Jb"}]),
        _raw(notices=[{"time": 1.0, "kind": "k", "text": "x"}] * (MAX_NOTICES + 1)),
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


def test_records_of_peers_before_the_optional_fields_still_read() -> None:
    values = dataclasses.asdict(GOOD)
    del values["in_flight"], values["notices"]
    assert ProgressRecord.from_bytes(json.dumps(values).encode()) == GOOD


def test_the_longest_record_fits() -> None:
    """Every text at its longest, in 4-byte characters, notices included: under the limit."""
    wide = "\U0001f600"
    notices = tuple(Notice(1e10, wide * 32, wide * MAX_NOTICE_TEXT) for _ in range(MAX_NOTICES))
    record = dataclasses.replace(
        GOOD,
        name=wide * MAX_TEXT,
        device=wide * MAX_TEXT,
        algo=wide * MAX_TEXT,
        last_outer=wide * MAX_TEXT,
        in_flight=1024,
        notices=notices,
    )
    raw = record.to_bytes()
    assert len(raw) <= MAX_RECORD_BYTES and ProgressRecord.from_bytes(raw) == record


def test_bans_and_recoveries_become_notices_in_the_record() -> None:
    out = Progress("json")
    out.event("peer_banned", "banned abc for 60 s (false_data): " + "x" * 500, peer_id="abc")
    out.event("progress", "step 1")
    for n in range(MAX_NOTICES + 2):
        out.event("stage_recovered", f"stage 1 rebuilt #{n}")
    stats = TrainStats(in_flight=2)
    facts = PeerFacts(run="r", algo="streaming-diloco", device="cpu", name="")
    record = make_record(facts, stats, Metrics(), 0.0, out.notices)
    assert [n.text for n in record.notices] == [
        f"stage 1 rebuilt #{n}" for n in range(2, MAX_NOTICES + 2)
    ]
    assert record.in_flight == 2
    assert ProgressRecord.from_bytes(record.to_bytes()) == record
    out = Progress("json")
    out.event("peer_banned", "banned abc for 60 s (false_data): " + "x" * 500, peer_id="abc")
    (notice,) = out.notices
    assert notice.kind == "peer_banned" and len(notice.text) == MAX_NOTICE_TEXT
