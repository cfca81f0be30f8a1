"""Identity keys on disk, peer ids, and the replay guard's refusals."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.protocol.errors import AuthError, IdentityError
from swarmd.protocol.identity import KEY_FILE, Identity, PeerId, ReplayGuard, SignedHeader


def test_key_created_private_and_id_stable(tmp_path: Path) -> None:
    created = Identity.create(tmp_path / "state")
    path = tmp_path / "state" / KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = Identity.load(tmp_path / "state")
    assert loaded.peer_id == created.peer_id
    assert loaded.public_key == created.public_key
    assert PeerId.from_string(str(created.peer_id)) == created.peer_id
    assert created.peer_id == PeerId.from_public_key(created.public_key)
    assert Identity.generate().peer_id != created.peer_id


def test_refuses_to_overwrite_or_load_unsafe_keys(tmp_path: Path) -> None:
    Identity.create(tmp_path)
    with pytest.raises(IdentityError, match="already exists"):
        Identity.create(tmp_path)
    os.chmod(tmp_path / KEY_FILE, 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        Identity.load(tmp_path)
    os.chmod(tmp_path / KEY_FILE, 0o600)
    (tmp_path / KEY_FILE).write_bytes(b"not a key")
    with pytest.raises(IdentityError, match="not a valid identity key"):
        Identity.load(tmp_path)
    with pytest.raises(IdentityError, match="no identity"):
        Identity.load(tmp_path / "missing")


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_replay_guard() -> None:
    clock = Clock(1_000_000.0)
    guard = ReplayGuard(max_skew_s=30, clock=clock)
    me = Identity.generate()
    header = me.sign_request("/a/B", b"body", now=clock.now)
    assert guard.verify("/a/B", header, b"body") == me.peer_id
    with pytest.raises(AuthError, match="replayed"):
        guard.verify("/a/B", header, b"body")
    with pytest.raises(AuthError, match="signature"):
        guard.verify("/a/B", me.sign_request("/a/B", b"other", now=clock.now), b"body")
    with pytest.raises(AuthError, match="signature"):
        guard.verify("/a/C", me.sign_request("/a/B", b"body", now=clock.now), b"body")
    with pytest.raises(AuthError, match="away from our clock"):
        guard.verify("/a/B", me.sign_request("/a/B", b"body", now=clock.now - 31), b"body")
    with pytest.raises(AuthError, match="away from our clock"):
        guard.verify("/a/B", me.sign_request("/a/B", b"body", now=clock.now + 31), b"body")
    # After the window passes the nonce is forgotten, and the old request is refused as stale.
    clock.now += 61
    assert len(guard._seen) == 1
    with pytest.raises(AuthError, match="away from our clock"):
        guard.verify("/a/B", header, b"body")
    guard.verify("/a/B", me.sign_request("/a/B", b"body", now=clock.now), b"body")
    assert len(guard._seen) == 1  # only the new nonce is remembered


def test_replay_guard_refuses_rather_than_forgets() -> None:
    clock = Clock(500.0)
    guard = ReplayGuard(max_skew_s=30, max_entries=3, clock=clock)
    me = Identity.generate()
    for _ in range(3):
        guard.verify("/m", me.sign_request("/m", b"", now=clock.now), b"")
    with pytest.raises(AuthError, match="too many"):
        guard.verify("/m", me.sign_request("/m", b"", now=clock.now), b"")


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["swarmd-key-bin", "swarmd-ts", "swarmd-nonce-bin", "swarmd-sig-bin", "x"]),
        st.one_of(st.binary(max_size=80), st.text(max_size=20)),
    )
)
def test_random_metadata_only_clear_errors(metadata: dict[str, str | bytes]) -> None:
    guard = ReplayGuard()
    with pytest.raises(AuthError):
        guard.verify("/m", SignedHeader.from_metadata(metadata), b"")
