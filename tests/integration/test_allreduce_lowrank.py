"""codec lowrank: PowerSGD's two all-reduces between 4 real processes equal the same
arithmetic done in one process, round after round (warm Q and error feedback carried), and the
survivors of a member killed mid-round agree."""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import torch

from swarmd.compression.lowrank import PowerSGD, PowerSGDConfig, orthogonalize
from tests.harness.allreduce import WEIGHTS, load_result, members, run_round, start_peers
from tests.harness.allreduce_peer import local_values
from tests.harness.processes import ProcessGroup

# Two matrices that compress at rank 4, a 1-D tensor and a small matrix (64 values < 16 * 4
# factor values: it would not shrink) that both travel whole.
SHAPES = [(64, 48), (100,), (32, 96), (8, 8)]
NAMES = [f"t{i}" for i in range(len(SHAPES))]
NUMEL = sum(math.prod(s) for s in SHAPES)


def tensors_of(flat: torch.Tensor) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in SHAPES:
        n = math.prod(shape)
        out.append(flat[offset : offset + n].view(shape))
        offset += n
    return out


def wmean(values: dict[int, torch.Tensor]) -> torch.Tensor:
    total = sum(WEIGHTS[i] for i in values)
    acc = sum(WEIGHTS[i] * v.double() for i, v in values.items())
    assert isinstance(acc, torch.Tensor)
    return (acc / total).float()


def reference(contributors: list[int], rounds: int) -> list[torch.Tensor]:
    """PowerSGD written out for the group: P_i = M_i Q, P̂ = orth(mean P), Q_i = M_iᵀ P̂,
    result P̂ mean(Q)ᵀ, each peer's error feedback M_i - P̂ Q_iᵀ, Q warm-started from mean Q;
    tensors that would not shrink are averaged whole."""
    psgd = {i: PowerSGD(PowerSGDConfig(rank=4)) for i in contributors}
    out = []
    for _ in range(rounds):
        result = []
        for name, shape in zip(NAMES, SHAPES, strict=True):
            idx = NAMES.index(name)
            rounds_ = {
                i: psgd[i].begin(name, tensors_of(local_values(i, NUMEL))[idx]) for i in psgd
            }
            any_round = next(iter(rounds_.values()))
            if any_round.passthrough:
                result.append(wmean({i: r.dense for i, r in rounds_.items()}).reshape(-1))
                continue
            p_mean = wmean({i: r.p for i, r in rounds_.items()})
            qs = {i: r.compute_q(p_mean) for i, r in rounds_.items()}
            q_mean = wmean(qs)
            finished = [r.finish(q_mean) for r in rounds_.values()]
            p_hat = orthogonalize(p_mean)
            torch.testing.assert_close(finished[0], (p_hat @ q_mean.T).reshape(shape))
            result.append(finished[0].reshape(-1))
        out.append(torch.cat(result))
    return out


def test_four_peers_lowrank_equals_the_in_process_reference(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    peers = start_peers(processes, tmp_path, codec="lowrank", shapes=SHAPES, rank=4, numel=NUMEL)
    expected = reference([0, 1, 2, 3], rounds=3)
    for k, name in enumerate(("r1", "r2", "r3")):
        outs = run_round(peers, peers, name)
        assert all(o["ok"] and o["dropped"] == [] for o in outs), outs
        results = [load_result(o) for o in outs]
        assert all(torch.equal(r, results[0]) for r in results)  # the same bytes everywhere
        torch.testing.assert_close(results[0], expected[k], rtol=1e-4, atol=1e-5)
    # Rank 4 of a 64 x 48 matrix is not the matrix: the result is an approximation...
    truth = wmean({i: local_values(i, NUMEL) for i in range(4)})
    assert not torch.allclose(results[0][:3072], truth[:3072], atol=1e-3)
    # ...while what travels whole is averaged exactly.
    torch.testing.assert_close(results[0][3072:3172], truth[3072:3172])


def test_survivors_of_a_member_killed_mid_round_agree(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    peers = start_peers(
        processes, tmp_path, behaviors={2: "slow"}, codec="lowrank", shapes=SHAPES, rank=4,
        numel=NUMEL,
    )  # fmt: skip
    victim, survivors = peers[2], [p for i, p in enumerate(peers) if i != 2]
    for p in peers:
        p.send({"round": "k1", "members": members(peers)})
    time.sleep(0.5)  # pass 1 under way: the victim has sent nothing yet
    victim.process.send_signal(signal.SIGKILL)
    outs = [p.receive(timeout=60) for p in survivors]
    victim_id = str(victim.info["peer_id"])
    for o in outs:
        assert o["ok"], o
        assert o["dropped"] == [victim_id]
    results = [load_result(o) for o in outs]
    assert all(torch.equal(r, results[0]) for r in results)
    torch.testing.assert_close(results[0], reference([0, 1, 3], rounds=1)[0], rtol=1e-4, atol=1e-5)
