"""DHT records: canonical signatures, size/expiry limits, peer-bound sub-keys, verify cache."""

from __future__ import annotations

import dataclasses

import pytest

from swarmd.node.dht.records import (
    Record,
    RecordError,
    RecordLimits,
    Verifier,
    check_shape,
    sign_record,
)
from swarmd.protocol.identity import Identity

NOW = 1_800_000_000.0
LIMITS = RecordLimits(max_key_bytes=64, max_subkey_bytes=60, max_value_bytes=1024, max_ttl_s=3600)


def check(record: Record, verifier: Verifier | None = None) -> None:
    (verifier or Verifier()).check(record, LIMITS, NOW)


def test_signed_record_verifies_and_round_trips_through_protobuf() -> None:
    me = Identity.generate()
    record = sign_record(me, b"run/config", b"value", NOW + 60, subkey=b"lr")
    check(record)
    again = Record.from_pb(record.to_pb())
    assert again == record
    assert again.owner == me.peer_id
    assert again.expires == pytest.approx(NOW + 60)
    plain = sign_record(me, b"k", b"v", NOW + 60)
    assert Record.from_pb(plain.to_pb()).subkey is None
    # An empty sub-key is a sub-key, not "no sub-key": the two must not collide.
    empty = sign_record(me, b"k", b"v", NOW + 60, subkey=b"")
    assert Record.from_pb(empty.to_pb()).subkey == b""
    assert empty.signed_message() != plain.signed_message()


@pytest.mark.parametrize(
    "change",
    [
        {"value": b"other"},
        {"key": b"run/other"},
        {"subkey": b"lr2"},
        {"subkey": None},
        {"expires_ms": int((NOW + 3000) * 1000)},
        {"owner_key": Identity.generate().public_key},
    ],
)
def test_any_tampering_breaks_the_signature(change: dict[str, object]) -> None:
    record = sign_record(Identity.generate(), b"run/config", b"value", NOW + 60, subkey=b"lr")
    with pytest.raises(RecordError, match="signature"):
        check(dataclasses.replace(record, **change))  # type: ignore[arg-type]


def test_unsigned_and_forged_records_are_refused() -> None:
    record = sign_record(Identity.generate(), b"k", b"v", NOW + 60)
    with pytest.raises(RecordError, match="not signed"):
        check(dataclasses.replace(record, signature=b""))
    with pytest.raises(RecordError, match="not signed"):
        check(dataclasses.replace(record, owner_key=b""))
    forged = dataclasses.replace(record, signature=bytes(64))
    with pytest.raises(RecordError, match="signature does not verify"):
        check(forged)


def test_size_and_expiry_limits() -> None:
    me = Identity.generate()
    with pytest.raises(RecordError, match="key of 65 B"):
        check(sign_record(me, b"k" * 65, b"v", NOW + 60))
    with pytest.raises(RecordError, match="empty key"):
        check(sign_record(me, b"", b"v", NOW + 60))
    with pytest.raises(RecordError, match="sub-key of 61 B"):
        check(sign_record(me, b"k", b"v", NOW + 60, subkey=b"s" * 61))
    with pytest.raises(RecordError, match="value of 1025 B"):
        check(sign_record(me, b"k", b"v" * 1025, NOW + 60))
    with pytest.raises(RecordError, match="expired"):
        check(sign_record(me, b"k", b"v", NOW - 1))
    with pytest.raises(RecordError, match="ahead"):
        check(sign_record(me, b"k", b"v", NOW + 3601))
    check(sign_record(me, b"k" * 64, b"v" * 1024, NOW + 3600, subkey=b"s" * 60))


def test_a_sub_key_naming_a_peer_can_only_be_written_by_that_peer() -> None:
    me, other = Identity.generate(), Identity.generate()
    limits = RecordLimits()
    check_shape(sign_record(me, b"k", b"v", NOW + 60, str(me.peer_id).encode()), limits, NOW)
    squat = sign_record(other, b"k", b"v", NOW + 60, str(me.peer_id).encode())
    with pytest.raises(RecordError, match="names a peer"):
        check_shape(squat, limits, NOW)


def test_verifier_caches_only_valid_records(monkeypatch: pytest.MonkeyPatch) -> None:
    import swarmd.node.dht.records as records
    from swarmd.protocol.identity import verify_signature as real

    calls = 0

    def counting(*args: bytes) -> bool:
        nonlocal calls
        calls += 1
        return real(*args)

    monkeypatch.setattr(records, "verify_signature", counting)
    verifier = Verifier(capacity=2)
    record = sign_record(Identity.generate(), b"k", b"v", NOW + 60)
    for _ in range(3):
        verifier.verify(record)
    assert calls == 1
    forged = dataclasses.replace(record, value=b"w")
    for _ in range(2):
        with pytest.raises(RecordError):
            verifier.verify(forged)
    assert calls == 3


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_value_bytes"):
        RecordLimits(max_value_bytes=0)
    with pytest.raises(ValueError, match="finite"):
        sign_record(Identity.generate(), b"k", b"v", float("inf"))
