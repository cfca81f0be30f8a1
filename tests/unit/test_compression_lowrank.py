"""PowerSGD: exactness at full rank, the two-phase API across simulated peers, state
save/restore, and agreement with torch's own powerSGD_hook."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ref

from swarmd.compression import (
    CompressionError,
    DecodeLimits,
    PowerSGD,
    PowerSGDConfig,
    decode,
)

LIMITS = DecodeLimits(max_elements=1 << 20, max_bytes=1 << 24)
ALWAYS = 0.0  # min_compression_ratio that compresses even matrices that would not shrink


def one_round(psgd: PowerSGD, key: str, x: torch.Tensor) -> torch.Tensor:
    rnd = psgd.begin(key, x)
    if rnd.passthrough:
        assert rnd.dense is not None
        return rnd.finish(rnd.dense)
    assert rnd.p is not None
    return rnd.finish(rnd.compute_q(rnd.p))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(n=st.integers(1, 12), m=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_full_rank_is_exact(n: int, m: int, seed: int) -> None:
    x = torch.randn(n, m, generator=torch.Generator().manual_seed(seed))
    psgd = PowerSGD(PowerSGDConfig(rank=min(n, m), min_compression_ratio=ALWAYS))
    assert psgd.compresses((n, m))
    torch.testing.assert_close(one_round(psgd, "w", x), x, atol=1e-4, rtol=1e-4)
    # ... and through the single-peer wire format.
    torch.testing.assert_close(decode(psgd.encode("v", x), LIMITS), x, atol=1e-4, rtol=1e-4)


def test_full_rank_exact_for_conv_shaped_and_rank_deficient() -> None:
    x = torch.randn(6, 2, 3, 3)
    psgd = PowerSGD(PowerSGDConfig(rank=6, min_compression_ratio=ALWAYS))
    torch.testing.assert_close(one_round(psgd, "conv", x), x, atol=1e-4, rtol=1e-4)
    low = torch.randn(20, 2) @ torch.randn(2, 30)  # rank 2 < requested rank 4
    psgd = PowerSGD(PowerSGDConfig(rank=4))
    torch.testing.assert_close(one_round(psgd, "low", low), low, atol=1e-4, rtol=1e-4)
    zeros = torch.zeros(20, 30)
    assert torch.equal(one_round(psgd, "zeros", zeros), zeros)


def test_passthrough_for_vectors_and_matrices_that_would_not_shrink() -> None:
    psgd = PowerSGD(PowerSGDConfig(rank=4))
    for shape in [(50,), (), (4, 4), (3, 100), (0, 10)]:
        x = torch.randn(shape)
        rnd = psgd.begin("b", x)
        assert rnd.passthrough and rnd.p is None and rnd.dense is not None
        assert torch.equal(rnd.finish(rnd.dense), x)
        assert torch.equal(decode(psgd.encode("b", x), LIMITS), x)
    assert psgd.compresses((100, 100))


def test_two_phase_between_simulated_peers_averages_exactly_at_full_rank() -> None:
    """Sum P, orthogonalise, average Q: with rank = min(n, m) the result is the mean."""
    peers = [PowerSGD(PowerSGDConfig(rank=5, min_compression_ratio=ALWAYS)) for _ in range(3)]
    grads = [torch.randn(5, 9) for _ in peers]
    rounds = [p.begin("w", g) for p, g in zip(peers, grads, strict=True)]
    p_sum = torch.stack([r.p for r in rounds if r.p is not None]).sum(0)
    q_mean = torch.stack([r.compute_q(p_sum) for r in rounds]).mean(0)
    outs = [r.finish(q_mean) for r in rounds]
    mean = torch.stack(grads).mean(0)
    for out in outs:
        torch.testing.assert_close(out, mean, atol=1e-4, rtol=1e-4)
    # Warm-start Q is the averaged one, hence identical on every peer.
    assert all(torch.equal(p.q_state["w"], peers[0].q_state["w"]) for p in peers)


def test_low_rank_across_peers_shares_one_subspace_and_keeps_errors_local() -> None:
    peers = [PowerSGD(PowerSGDConfig(rank=2)) for _ in range(2)]
    grads = [torch.randn(30, 40) for _ in peers]
    rounds = [p.begin("w", g) for p, g in zip(peers, grads, strict=True)]
    # Identical initial Q on every peer (derived from seed and name, not process state).
    assert rounds[0].p is not None and rounds[1].p is not None
    p_sum = rounds[0].p + rounds[1].p
    qs = [r.compute_q(p_sum) for r in rounds]
    out = [r.finish((qs[0] + qs[1]) / 2) for r in rounds]
    torch.testing.assert_close(out[0], out[1])
    for peer, g in zip(peers, grads, strict=True):
        err = peer.residuals.residual("w")
        assert err is not None and err.shape == g.shape and float(err.norm()) > 0


def test_error_feedback_sum_tracks_inputs_and_state_round_trips() -> None:
    gen = torch.Generator().manual_seed(0)
    psgd = PowerSGD(PowerSGDConfig(rank=2))
    total_in = torch.zeros(24, 32)
    total_out = torch.zeros(24, 32)
    for step in range(40):
        x = torch.randn(24, 32, generator=gen)
        total_in += x
        total_out += one_round(psgd, "w", x)
        if step == 20:  # checkpoint and restore mid-run
            saved = psgd.state_dict()
            psgd = PowerSGD(PowerSGDConfig(rank=2))
            psgd.load_state_dict(saved)
    residual = psgd.residuals.residual("w")
    assert residual is not None
    # Sum of outputs = sum of inputs - final residual, exactly (up to float rounding).
    torch.testing.assert_close(total_out + residual, total_in, atol=1e-3, rtol=1e-4)
    assert float(residual.norm()) < 0.5 * float(total_in.norm())


def test_phase_misuse_and_bad_reduced_tensors() -> None:
    psgd = PowerSGD(PowerSGDConfig(rank=2))
    rnd = psgd.begin("w", torch.randn(20, 30))
    with pytest.raises(RuntimeError):
        rnd.finish(torch.zeros(30, 2))
    with pytest.raises(CompressionError, match="shape"):
        rnd.compute_q(torch.zeros(20, 3))
    with pytest.raises(CompressionError, match="NaN"):
        rnd.compute_q(torch.full((20, 2), float("nan")))
    q = rnd.compute_q(rnd.p if rnd.p is not None else torch.zeros(0))
    with pytest.raises(CompressionError, match="shape"):
        rnd.finish(q.T)
    with pytest.raises(CompressionError):
        psgd.begin("w", torch.tensor([[float("inf"), 1.0], [1.0, 1.0]]))
    with pytest.raises(CompressionError):
        psgd.load_state_dict({"bogus": torch.zeros(2)})


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="rank"):
        PowerSGDConfig(rank=0)
    with pytest.raises(ValueError, match="min_compression_ratio"):
        PowerSGDConfig(min_compression_ratio=float("nan"))
    with pytest.raises(ValueError, match="seed"):
        PowerSGDConfig(seed=-1)


def test_matches_torch_powersgd_hook_single_process_gloo() -> None:
    """Same matrices through torch's reference hook (DDP, gloo, world size 1) and ours."""
    n, m, rank, steps = 16, 24, 3, 5
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(n, m, generator=gen) for _ in range(2 + steps)]
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:

        class One(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = torch.nn.Parameter(torch.zeros(n, m))

            def forward(self, g: torch.Tensor) -> torch.Tensor:
                return (self.w * g).sum()  # d/dw = g: the hook sees exactly g

        model = torch.nn.parallel.DistributedDataParallel(One())
        state = ref.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=2,
            min_compression_rate=0.5,
            use_error_feedback=True,
            warm_start=True,
            random_seed=0,
        )
        model.register_comm_hook(state, ref.powerSGD_hook)
        assert state.iter == 0
        hook_out = []
        for g in grads:
            model.zero_grad(set_to_none=True)
            model(g).backward()  # through DDP's forward, or the reducer never runs
            assert model.module.w.grad is not None  # type: ignore[union-attr]
            hook_out.append(model.module.w.grad.clone())  # type: ignore[union-attr]
    finally:
        if started:
            dist.destroy_process_group()
    assert state.iter == len(grads)  # the hook really ran on every step
    # The first two steps are plain all-reduce in the hook; later ones are compressed.
    torch.testing.assert_close(hook_out[0], grads[0])
    assert float((hook_out[2] - grads[2]).norm()) > 0.1
    # The hook's initial Q: numpy RandomState(seed) -> torch seed -> randn -> orthogonalise.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(np.random.RandomState(0).randint(1_000_000_000))
        q0 = torch.randn(1, m, rank)[0]
    ours = PowerSGD(PowerSGDConfig(rank=rank, min_compression_ratio=0.5))
    ours.load_state_dict({"q:w": q0})
    for g, expected in zip(grads[2:], hook_out[2:], strict=True):
        torch.testing.assert_close(one_round(ours, "w", g), expected, atol=1e-4, rtol=1e-4)
