"""A member's side and a reducer's side of a part's proof (proof.py holds the checks).

Kept apart from exchange.py, which moves the bytes: this module decides whether to trust
them and returns what it decided (a verdict, the members that caught an equivocation, a
commitment), and the exchange applies it. It never holds the exchange itself, so the
dependency runs one way: exchange -> verify.
"""

from __future__ import annotations

import functools
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import trio

from swarmd.compression import CompressionError, DecodeLimits, decode
from swarmd.node.averaging.codecs import Encoded
from swarmd.node.averaging.commit import Committed, commit, form_for
from swarmd.node.averaging.config import AllReduceConfig
from swarmd.node.averaging.link import Link
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
from swarmd.node.averaging.round import Round
from swarmd.node.runtime import offload
from swarmd.protocol import averaging_pb2 as apb
from swarmd.protocol import rpc
from swarmd.protocol.framing import RECEIVE_BUFFERS
from swarmd.protocol.identity import PeerId

log = logging.getLogger("swarmd.allreduce")

#: The Averager service's proof method (exchange.SERVICE; named here to keep imports one way).
GET_PROOF = rpc.method_path("swarmd.averaging.v1.Averager", "GetProof")
ACCEPTED_PROOFS = rpc.method_path("swarmd.averaging.v1.Averager", "AcceptedProofs")

#: Tries at a reducer's proof when the connection is lost, the first pause between them
#: (doubling), all within the request's deadline: a lost message is over in a try or two, and
#: a reducer that died mid-round must not hold the round. Asking until the deadline held a
#: chaos run's round 15 s on a killed reducer, long enough that its restarted process (new
#: port, same id) met only the stale group record naming its old address and sat out.
PROOF_TRIES = 4
PROOF_RETRY_S = 0.05

#: The reducer's proof for a part (or why there is none), and the nonce sent for it.
Asked = tuple[apb.PartProof | str, bytes]


@dataclass(frozen=True)
class Sent:
    """What this member gave a part's reducer: what the reducer's proof must account for."""

    #: Whether the part came through a relay (the reducer's commitment is then not at hand).
    relayed: bool
    weight: float
    #: Whether the reducer acknowledged the contribution.
    acked: bool
    #: The reduced part as this member decoded it.
    result: torch.Tensor
    #: The reducer's commitment to its own contribution, served with the part.
    commitment: bytes
    #: This member's values of the part, and what their encoding lost (None: no error
    #: feedback).
    values: torch.Tensor
    lost: torch.Tensor | None
    #: The bytes it sent, by part, read when a probe needs them (the part may still be
    #: encoding when the claim is made); this part's are `encoded[part]`, if any.
    encoded: Mapping[int, Encoded]
    part: int
    #: Whether the round's codec made them (False: a test's own encoder did).
    own_codec: bool


def contribution(sent: Sent, codec: str, ranges: Ranges) -> torch.Tensor | None:
    """The part as its reducer decoded it from this member's bytes, on ``ranges`` (None: it
    sent none, or bytes that decode to nothing a reducer could use)."""
    encoded = sent.encoded.get(sent.part)
    if encoded is None:
        return None
    if sent.own_codec and codec == "fp32":
        return gather(sent.values, ranges)
    lost = sent.lost
    if sent.own_codec and lost is not None:
        # What the reducer decoded is what this member meant to send less what the codec
        # lost (to a float32 rounding): no decoding pass over the whole part.
        return torch.cat([sent.values[a:b] - lost[a:b] for a, b in ranges])
    blob = b"".join(encoded)
    try:
        limits = DecodeLimits(max_elements=sent.values.numel(), max_bytes=len(blob) * 8 + 4096)
        return gather(decode(blob, limits), ranges)
    except CompressionError:
        return None


@dataclass(frozen=True)
class Verdict:
    #: Why the proof does not hold (a `Rejection` when that is evidence), or None when it does.
    why: str | None
    #: What this member tells fellow members it accepted (cross_check), when the proof held.
    accepted: apb.AcceptedProof | None = None
    #: The members whose contributions the part holds, as its proof lists them: the same
    #: for every member that accepted it.
    used: frozenset[int] = frozenset()


def _digest_of(proof: apb.PartProof, j: int, attempt: int) -> apb.AcceptedProof:
    return apb.AcceptedProof(
        part=j,
        attempt=attempt,
        digest=proof_digest(proof),
        signer_key=proof.signer_key,
        signature=proof.signature,
    )


async def cross_check(rnd: Round, link: Link, elapsed_s: float) -> list[tuple[int, int, PeerId]]:
    """Compares the proofs this peer accepted with those the other members were given
    (BTARD's broadcast of what each member was told, cut to one small call per member;
    accepted or refused: `Round.received`). A member checks only its
    own entry and the reducer's, so a reducer could tell each member a story that forges an
    entry that member cannot check; a fellow member holding the reducer's signature on
    another proof for the same part proves it did. Such a part is re-reduced without the
    reducer by every member that sees it (Exchange.fall_back), and the reducer is banned.
    Detections are not passed on: a reducer that serves one member late enough that only it
    compares in time splits the group on that part (the others applied a proof forging that
    member's entry), and a fallback reducer that did not see it reduces nothing, so the
    members that did go on to the next fallback (bounded by their deadlines).

    Waits for the others at most half as long as the round took so far (and 1 to
    `cross_check_s` seconds): a member that never answers costs a bounded share of a round.
    Returns each (part, attempt, witness) whose reducer signed another proof: the exchange
    re-reduces those parts and bans their reducers."""
    cfg = link.config
    found: list[tuple[int, int, PeerId]] = []
    mine = dict(rnd.accepted)
    if not mine:
        return found
    n = len(rnd.group.members)
    timeout = min(cfg.cross_check_s, max(1.0, 0.5 * elapsed_s))
    req = apb.AcceptedProofsRequest(round_id=rnd.group.round_id)

    async def ask(i: int) -> None:
        member = rnd.group.members[i]
        try:
            theirs = await link.client.unary(
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
                found.append((item.part, item.attempt, member.peer_id))

    # Only members that can hold a proof of a part this peer accepted: not its reducer (in a
    # pair, nobody).
    reducers = {rnd.reducer_of(j, a) for j, a in mine}
    asked = [i for i in range(n) if i != rnd.me and reducers != {i} and rnd.group.reachable(i)]
    with trio.move_on_after(timeout + 1.0):
        async with trio.open_nursery() as nursery:
            for i in asked:
                nursery.start_soon(ask, i)
    return found


def commit_own(
    rnd: Round,
    cfg: AllReduceConfig,
    j: int,
    attempt: int,
    own: torch.Tensor,
    residual: torch.Tensor | None,
    to_send: torch.Tensor,
) -> tuple[Committed, bool]:
    """This peer's contribution to a part it reduces, in the round's number format and
    committed to before any member's nonce exists (commit.py). Its own part's rounding goes
    to error feedback, as its other parts' does; a fallback part's send recorded the same
    rounding already (the same quantiser on the same values). Also returns whether its own
    part went in rounded (its error feedback then holds what that lost)."""
    block, _ = cfg.proof_block(rnd.codec_name)
    form = form_for(rnd.codec_name, cfg.int8_block_size, cfg.int8_bits)
    s, e = rnd.bounds[j]
    lost = out = None
    rounded = j == rnd.me and attempt == 0 and residual is not None and form.kind != "fp32"
    if rounded:
        assert residual is not None
        lost = residual[s:e]
        # `to_send` is then this round's own buffer, and its own part is read nowhere
        # else: the rounded values replace it there.
        out = own if own.data_ptr() == to_send[s:e].data_ptr() else None
    # The codes in a pooled buffer (Reduction.release hands it back): fresh ones cost the
    # kernel zeroing 25 MB a round.
    buf = RECEIVE_BUFFERS.take(e - s) if form.kind == "int8" and e > s else None
    codes = None if buf is None else torch.frombuffer(buf, dtype=torch.int8)
    committed = commit(own, form, sample_block(block), lost, out, codes=codes)
    committed.buffer = buf
    return committed, rounded


async def prove(rnd: Round, link: Link, j: int, attempt: int, fetch_timeout: float) -> None:
    """Waits for every other contributor's nonce (or ``fetch_timeout``, the time a member may
    take to fetch the part), then projects the contributions once for all members
    (proof.py) into the reduction's `proof`."""
    probes = link.config.probes
    red = rnd.reduction(j, attempt)
    if probes == 0 or red.decoded is None:
        return
    if not red.has_all_nonces():
        with trio.move_on_after(fetch_timeout):
            await red.nonces_in.wait()
    red.sealed = True
    # Only the members it used: any other nonce would be one it could have made up.
    nonces = {i: v for i, v in red.nonces.items() if i in red.used}
    if not nonces or red.encoded is None:
        return  # nobody it used asked: nobody can check a proof
    seed = probe_seed(rnd.group.round_id, j, attempt, nonces)
    weights = {i: red.weights[i] for i in red.used}
    cfg = link.config
    served, (block, _), density = red.encoded, cfg.proof_block(rnd.codec_name), cfg.probe_density
    own = red.committed if rnd.me in red.used else None
    identity = link.client.identity

    def make() -> apb.PartProof:
        proof = make_proof(red.used, weights, nonces, seed, probes, served, block, density, own)
        if identity is not None:
            sign_proof(proof, identity, rnd.group.round_id, j, attempt)
        return proof

    red.proof = await offload.run_sync(make)


async def request_proof(
    rnd: Round, client: rpc.TensorCaller, j: int, attempt: int, timeout: float
) -> Asked:
    """The reducer's proof for part j (or why there is none), and the nonce sent for it."""
    reducer = rnd.group.members[rnd.reducer_of(j, attempt)]
    nonce = secrets.token_bytes(NONCE_BYTES)
    req = apb.ProofRequest(round_id=rnd.group.round_id, part=j, attempt=attempt, nonce=nonce)
    deadline = trio.current_time() + timeout
    backoff = PROOF_RETRY_S
    for tries_left in range(PROOF_TRIES - 1, -1, -1):
        try:
            proof = await client.unary(
                reducer.address,
                GET_PROOF,
                req,
                apb.PartProof,
                timeout=max(deadline - trio.current_time(), 0.0),
                recipient=reducer.peer_id,
            )
        except (rpc.RpcError, OSError) as exc:
            # A lost connection is the network's failure, not the reducer's answer: refusing
            # the part for it gave the two members of a pair different results (one took the
            # reduced part, the other kept its own), and their states forked (seen in CI
            # under 2 % injected loss). The same nonce goes again: if the first request did
            # arrive, the reducer keeps the nonce it got first and its proof carries that one.
            lost = not isinstance(exc, rpc.RpcError) or exc.code is rpc.StatusCode.UNAVAILABLE
            if not lost or not tries_left or trio.current_time() + backoff >= deadline:
                return f"was not given: {exc}", nonce
            await trio.sleep(backoff)
            backoff *= 2
            continue
        return proof, nonce
    raise AssertionError("unreachable: the last try returns")


async def check(
    rnd: Round,
    cfg: AllReduceConfig,
    j: int,
    attempt: int,
    blob: bytes | bytearray,
    asked: Asked,
    sent: Sent,
) -> Verdict:
    """Checks the reducer's proof (``asked``) of part j against what this member sent."""
    proof, nonce = asked
    if isinstance(proof, str):
        return Verdict(proof)
    # Served to fellow members whatever the verdict (Round.received): they check whose
    # signature it bears.
    rnd.received[(j, attempt)] = _digest_of(proof, j, attempt)
    reducer = rnd.reducer_of(j, attempt)

    def verify() -> Verdict:
        claim = Claim(
            round_id=rnd.group.round_id,
            part=j,
            attempt=attempt,
            me=rnd.me,
            reducer=reducer,
            members=len(rnd.group.members),
            nonce=nonce,
            relayed=sent.relayed,
            contribution=functools.partial(contribution, sent, rnd.codec_name),
            weight=sent.weight,
            acked=sent.acked,
            result=sent.result,
            blob=blob,
            codec=rnd.codec_name,
            int8_block_size=cfg.proof_block(rnd.codec_name)[0],
            int8_bits=cfg.proof_block(rnd.codec_name)[1],
            density=cfg.probe_density,
            commitment=sent.commitment,
            form=form_for(rnd.codec_name, cfg.int8_block_size, cfg.int8_bits),
            signer=rnd.group.members[reducer].peer_id,
        )
        why = check_proof(proof, claim, cfg.probes, cfg.reduction)
        if why is not None:
            return Verdict(why)
        if left_out(proof, claim):
            log.warning(
                "round %s: reducer %s left this peer's contribution out of part %d (attempt %d)",
                rnd.group.round_id.hex()[:12],
                rnd.group.members[reducer].peer_id.short(),
                j,
                attempt,
            )
        accepted = rnd.received[(j, attempt)]
        return Verdict(None, accepted, frozenset(e.member for e in proof.entries))

    return await offload.run_sync(verify)
