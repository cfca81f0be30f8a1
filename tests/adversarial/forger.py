"""A reducer that knows about proofs: it serves its part negated and fills in its own entry of
the proof so that the weighted mean of the entries matches what it served (proof.py's gap
before commit.py: nobody else holds the reducer's own contribution). Installed into a peer
process by tests/adversarial/lying_peer.py and tests/integration/allreduce_peer.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from swarmd.compression import DecodeLimits, decode
from swarmd.node.averaging import round as round_module
from swarmd.node.averaging import verify
from swarmd.node.averaging.proof import gather, project, sample, sample_block
from swarmd.protocol import averaging_pb2 as apb


def install() -> None:
    honest_aggregate = round_module.__dict__["aggregate"]
    honest_proof = verify.__dict__["make_proof"]

    def aggregate(*args: Any, **kwargs: Any) -> torch.Tensor:
        result: torch.Tensor = honest_aggregate(*args, **kwargs)
        return result.neg_()

    def make_proof(*args: Any) -> apb.PartProof:
        proof: apb.PartProof = honest_proof(*args)
        used: Mapping[int, torch.Tensor] = args[0]
        weights: Mapping[int, float] = args[1]
        nonces: Mapping[int, bytes] = args[2]
        seed: bytes = args[3]
        probes: int = args[4]
        served: Sequence[bytes | memoryview] = args[5]
        block: int = args[6]
        density: float = args[7]
        mine = [m for m in used if m not in nonces]  # the reducer sends itself no nonce
        if len(mine) != 1:
            return proof
        blob = b"".join(bytes(s) for s in served)
        numel = next(iter(used.values())).numel()
        result = decode(blob, DecodeLimits(max_elements=numel, max_bytes=len(blob) * 8 + 4096))
        ranges = sample(seed, numel, sample_block(block), density)
        (target,) = project([gather(result, ranges)], seed, probes)
        total = sum(weights[i] for i in used)
        entry = next(e for e in proof.entries if e.member == mine[0])
        for k in range(probes):
            others = sum(e.weight * e.projections[k] for e in proof.entries if e is not entry)
            entry.projections[k] = (total * target[k] - others) / entry.weight
        return proof

    round_module.__dict__["aggregate"] = aggregate
    verify.__dict__["make_proof"] = make_proof
