"""Reducers that know about proofs, installed into a peer process by
tests/harness/lying_peer.py and tests/harness/allreduce_peer.py. Both serve their part
negated and fill in an entry of the proof so that the weighted mean of the entries matches
what they served:

* `install` fills in its own entry (nobody else holds the reducer's own contribution: the
  gap before commit.py);
* `install_equivocator` tells each member its own story: a proof in which another member's
  entry, one the asker cannot check, is filled in (the gap before verify.cross_check). Every
  proof is signed, as a reducer must sign them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from swarmd.compression import DecodeLimits, decode
from swarmd.node.averaging import round as round_module
from swarmd.node.averaging import verify
from swarmd.node.averaging.allreduce import Averager
from swarmd.node.averaging.proof import (
    gather,
    probe_seed,
    project,
    sample,
    sample_block,
    sign_proof,
)
from swarmd.protocol import averaging_pb2 as apb
from swarmd.protocol import rpc


def _always() -> bool:
    return True


def install(when: Callable[[], bool] = _always) -> None:
    """``when``: whether the code running now is the liar's (always, in a liar's process; in
    the simulator, whether the current host is the liar's: swarmd/node/sim/network.py)."""
    honest_aggregate = round_module.__dict__["aggregate"]
    honest_proof = verify.__dict__["make_proof"]

    def aggregate(*args: Any, **kwargs: Any) -> torch.Tensor:
        result: torch.Tensor = honest_aggregate(*args, **kwargs)
        return result.neg_() if when() else result

    def make_proof(*args: Any) -> apb.PartProof:
        proof: apb.PartProof = honest_proof(*args)
        if not when():
            return proof
        used: Mapping[int, torch.Tensor] = args[0]
        nonces: Mapping[int, bytes] = args[2]
        seed: bytes = args[3]
        served: Sequence[bytes | memoryview] = args[5]
        block: int = args[6]
        density: float = args[7]
        mine = [m for m in used if m not in nonces]  # the reducer sends itself no nonce
        if len(mine) != 1:
            return proof
        blob = b"".join(bytes(s) for s in served)
        numel = next(iter(used.values())).numel()
        _fit(proof, mine[0], blob, numel, seed, block, density)
        return proof

    round_module.__dict__["aggregate"] = aggregate
    verify.__dict__["make_proof"] = make_proof


def _fit(
    proof: apb.PartProof,
    victim: int,
    blob: bytes,
    numel: int,
    seed: bytes,
    block: int,
    density: float,
) -> None:
    """Rewrites ``victim``'s projections so the entries' weighted mean is the served part's."""
    probes = len(proof.entries[0].projections)
    result = decode(blob, DecodeLimits(max_elements=numel, max_bytes=len(blob) * 8 + 4096))
    ranges = sample(seed, numel, sample_block(block), density)
    (target,) = project([gather(result, ranges)], seed, probes)
    total = sum(e.weight for e in proof.entries)
    entry = next(e for e in proof.entries if e.member == victim)
    for k in range(probes):
        others = sum(e.weight * e.projections[k] for e in proof.entries if e is not entry)
        entry.projections[k] = (total * target[k] - others) / entry.weight


def install_equivocator(when: Callable[[], bool] = _always) -> None:
    honest_aggregate = round_module.__dict__["aggregate"]
    honest_get_proof = Averager._get_proof

    def aggregate(*args: Any, **kwargs: Any) -> torch.Tensor:
        result: torch.Tensor = honest_aggregate(*args, **kwargs)
        return result.neg_() if when() else result

    async def get_proof(
        self: Averager, req: apb.ProofRequest, ctx: rpc.CallContext
    ) -> apb.PartProof:
        proof = await honest_get_proof(self, req, ctx)
        if not when():
            return proof
        rnd = await self._find_round(req.round_id)
        asker = rnd.group.index_of(ctx.peer_id) if ctx.peer_id is not None else None
        victims = [e.member for e in proof.entries if e.member not in (asker, rnd.me)]
        red = rnd.reduction(req.part, req.attempt)
        if not victims or red.encoded is None:
            return proof
        forged = apb.PartProof()
        forged.CopyFrom(proof)
        nonces = {n.member: bytes(n.nonce) for n in forged.nonces}
        seed = probe_seed(rnd.group.round_id, req.part, req.attempt, nonces)
        blob = b"".join(bytes(x) for x in red.encoded)
        block, _ = self.config.proof_block(rnd.codec_name)
        density = self.config.probe_density
        _fit(forged, victims[0], blob, red.numel, seed, block, density)
        identity = self._link.client.identity
        assert identity is not None
        sign_proof(forged, identity, rnd.group.round_id, req.part, req.attempt)
        return forged

    round_module.__dict__["aggregate"] = aggregate
    Averager._get_proof = get_proof  # type: ignore[method-assign]
