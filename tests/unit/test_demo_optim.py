"""DeMo (swarmd.optim.demo) against an independent, deliberately plain reading of the paper.

`PaperDeMo` below works in numpy float64 with dense DCT matrices built from the textbook
formula and explicit per-block loops, sharing no code or structure with the implementation;
swarmd's DeMo runs on float64 parameters so the two agree to ~1e-12 (float32 rounding could
flip the sign of a near-zero element, a real but meaningless difference).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from swarmd.compression.sparse_wire import decode_sparse, encode_sparse
from swarmd.optim.demo import DeMo, DeMoConfig, SparseUpdate
from swarmd.optim.demo_robust import clipped_to_median, opposed
from swarmd.optim.demo_state import DeMoRun
from swarmd.optim.schedule import LrSchedule

# -- the paper, plainly ---------------------------------------------------------------------------


def dct_2_ortho(n: int) -> np.ndarray:
    """C[k, j] = s_k cos(pi (2j+1) k / 2n), s_0 = sqrt(1/n), s_k = sqrt(2/n)."""
    c = np.zeros((n, n))
    for k in range(n):
        for j in range(n):
            scale = math.sqrt(1.0 / n) if k == 0 else math.sqrt(2.0 / n)
            c[k, j] = scale * math.cos(math.pi * (2 * j + 1) * k / (2 * n))
    return c


def smaller_split(n: int, target: int) -> int:
    """The reference's `_get_smaller_split`: the target if it divides n, else the divisor just
    below the first divisor above the target, else (no divisor above it) n itself."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    if target in divisors:
        return target
    above = [i for i, d in enumerate(divisors) if d > target]
    if not above:
        return n
    return divisors[above[0] - 1] if above[0] > 0 else divisors[0]


Sent = dict[tuple[int, int], dict[int, float]]  # per block: coefficient index -> value


class PaperDeMo:
    """One or several peers' DeMo in numpy, per-block loops, float64."""

    def __init__(self, shapes: list[tuple[int, ...]], cfg: DeMoConfig) -> None:
        self.cfg = cfg
        self.shapes = shapes
        self.mats = [self.as_matrix(np.zeros(s)).shape for s in shapes]
        self.delta = [np.zeros(m) for m in self.mats]
        self.sides = []
        for shape, (rows, cols) in zip(shapes, self.mats, strict=True):
            h = 1 if len(shape) <= 1 else smaller_split(rows, cfg.compression_chunk)
            self.sides.append((h, smaller_split(cols, cfg.compression_chunk)))

    @staticmethod
    def as_matrix(x: np.ndarray) -> np.ndarray:
        return x.reshape(1, -1) if x.ndim <= 1 else x.reshape(x.shape[0], -1)

    def prepare(self, grads: list[np.ndarray], lr: float) -> list[Sent]:
        sent_all = []
        for t, g in enumerate(grads):
            d = self.cfg.compression_decay * self.delta[t] + lr * self.as_matrix(g)
            h, w = self.sides[t]
            dh, dw = dct_2_ortho(h), dct_2_ortho(w)
            k = min(self.cfg.compression_topk, h * w)
            sent = {}
            for by in range(d.shape[0] // h):
                for bx in range(d.shape[1] // w):
                    rs, cs = slice(by * h, by * h + h), slice(bx * w, bx * w + w)
                    coeffs = (dh @ d[rs, cs] @ dw.T).reshape(-1)
                    keep = np.argsort(-np.abs(coeffs), kind="stable")[:k]
                    sent[(by, bx)] = {int(i): float(coeffs[i]) for i in keep}
                    sparse = np.zeros(h * w)
                    sparse[keep] = coeffs[keep]
                    d[rs, cs] -= dh.T @ sparse.reshape(h, w) @ dw
            self.delta[t] = d
            sent_all.append(sent)
        return sent_all

    def apply(self, params: list[np.ndarray], peers: list[list[Sent]], lr: float) -> None:
        for t, p in enumerate(params):
            h, w = self.sides[t]
            dh, dw = dct_2_ortho(h), dct_2_ortho(w)
            m = self.as_matrix(p)  # a view: updated in place
            m *= 1.0 - lr * self.cfg.weight_decay
            for by, bx in peers[0][t]:
                senders: dict[int, list[float]] = {}
                for peer in peers:
                    for i, v in peer[t][(by, bx)].items():
                        senders.setdefault(i, []).append(v)
                coeffs = np.zeros(h * w)
                for i, vs in senders.items():
                    coeffs[i] = sum(vs) / len(vs)  # mean over the peers that sent i
                x = dh.T @ coeffs.reshape(h, w) @ dw
                m[by * h : by * h + h, bx * w : bx * w + w] -= lr * np.sign(x)


# -- helpers ------------------------------------------------------------------------------------

SHAPES = [(37,), (48, 80), (97, 131), (128, 192)]


def make_params(
    shapes: Sequence[tuple[int, ...]], seed: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def grads_for(shapes: Sequence[tuple[int, ...]], steps: int, seed: int) -> list[list[torch.Tensor]]:
    """Gradients drawn up front, independent of the parameters, so a difference in one step
    cannot snowball; smooth + noise so the DCT has structure to find."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for s in shapes:
            smooth = torch.linspace(-1, 1, math.prod(s), dtype=torch.float64).reshape(s)
            step.append(
                smooth * torch.randn((), generator=gen, dtype=torch.float64)
                + torch.randn(s, generator=gen, dtype=torch.float64)
            )
        out.append(step)
    return out


def set_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g.to(p.dtype).clone()


def decode_dense(update: SparseUpdate, shape: tuple[int, ...], chunk: int) -> np.ndarray:
    """What one SparseUpdate stands for, decoded with the test's own DCT and loops."""
    rows, cols = PaperDeMo.as_matrix(np.zeros(shape)).shape
    h = 1 if len(shape) <= 1 else smaller_split(rows, chunk)
    w = smaller_split(cols, chunk)
    dh, dw = dct_2_ortho(h), dct_2_ortho(w)
    idx = update.indices.reshape(-1, update.indices.shape[-1]).numpy()
    val = update.values.reshape(-1, update.values.shape[-1]).double().numpy()
    out = np.zeros((rows, cols))
    for b in range(idx.shape[0]):
        by, bx = divmod(b, cols // w)
        coeffs = np.zeros(h * w)
        coeffs[idx[b]] = val[b]
        out[by * h : by * h + h, bx * w : bx * w + w] = dh.T @ coeffs.reshape(h, w) @ dw
    return out.reshape(shape)


# -- (a) one peer equals the paper ----------------------------------------------------------------


def test_chunking_follows_the_reference_split() -> None:
    assert [smaller_split(n, 64) for n in (37, 48, 80, 97, 131, 128, 192, 64, 1)] == [
        37, 48, 40, 1, 1, 64, 64, 64, 1,
    ]  # fmt: skip
    demo = DeMo(make_params([*SHAPES, (4, 6, 10)], 0, torch.float32), DeMoConfig())
    # Primes above the chunk get blocks of 1 (the reference's rule, not the whole dimension).
    assert demo.layout() == [
        ((1,), 37),
        ((1, 2), 48 * 40),
        ((97, 131), 1),
        ((2, 3), 64 * 64),
        ((1, 1), 4 * 60),
    ]
    ups = demo.prepare()
    assert [tuple(u.indices.shape) for u in ups] == [
        (1, 32), (1, 2, 32), (97, 131, 1), (2, 3, 32), (1, 1, 32),
    ]  # fmt: skip
    assert all(u.indices.dtype == torch.int64 for u in ups)


@pytest.mark.parametrize(
    ("shapes", "weight_decay", "topk", "chunk"),
    [
        (SHAPES, 0.0, 32, 64),
        ([(37,), (48, 80), (128, 192), (4, 6, 10)], 0.1, 32, 64),
        ([(37,), (48, 80), (12, 20)], 0.05, 5, 8),
    ],
)
def test_one_peer_matches_the_paper(
    shapes: list[tuple[int, ...]], weight_decay: float, topk: int, chunk: int
) -> None:
    cfg = DeMoConfig(
        lr=1e-2, compression_topk=topk, compression_chunk=chunk, weight_decay=weight_decay
    )
    params = make_params(shapes, 1, torch.float64)
    ref_params = [p.numpy().copy() for p in params]
    demo, ref = DeMo(params, cfg), PaperDeMo(shapes, cfg)
    steps = 20
    for t, grads in enumerate(grads_for(shapes, steps, 2)):
        lr = cfg.lr * (1.0 - t / (2 * steps))  # a schedule: lr changes between steps
        demo.lr = lr
        set_grads(params, grads)
        demo.step(lambda own: [own])
        ref.apply(ref_params, [ref.prepare([g.numpy() for g in grads], lr)], lr)
    state = demo.state_dict()
    for i, (p, want) in enumerate(zip(params, ref_params, strict=True)):
        np.testing.assert_allclose(p.numpy(), want, rtol=0, atol=1e-12)
        got_delta = state[f"delta.{i}"].numpy().reshape(ref.delta[i].shape)
        np.testing.assert_allclose(got_delta, ref.delta[i], rtol=0, atol=1e-12)
    # The test can fail: the parameters moved by whole lr steps, not by rounding noise.
    start = make_params(shapes, 1, torch.float64)
    assert all(float((p - s).abs().max()) > 5 * cfg.lr for p, s in zip(params, start, strict=True))


# -- (b) several peers --------------------------------------------------------------------------


def test_three_peers_stay_identical_and_match_the_paper() -> None:
    shapes = [(37,), (48, 80), (16, 24)]
    # The reference's plain mean (demo_robust.py's rules are swarmd's, tested below).
    cfg = DeMoConfig(
        lr=1e-2,
        compression_topk=4,
        compression_chunk=8,
        weight_decay=0.01,
        clip_to_median=0,
        drop_opposed=False,
    )
    peers = [make_params(shapes, 3, torch.float64) for _ in range(3)]
    demos = [DeMo(p, cfg) for p in peers]
    ref_params = [p.numpy().copy() for p in make_params(shapes, 3, torch.float64)]
    refs = [PaperDeMo(shapes, cfg) for _ in range(3)]
    for step in range(8):
        grads = [grads_for(shapes, 1, 100 * step + j)[0] for j in range(3)]
        for params, g in zip(peers, grads, strict=True):
            set_grads(params, g)
        sent = [d.prepare() for d in demos]
        for d in demos:
            d.apply(sent)
        ref_sent = [
            r.prepare([x.numpy() for x in g], cfg.lr) for r, g in zip(refs, grads, strict=True)
        ]
        refs[0].apply(ref_params, ref_sent, cfg.lr)
    for t in range(len(shapes)):
        assert torch.equal(peers[0][t], peers[1][t]) and torch.equal(peers[0][t], peers[2][t])
        np.testing.assert_allclose(peers[0][t].numpy(), ref_params[t], rtol=0, atol=1e-12)


def _one_coefficient(index: int, value: float) -> SparseUpdate:
    return SparseUpdate(torch.tensor([[index]]), torch.tensor([[value]], dtype=torch.float64))


def test_duplicate_indices_are_averaged_over_their_senders_only() -> None:
    """Coefficient 0 is sent by A and B, coefficient 1 by C alone. The rule gives c = (3, 2.5);
    dividing by all three peers, summing, or counting the zero background each give a
    different sign pattern, so only the rule passes."""
    n, lr = 4, 0.5
    basis = dct_2_ortho(n)

    def signs(c0: float, c1: float) -> np.ndarray:
        out: np.ndarray = np.sign(basis.T @ np.array([c0, c1, 0.0, 0.0]))
        return out

    expected = signs((4.0 + 2.0) / 2, 2.5)
    for wrong in (signs(6.0 / 3, 2.5 / 3), signs(6.0, 2.5), signs(6.0 / 3, 2.5 / 2)):
        assert not np.array_equal(expected, wrong)
    p = torch.zeros(n, dtype=torch.float64)
    demo = DeMo([p], DeMoConfig(lr=lr, compression_topk=1, compression_chunk=n))
    gathered = [[_one_coefficient(0, 4.0)], [_one_coefficient(0, 2.0)], [_one_coefficient(1, 2.5)]]
    demo.apply(gathered)
    np.testing.assert_array_equal(p.numpy(), -lr * expected)


# -- (c) error feedback ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "bits"), [(torch.float32, 16), (torch.float64, 16), (torch.float32, 4)]
)
def test_what_is_sent_is_removed_from_the_momentum(dtype: torch.dtype, bits: int) -> None:
    """With integer codes what is removed is what the codes decode to: the rounding stays in
    δ (error feedback), and the wire carries exactly those values."""
    shapes = [(37,), (48, 80), (128, 192), (4, 6, 10)]
    cfg = DeMoConfig(lr=0.1, compression_decay=0.9, value_bits=bits)
    params = make_params(shapes, 4, dtype)
    demo = DeMo(params, cfg)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    for grads in grads_for(shapes, 3, 5):
        before = demo.state_dict()
        set_grads(params, grads)
        sent = demo.prepare()
        after = demo.state_dict()
        for i, (s, g, u) in enumerate(zip(shapes, grads, sent, strict=True)):
            want = before[f"delta.{i}"].double().numpy() * 0.9 + 0.1 * g.to(dtype).double().numpy()
            got = after[f"delta.{i}"].double().numpy() + decode_dense(u, s, 64)
            np.testing.assert_allclose(got, want, rtol=0, atol=tol)
            assert float(np.abs(decode_dense(u, s, 64)).max()) > 1e-3  # something was sent
        if bits < 16:
            wire = decode_sparse(encode_sparse(sent, cfg.value_dtype), demo.layout(), 1 << 24)
            for u, w in zip(sent, wire, strict=True):
                torch.testing.assert_close(w.values, u.values, rtol=1e-6, atol=0)
                per_block = u.values.reshape(-1, u.values.shape[-1])
                assert len(per_block[0].unique()) <= 15  # 4-bit codes: at most 15 levels
        demo.apply([sent])


def test_missing_grad_counts_as_zero() -> None:
    p = torch.ones(8, 8)
    demo = DeMo([p], DeMoConfig(lr=1.0, compression_decay=0.5, compression_topk=64))
    p.grad = torch.ones(8, 8)
    demo.prepare()  # k = whole block: everything is sent, δ is zero up to rounding
    p.grad = None
    ups = demo.prepare()
    assert float(ups[0].values.abs().max()) < 1e-6
    assert float(demo.state_dict()["delta.0"].abs().max()) < 1e-6


# -- (d) state round trip -------------------------------------------------------------------------


def test_state_dict_round_trip_continues_identically() -> None:
    shapes = [(37,), (48, 80), (16, 24)]
    cfg = DeMoConfig(lr=1e-2, compression_topk=4, compression_chunk=8)
    params_a = make_params(shapes, 6, torch.float32)
    a = DeMo(params_a, cfg)
    grads = grads_for(shapes, 10, 7)
    for g in grads[:5]:
        set_grads(params_a, g)
        a.step(lambda own: [own])
    params_b = [p.detach().clone() for p in params_a]
    b = DeMo(params_b, cfg)
    b.load_state_dict(a.state_dict())
    for g in grads[5:]:
        for params in (params_a, params_b):
            set_grads(params, g)
        a.step(lambda own: [own])
        b.step(lambda own: [own])
    assert all(torch.equal(x, y) for x, y in zip(params_a, params_b, strict=True))
    fresh_params = [p.detach().clone() for p in params_b]
    fresh = DeMo(fresh_params, cfg)  # without δ the next step differs: the state matters
    for params, opt in ((params_b, b), (fresh_params, fresh)):
        set_grads(params, grads[0])
        opt.step(lambda own: [own])
    assert not all(torch.equal(x, y) for x, y in zip(params_b, fresh_params, strict=True))


def test_load_state_dict_validates_before_changing_anything() -> None:
    demo = DeMo([torch.zeros(3, 4), torch.zeros(5)], DeMoConfig())
    good = {"delta.0": torch.ones(3, 4), "delta.1": torch.ones(5)}
    bad_cases: list[tuple[dict[str, Any], str]] = [
        ({"delta.0": torch.ones(3, 4)}, "missing keys"),
        ({**good, "delta.2": torch.ones(1)}, "unexpected keys"),
        ({**good, "delta.1": torch.ones(6)}, "shape"),
        ({**good, "delta.1": torch.ones(5, dtype=torch.int64)}, "floating-point"),
        ({**good, "delta.1": torch.tensor([1.0, math.nan, 0, 0, 0])}, "NaN"),
        ({**good, "delta.1": [1.0] * 5}, "floating-point"),
    ]
    for state, message in bad_cases:
        with pytest.raises(ValueError, match=message):
            demo.load_state_dict(state)
        assert all(float(v.abs().sum()) == 0 for v in demo.state_dict().values())
    demo.load_state_dict(good)
    assert torch.equal(demo.state_dict()["delta.0"], torch.ones(3, 4))


# -- (e) validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": 0.0}, "lr must be > 0"),
        ({"lr": -1e-3}, "lr must be > 0"),
        ({"lr": math.inf}, "lr must be a finite number"),
        ({"lr": math.nan}, "lr must be a finite number"),
        ({"lr": True}, "lr must be a finite number"),
        ({"compression_decay": 1.0}, r"compression_decay must be in \[0, 1\)"),
        ({"compression_decay": -0.1}, r"compression_decay must be in \[0, 1\)"),
        ({"compression_topk": 0}, "compression_topk must be an int >= 1"),
        ({"compression_topk": 2.0}, "compression_topk must be an int >= 1"),
        ({"compression_chunk": 0}, "compression_chunk must be an int >= 1"),
        ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
        ({"weight_decay": math.nan}, "weight_decay must be a finite number"),
        ({"value_bits": 2}, r"value_bits must be one of \[4, 8, 16\]"),
    ],
)
def test_config_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DeMoConfig(**kwargs)  # type: ignore[arg-type]


def test_constructor_and_lr_validation() -> None:
    p = torch.zeros(4)
    with pytest.raises(ValueError, match="at least one"):
        DeMo([], DeMoConfig())
    with pytest.raises(ValueError, match="same parameter twice"):
        DeMo([p, p], DeMoConfig())
    with pytest.raises(ValueError, match="floating-point"):
        DeMo([torch.zeros(4, dtype=torch.int64)], DeMoConfig())
    demo = DeMo([p], DeMoConfig())
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="lr"):
            demo.lr = bad
    demo.lr = 0.25
    assert demo.lr == 0.25


def test_apply_validates_every_update_before_moving_anything() -> None:
    a, b = torch.ones(8), torch.ones(3, 4)
    demo = DeMo([a, b], DeMoConfig(compression_topk=2))
    a.grad, b.grad = torch.randn(8), torch.randn(3, 4)
    good = demo.prepare()
    idx, val = good[1].indices, good[1].values

    def with_second(update: object) -> list[list[SparseUpdate]]:
        return [good, [good[0], update]]  # type: ignore[list-item]

    cases = [
        ([], "at least one peer"),
        ([good[:1]], "sent 1 updates"),
        (with_second("nope"), "expected a SparseUpdate"),
        (with_second(SparseUpdate(idx.int(), val)), "int64"),
        (with_second(SparseUpdate(idx[..., :1], val)), "do not match"),
        (with_second(SparseUpdate(idx.reshape(-1), val.reshape(-1))), "do not match"),
        (with_second(SparseUpdate(idx, val, 5)), "block size"),
        (with_second(SparseUpdate(idx + 12, val)), "outside"),
        (with_second(SparseUpdate(idx - 1 - idx, val)), "outside"),
        (with_second(SparseUpdate(idx, val * math.nan)), "NaN"),
        (with_second(SparseUpdate(idx.new_zeros(1, 1, 0), val.new_zeros(1, 1, 0))), "k = 0"),
    ]
    for gathered, message in cases:
        with pytest.raises(ValueError, match=message):
            demo.apply(gathered)
        assert float(a.sum()) == 8 and float(b.sum()) == 12
    demo.apply([good, good])
    assert float((a - 1).abs().max()) > 0


class _Scaled(torch.nn.Module):
    """A model whose loss is its weight's sum times a large factor: a gradient of norm ~1e4."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8, 16))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss = 1000.0 * (self.w * x.float().mean()).sum()
        return loss, loss


@pytest.mark.parametrize("clip", [1.0, None])
def test_a_run_clips_the_gradient_before_the_momentum(clip: float | None) -> None:
    run = DeMoRun(_Scaled(), DeMoConfig(lr=1e-3), LrSchedule("constant", 0, 0), clip)
    run.gradients((torch.ones(2, 4), torch.ones(2, 4)))
    norm = float(torch.linalg.vector_norm(run.model.w.grad))
    assert norm == pytest.approx(1.0, rel=1e-5) if clip else norm > 1000


def _steps_with_a_liar(clip: float, factor: float, drop: bool = True) -> float:
    """Three peers on a shared least-squares target, the last sending its coefficients
    x ``factor``: the honest peers' distance to the optimum after 200 steps, over the one
    they started at."""
    # A generator of its own: the global one is shared with any thread an earlier test left
    # drawing from it (one full-suite run saw different figures here, never reproduced alone).
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(32, 32, dtype=torch.float64, generator=gen)
    cfg = DeMoConfig(
        lr=1e-2, compression_topk=8, compression_chunk=16, clip_to_median=clip, drop_opposed=drop
    )
    params = [[torch.zeros(32, 32, dtype=torch.float64)] for _ in range(3)]
    demos = [DeMo(p, cfg) for p in params]
    start = float(target.norm())
    for _ in range(200):
        for p in params:
            noise = torch.randn(32, 32, dtype=torch.float64, generator=gen)
            p[0].grad = p[0].detach() - target + 0.3 * noise
        sent = [d.prepare() for d in demos]
        sent[2] = [SparseUpdate(u.indices, u.values * factor, u.block_size) for u in sent[2]]
        for d in demos:
            d.apply(sent)
    assert torch.equal(params[0][0], params[1][0])  # clipped or not, members agree
    return float((params[0][0] - target).norm()) / start


def test_a_member_sending_its_coefficients_x_minus_1000_is_bounded_then_left_out() -> None:
    """Measured (seed 0), distance left of the starting one: honest 0.42; the liar
    unbounded 1.38 (it turns the honest ones round), clipped only 0.80 (it weighs one honest
    peer sending the opposite), clipped and left out when opposed 0.55; two honest peers
    alone reach 0.51 (the third's samples are what the liar takes away)."""
    honest = _steps_with_a_liar(1.0, 1.0)
    # The rules cost honest peers nothing here.
    assert honest == pytest.approx(_steps_with_a_liar(0.0, 1.0, drop=False), rel=0.05)
    assert _steps_with_a_liar(0.0, -1000.0, drop=False) > 1.0
    clipped = _steps_with_a_liar(1.0, -1000.0, drop=False)
    both = _steps_with_a_liar(1.0, -1000.0)
    assert honest < 0.5 and both < clipped < 0.9, (honest, clipped, both)


def test_a_member_opposed_to_the_rest_is_left_out_and_a_pair_never_is() -> None:
    shapes = [(2, 4)]
    idx = torch.tensor([[0, 1], [2, 3]])
    agree = torch.tensor([[1.0, 2.0], [1.0, 1.0]])
    members = [agree, agree * 1.5, agree * 0.5, -agree]
    indices = [[idx] * 4]
    assert opposed(indices, [members], shapes) == [3]
    assert opposed([[idx] * 2], [[agree, -agree]], shapes) == []  # a pair: no majority
    # Half or more opposed: no majority to trust, nobody left out.
    assert opposed(indices, [[agree, agree, -agree, -agree]], shapes) == []
    # Disjoint coefficients are orthogonal, not opposed.
    other = torch.tensor([[2, 3], [0, 1]])
    assert opposed([[idx, idx, other]], [[agree, agree, -agree]], shapes) == []


def test_clipping_leaves_peers_within_the_median_norm_as_they_are() -> None:
    values = [torch.full((4,), x) for x in (1.0, 2.0, 3.0, 400.0)]
    out = clipped_to_median(values, 1.0)
    # The lower median of four norms is the second: 2 x |(2, 2, 2, 2)| = 4.
    assert [float(v.norm()) for v in out] == pytest.approx([2.0, 4.0, 4.0, 4.0])
    assert out[0] is values[0] and float(values[3][0]) == 400.0  # inputs never changed
    assert clipped_to_median(values, 0.0) is values
