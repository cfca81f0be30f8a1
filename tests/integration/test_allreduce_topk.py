"""The top-k all-reduce between 4 real processes equals the same arithmetic done in one
process, round after round (error feedback carried), and survives a member killed mid-round."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from swarmd.compression import DecodeLimits, TopKCodec, TopKConfig, decode
from swarmd.node.averaging.group import part_bounds
from swarmd.node.averaging.reduction import ReductionConfig, aggregate
from tests.harness.allreduce import NUMEL, WEIGHTS, load_result, members, run_round, start_peers
from tests.harness.allreduce_peer import local_values
from tests.harness.processes import Proc, ProcessGroup

# 4 parts of 12,500 values: twelve whole chunks of 1024 and a short one each.
CONFIG = TopKConfig(chunk=1024, density=1 / 32, bits=2)
SETTINGS: dict[str, Any] = {
    "codec": "topk",
    "topk_chunk": 1024,
    "topk_density": 1 / 32,
    "topk_bits": 2,
}
LIMITS = DecodeLimits(max_elements=NUMEL, max_bytes=1 << 24)


def reference(
    contributors: list[int], position: dict[int, int], rounds: int
) -> list[tuple[torch.Tensor, dict[int, torch.Tensor]]]:
    """Per round, the result every member should hold and what each contributor sent: each
    peer sends top-k of (its values + its residual) per part, keeps the rest; each part is
    the weighted mean of what was sent, in member order, served at 8 bits."""
    codec = TopKCodec(CONFIG)
    served = TopKCodec(TopKConfig(chunk=CONFIG.chunk, density=1.0, bits=8))
    bounds = part_bounds(NUMEL, [1.0] * 4)
    residual = {i: torch.zeros(NUMEL) for i in contributors}
    order = sorted(contributors, key=position.__getitem__)
    out = []
    for _ in range(rounds):
        sent = {}
        for i in contributors:
            to_send = local_values(i, NUMEL) + residual[i]
            sent[i] = torch.cat([decode(codec.encode(to_send[s:e]), LIMITS) for s, e in bounds])
            residual[i] = to_send - sent[i]
        result = torch.empty(NUMEL)
        for s, e in bounds:
            mean = aggregate(
                [sent[i][s:e] for i in order],
                [WEIGHTS[i] for i in order],
                ReductionConfig(),
                exact=False,
            )
            result[s:e] = decode(served.encode(mean), LIMITS)
        out.append((result, sent))
    return out


def check_against_the_sum(result: torch.Tensor, sent: dict[int, torch.Tensor]) -> None:
    """Independently of the library's mean: the result is sum(w_i sent_i) / sum(w_i) over
    the contributors (an entry one peer sent is divided by everyone's weight, not its own)
    within the 8-bit rounding of the served part."""
    total = sum(WEIGHTS[i] for i in sent)
    truth = sum(WEIGHTS[i] * v.double() for i, v in sent.items()) / total
    assert isinstance(truth, torch.Tensor)
    for start, end in part_bounds(NUMEL, [1.0] * 4):  # chunks start at each part's start
        for s in range(start, end, CONFIG.chunk):
            e = min(end, s + CONFIG.chunk)
            t, r = truth[s:e], result[s:e].double()
            assert float((r - t).abs().max()) <= float(t.abs().max()) / 255 * 1.01 + 1e-12
    senders = sum((v != 0).int() for v in sent.values())
    assert isinstance(senders, torch.Tensor)
    alone = int(torch.nonzero(senders == 1)[0])
    (who,) = [i for i, v in sent.items() if v[alone] != 0]
    assert float(truth[alone]) == pytest.approx(WEIGHTS[who] * float(sent[who][alone]) / total)
    assert float(result[alone]) == pytest.approx(float(truth[alone]), rel=0.02)


def positions(peers: list[Proc]) -> dict[int, int]:
    order = [m[0] for m in members(peers)]
    return {i: order.index(str(p.info["peer_id"])) for i, p in enumerate(peers)}


def test_four_peers_topk_equal_the_in_process_reference(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    peers = start_peers(processes, tmp_path, **SETTINGS)
    expected = reference([0, 1, 2, 3], positions(peers), rounds=3)
    for name, (want, sent) in zip(("t1", "t2", "t3"), expected, strict=True):
        outs = run_round(peers, peers, name)
        assert all(o["ok"] and o["dropped"] == [] and o["failed_parts"] == [] for o in outs)
        # Every reducer's proof held (a refused part would have been recovered elsewhere).
        assert all(o["recovered_parts"] == [] for o in outs), outs
        results = [load_result(o) for o in outs]
        assert all(torch.equal(r, want) for r in results), name
        check_against_the_sum(want, sent)
    # Sparse on the wire: each member sent at most k of every chunk of each part.
    assert all(int((v != 0).sum()) <= 4 * 13 * CONFIG.k for v in sent.values())


# SIGSTOP (20 s of deadlines in real time) is simulated in tests/unit/test_sim_allreduce.py.
@pytest.mark.parametrize(
    "sig", [signal.SIGKILL, pytest.param(signal.SIGSTOP, marks=pytest.mark.slow)]
)
def test_topk_member_killed_or_stopped_mid_round(
    processes: ProcessGroup, tmp_path: Path, sig: signal.Signals
) -> None:
    peers = start_peers(processes, tmp_path, behaviors={2: "slow"}, **SETTINGS)
    victim, survivors = peers[2], [p for i, p in enumerate(peers) if i != 2]
    for p in peers:
        p.send({"round": "k1", "members": members(peers)})
    time.sleep(0.5)  # everyone is mid-round: parts sent, the victim's still pending
    victim.process.send_signal(sig)
    start = time.monotonic()
    outs = [p.receive(timeout=60) for p in survivors]
    elapsed = time.monotonic() - start
    assert elapsed < 30, f"survivors took {elapsed:.1f}s"
    victim_id = str(victim.info["peer_id"])
    for o in outs:
        assert o["ok"], o
        assert o["dropped"] == [victim_id]
    results = [load_result(o) for o in outs]
    ((want, sent),) = reference([0, 1, 3], positions(peers), rounds=1)
    assert all(torch.equal(r, want) for r in results)
    check_against_the_sum(want, sent)


def test_topk_reducer_serving_a_flipped_part_is_refused(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """The proof's bound for a sparse 8-bit part is tight enough to catch a flip: the honest
    members refuse peer 1's part and re-reduce it among themselves."""
    peers = start_peers(processes, tmp_path, behaviors={1: "flip"}, **SETTINGS)
    outs = run_round(peers, peers, "liar1")
    where = positions(peers)
    honest = [o for i, o in enumerate(outs) if i != 1]
    for o in honest:
        assert o["ok"] and where[1] in o["recovered_parts"], o
    results = [load_result(o) for o in honest]
    ((all_four, _),) = reference([0, 1, 2, 3], where, rounds=1)
    ((without, _),) = reference([0, 2, 3], where, rounds=1)
    for j, (s, e) in enumerate(part_bounds(NUMEL, [1.0] * 4)):
        expected = without if j == where[1] else all_four
        assert all(torch.equal(r[s:e], expected[s:e]) for r in results), f"part {j}"
