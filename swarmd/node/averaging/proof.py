"""A reducer's proof that the part it served is the weighted mean of the contributions it
names, checked by every member before the part touches its model.

A member cannot see the other members' contributions, but it can check a random projection.
This is BTARD's cross-check (Gorbunov et al. 2022, "Secure Distributed Training at Scale",
section 3.2 and appendix on verifying all-reduce), cut down to what a plain mean needs:

* once the reducer has served the part, each member sends it a fresh nonce (so the nonce
  cannot have shaped the bytes it already holds); the nonces seed ``probes`` random sign
  vectors z (AES-CTR keystream, the same on every CPU; torch's RNG is not);
* the reducer answers every member with one proof: for each contribution it used, the
  member, the weight and <g_i, z> per probe, and the nonces it seeded z from;
* each member checks that its own nonce seeded z, that its own contribution is there with
  the weight it declared and the projection it computes itself, and that
  sum(w_i <g_i, z>) / W equals <r, z> for the part r it received, within what the result's
  quantisation can move it (Hoeffding: |<d, z>| <= 6 ||d|| for a sign vector drawn after d
  was fixed, except with probability 2e-8).

A reducer that flips or rescales its result fails the last check unless it lies about a
contribution's projection; every member vouches for its own, so the only entry it can
invent is its own contribution. What it can do is then what a member can do with its
contribution (bounded by the reducer-side outlier rules and, with robust aggregation, by
issue 28's machinery), not more. With robust aggregation (trimmed mean, centered clip, three
or more contributions) the result is not linear in the contributions and only the entries
are checked. What BTARD adds and this does not: recomputing a peer's gradient from public data
(swarmd's peers train on their own data) and MPRNG-agreed accusations and bans.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from swarmd.compression.int8 import SCALE_MIN
from swarmd.node.averaging.reduction import ReductionConfig, l2_norm, weight_outliers
from swarmd.protocol import averaging_pb2 as apb

NONCE_BYTES = 16
#: Hoeffding's multiplier: P(|<d, z>| > k ||d||) <= 2 exp(-k^2 / 2) for independent signs.
SIGMAS = 6.0
#: Relative float error allowed for in the reducer's mean (float32, a few additions per
#: element) and in projections computed by different machines.
FLOAT_SLACK = 1e-5
#: Elements per step of the projection: the probes' chunk stays in cache.
_CHUNK = 1 << 16


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
    if codec != "int8":
        raise ValueError(f"unknown codec {codec!r}")
    # Each element is within scale/2 of its input and the block's largest decodes to
    # qmax x scale (int8.py), so scale is the block's absmax / qmax, or the floor.
    qmax = (1 << (bits - 1)) - 1
    full = decoded.numel() // block * block
    blocks = [decoded[:full].view(-1, block).abs().amax(dim=1)] if full else []
    counts = [block] * (1 if full else 0)
    if full < decoded.numel():
        blocks.append(decoded[full:].abs().amax().reshape(1))
        counts.append(decoded.numel() - full)
    total = 0.0
    for amax, count in zip(blocks, counts, strict=True):
        half = amax.double() * (0.5 * (1 + 1e-6) / qmax) + SCALE_MIN
        total += count * float((half * half).sum())
    return math.sqrt(total)


@dataclass(frozen=True)
class Claim:
    """What a member knows of a part it obtained, to check its reducer's proof against."""

    round_id: bytes
    part: int
    attempt: int
    me: int
    reducer: int
    members: int
    #: The nonce this member sent with its request; None if the part came from a relay (the
    #: relaying member checked the proof with its own nonce in it).
    nonce: bytes | None
    #: This member's contribution as the reducer decoded it, with its weight, if the reducer
    #: acknowledged it; None if it never arrived.
    contribution: torch.Tensor | None
    weight: float
    #: The part as this member received it, and how it was encoded.
    result: torch.Tensor
    codec: str
    int8_block_size: int
    int8_bits: int


def check_proof(
    proof: apb.PartProof, claim: Claim, probes: int, reduction: ReductionConfig
) -> str | None:
    """Why the proof does not hold for this member, or None when it does."""
    why = _check_form(proof, claim, probes, reduction)
    if why is not None:
        return why
    nonces = {n.member: bytes(n.nonce) for n in proof.nonces}
    seed = probe_seed(claim.round_id, claim.part, claim.attempt, nonces)
    own = claim.contribution if claim.me in {e.member for e in proof.entries} else None
    vectors = [claim.result] + ([own] if own is not None else [])
    projected = project(vectors, seed, probes)
    entries = {e.member: e for e in proof.entries}
    if own is not None:
        mine, norm = entries[claim.me].projections, l2_norm(own)
        for k in range(probes):
            if abs(mine[k] - projected[1][k]) > SIGMAS * FLOAT_SLACK * norm + 1e-30:
                got, want = mine[k], projected[1][k]
                return f"misstates this member's contribution ({got:.6g}, not {want:.6g})"
    if reduction.aggregation != "mean" and len(entries) >= 3:
        return None  # a robust aggregate is not linear in the contributions
    total = sum(e.weight for e in entries.values())
    mine_norm = l2_norm(claim.contribution) if claim.contribution is not None else 0.0
    scale = reduction.norm_outlier_factor * max(mine_norm, l2_norm(claim.result))
    bound = quantization_bound(claim.result, claim.codec, claim.int8_block_size, claim.int8_bits)
    tolerance = SIGMAS * (bound + FLOAT_SLACK * scale)
    for k in range(probes):
        mean = sum(e.weight * e.projections[k] for e in entries.values()) / total
        if not abs(mean - projected[0][k]) <= tolerance:
            return (
                f"is not the mean of the contributions it names: probe {k} gives "
                f"{projected[0][k]:.6g}, the contributions {mean:.6g} (tolerance {tolerance:.3g})"
            )
    return None


def _check_form(
    proof: apb.PartProof, claim: Claim, probes: int, reduction: ReductionConfig
) -> str | None:
    nonces: dict[int, bytes] = {}
    for n in proof.nonces:
        if n.member >= claim.members or n.member in nonces or len(n.nonce) != NONCE_BYTES:
            return "a malformed nonce list"
        nonces[n.member] = bytes(n.nonce)
    if claim.reducer in nonces:
        return "seeded its probes with its own nonce"  # chosen last, it could steer them
    if not nonces:
        return "seeded its probes with no member's nonce"
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
    # A member whose contribution was used needs its own nonce in the probes (they were then
    # drawn after the bytes it holds were fixed). One left out (an outlier, or late) is in
    # the position of a member that contributed nothing; `left_out` lets it log the fact.
    if claim.me in entries:
        if claim.nonce is not None and nonces.get(claim.me) != claim.nonce:
            return "left this member's nonce out of its probes"
        if claim.contribution is not None and entries[claim.me].weight != claim.weight:
            return f"misstates this member's weight ({entries[claim.me].weight:.6g})"
    bad = weight_outliers({m: e.weight for m, e in entries.items()}, reduction)
    if bad:
        return f"names implausible weights: {sorted(bad.values())}"
    return None


def left_out(proof: apb.PartProof, claim: Claim) -> bool:
    """Whether the reducer acknowledged this member's contribution but did not use it."""
    return claim.contribution is not None and all(e.member != claim.me for e in proof.entries)


def make_proof(
    used: Mapping[int, torch.Tensor],
    weights: Mapping[int, float],
    nonces: Mapping[int, bytes],
    seed: bytes,
    probes: int,
) -> apb.PartProof:
    """The reducer's side: the projections of every contribution it aggregated."""
    order = sorted(used)
    projected = project([used[i] for i in order], seed, probes)
    return apb.PartProof(
        entries=[
            apb.ProofEntry(member=i, weight=weights[i], projections=p)
            for i, p in zip(order, projected, strict=True)
        ],
        nonces=[apb.ProofNonce(member=m, nonce=nonces[m]) for m in sorted(nonces)],
    )
