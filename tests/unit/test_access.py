"""Run access rules (node/access.py) on hand-made records and calls."""

from __future__ import annotations

import pytest

from swarmd.node.access import MAX_LISTED, AccessError, AccessList, RunAccess, derive_key
from swarmd.node.dht import Value
from swarmd.node.runkeys import access_key, config_key, members_key
from swarmd.protocol import rpc
from swarmd.protocol.identity import Identity, PeerId

SECRET = b"a-secret-of-enough-bytes"


def _ids(n: int) -> list[PeerId]:
    return [Identity.generate().peer_id for _ in range(n)]


def _ctx(peer: PeerId, signature: bytes = b"s" * 64, access: bytes = b"") -> rpc.CallContext:
    return rpc.CallContext("/x/Y", peer, "ipv4:127.0.0.1:1", signature, access)


def _denied(access: RunAccess, ctx: rpc.CallContext) -> bool:
    try:
        access.gate(ctx)
    except rpc.RpcError as exc:
        assert exc.code is rpc.StatusCode.PERMISSION_DENIED
        return True
    return False


def test_access_list_round_trips_and_refuses_malformed_records() -> None:
    a, b = _ids(2)
    listed = AccessList(frozenset({a}), frozenset({b}), 7)
    assert AccessList.from_bytes(listed.to_bytes()) == listed
    for raw in (b"{", b"[]", b'{"allow": [], "deny": []}', b'{"allow": ["x"], "deny": [], '
                b'"version": 1}', b'{"allow": [], "deny": [], "version": -1}'):  # fmt: skip
        with pytest.raises(AccessError):
            AccessList.from_bytes(raw)
    with pytest.raises(AccessError):
        AccessList(frozenset({a}), frozenset({a}))
    with pytest.raises(AccessError):
        AccessList.from_bytes(b'{"allow": [' + b",".join([b'"x"'] * (MAX_LISTED + 1)) + b"]}")


def test_allow_and_deny_move_a_key_and_always_raise_the_version() -> None:
    (a,) = _ids(1)
    listed = AccessList(version=100).allowing(a, now_ms=50)
    assert a in listed.allow and listed.version == 101
    denied = listed.denying(a, now_ms=500)
    assert a in denied.deny and a not in denied.allow and denied.version == 500


def test_allowlist_admits_listed_keys_and_the_creator_and_refuses_the_rest() -> None:
    creator, me, friend, stranger = _ids(4)
    access = RunAccess("r", "allowlist", creator, me)
    assert not access.listed_in() and access.admits(me)  # its own records are always read
    access.listed = AccessList(frozenset({me, friend}))
    assert access.listed_in()
    assert access.admits(creator) and access.admits(friend) and not access.admits(stranger)
    assert not _denied(access, _ctx(friend)) and not _denied(access, _ctx(creator))
    assert _denied(access, _ctx(stranger))
    assert _denied(access, rpc.CallContext("/x/Y", None, "ipv4:127.0.0.1:1"))


def test_a_secret_run_needs_a_tag_of_this_request_under_this_secret() -> None:
    creator, me, other = _ids(3)
    access = RunAccess("r", "secret", creator, me, SECRET, paths=frozenset({"/x/Y"}))
    sig = b"q" * 64
    tag = access.request_tag("/x/Y", sig)
    assert len(tag) == 32 and access.request_tag("/dht/Find", sig) == b""
    assert not _denied(access, _ctx(other, sig, tag))
    assert _denied(access, _ctx(other, sig))  # no tag
    assert _denied(access, _ctx(other, b"r" * 64, tag))  # another request's tag
    guess = RunAccess("r", "secret", creator, me, b"another-secret-of-bytes", paths=access.paths)
    assert _denied(access, _ctx(other, sig, guess.request_tag("/x/Y", sig)))
    # The same secret under another run name gives other tags.
    assert derive_key("r", SECRET) != derive_key("r2", SECRET)
    with pytest.raises(AccessError, match="--secret-file"):
        RunAccess("r", "secret", creator, me)
    with pytest.raises(AccessError, match="at least 16 bytes"):
        RunAccess("r", "secret", creator, me, b"short")


def test_member_tokens_admit_only_their_own_signer() -> None:
    creator, me, member, copier = _ids(4)
    access = RunAccess("r", "secret", creator, me, SECRET)
    token = access.member_token(member)
    access.take_members(
        [
            (str(member), Value(token, 0.0, member)),
            # A copied token under the copier's own sub-key does not verify for its key.
            (str(copier), Value(token, 0.0, copier)),
        ]
    )
    assert access.admits(member) and not access.admits(copier)
    assert not access.creator_token_mismatch({})
    assert access.creator_token_mismatch({str(creator): Value(b"x" * 32, 0.0, creator)})
    good = {str(creator): Value(access.member_token(creator), 0.0, creator)}
    assert not access.creator_token_mismatch(good)


def test_only_the_creators_newest_list_is_taken() -> None:
    creator, me, stranger, friend = _ids(4)
    access = RunAccess("r", "allowlist", creator, me)
    forged = AccessList(frozenset({stranger}), version=10**12).to_bytes()
    access.take_list({str(stranger): Value(forged, 0.0, stranger)})
    access.take_list({str(creator): Value(forged, 0.0, stranger)})  # wrong signer in the slot
    assert not access.admits(stranger)
    access.take_list({str(creator): Value(AccessList(frozenset({friend}), version=5).to_bytes(),
                                          0.0, creator)})  # fmt: skip
    access.take_list({str(creator): Value(AccessList(version=4).to_bytes(), 0.0, creator)})
    assert access.admits(friend)  # an older replica's copy did not replace it
    access.take_list({str(creator): Value(b"{not json", 0.0, creator)})
    assert access.admits(friend)


def test_a_creator_ban_refuses_a_key_in_every_mode() -> None:
    creator, me, banned = _ids(3)
    for mode, secret in (("open", None), ("allowlist", None), ("secret", SECRET)):
        access = RunAccess("r", mode, creator, me, secret, paths=frozenset({"/x/Y"}))  # type: ignore[arg-type]
        access.listed = AccessList(deny=frozenset({banned}), version=1)
        assert not access.admits(banned)
        sig = b"z" * 64
        assert _denied(access, _ctx(banned, sig, access.request_tag("/x/Y", sig)))
        assert not access.dht_filter(b"swarmd/r/peers", banned)


def test_the_dht_filter_covers_the_runs_keys_but_not_its_config_or_other_runs() -> None:
    creator, me, stranger = _ids(3)
    access = RunAccess("r", "allowlist", creator, me)
    for key in ("swarmd/r/mm/0/3/abc", "swarmd/r/peers", "swarmd/r/stages", "r/state"):
        assert not access.dht_filter(key.encode(), stranger), key
        assert access.dht_filter(key.encode(), creator)
    for key in (config_key("r"), access_key("r"), members_key("r"), "swarmd/other/peers"):
        assert access.dht_filter(key.encode(), stranger), key


def test_the_run_config_knows_the_same_modes() -> None:
    from swarmd.node.access import ACCESS_MODES
    from swarmd.node.peer import runconfig

    assert runconfig.ACCESS_MODES == ACCESS_MODES
    with pytest.raises(runconfig.RunConfigError, match="access must be one of"):
        runconfig.RunConfig(name="r", access="closed")
