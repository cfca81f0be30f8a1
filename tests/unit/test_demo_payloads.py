"""DeMo payloads as a member receives them: bad ones are refused, logged, and their sender is
left out of the step; the rest are applied in the same order on every member."""

from __future__ import annotations

import logging
import struct

import pytest
import torch

from swarmd.compression.sparse_wire import encode_sparse
from swarmd.node.algorithms.demo.strategy import decode_payloads
from swarmd.node.bans import Bans
from swarmd.optim.demo import DeMo, DeMoConfig
from swarmd.protocol.identity import Identity, PeerId

CONFIG = DeMoConfig(compression_topk=4, compression_chunk=8)
LIMIT = 1 << 20


def _peer_payload(shapes: list[tuple[int, ...]], seed: int) -> tuple[DeMo, bytes]:
    torch.manual_seed(seed)
    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape)
    opt = DeMo(params, CONFIG)
    return opt, encode_sparse(opt.prepare())


def _ids(n: int) -> list[PeerId]:
    return sorted((Identity.generate().peer_id for _ in range(n)), key=str)


SHAPES = [(12, 24), (8,)]  # blocks of 6 x 8 = 48 coefficients: 6-bit indices reach 63


def test_good_payloads_come_back_in_peer_id_order() -> None:
    ids = _ids(3)
    opts_payloads = [_peer_payload(SHAPES, i) for i in range(3)]
    layout = opts_payloads[0][0].layout()
    shuffled = {
        ids[2]: opts_payloads[2][1],
        ids[0]: opts_payloads[0][1],
        ids[1]: opts_payloads[1][1],
    }
    got = decode_payloads(shuffled, layout, LIMIT)
    for (_, payload), updates in zip(opts_payloads, got, strict=True):
        again = decode_payloads({ids[0]: payload}, layout, LIMIT)[0]
        for a, b in zip(updates, again, strict=True):
            assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)


def _corrupt(payload: bytes, how: str) -> bytes:
    if how == "wrong shapes":
        return _peer_payload([(24, 12), (8,)], 9)[1]
    if how == "truncated":
        return payload[:-3]
    if how == "longer than declared":
        return payload + b"\0" * 64
    if how == "index out of range":
        # The first tensor's first index (the low 6 bits of its first byte) set to 50.
        header = struct.calcsize("<4sBBI")
        table = 1 + 1 + 4 + 4 + 2 * 4 + 1 + 1 + 4 + 4 + 1 * 4
        at = header + table
        return payload[:at] + bytes([(payload[at] & 0xC0) | 50]) + payload[at + 1 :]
    if how == "NaN values":
        bad = bytearray(payload)
        bad[-2:] = struct.pack("<H", 0x7FC0)  # a bf16 NaN as the last value
        return bytes(bad)
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how",
    ["wrong shapes", "truncated", "longer than declared", "index out of range", "NaN values"],
)
def test_a_bad_payload_is_refused_logged_and_its_sender_left_out(
    how: str, caplog: pytest.LogCaptureFixture
) -> None:
    ids = _ids(3)
    (opt, good0), (_, good1), (_, good2) = (_peer_payload(SHAPES, i) for i in range(3))
    bad = _corrupt(good2, how)
    assert bad != good2
    bans = Bans()
    with caplog.at_level(logging.WARNING, logger="swarmd.demo"):
        payloads = {ids[0]: good0, ids[1]: good1, ids[2]: bad}
        got = decode_payloads(payloads, opt.layout(), LIMIT, bans)
    assert len(got) == 2
    assert f"refused DeMo payload from {ids[2].short()}" in caplog.text
    # Bytes that do not decode are evidence: the sender is banned, nobody else.
    assert bans.banned(ids[2]) and not bans.banned(ids[0]) and not bans.banned(ids[1])
    # What is left still applies.
    opt.apply(got)
