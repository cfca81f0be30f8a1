"""A member's side and a reducer's side of a part's proof (proof.py holds the checks).

Kept apart from exchange.py, which calls these with itself: the exchange moves bytes, this
module decides whether to trust them.
"""

from __future__ import annotations

import functools
import logging
import secrets
from typing import TYPE_CHECKING

import torch
import trio

from swarmd.compression import CompressionError, DecodeLimits, decode
from swarmd.node.averaging.commit import Committed, commit, form_for
from swarmd.node.averaging.proof import (
    NONCE_BYTES,
    Claim,
    Ranges,
    check_proof,
    gather,
    left_out,
    make_proof,
    probe_seed,
    proof_digest,
    sample_block,
    sign_proof,
    signed_by,
)
from swarmd.protocol import averaging_pb2 as apb
from swarmd.protocol import rpc

if TYPE_CHECKING:
    from swarmd.node.averaging.exchange import Exchange

log = logging.getLogger("swarmd.allreduce")

#: The Averager service's proof method (exchange.SERVICE; named here to keep imports one way).
GET_PROOF = rpc.method_path("swarmd.averaging.v1.Averager", "GetProof")
ACCEPTED_PROOFS = rpc.method_path("swarmd.averaging.v1.Averager", "AcceptedProofs")


async def cross_check(ex: Exchange, elapsed_s: float) -> None:
    """Compares the proofs this peer accepted with the other members' (BTARD's broadcast of
    what each member was told, cut to one small call per member). A member checks only its
    own entry and the reducer's, so a reducer could tell each member a story that forges an
    entry that member cannot check; a fellow member holding the reducer's signature on
    another proof for the same part proves it did. Such a part is re-reduced without the
    reducer by every member that sees it (Exchange.fall_back), and the reducer is banned.
    Detections are not passed on: a reducer that serves one member late enough that only it
    compares in time splits the group on that part (the others applied a proof forging that
    member's entry), and a fallback reducer that did not see it reduces nothing, so the
    members that did go on to the next fallback (bounded by their deadlines).

    Waits for the others at most half as long as the round took so far (and 1 to
    `cross_check_s` seconds): a member that never answers costs a bounded share of a round."""
    rnd, cfg = ex.rnd, ex.link.config
    mine = dict(rnd.accepted)
    if not mine:
        return
    n = len(rnd.group.members)
    timeout = min(cfg.cross_check_s, max(1.0, 0.5 * elapsed_s))
    req = apb.AcceptedProofsRequest(round_id=rnd.group.round_id)

    async def ask(i: int) -> None:
        member = rnd.group.members[i]
        try:
            theirs = await ex.link.client.unary(
                member.address,
                ACCEPTED_PROOFS,
                req,
                apb.AcceptedProofs,
                timeout=timeout,
                recipient=member.peer_id,
            )
        except (rpc.RpcError, OSError):
            return  # nothing learnt; not evidence of anything
        for item in theirs.proofs[: 2 * n * n]:
            own = mine.get((item.part, item.attempt))
            if (
                own is None
                or item.digest == own.digest
                or item.part >= n
                or item.attempt >= rnd.attempts
            ):
                continue
            if rnd.reducer_of(item.part, item.attempt) == i:
                continue  # a reducer showing a second proof of its own would pick its accusers
            reducer = rnd.group.members[rnd.reducer_of(item.part, item.attempt)].peer_id
            args = (rnd.group.round_id, item.part, item.attempt, bytes(item.digest))
            if signed_by(reducer, bytes(item.signer_key), bytes(item.signature), *args):
                ex.equivocated(item.part, item.attempt, member.peer_id)

    # Only members that can hold a proof of a part this peer accepted: not its reducer (in a
    # pair, nobody).
    reducers = {rnd.reducer_of(j, a) for j, a in mine}
    asked = [i for i in range(n) if i != rnd.me and reducers != {i} and rnd.group.reachable(i)]
    with trio.move_on_after(timeout + 1.0):
        async with trio.open_nursery() as nursery:
            for i in asked:
                nursery.start_soon(ask, i)


def commit_own(ex: Exchange, j: int, attempt: int, own: torch.Tensor) -> Committed:
    """This peer's contribution to a part it reduces, in the round's number format and
    committed to before any member's nonce exists (commit.py). Its own part's rounding goes
    to error feedback, as its other parts' does; a fallback part's send recorded the same
    rounding already (the same quantiser on the same values)."""
    rnd, cfg = ex.rnd, ex.link.config
    block, _ = cfg.proof_block(rnd.codec_name)
    form = form_for(rnd.codec_name, cfg.int8_block_size, cfg.int8_bits)
    s, e = rnd.bounds[j]
    residual = out = None
    if j == rnd.me and attempt == 0 and ex.residual is not None and form.kind != "fp32":
        residual = ex.residual[s:e]
        ex.own_rounded = True
        # `to_send` is then this round's own buffer, and its own part is read nowhere
        # else: the rounded values replace it there.
        out = own if own.data_ptr() == ex.to_send[s:e].data_ptr() else None
    return commit(own, form, sample_block(block), residual, out)


async def prove(ex: Exchange, j: int, attempt: int) -> None:
    """Waits for every other contributor's nonce (or the time a member may take to fetch
    the part), then projects the contributions once for all members (proof.py)."""
    rnd, probes = ex.rnd, ex.link.config.probes
    red = rnd.reduction(j, attempt)
    if probes == 0 or red.decoded is None:
        return
    if not red.has_all_nonces():
        with trio.move_on_after(ex.fetch_timeout):
            await red.nonces_in.wait()
    red.sealed = True
    # Only the members it used: any other nonce would be one it could have made up.
    nonces = {i: v for i, v in red.nonces.items() if i in red.used}
    if not nonces or red.encoded is None:
        return  # nobody it used asked: nobody can check a proof
    seed = probe_seed(rnd.group.round_id, j, attempt, nonces)
    weights = {i: red.weights[i] for i in red.used}
    cfg = ex.link.config
    served, (block, _), density = red.encoded, cfg.proof_block(rnd.codec_name), cfg.probe_density
    own = red.committed if rnd.me in red.used else None
    identity = ex.link.client.identity

    def make() -> apb.PartProof:
        proof = make_proof(red.used, weights, nonces, seed, probes, served, block, density, own)
        if identity is not None:
            sign_proof(proof, identity, rnd.group.round_id, j, attempt)
        return proof

    red.proof = await trio.to_thread.run_sync(make)


async def request_proof(ex: Exchange, j: int, attempt: int) -> tuple[apb.PartProof | str, bytes]:
    """The reducer's proof for part j (or why there is none), and the nonce sent for it."""
    rnd = ex.rnd
    reducer = rnd.group.members[rnd.reducer_of(j, attempt)]
    nonce = secrets.token_bytes(NONCE_BYTES)
    req = apb.ProofRequest(round_id=rnd.group.round_id, part=j, attempt=attempt, nonce=nonce)
    try:
        proof = await ex.link.client.unary(
            reducer.address,
            GET_PROOF,
            req,
            apb.PartProof,
            # The reducer waits up to fetch_timeout for nonces, then makes one pass over
            # the part per contribution: about as long as a transfer of it.
            timeout=ex.fetch_timeout + ex.link.deadline(ex.bytes_per_part),
            recipient=reducer.peer_id,
        )
    except (rpc.RpcError, OSError) as exc:
        return f"was not given: {exc}", nonce
    return proof, nonce


async def check(
    ex: Exchange,
    j: int,
    attempt: int,
    blob: bytes | bytearray,
    relayed: bool,
    early: tuple[apb.PartProof | str, bytes] | None,
) -> str | None:
    """Asks the part's reducer for its proof (unless asked already) and checks it."""
    rnd, cfg = ex.rnd, ex.link.config
    proof, nonce = early if early is not None else await request_proof(ex, j, attempt)
    if isinstance(proof, str):
        return proof
    s, e = rnd.bounds[j]
    reducer = rnd.reducer_of(j, attempt)

    def verify() -> str | None:
        claim = Claim(
            round_id=rnd.group.round_id,
            part=j,
            attempt=attempt,
            me=rnd.me,
            reducer=reducer,
            members=len(rnd.group.members),
            nonce=nonce,
            relayed=relayed,
            contribution=functools.partial(sent, ex, j),
            weight=ex.weight,
            acked=(j, attempt) in ex.acked,
            result=ex.result[s:e],
            blob=blob,
            codec=rnd.codec_name,
            int8_block_size=cfg.proof_block(rnd.codec_name)[0],
            int8_bits=cfg.proof_block(rnd.codec_name)[1],
            density=cfg.probe_density,
            commitment=b"" if relayed else ex.commitments.get((j, attempt), b""),
            form=form_for(rnd.codec_name, cfg.int8_block_size, cfg.int8_bits),
            signer=rnd.group.members[reducer].peer_id,
        )
        why = check_proof(proof, claim, cfg.probes, cfg.reduction)
        if why is None:
            ex.verified[(j, attempt)] = apb.AcceptedProof(
                part=j,
                attempt=attempt,
                digest=proof_digest(proof),
                signer_key=proof.signer_key,
                signature=proof.signature,
            )
        if why is None and left_out(proof, claim):
            log.warning(
                "round %s: reducer %s left this peer's contribution out of part %d (attempt %d)",
                rnd.group.round_id.hex()[:12],
                rnd.group.members[reducer].peer_id.short(),
                j,
                attempt,
            )
        return why

    return await trio.to_thread.run_sync(verify)


def sent(ex: Exchange, j: int, ranges: Ranges) -> torch.Tensor | None:
    """Part j as its reducer decoded it from this peer's bytes, on ``ranges`` (None: it
    sent none, or bytes that decode to nothing a reducer could use)."""
    if j not in ex.encoded_parts:
        return None
    s, e = ex.rnd.bounds[j]
    mine, lost = ex.to_send[s:e], ex.residual
    if ex.link.outgoing_encoder is None and ex.rnd.codec_name == "fp32":
        return gather(mine, ranges)
    if ex.link.outgoing_encoder is None and lost is not None:
        # What the reducer decoded is what this peer meant to send less what the codec
        # lost (to a float32 rounding): no decoding pass over the whole part.
        return torch.cat([mine[a:b] - lost[s + a : s + b] for a, b in ranges])
    blob = b"".join(ex.encoded_parts[j])
    try:
        limits = DecodeLimits(max_elements=e - s, max_bytes=len(blob) * 8 + 4096)
        return gather(decode(blob, limits), ranges)
    except CompressionError:
        return None
