"""Butterfly all-reduce between 4 real processes: exact results, and failures survived."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch
import trio

from swarmd.node.averaging.allreduce import PUT_PART, part_bounds
from swarmd.protocol import averaging_pb2 as apb
from swarmd.protocol import rpc
from swarmd.protocol.framing import TensorMeta
from swarmd.protocol.identity import Identity
from tests.harness.allreduce import (
    NUMEL,
    load_result,
    members,
    run_round,
    start_peers,
    weighted_mean,
)
from tests.harness.allreduce_peer import local_values, round_id
from tests.harness.processes import ProcessGroup


def test_four_peers_fp32_exact_weighted_mean(processes: ProcessGroup, tmp_path: Path) -> None:
    peers = start_peers(processes, tmp_path)
    for name in ("r1", "r2"):
        outs = run_round(peers, peers, name)
        assert all(o["ok"] and o["dropped"] == [] and o["failed_parts"] == [] for o in outs)
        results = [load_result(o) for o in outs]
        assert torch.equal(results[0], weighted_mean([0, 1, 2, 3]))
        assert all(torch.equal(r, results[0]) for r in results)


def test_four_peers_int8_within_bound(processes: ProcessGroup, tmp_path: Path) -> None:
    peers = start_peers(processes, tmp_path, codec="int8")
    outs = run_round(peers, peers, "q1")
    assert all(o["ok"] for o in outs)
    results = [load_result(o) for o in outs]
    assert all(torch.equal(r, results[0]) for r in results)  # the same bytes everywhere
    truth = weighted_mean([0, 1, 2, 3])
    # Each sender's part is quantised once (error <= absmax/254 per block), the mean once more.
    sent = max(float(local_values(i, NUMEL).abs().max()) for i in range(4)) / 254
    bound = sent + float(truth.abs().max()) / 254 + 1e-6
    err = float((results[0] - truth).abs().max())
    assert 0 < err <= bound, (err, bound)


# SIGSTOP (20 s of deadlines in real time) is simulated in tests/unit/test_sim_allreduce.py.
@pytest.mark.parametrize(
    "sig", [signal.SIGKILL, pytest.param(signal.SIGSTOP, marks=pytest.mark.slow)]
)
def test_peer_killed_or_stopped_mid_round(
    processes: ProcessGroup, tmp_path: Path, sig: signal.Signals
) -> None:
    peers = start_peers(processes, tmp_path, behaviors={2: "slow"})
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
    assert torch.equal(results[0], weighted_mean([0, 1, 3]))
    assert all(torch.equal(r, results[0]) for r in results)


@pytest.mark.parametrize("behavior", ["nan", "shape", "huge"])
def test_bad_sender_is_dropped(processes: ProcessGroup, tmp_path: Path, behavior: str) -> None:
    peers = start_peers(processes, tmp_path, behaviors={1: behavior})
    outs = run_round(peers, peers, "b1")
    bad_id = str(peers[1].info["peer_id"])
    honest = [o for i, o in enumerate(outs) if i != 1]
    for o in honest:
        assert o["ok"] and o["dropped"] == [bad_id], o
    results = [load_result(o) for o in honest]
    assert all(torch.equal(r, results[0]) for r in results)
    # The liar reduced its own part honestly (its own values never crossed the wire); every
    # other part is the mean of the three honest peers.
    order = [m[0] for m in members(peers)]
    bounds = part_bounds(NUMEL, [1.0] * 4)
    all_four, without = weighted_mean([0, 1, 2, 3]), weighted_mean([0, 2, 3])
    for j, (s, e) in enumerate(bounds):
        expected = all_four if order[j] == bad_id else without
        assert torch.equal(results[0][s:e], expected[s:e]), f"part {j}"
    # NaN and a wrong shape prove a fault (both fail to decode within the part's bounds):
    # every honest reducer bans the sender, with the evidence. One huge update is only a
    # strike (an honest peer can be far off once).
    time.sleep(0.2)  # the stderr pumps
    evidence = {"nan": "NaN or infinity", "shape": "elements, over the limit"}.get(behavior)
    for i, p in enumerate(peers):
        log = "".join(p.stderr_tail)
        if i == 1:
            continue
        if evidence is None:
            assert "banned peer" not in log, log
        else:
            assert "(ban 1, undecodable)" in log and evidence in log, log


@pytest.mark.parametrize("codec", ["fp32", "int8"])
@pytest.mark.parametrize("behavior", ["flip", "x-20", "forge"])
def test_lying_reducer_is_refused_and_its_part_re_reduced(
    processes: ProcessGroup, tmp_path: Path, behavior: str, codec: str
) -> None:
    """Peer 1 serves its part negated (or x -20, or negated with its own proof entry forged to
    fit): the honest members refuse it and re-reduce it among themselves, so they end with the
    same values, the honest mean there."""
    peers = start_peers(processes, tmp_path, behaviors={1: behavior}, codec=codec)
    outs = run_round(peers, peers, "liar1")
    order = [m[0] for m in members(peers)]
    liar_part = order.index(str(peers[1].info["peer_id"]))
    honest = [o for i, o in enumerate(outs) if i != 1]
    for o in honest:
        assert o["ok"] and liar_part in o["recovered_parts"], o
    results = [load_result(o) for o in honest]
    assert all(torch.equal(r, results[0]) for r in results)
    all_four, without = weighted_mean([0, 1, 2, 3]), weighted_mean([0, 2, 3])
    for j, (s, e) in enumerate(part_bounds(NUMEL, [1.0] * 4)):
        expected = without if j == liar_part else all_four
        if codec == "fp32":
            assert torch.equal(results[0][s:e], expected[s:e]), f"part {j}"
        else:  # two quantisations (contribution, result): well within 3% of the mean's scale
            err = float((results[0][s:e] - expected[s:e]).abs().max())
            assert err <= 0.03 * float(expected[s:e].abs().max()), (j, err)
    time.sleep(0.2)  # the stderr pumps
    evidence = "".join(line for p in (peers[0], peers[2], peers[3]) for line in p.stderr_tail)
    assert "refused part" in evidence, evidence
    if behavior == "forge":  # its forged entry does not open from what it committed to
        assert "misstates its own contribution" in evidence, evidence


def test_an_equivocating_reducer_is_caught_by_comparing_proofs(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """Peer 1 serves its part negated and gives each member its own signed proof, with an entry
    that member cannot check filled in to fit: every proof passes alone. The members compare
    the proofs they accepted, find the reducer's signature on two different ones, ban it and
    re-reduce its part without it: they end with the same values, the honest mean there.
    Before the comparison every honest member applied the negated part."""
    peers = start_peers(processes, tmp_path, behaviors={1: "equivocate"})
    outs = run_round(peers, peers, "equivocate")
    order = [m[0] for m in members(peers)]
    liar_part = order.index(str(peers[1].info["peer_id"]))
    s, e = part_bounds(NUMEL, [1.0] * 4)[liar_part]
    all_four = weighted_mean([0, 1, 2, 3])
    honest = [o for i, o in enumerate(outs) if i != 1]
    for o in honest:
        assert o["ok"] and liar_part in o["recovered_parts"], o
    results = [load_result(o) for o in honest]
    assert all(torch.equal(r, results[0]) for r in results)
    # fp32: exactly a mean of honest contributions there (all three, unless one reached the
    # fallback reducer after its deadline), never the lie.
    subsets = [[0, 2, 3], [0, 2], [0, 3], [2, 3]]
    assert any(torch.equal(results[0][s:e], weighted_mean(c)[s:e]) for c in subsets)
    rest = torch.cat([results[0][:s], results[0][e:]])
    assert torch.equal(rest, torch.cat([all_four[:s], all_four[e:]]))
    time.sleep(0.2)  # the stderr pumps
    for i in (0, 2, 3):
        log = "".join(peers[i].stderr_tail)
        assert "signed two different proofs" in log and "(ban 1, false_data)" in log, log


def test_stale_round_message_refused(processes: ProcessGroup, tmp_path: Path) -> None:
    peers = start_peers(processes, tmp_path, linger_s=0.0)
    run_round(peers, peers, "old")
    run_round(peers, peers, "new")  # starting a round retires the finished one

    async def late_part() -> rpc.RpcError:
        client = rpc.RpcClient(Identity.generate())
        info = apb.PartInfo(round_id=round_id("old"), part=0, weight=1.0)
        meta = TensorMeta("uint8", (4,), info=info.SerializeToString())
        try:
            with pytest.raises(rpc.RpcError) as err:
                await client.put_tensor(
                    peers[0].address, PUT_PART, meta, memoryview(bytes(4)), apb.PartAck, timeout=10
                )
            return err.value
        finally:
            client.close()

    error = trio.run(late_part)
    assert error.code is rpc.StatusCode.FAILED_PRECONDITION and "stale" in error.details
