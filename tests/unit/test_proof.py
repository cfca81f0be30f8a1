"""A reducer's proof (swarmd/node/averaging/proof.py): an honest one holds for every codec and
weighting, and each lie a reducer can tell about its part is refused."""

from __future__ import annotations

import dataclasses
import functools
import random
import secrets

import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from swarmd.compression import DecodeLimits, TopKCodec, TopKConfig, decode, encode_segments
from swarmd.node.averaging.codecs import TOPK_RESULT_BITS, make_codec
from swarmd.node.averaging.commit import Committed, Form, commit, form_for
from swarmd.node.averaging.config import AllReduceConfig
from swarmd.node.averaging.proof import (
    MAX_SAMPLED,
    NONCE_BYTES,
    Claim,
    check_proof,
    gather,
    left_out,
    make_proof,
    probe_seed,
    project,
    quantization_bound,
    sample,
    sample_block,
    sign_proof,
)
from swarmd.node.averaging.reduction import ReductionConfig, weighted_mean
from swarmd.node.bans import Rejection
from swarmd.protocol import averaging_pb2 as apb
from swarmd.protocol.identity import Identity

ROUND = b"r" * 32
REDUCER = 2
EXACT = Form("fp32")
KEY = Identity.generate()  # the reducer's


def roundtrip(values: torch.Tensor, codec: str, bits: int = 8) -> torch.Tensor:
    blob = b"".join(encode_segments(make_codec(codec, 256, bits), values))  # type: ignore[arg-type]
    return decode(blob, DecodeLimits(max_elements=values.numel(), max_bytes=len(blob) * 8))


def honest_part(
    codec: str, n: int = 10_001, bits: int = 8, weights: tuple[float, ...] = (1.0, 2.0, 3.0)
) -> tuple[dict[int, torch.Tensor], dict[int, float], torch.Tensor]:
    """Contributions as the reducer decoded them (member 2 is the reducer: raw), and the part
    as every member decodes it."""
    gen = torch.Generator().manual_seed(n + bits)
    raw = {i: torch.randn(n, generator=gen) * (i + 1) for i in range(len(weights))}
    used = {i: v if i == REDUCER else roundtrip(v, codec, bits) for i, v in raw.items()}
    w = dict(enumerate(weights))
    mean = weighted_mean([used[i] for i in sorted(used)], [w[i] for i in sorted(used)])
    return used, w, roundtrip(mean, codec, bits)


def served(result: torch.Tensor) -> bytes:
    return result.numpy().tobytes()  # stands for the encoded bytes: only their digest is read


def prove(
    used: dict[int, torch.Tensor],
    weights: dict[int, float],
    nonces: dict[int, bytes],
    result: torch.Tensor,
    probes: int = 2,
    density: float = 1.0,
) -> apb.PartProof:
    seed = probe_seed(ROUND, 1, 0, nonces)
    # The reducer commits its own contribution exactly (fp32): the other forms are
    # test_commit's, and test_a_reducer_committed_in_int8_passes below.
    own = commit(used[REDUCER], EXACT, sample_block(256)) if REDUCER in used else None
    proof = make_proof(used, weights, nonces, seed, probes, [served(result)], 256, density, own)
    sign_proof(proof, KEY, ROUND, 1, 0)
    return proof


def check(proof: apb.PartProof, claim: Claim, probes: int, cfg: ReductionConfig) -> str | None:
    """check_proof on the proof as the reducer signed it: every lie below is a signed one
    (test_an_altered_or_unsigned_proof_proves_nothing has the unsigned)."""
    signed = apb.PartProof()
    signed.CopyFrom(proof)
    sign_proof(signed, KEY, claim.round_id, claim.part, claim.attempt)
    return check_proof(signed, claim, probes, cfg)


def prove_and_claim(
    used: dict[int, torch.Tensor],
    weights: dict[int, float],
    result: torch.Tensor,
    codec: str,
    *,
    probes: int = 2,
    bits: int = 8,
    me: int = 0,
    density: float = 1.0,
) -> tuple[apb.PartProof, Claim]:
    nonces = {i: secrets.token_bytes(NONCE_BYTES) for i in used if i != REDUCER}
    proof = prove(used, weights, nonces, result, probes, density)
    claim = Claim(
        round_id=ROUND,
        part=1,
        attempt=0,
        me=me,
        reducer=REDUCER,
        members=len(used),
        nonce=nonces[me],
        relayed=False,
        contribution=functools.partial(gather, used[me]),
        weight=weights[me],
        acked=True,
        result=result,
        blob=served(result),
        codec=codec,
        int8_block_size=256,
        int8_bits=bits,
        density=density,
        commitment=bytes(proof.own_commitment),
        form=EXACT,
        signer=KEY.peer_id,
    )
    return proof, claim


@pytest.mark.parametrize(("codec", "bits"), [("fp32", 8), ("fp16", 8), ("int8", 8), ("int8", 4)])
def test_an_honest_reducer_passes(codec: str, bits: int) -> None:
    used, weights, result = honest_part(codec, bits=bits)
    for me in (0, 1):
        proof, claim = prove_and_claim(used, weights, result, codec, probes=4, bits=bits, me=me)
        assert check(proof, claim, 4, ReductionConfig()) is None


@pytest.mark.parametrize(("codec", "probes"), [("fp32", 2), ("int8", 8)])
@pytest.mark.parametrize("factor", [-1.0, 0.0, 0.5])
def test_a_result_that_is_not_the_mean_is_refused(codec: str, probes: int, factor: float) -> None:
    """Flipped, zeroed or halved at honest bytes. int8 leaves a tolerance (its rounding): one
    probe misses a flip ~3% of the time, so this uses 8 (a miss chance of ~1e-12)."""
    used, weights, result = honest_part(codec)
    lie = roundtrip(result * factor, codec)
    proof, claim = prove_and_claim(used, weights, lie, codec, probes=probes)
    why = check(proof, claim, probes, ReductionConfig())
    assert why is not None and "not the mean" in why


def test_a_reducer_cannot_drop_a_contribution_and_claim_it() -> None:
    """It aggregates members 1 and 2 only but lists 0 too: the mean no longer matches."""
    used, weights, _ = honest_part("fp32")
    without = weighted_mean([used[1], used[2]], [weights[1], weights[2]])
    proof, claim = prove_and_claim(used, weights, without, "fp32")
    assert "not the mean" in (check(proof, claim, 2, ReductionConfig()) or "")


def test_each_member_checks_its_own_entry() -> None:
    used, weights, result = honest_part("fp32")
    proof, claim = prove_and_claim(used, weights, result, "fp32")
    cfg = ReductionConfig()
    cases: list[tuple[apb.PartProof, str]] = []
    heavier = apb.PartProof()
    heavier.CopyFrom(proof)
    heavier.entries[0].weight = 1.5
    cases.append((heavier, "misstates this member's weight"))
    misstated = apb.PartProof()
    misstated.CopyFrom(proof)
    misstated.entries[0].projections[1] += 1.0
    cases.append((misstated, "misstates this member's contribution"))
    no_nonce = apb.PartProof()
    no_nonce.CopyFrom(proof)
    del no_nonce.nonces[0]
    cases.append((no_nonce, "left this member's nonce out"))
    own_nonce = apb.PartProof()
    own_nonce.CopyFrom(proof)
    own_nonce.nonces.add(member=REDUCER, nonce=b"x" * NONCE_BYTES)
    cases.append((own_nonce, "its own nonce"))
    huge = apb.PartProof()
    huge.CopyFrom(proof)
    huge.entries[2].weight = 1e9
    cases.append((huge, "implausible weights"))
    for bad, why in cases:
        # The run bounds what a member may declare (4 x H x batch x local ranks).
        bounded = ReductionConfig(max_weight=1e6)
        assert why in (check(bad, claim, 2, bounded) or ""), why
    # Within the bound, a weight beyond 4 x the median counts as 4 x the median ({1, 1, 5}:
    # 5 counts 4), and the member holds the reducer to that mean.
    declared = {0: 1.0, 1: 1.0, 2: 5.0}
    used, _, _ = honest_part("fp32", weights=(1.0, 1.0, 5.0))
    order = sorted(used)
    clipped = weighted_mean([used[i] for i in order], [min(declared[i], 4.0) for i in order])
    proof5, claim5 = prove_and_claim(used, declared, clipped, "fp32")
    assert check(proof5, claim5, 2, cfg) is None
    unclipped = weighted_mean([used[i] for i in order], [declared[i] for i in order])
    proof6, claim6 = prove_and_claim(used, declared, unclipped, "fp32")
    assert "is not the mean" in (check(proof6, claim6, 2, cfg) or "")
    invented = apb.PartProof()
    invented.CopyFrom(proof)
    del invented.entries[1]
    assert "did not use" in (check(invented, claim, 2, cfg) or "")


def test_a_relayed_copy_or_a_left_out_member_takes_only_the_bytes_checked() -> None:
    """A relay knew the probes when it served its copy, and a member left out of the mean may
    ask after they were drawn: they take only the bytes the proof's digest names."""
    used, weights, result = honest_part("fp32")
    cfg = ReductionConfig()
    others = {1: secrets.token_bytes(NONCE_BYTES)}
    proof = prove(used, weights, others, result)
    _, claim = prove_and_claim(used, weights, result, "fp32")
    relayed = dataclasses.replace(claim, relayed=True)
    assert check(proof, relayed, 2, cfg) is None
    assert check(proof, claim, 2, cfg) is not None  # direct: its nonce must be there
    crafted = result.clone()
    crafted[:10] *= -1
    other_bytes = dataclasses.replace(relayed, result=crafted, blob=served(crafted))
    assert "other bytes" in (check(proof, other_bytes, 2, cfg) or "")
    # Member 0's part was not used (an outlier, or late): the mean of 1 and 2 holds, its
    # nonce is not needed, the digest is; it can tell it was left out.
    two = {1: used[1], 2: used[2]}
    mean = weighted_mean([used[1], used[2]], [weights[1], weights[2]])
    late = prove(two, weights, others, mean)
    acked = dataclasses.replace(claim, result=mean, blob=served(mean))
    unacked = dataclasses.replace(acked, acked=False)
    assert check(late, acked, 2, cfg) is None and left_out(late, acked)
    assert check(late, unacked, 2, cfg) is None and not left_out(late, unacked)
    assert not left_out(proof, claim)
    wrong = dataclasses.replace(acked, result=crafted, blob=served(crafted))
    assert "other bytes" in (check(late, wrong, 2, cfg) or "")


def test_robust_aggregation_checks_only_the_entries() -> None:
    used, weights, _ = honest_part("fp32")
    trimmed = torch.stack(list(used.values())).median(dim=0).values
    proof, claim = prove_and_claim(used, weights, trimmed, "fp32")
    assert check(proof, claim, 2, ReductionConfig(aggregation="trimmed_mean")) is None
    assert check(proof, claim, 2, ReductionConfig()) is not None


def test_projection_is_the_keystream_sign_vector() -> None:
    """Every machine derives the same probes: the sign bit of AES-256-CTR keystream byte i,
    probe k starting at counter block k << 64 (torch's RNG differs across CPUs)."""
    seed = probe_seed(ROUND, 3, 1, {0: b"a" * NONCE_BYTES, 4: b"b" * NONCE_BYTES})
    assert seed != probe_seed(ROUND, 3, 1, {0: b"a" * NONCE_BYTES, 4: b"c" * NONCE_BYTES})
    n = 70_000  # more than one chunk, not a multiple of it
    v = torch.randn(n, generator=torch.Generator().manual_seed(5))
    got = project([v, 2 * v], seed, 3)
    for k in range(3):
        stream = Cipher(algorithms.AES(seed), modes.CTR((k << 64).to_bytes(16, "big")))
        keystream = stream.encryptor().update(bytes(n))
        z = torch.tensor([-1.0 if b >= 128 else 1.0 for b in keystream], dtype=torch.float64)
        want = float(v.double() @ z)
        assert got[0][k] == pytest.approx(want, rel=1e-12, abs=1e-9)
        assert got[1][k] == pytest.approx(2 * want, rel=1e-12, abs=1e-9)


@pytest.mark.parametrize(
    ("codec", "bits", "n"), [("int8", 8, 10_000), ("int8", 3, 1_000), ("fp16", 8, 5_000)]
)
def test_quantization_bound_holds(codec: str, bits: int, n: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    for scale in (1e-30, 1e-3, 1.0, 1e3):  # fp16 overflows at 65504: refused as non-finite
        r = torch.randn(n, generator=gen) * scale
        r[7] = 40 * scale  # an outlier in one block
        decoded = roundtrip(r, codec, bits)
        err = float(torch.linalg.vector_norm((r - decoded).double()))
        bound = quantization_bound(decoded, codec, 256, bits)
        assert err <= bound, (scale, err, bound)
        # Not vacuous: no more than the worst case of the codec's own rounding.
        if codec == "int8":
            ceiling = n**0.5 * float(decoded.abs().max()) / (2 * ((1 << (bits - 1)) - 1))
        else:
            ceiling = 2.0**-9 * float(torch.linalg.vector_norm(r.double())) + 2.0**-23 * n**0.5
        assert bound <= ceiling * 1.001 + 1e-36, (scale, bound, ceiling)


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_sampled_probes_pass_an_honest_part_and_catch_a_flip(codec: str) -> None:
    """One block in eight is read (the default): the same verdicts on a part of 300 k values,
    for an eighth of the work."""
    used, weights, result = honest_part(codec, n=300_000)
    proof, claim = prove_and_claim(used, weights, result, codec, probes=8, density=0.125)
    assert check(proof, claim, 8, ReductionConfig()) is None
    lie = roundtrip(-result, codec)
    proof, claim = prove_and_claim(used, weights, lie, codec, probes=8, density=0.125)
    assert "not the mean" in (check(proof, claim, 8, ReductionConfig()) or "")


def test_the_sample_is_drawn_from_the_seed_and_whole_blocks() -> None:
    seed = probe_seed(ROUND, 0, 0, {1: b"n" * NONCE_BYTES})
    ranges = sample(seed, 1_000_003, 4096, 0.125)
    assert ranges == sample(seed, 1_000_003, 4096, 0.125)
    assert ranges != sample(
        probe_seed(ROUND, 0, 1, {1: b"n" * NONCE_BYTES}), 1_000_003, 4096, 0.125
    )
    assert all(a % 4096 == 0 and 0 < b - a <= 4096 for a, b in ranges)
    assert 0.06 < len(ranges) / (1_000_003 / 4096) < 0.2
    assert sample(seed, 50_000, 4096, 0.125) == [(0, 50_000)]  # small parts: read whole


def test_quantization_bound_holds_for_a_sparse_topk_mean() -> None:
    """A reduced top-k part is served sparse at 8 bits (codecs.result_codec): the bound holds,
    and it counts only the entries that are not exactly zero."""
    served = TopKCodec(TopKConfig(chunk=512, density=1.0, bits=TOPK_RESULT_BITS))
    gen = torch.Generator().manual_seed(0)
    for scale in (1e-30, 1e-3, 1.0, 1e3):
        r = torch.zeros(5000)
        at = torch.randperm(5000, generator=gen)[:400]
        r[at] = torch.randn(400, generator=gen) * scale
        r[at[0]] = 40 * scale
        decoded = decode(served.encode(r), DecodeLimits(max_elements=5000, max_bytes=1 << 20))
        err = float(torch.linalg.vector_norm((r - decoded).double()))
        bound = quantization_bound(decoded, "topk", 512, TOPK_RESULT_BITS)
        assert err <= bound, (scale, err, bound)
        ceiling = 400**0.5 * float(decoded.abs().max()) / 255
        assert bound <= ceiling * 1.001 + 1e-35, (scale, bound, ceiling)


def _forge_own_entry(proof: apb.PartProof, claim: Claim, probes: int) -> None:
    """Fills in the reducer's own projections so the weighted mean of the entries equals the
    projection of the part served (the attack a reducer that knows about proofs makes)."""
    nonces = {n.member: bytes(n.nonce) for n in proof.nonces}
    seed = probe_seed(ROUND, 1, 0, nonces)
    ranges = sample(seed, claim.result.numel(), sample_block(256), claim.density)
    (target,) = project([gather(claim.result, ranges)], seed, probes)
    total = sum(e.weight for e in proof.entries)
    own = next(e for e in proof.entries if e.member == REDUCER)
    for k in range(probes):
        others = sum(e.weight * e.projections[k] for e in proof.entries if e is not own)
        own.projections[k] = (total * target[k] - others) / own.weight


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_a_reducer_cannot_fill_in_its_own_entry(codec: str) -> None:
    """Its own entry must open from the commitment it served with the part, before the
    probes: a forged entry, or a commitment made afterwards to values that fit, is refused.
    Without the commitment the forged entry passed (proof.py's gap, issue 30 item 5)."""
    used, weights, result = honest_part(codec)
    lie = roundtrip(-result, codec)
    proof, claim = prove_and_claim(used, weights, lie, codec, probes=4)
    assert "not the mean" in (check(proof, claim, 4, ReductionConfig()) or "")
    _forge_own_entry(proof, claim, 4)
    assert "misstates its own contribution" in (check(proof, claim, 4, ReductionConfig()) or "")
    # A fresh commitment, opened honestly, to a contribution chosen after the probes.
    nonces = {n.member: bytes(n.nonce) for n in proof.nonces}
    seed = probe_seed(ROUND, 1, 0, nonces)
    later = commit(used[REDUCER] * -5, EXACT, sample_block(256))
    crafted = dict(used)
    crafted[REDUCER] = later.values
    reproof = make_proof(crafted, weights, nonces, seed, 4, [served(lie)], 256, 1.0, later)
    assert "other than the one it served" in (check(reproof, claim, 4, ReductionConfig()) or "")
    # Without any opening.
    bare = apb.PartProof()
    bare.CopyFrom(proof)
    bare.own_commitment = b""
    assert "without a commitment" in (check(bare, claim, 4, ReductionConfig()) or "")


#: Seeded sets of nonces the statistical checks below are run on (replayable, not flaky).
DRAWS = 50


def seeded_nonces(used: dict[int, torch.Tensor], rng: random.Random) -> dict[int, bytes]:
    return {i: rng.randbytes(NONCE_BYTES) for i in used if i != REDUCER}


def check_committed(
    used: dict[int, torch.Tensor],
    weights: dict[int, float],
    result: torch.Tensor,
    own: Committed,
    nonces: dict[int, bytes],
    bits: int,
    probes: int,
) -> str | None:
    """check() on a proof whose reducer committed its own values in the daemon's int8 form."""
    seed = probe_seed(ROUND, 1, 0, nonces)
    proof = make_proof(used, weights, nonces, seed, probes, [served(result)], 256, 1 / 32, own)
    _, claim = prove_and_claim(used, weights, result, "int8", bits=bits, density=1 / 32)
    claim = dataclasses.replace(claim, nonce=nonces[0], commitment=own.root, form=own.form)
    return check(proof, claim, probes, ReductionConfig())


@pytest.mark.parametrize("bits", [8, 4, 3])
def test_a_reducer_committed_in_int8_passes_and_a_flip_is_still_caught(bits: int) -> None:
    """The daemon's form for int8 rounds (3 bits is the run's default): the reducer's own
    values quantised like everyone's, the daemon's number of probes. The check is
    statistical: over 50 seeded nonce sets the honest part passes every time and the
    flipped one is refused at least 48 times. At 3 bits, before the energy check and with 2
    probes, the flip passed ~72% of checks (and a CI run, at 4 bits and 8 probes, once)."""
    probes = AllReduceConfig().probes
    form = form_for("int8", 256, bits)
    used, weights, _ = honest_part("int8", bits=bits)
    own = commit(used[REDUCER], form, sample_block(256))
    used[REDUCER] = own.values
    mean = weighted_mean([used[i] for i in sorted(used)], [weights[i] for i in sorted(used)])
    honest, flipped = roundtrip(mean, "int8", bits), roundtrip(-mean, "int8", bits)
    rng = random.Random(bits)
    passed = refused = 0
    for _ in range(DRAWS):
        nonces = seeded_nonces(used, rng)
        why = check_committed(used, weights, honest, own, nonces, bits, probes)
        assert why is None, why
        passed += 1
        refused += check_committed(used, weights, flipped, own, nonces, bits, probes) is not None
    assert passed == DRAWS and refused >= DRAWS - 2, refused


@pytest.mark.parametrize("probes", [2, 16])
def test_a_part_rounded_to_the_edge_of_every_cell_passes(probes: int) -> None:
    """The tolerance's soundness side: a result off the mean by as much as rounding allows
    anywhere (half a step in every element, signs random) must pass every probe and the
    energy check, or an honest reducer could be banned. With the energy check's factor
    sqrt(k) (the probes' expected energy, no tail) it was refused ~half the time."""
    gen = torch.Generator().manual_seed(probes)
    bits, n = 3, 10_001
    decoded = roundtrip(torch.randn(n, generator=gen), "int8", bits)
    blocks = decoded[: n // 256 * 256].view(-1, 256).abs().amax(dim=1).repeat_interleave(256)
    amax = torch.cat([blocks, decoded[n // 256 * 256 :].abs().amax().expand(n % 256)])
    signs = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    mean = decoded + signs * amax * (0.5 / ((1 << (bits - 1)) - 1)) * (1 - 1e-6)
    used, weights = {0: mean, 1: mean}, {0: 1.0, 1: 1.0}
    rng = random.Random(probes)
    for _ in range(DRAWS):
        nonces = {1: rng.randbytes(NONCE_BYTES), 0: rng.randbytes(NONCE_BYTES)}
        proof = prove(used, weights, nonces, decoded, probes)
        _, claim = prove_and_claim(used, weights, decoded, "int8", probes=probes, bits=bits)
        claim = dataclasses.replace(claim, nonce=nonces[0])
        why = check(proof, claim, probes, ReductionConfig())
        assert why is None, why


def test_a_non_finite_commitment_is_refused() -> None:
    """NaN in the reducer's committed values would make every projection (and tolerance)
    NaN, and a NaN comparison is False: refused instead (found on review)."""
    used, weights, result = honest_part("fp32")
    poisoned = used[REDUCER].clone()
    poisoned[::4096] = float("nan")
    own = commit(poisoned, EXACT, sample_block(256))
    nonces = {i: secrets.token_bytes(NONCE_BYTES) for i in used if i != REDUCER}
    seed = probe_seed(ROUND, 1, 0, nonces)
    proof = make_proof(used, weights, nonces, seed, 4, [served(-result)], 256, 1.0, own)
    _, claim = prove_and_claim(used, weights, -result, "fp32", probes=4)
    claim = dataclasses.replace(claim, nonce=nonces[0], commitment=own.root)
    _forge_own_entry(proof, claim, 4)
    assert "non-finite" in (check(proof, claim, 4, ReductionConfig()) or "")


def test_a_left_out_member_still_holds_the_reducer_to_the_root_it_was_served() -> None:
    """Left out, a member cannot pin the probes (its nonce is not needed), so a reducer could
    commit afresh to whatever fits: the root served with the bytes must still be the one."""
    used, weights, result = honest_part("fp32")
    served_root = commit(used[REDUCER], EXACT, sample_block(256)).root
    lie = -result
    n1 = {1: secrets.token_bytes(NONCE_BYTES)}
    total = weights[1] + weights[2]
    fitted = commit((total * lie - weights[1] * used[1]) / weights[2], EXACT, sample_block(256))
    two = {1: used[1], 2: fitted.values}
    seed = probe_seed(ROUND, 1, 0, n1)
    proof = make_proof(two, weights, n1, seed, 2, [served(lie)], 256, 1.0, fitted)
    _, claim = prove_and_claim(used, weights, lie, "fp32")
    claim = dataclasses.replace(claim, commitment=served_root)
    assert left_out(proof, claim)
    assert "other than the one it served" in (check(proof, claim, 2, ReductionConfig()) or "")


def test_the_sample_is_capped_whatever_the_density() -> None:
    """A proof opens the sample (commit.py) and must fit a 4 MiB unary message."""
    seed = probe_seed(ROUND, 0, 0, {1: b"n" * NONCE_BYTES})
    for numel, density in ((50_000_000, 1.0), (50_000_000, 1 / 32), (3_000_000_000, 1 / 32)):
        ranges = sample(seed, numel, 4096, density)
        assert sum(b - a for a, b in ranges) <= MAX_SAMPLED, (numel, density)
        assert ranges == sample(seed, numel, 4096, density)
    assert sample(seed, 400_000, 4096, 1.0) == [(0, 400_000)]  # within the cap: read whole


def test_an_altered_or_unsigned_proof_proves_nothing() -> None:
    """Unary answers are not MAC'd: a proof changed on the way fails its signature, and that
    refusal is not evidence against the reducer (no ban: it may be the network's doing)."""
    used, weights, result = honest_part("fp32")
    proof, claim = prove_and_claim(used, weights, result, "fp32")
    assert check_proof(proof, claim, 2, ReductionConfig()) is None  # as signed
    altered = apb.PartProof()
    altered.CopyFrom(proof)
    altered.entries[1].projections[0] += 1.0
    for bad in (altered, apb.PartProof(entries=proof.entries, nonces=proof.nonces)):
        why = check_proof(bad, claim, 2, ReductionConfig())
        assert why is not None and "not signed" in why and not isinstance(why, Rejection)
    someone = dataclasses.replace(claim, signer=Identity.generate().peer_id)
    assert "not signed" in (check_proof(proof, someone, 2, ReductionConfig()) or "")
    # A lie the reducer signed is evidence.
    lie = roundtrip(-result, "fp32")
    proof, claim = prove_and_claim(used, weights, lie, "fp32", probes=8)
    assert isinstance(check_proof(proof, claim, 8, ReductionConfig()), Rejection)
