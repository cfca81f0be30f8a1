"""A reducer's proof that the part it served is the weighted mean of the contributions it
names, checked by every member before the part touches its model.

A member cannot see the other members' contributions, but it can check a random projection.
This is BTARD's cross-check (Gorbunov et al. 2022, "Secure Distributed Training at Scale",
section 3.2), cut down to what a plain mean needs:

* once the reducer has served the part, each member sends it a fresh nonce (so the nonce
  cannot have shaped the bytes it already holds); the nonces of the members it used seed
  ``probes`` random sign vectors z (AES-CTR keystream, the same on every CPU; torch's RNG is
  not);
* the reducer answers every member with one signed proof: for each contribution it used, the
  member, the weight and <g_i, z> per probe; the nonces; the opening of its own contribution
  (commit.py); the digest of that commitment and the bytes it served;
* each member checks that its own nonce seeded z, that its own contribution is there with
  the weight it declared and the projection it computes itself, and that
  sum(w_i <g_i, z>) / W equals <r, z> for the part r it received, within what the result's
  quantisation can move it (Hoeffding: |<d, z>| <= 6 ||d|| for a sign vector drawn after d
  was fixed, except with probability 2e-8). A member that got its copy from a relay, or was
  left out of the mean, takes only the bytes the digest names (the probes were known by then).

What this catches: a reducer that scales, flips or replaces its result, or drops, reweights or
misstates a member's contribution, or its own: its own entry is opened from a commitment it
served with the part's bytes, before the probes existed (commit.py; before that, a reducer
that knew about proofs filled in its own entry and served any part within the members' norm
bound). Proofs are signed, and members compare the proofs they accepted
(verify.cross_check): a reducer that told different members different stories, each filling
in an entry the asker cannot check, is caught by its own signatures. What it does not: a
reducer commits after it has seen the other contributions, so it can choose its own within the
members' norm bound, as any member that guessed the others' could, and so can one that fills in
a colluder's entry in the one proof it gives everyone; bounding that is robust aggregation's
(issue 28), whose result is not linear in the contributions: with it and three or more
contributions only the entries are checked. The int8 tolerance is a worst case (scale / 2 per
element): a flip escapes one probe ~3% of the time, but a change of ~10% of the part's norm
passes two probes often (measured: a third of the time). What BTARD adds and this does not:
recomputing gradients from public data (swarmd's peers train on their own data), MPRNG-agreed
accusations and run-wide bans (each peer bans on its own evidence: node/bans.py).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from blake3 import blake3
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from swarmd.compression.int8 import SCALE_MIN
from swarmd.node.averaging.commit import HASH_BYTES, Committed, Form, open_blocks, opened_values
from swarmd.node.averaging.reduction import (
    ReductionConfig,
    clip_weights,
    l2_norm,
    weight_outliers,
)
from swarmd.node.bans import Rejection
from swarmd.protocol import averaging_pb2 as apb
from swarmd.protocol.identity import Identity, PeerId, verify_signature

NONCE_BYTES = 16
#: Hoeffding's multiplier: P(|<d, z>| > k ||d||) <= 2 exp(-k^2 / 2) for independent signs.
SIGMAS = 6.0
#: The energy check's exponent: an honest part is refused by it with probability at most
#: e^-18 (~1.5e-8, the single-probe check's 2 exp(-18) at SIGMAS).
ENERGY_TAIL = 18.0
#: Relative float error allowed for in the reducer's mean (float32, a few additions per
#: element) and in projections computed by different machines.
FLOAT_SLACK = 1e-5
#: Elements per step of the projection: the probes' chunk stays in cache.
_CHUNK = 1 << 16
#: Parts with at most this many sample blocks are checked whole.
_SMALL_BLOCKS = 16
#: Values the probes read at most, whatever the density: a proof opens the reducer's own
#: sampled values (commit.py), 2 MiB in its largest form (fp32) plus their Merkle paths,
#: within the 4 MiB unary message cap.
MAX_SAMPLED = 1 << 19
#: Ranges [start, end) of a part's elements.
Ranges = list[tuple[int, int]]


def sample_block(int8_block_size: int) -> int:
    """The unit the probes sample: ~4096 elements, whole int8 blocks (so the rounding bound of a
    sample is the bound of the int8 blocks in it)."""
    return int8_block_size * max(1, 4096 // int8_block_size)


def sample(seed: bytes, numel: int, block: int, density: float) -> Ranges:
    """Which blocks of the part the probes read: each with probability ``density``, drawn from
    the same seed (after the bytes were fixed), at least one. Measured on 4 x 100 M int8
    values (benchmarks/allreduce.py): probing every element cost 1.5 CPU-s per peer per round
    (the round took 2.5x as long), one block in eight 0.44 CPU-s (+48%), one in 32 (the
    default) is within the round's run-to-run noise. A flip or rescale of the part shows the
    same in any sample; a change confined to a few blocks is seen only when a probed block
    holds it."""
    blocks = -(-numel // block)
    most = max(_SMALL_BLOCKS, MAX_SAMPLED // block)
    if blocks <= _SMALL_BLOCKS or (density >= 1 and blocks <= most):
        return [(0, numel)] if numel else []
    key = hashlib.sha256(b"swarmd/probe-sample/v2" + seed).digest()
    raw = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor().update(bytes(2 * blocks))
    draws = torch.frombuffer(bytearray(raw), dtype=torch.int16).to(torch.int32) & 0xFFFF
    cut = max(1, round(65536 * min(density, 1.0)))
    chosen = torch.nonzero(draws < cut).flatten()
    if chosen.numel() > most:
        # A proof opens the reducer's sampled blocks (commit.py) and must fit a unary
        # message: the `most` blocks with the smallest draws, whatever the density.
        chosen = chosen[torch.argsort(draws[chosen], stable=True)[:most]].sort().values
    picked = chosen.tolist() or [0]
    return [(b * block, min(numel, (b + 1) * block)) for b in picked]


def gather(values: torch.Tensor, ranges: Ranges) -> torch.Tensor:
    """The sampled elements, in order (the vector itself when it is read whole)."""
    if len(ranges) == 1 and ranges[0] == (0, values.numel()):
        return values
    return torch.cat([values[a:b] for a, b in ranges]) if ranges else values[:0]


def probe_seed(round_id: bytes, part: int, attempt: int, nonces: Mapping[int, bytes]) -> bytes:
    """The AES key of the probes: the part and every nonce, in member order."""
    h = hashlib.sha256(b"swarmd/probe/v1")
    h.update(struct.pack(">I", len(round_id)) + round_id + struct.pack(">II", part, attempt))
    for member in sorted(nonces):
        h.update(struct.pack(">IB", member, len(nonces[member])) + nonces[member])
    return h.digest()


def project(vectors: Sequence[torch.Tensor], seed: bytes, probes: int) -> list[list[float]]:
    """<v, z_k> for every vector and probe, in float64. z_k[i] is +1 or -1 by the sign bit of
    keystream byte i of AES-256-CTR under ``seed``, counter block k << 64."""
    n = vectors[0].numel() if vectors else 0
    streams = [
        Cipher(algorithms.AES(seed), modes.CTR((k << 64).to_bytes(16, "big"))).encryptor()
        for k in range(probes)
    ]
    acc = torch.zeros(len(vectors), probes, dtype=torch.float64)
    zeros = bytes(_CHUNK)
    signs = torch.empty(probes, _CHUNK, dtype=torch.float64)
    xs = torch.empty(len(vectors), _CHUNK, dtype=torch.float64)
    for start in range(0, n, _CHUNK):
        m = min(n, start + _CHUNK) - start
        raw = bytearray(b"".join(s.update(zeros[:m]) for s in streams))
        codes = torch.frombuffer(raw, dtype=torch.int8).view(probes, m)
        z = signs[:, :m]
        z.copy_(codes.bitwise_or_(1))  # odd, so never 0: the sign is +1 or -1
        z.sign_()
        x = xs[:, :m]
        for row, v in enumerate(vectors):
            x[row].copy_(v[start : start + m])
        acc.addmm_(x, z.T)
    return acc.tolist()


def quantization_bound(decoded: torch.Tensor, codec: str, block: int, bits: int) -> float:
    """An upper bound on ||r - decoded|| for any r that the codec turns into ``decoded``."""
    if codec == "fp32" or decoded.numel() == 0:
        return 0.0
    if codec == "fp16":  # round to nearest: half an ulp (2^-11 relative), subnormals 2^-25
        return 2.0**-10 * l2_norm(decoded) + 2.0**-24 * math.sqrt(decoded.numel())
    if codec == "topk":
        return _topk_bound(decoded, block, bits)
    if codec != "int8":
        raise ValueError(f"unknown codec {codec!r}")
    # Each element is within scale/2 of its input and the block's largest decodes to
    # qmax x scale (int8.py), so scale is the block's absmax / qmax, or the floor.
    qmax = (1 << (bits - 1)) - 1
    full = decoded.numel() // block * block
    blocks = [_absmax(decoded[:full].view(-1, block))] if full else []
    counts = [block] * (1 if full else 0)
    if full < decoded.numel():
        blocks.append(_absmax(decoded[full:].view(1, -1)))
        counts.append(decoded.numel() - full)
    total = 0.0
    for amax, count in zip(blocks, counts, strict=True):
        half = amax.double() * (0.5 * (1 + 1e-6) / qmax) + SCALE_MIN
        total += count * float((half * half).sum())
    return math.sqrt(total)


def _absmax(rows: torch.Tensor) -> torch.Tensor:
    """Each row's largest |value|, exactly, from one pass that writes nothing per element:
    `abs().amax()` wrote a fresh copy of the whole part first (100 MB a part at every member,
    each round: the kernel zeroing its pages cost more than the pass)."""
    low, high = torch.aminmax(rows, dim=1)
    return torch.maximum(high, low.neg())


def _topk_bound(decoded: torch.Tensor, chunk: int, bits: int) -> float:
    """A reduced top-k part (codecs.result_codec) is exact where it is zero and within one
    scale elsewhere, its chunk's largest |value| / (2^bits - 1) (or the smallest normal):
    the largest value is sent as the top level (compression/topk.py)."""
    levels = (1 << bits) - 1
    pad = -decoded.numel() % chunk
    rows = torch.cat([decoded, decoded.new_zeros(pad)]).view(-1, chunk).double()
    scale = rows.abs().amax(dim=1) * ((1 + 1e-6) / levels) + SCALE_MIN
    return math.sqrt(float(((rows != 0).sum(dim=1) * scale * scale).sum()))


def proof_digest(proof: apb.PartProof) -> bytes:
    """What the reducer signs: the proof with its signature fields empty."""
    bare = apb.PartProof()
    bare.CopyFrom(proof)
    bare.ClearField("signer_key")
    bare.ClearField("signature")
    return hashlib.sha256(bare.SerializeToString(deterministic=True)).digest()


def _signed(round_id: bytes, part: int, attempt: int, digest: bytes) -> bytes:
    head = struct.pack(">I", len(round_id)) + round_id + struct.pack(">II", part, attempt)
    return b"swarmd/proof-signature/v1" + head + digest


def sign_proof(
    proof: apb.PartProof, identity: Identity, round_id: bytes, part: int, attempt: int
) -> None:
    """Signed, a proof binds its reducer: two of them for one part that differ are evidence
    that it told members different stories (equivocation; verify.cross_check)."""
    proof.signer_key = identity.public_key
    proof.signature = identity.sign(_signed(round_id, part, attempt, proof_digest(proof)))


def signed_by(
    reducer: PeerId,
    key: bytes,
    signature: bytes,
    round_id: bytes,
    part: int,
    attempt: int,
    digest: bytes,
) -> bool:
    return PeerId.from_public_key(key) == reducer and verify_signature(
        key, signature, _signed(round_id, part, attempt, digest)
    )


@dataclass(frozen=True)
class Claim:
    """What a member knows of a part it obtained, to check its reducer's proof against."""

    round_id: bytes
    part: int
    attempt: int
    me: int
    reducer: int
    members: int
    #: The nonce this member sent with its request.
    nonce: bytes
    #: Whether the bytes came from a relay rather than the reducer: the relay knew the probes
    #: by then, so only the bytes the proof names (its digest) are taken, nonce or not.
    relayed: bool
    #: This member's contribution as the reducer decoded it, on the sampled ranges (None: it
    #: sent none), its weight, and whether the reducer acknowledged it.
    contribution: Callable[[Ranges], torch.Tensor | None]
    weight: float
    acked: bool
    #: The part as this member received it (decoded, and the bytes), and how it was encoded.
    result: torch.Tensor
    blob: bytes | bytearray
    codec: str
    #: The result's rounding unit and bits: int8's blocks, or top-k's chunks at the result's
    #: bits (AllReduceConfig.proof_block).
    int8_block_size: int
    int8_bits: int
    density: float
    #: The reducer's commitment to its own contribution, served with the bytes (empty: none
    #: came, or they came from a relay), and the form it is committed in (commit.py).
    commitment: bytes
    form: Form
    #: The reducer's peer id: the proof must carry its signature.
    signer: PeerId


class _Excused(str):
    """A refusal that proves nothing against the reducer: timing, or a relay's doing."""


def check_proof(
    proof: apb.PartProof, claim: Claim, probes: int, reduction: ReductionConfig
) -> str | None:
    """Why the proof does not hold for this member, or None when it does; a `Rejection`
    (evidence for a ban) unless the refusal could be the network's or a relay's doing."""
    why = _verdict(proof, claim, probes, reduction)
    if why is None or isinstance(why, _Excused):
        return why
    return Rejection(why, "false_data")


def _verdict(
    proof: apb.PartProof, claim: Claim, probes: int, reduction: ReductionConfig
) -> str | None:
    why = _check_form(proof, claim, probes, reduction)
    if why is not None:
        return why
    nonces = {n.member: bytes(n.nonce) for n in proof.nonces}
    seed = probe_seed(claim.round_id, claim.part, claim.attempt, nonces)
    block = sample_block(claim.int8_block_size)
    ranges = sample(seed, claim.result.numel(), block, claim.density)
    result = gather(claim.result, ranges)
    mine = claim.contribution(ranges)
    used_mine = claim.me in {e.member for e in proof.entries}
    if used_mine and mine is None:
        return "names a contribution this member never sent"
    own = mine if used_mine else None
    entries = {e.member: e for e in proof.entries}
    # Each entry a member can check itself: its own, and the reducer's, opened from the
    # commitment it served before the probes existed (commit.py).
    checked: list[tuple[int, torch.Tensor]] = [(claim.me, own)] if own is not None else []
    if claim.reducer in entries and claim.reducer != claim.me:
        theirs = opened_values(
            bytes(proof.own_commitment),
            claim.form,
            block,
            claim.result.numel(),
            ranges,
            bytes(proof.own_reveal),
            list(proof.own_paths),
        )
        if isinstance(theirs, str):
            return theirs
        checked.append((claim.reducer, theirs))
    projected = project([result] + [v for _, v in checked], seed, probes)
    for row, (member, values) in enumerate(checked, start=1):
        stated, norm = entries[member].projections, l2_norm(values)
        for k in range(probes):
            # Written so that a NaN anywhere refuses (a NaN comparison is False).
            if not abs(stated[k] - projected[row][k]) <= SIGMAS * FLOAT_SLACK * norm + 1e-30:
                got, want = stated[k], projected[row][k]
                whose = "this member's" if member == claim.me else "its own"
                return f"misstates {whose} contribution ({got:.6g}, not {want:.6g})"
    if reduction.aggregation != "mean" and len(entries) >= 3:
        return None  # a robust aggregate is not linear in the contributions
    # The weights the reducer averaged with (clipped at the run's multiple of their median).
    weights = clip_weights({m: e.weight for m, e in entries.items()}, reduction)
    total = sum(weights.values())
    mine_norm = l2_norm(mine) if mine is not None else 0.0
    # How large the contributions can be against this member's own and the mean, for the
    # float slack of the mean: the run's relative bound, or (none: SWARM) the mean itself.
    factor = reduction.norm_outlier_factor if math.isfinite(reduction.norm_outlier_factor) else 1
    scale = factor * max(mine_norm, l2_norm(result))
    bound = quantization_bound(result, claim.codec, claim.int8_block_size, claim.int8_bits)
    tolerance = SIGMAS * (bound + FLOAT_SLACK * scale)
    gaps = []
    for k in range(probes):
        mean = sum(weights[m] * e.projections[k] for m, e in entries.items()) / total
        gaps.append(mean - projected[0][k])
        if not abs(gaps[-1]) <= tolerance:
            return (
                f"is not the mean of the contributions it names: probe {k} gives "
                f"{projected[0][k]:.6g}, the contributions {mean:.6g} (tolerance {tolerance:.3g})"
            )
    energy, most = math.sqrt(sum(g * g for g in gaps)), energy_factor(probes) * tolerance / SIGMAS
    if not energy <= most:
        return (
            f"is not the mean of the contributions it names: its {probes} probes miss by "
            f"{energy:.6g} together (tolerance {most:.3g})"
        )
    return None


def energy_factor(probes: int, tail: float = ENERGY_TAIL) -> float:
    """How far, in units of ||e||, the probes' misses may reach together, sqrt(sum_k <z_k, e>^2),
    for a fixed e (the part's rounding) before the probes were drawn: sqrt(k + 2 sqrt(k t)
    + 2t), exceeded with probability at most e^-t (Laurent and Massart's chi-square bound; it
    needs only E exp(l <z, e>^2) <= (1 - 2 l ||e||^2)^-1/2, which random signs meet).

    Why a second check: at 3 bits (the run's default int8) the rounding bound is ~half the
    part's norm, so a sign-flipped part (each probe misses by 2 |<z, m>|) escapes a probe's
    own 6-sigma bound ~85% of the time, and two probes 75% (test_proof). Its misses summed
    over 16 probes stand out ~99% of the time at the same false-refusal rate."""
    return math.sqrt(probes + 2 * math.sqrt(probes * tail) + 2 * tail)


def _check_form(
    proof: apb.PartProof, claim: Claim, probes: int, reduction: ReductionConfig
) -> str | None:
    digest_ = proof_digest(proof)
    key, sig = bytes(proof.signer_key), bytes(proof.signature)
    if not signed_by(claim.signer, key, sig, claim.round_id, claim.part, claim.attempt, digest_):
        # Unsigned, it may have been changed on the way (unary answers are not MAC'd).
        return _Excused("is not signed by the reducer")
    entries: dict[int, apb.ProofEntry] = {}
    for e in proof.entries:
        values = [e.weight, *e.projections]
        if e.member >= claim.members or e.member in entries or len(e.projections) != probes:
            return "a malformed contribution list"
        if not (all(math.isfinite(v) for v in values) and e.weight > 0):
            return "a non-finite or non-positive entry"
        entries[e.member] = e
    if not entries:
        return "no contributions"
    nonces: dict[int, bytes] = {}
    for n in proof.nonces:
        if n.member >= claim.members or n.member in nonces or len(n.nonce) != NONCE_BYTES:
            return "a malformed nonce list"
        nonces[n.member] = bytes(n.nonce)
    if claim.reducer in nonces:
        return "seeded its probes with its own nonce"  # chosen last, it could steer them
    if not nonces:
        return "seeded its probes with no member's nonce"
    if not set(nonces) <= set(entries):
        # A nonce of a member it did not use would be its own to make up: grinding material.
        return "seeded its probes with nonces of members it did not use"
    if claim.reducer in entries and len(proof.own_commitment) != HASH_BYTES:
        return "uses its own contribution without a commitment to it"
    if claim.relayed or claim.me not in entries:
        # The probes were known before these bytes reached this member (a relay had its
        # proof; a member left out may ask after they were drawn): it takes only the bytes
        # the members whose nonces drew them checked.
        if proof.digest != digest([bytes(proof.own_commitment), memoryview(claim.blob)]):
            return _Excused("names other bytes than the ones this member got")  # the relay's?
    elif nonces.get(claim.me) != claim.nonce:
        return _Excused("left this member's nonce out of its probes")  # it came late?
    if claim.reducer in entries and claim.commitment and proof.own_commitment != claim.commitment:
        # Made after the probes were known, it could open to anything. (A member that got
        # its copy from a relay was served no root: the digest binds the one direct members
        # checked.)
        return "opens a commitment other than the one it served with the part"
    if claim.me in entries and entries[claim.me].weight != claim.weight:
        return f"misstates this member's weight ({entries[claim.me].weight:.6g})"
    # The run's bound (the median rule clips, and the mean above is checked with it).
    bad = weight_outliers({m: e.weight for m, e in entries.items()}, reduction)
    beyond = sorted(v for v in bad.values() if v.offence == "bad_weight")
    if beyond:
        return f"names implausible weights: {beyond}"
    return None


def left_out(proof: apb.PartProof, claim: Claim) -> bool:
    """Whether the reducer acknowledged this member's contribution but did not use it (an
    outlier, or late: the member is then where one that sent nothing is)."""
    return claim.acked and all(e.member != claim.me for e in proof.entries)


def digest(segments: bytes | bytearray | Sequence[bytes | memoryview]) -> bytes:
    """BLAKE3 of a part's bytes, whole or in the pieces they are served in (the reducer and
    every member hash the whole part each round: 2.6x SHA-256's speed, commit.py)."""
    h = blake3()
    for piece in [segments] if isinstance(segments, (bytes, bytearray)) else segments:
        h.update(piece)
    return h.digest()


def make_proof(
    used: Mapping[int, torch.Tensor],
    weights: Mapping[int, float],
    nonces: Mapping[int, bytes],
    seed: bytes,
    probes: int,
    served: Sequence[bytes | memoryview],
    int8_block_size: int,
    density: float,
    own: Committed | None = None,
) -> apb.PartProof:
    """The reducer's side: the projections of every contribution it aggregated (on the
    sampled blocks), its own opened there (``own``: its commitment, when it used its own),
    and the digest of its commitment and the bytes it serves."""
    order = sorted(used)
    numel = used[order[0]].numel() if order else 0
    ranges = sample(seed, numel, sample_block(int8_block_size), density)
    projected = project([gather(used[i], ranges) for i in order], seed, probes)
    root, reveal, paths = b"", b"", list[bytes]()
    if own is not None:
        root = own.root
        reveal, paths = open_blocks(own, ranges)
    return apb.PartProof(
        digest=digest([root, *served]),
        own_commitment=root,
        own_reveal=reveal,
        own_paths=paths,
        entries=[
            apb.ProofEntry(member=i, weight=weights[i], projections=p)
            for i, p in zip(order, projected, strict=True)
        ],
        nonces=[apb.ProofNonce(member=m, nonce=nonces[m]) for m in sorted(nonces)],
    )
