"""Butterfly all-reduce that finishes when peers die, stall or lie.

A group of n peers (same member order everywhere) splits the vector into n parts, sized by
each member's bandwidth. Phase 1 (reduce-scatter): every peer streams its part j, compressed,
to member j. Member j validates what arrives, waits until everyone expected has sent or its
deadline passes, and reduces (weighted mean, or a robust aggregate). Phase 2 (all-gather):
every peer fetches reduced part j from member j. Member j serves the *encoded* result and
decodes it for itself too, so every peer ends with the same bytes.

Failures, and what keeps survivors consistent:

* a sender that never sends, stalls, or sends garbage is left out of the parts it missed;
  the reducer names it in the result;
* a reducer that does not answer: the peer asks the other members for the copy they got
  from that reducer (`relay`); members only ever relay what they received directly, so
  there is no cycle and no guessing. Only if nobody has it do the survivors re-reduce the
  part at a fallback reducer (member (j + attempt) mod n), which waits for the survivors'
  contributions. Since nobody had the original, everyone ends with the re-reduced bytes.
  In a pair there is nobody to relay: the reducer is asked once more first (its partner
  re-reducing alone would keep its own values while the reducer kept the mean);
* nothing ever raises into the trainer: a part that cannot be averaged at all keeps the
  local values and is reported in `failed_parts`.

Deadlines come from measured throughput (an EWMA over completed transfers), never from a
hand-tuned constant: expected transfer time times a slack factor, plus a floor for latency.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import OrderedDict
from collections.abc import Callable

import torch
import trio

from swarmd.compression import CompressionError, DecodeLimits, ResidualStore
from swarmd.node.averaging.codecs import (
    CodecName,
    CodecPolicy,
    Encoded,
    decode_contribution,
    make_codec,
    part_limit,
)
from swarmd.node.averaging.config import AllReduceConfig, AllReduceResult, Throughput
from swarmd.node.averaging.exchange import GET_PART, PUT_PART, SERVICE, Exchange
from swarmd.node.averaging.group import Group, Member, part_bounds, sub_group
from swarmd.node.averaging.link import Link
from swarmd.node.averaging.proof import NONCE_BYTES
from swarmd.node.averaging.reduction import ReductionConfig, check_contribution, part_norms
from swarmd.node.averaging.round import Reduction, Round
from swarmd.node.bans import Bans, Rejection
from swarmd.node.metrics import Metrics
from swarmd.node.runtime import offload
from swarmd.protocol import averaging_pb2 as apb
from swarmd.protocol import rpc
from swarmd.protocol.framing import TensorMeta, payload_nbytes
from swarmd.protocol.identity import PeerId

log = logging.getLogger("swarmd.allreduce")

__all__ = [
    "GET_PART",
    "PUT_PART",
    "SERVICE",
    "AllReduceConfig",
    "AllReduceResult",
    "Averager",
    "CodecName",
    "CodecPolicy",
    "Group",
    "Member",
    "Throughput",
    "allreduce_named",
    "make_codec",
    "part_bounds",
    "sub_group",
]


class Averager:
    """Runs all-reduce rounds for this daemon and serves other members' requests."""

    def __init__(
        self,
        client: rpc.TensorCaller,
        me: PeerId,
        config: AllReduceConfig | None = None,
        metrics: Metrics | None = None,
        *,
        outgoing_encoder: Callable[[torch.Tensor], bytes] | None = None,
        bans: Bans | None = None,
    ) -> None:
        """``outgoing_encoder`` replaces the codec for this peer's own contributions; tests
        inject a lying peer with it (NaN, wrong shapes, huge values)."""
        self.config = config or AllReduceConfig()
        self._metrics = metrics
        self._me = me
        #: Peers this one refuses (bans.py): shared with matchmaking and state sync.
        self.bans = bans if bans is not None else Bans(observer=metrics)
        self.throughput = Throughput(self.config.initial_throughput)
        self._link = Link(
            client, self.config, metrics, outgoing_encoder, self.throughput, self.bans
        )
        self._residuals = ResidualStore()
        #: Per error-feedback key, last round's compensated vector: its memory is reused for
        #: the next one (fresh pages cost more than the arithmetic on them).
        self._spare: dict[str, torch.Tensor] = {}
        self._rounds: OrderedDict[bytes, Round] = OrderedDict()
        self._registered: dict[bytes, trio.Event] = {}
        self._stale: OrderedDict[bytes, None] = OrderedDict()

    def limit_weights(self, max_weight: float) -> None:
        """Bounds the weight a member may declare (the run knows how many samples a round
        can hold); a member declaring more is dropped from the part, with the evidence logged."""
        self.set_reduction(dataclasses.replace(self.config.reduction, max_weight=max_weight))

    def set_reduction(self, reduction: ReductionConfig) -> None:
        """Reduces parts by ``reduction`` from the next round on (the run's aggregation)."""
        self.set_config(dataclasses.replace(self.config, reduction=reduction))

    def set_config(self, config: AllReduceConfig) -> None:
        """Uses `config` from the next round on (a run's own settings, read after start)."""
        self.config = config
        self._link.config = config

    # -- service -----------------------------------------------------------------------------

    def service(self) -> rpc.Service:
        return rpc.Service(
            SERVICE,
            [
                rpc.tensor_in("PutPart", self._put_part, admit=self._admit_part),
                rpc.tensor_out("GetPart", apb.GetPartRequest, self._get_part),
                rpc.unary("GetProof", apb.ProofRequest, self._get_proof),
                rpc.unary("AcceptedProofs", apb.AcceptedProofsRequest, self._accepted_proofs),
            ],
        )

    async def _find_round(self, round_id: bytes) -> Round:
        if round_id in self._stale:
            raise rpc.RpcError(rpc.StatusCode.FAILED_PRECONDITION, "stale round")
        rnd = self._rounds.get(round_id)
        if rnd is not None:
            return rnd
        # The sender may be a little ahead of us: wait briefly for this round to start here.
        event = self._registered.get(round_id)
        if event is None:
            if len(self._registered) >= self.config.max_pending_rounds:
                raise rpc.RpcError(rpc.StatusCode.RESOURCE_EXHAUSTED, "too many unknown rounds")
            event = self._registered[round_id] = trio.Event()
        with trio.move_on_after(self.config.unknown_round_wait_s):
            await event.wait()
        rnd = self._rounds.get(round_id)
        if rnd is None:
            if not event.is_set():
                self._registered.pop(round_id, None)
            raise rpc.RpcError(rpc.StatusCode.NOT_FOUND, "unknown round")
        return rnd

    def _sender_index(self, rnd: Round, ctx: rpc.CallContext, contributing: bool = False) -> int:
        """The caller's index in the round. A banned peer may still fetch parts and proofs (it
        is in the group, and what it fetches is checked anyway) but its contributions are
        refused: whatever it sends is dropped for the ban's length, without waiting for it."""
        index = rnd.group.index_of(ctx.peer_id) if ctx.peer_id is not None else None
        if index is None or ctx.peer_id is None:
            raise rpc.RpcError(rpc.StatusCode.PERMISSION_DENIED, "sender is not in this group")
        if contributing and self.bans.banned(ctx.peer_id):
            why = self.bans.reason(ctx.peer_id)
            raise rpc.RpcError(rpc.StatusCode.PERMISSION_DENIED, f"sender is banned ({why})")
        return index

    async def _admit_part(self, meta: TensorMeta, ctx: rpc.CallContext) -> None:
        """Before a part's buffer is allocated: only a member this attempt expects, sending
        no more than the part's size at fp32 (the largest codec), is received at all."""
        _, _, red, sender = await self._part_target(meta, ctx)
        limit = part_limit(red.numel)
        if meta.nbytes > limit:
            red.add(
                sender,
                None,
                0.0,
                Rejection(f"declared {meta.nbytes} B, at most {limit} B", "bad_size"),
            )
            raise rpc.RpcError(
                rpc.StatusCode.INVALID_ARGUMENT, f"part of {meta.nbytes} B exceeds {limit} B"
            )

    async def _part_target(
        self, meta: TensorMeta, ctx: rpc.CallContext
    ) -> tuple[apb.PartInfo, Round, Reduction, int]:
        """The reduction a PutPart feeds and the sender's index, or why it has no place."""
        info = apb.PartInfo()
        try:
            info.ParseFromString(meta.info)
        except Exception:
            raise rpc.RpcError(rpc.StatusCode.INVALID_ARGUMENT, "malformed PartInfo") from None
        rnd = await self._find_round(info.round_id)
        sender = self._sender_index(rnd, ctx, contributing=True)
        n = len(rnd.group.members)
        if (
            info.part >= n
            or info.attempt >= rnd.attempts
            or not rnd.exchanged(info.part)
            or rnd.reducer_of(info.part, info.attempt) != rnd.me
        ):
            raise rpc.RpcError(
                rpc.StatusCode.FAILED_PRECONDITION, "this peer does not reduce that part"
            )
        red = rnd.reduction(info.part, info.attempt)
        if sender not in red.expected:  # a reducer that failed this part has no say in it
            raise rpc.RpcError(rpc.StatusCode.PERMISSION_DENIED, "not expected in this attempt")
        if red.done.is_set():
            raise rpc.RpcError(rpc.StatusCode.FAILED_PRECONDITION, "part already reduced (late)")
        if sender in red.values or sender in red.rejected:
            raise rpc.RpcError(rpc.StatusCode.ALREADY_EXISTS, "duplicate contribution")
        return info, rnd, red, sender

    async def _put_part(
        self, meta: TensorMeta, data: bytearray, ctx: rpc.CallContext
    ) -> apb.PartAck:
        info, rnd, red, sender = await self._part_target(meta, ctx)
        if not (math.isfinite(info.weight) and info.weight > 0):
            red.add(sender, None, 0.0, Rejection(f"bad weight {info.weight}", "bad_weight"))
            raise rpc.RpcError(rpc.StatusCode.INVALID_ARGUMENT, "weight must be finite and > 0")
        limits = DecodeLimits(max_elements=red.numel, max_bytes=part_limit(red.numel))
        try:
            value, backing, norm = await offload.run_sync(decode_contribution, data, limits)
        except CompressionError as exc:
            red.add(sender, None, 0.0, Rejection(f"undecodable: {exc}", "undecodable"))
            raise rpc.RpcError(rpc.StatusCode.INVALID_ARGUMENT, f"bad part: {exc}") from None
        if red.done.is_set():  # the deadline passed while we decoded
            raise rpc.RpcError(rpc.StatusCode.FAILED_PRECONDITION, "part already reduced (late)")
        why = check_contribution(value, red.numel)
        if why is not None:
            red.add(sender, None, 0.0, why)
            raise rpc.RpcError(rpc.StatusCode.INVALID_ARGUMENT, f"bad part: {why}")
        red.add(sender, value, info.weight)
        red.norms[sender] = norm
        red.buffers.append(backing)
        self._link.count_bytes("received", rnd.codec_name, len(data))
        return apb.PartAck(received_bytes=len(data))

    async def _get_part(
        self, req: apb.GetPartRequest, ctx: rpc.CallContext
    ) -> tuple[TensorMeta, Encoded]:
        rnd = await self._find_round(req.round_id)
        self._sender_index(rnd, ctx)
        n = len(rnd.group.members)
        if req.part >= n or req.attempt >= rnd.attempts:
            raise rpc.RpcError(rpc.StatusCode.INVALID_ARGUMENT, "no such part")
        if not rnd.exchanged(req.part):  # a client-mode member's: empty, nobody holds it
            raise rpc.RpcError(rpc.StatusCode.NOT_FOUND, "a client-mode member's part is empty")
        encoded: Encoded | None
        info = b""
        if req.relay:
            outcome = rnd.direct[req.part]
            await outcome.ready.wait()
            received = outcome.received
            encoded = outcome.encoded if received is None else [memoryview(received)]
        else:
            if rnd.reducer_of(req.part, req.attempt) != rnd.me:
                raise rpc.RpcError(rpc.StatusCode.FAILED_PRECONDITION, "not this peer's part")
            red = rnd.reduction(req.part, req.attempt)
            await red.done.wait()
            encoded = red.encoded
            info = apb.PartServed(own_commitment=red.commitment).SerializeToString()
        if encoded is None:
            raise rpc.RpcError(rpc.StatusCode.NOT_FOUND, "this peer has no copy of that part")
        nbytes = payload_nbytes(encoded)
        self._link.count_bytes("sent", rnd.codec_name, nbytes)
        return TensorMeta("uint8", (nbytes,), info=info), encoded

    async def _get_proof(self, req: apb.ProofRequest, ctx: rpc.CallContext) -> apb.PartProof:
        rnd = await self._find_round(req.round_id)
        sender = self._sender_index(rnd, ctx)
        n = len(rnd.group.members)
        if (
            req.part >= n
            or req.attempt >= rnd.attempts
            or not rnd.exchanged(req.part)
            or rnd.reducer_of(req.part, req.attempt) != rnd.me
        ):
            raise rpc.RpcError(rpc.StatusCode.FAILED_PRECONDITION, "not this peer's part")
        if len(req.nonce) != NONCE_BYTES:
            raise rpc.RpcError(
                rpc.StatusCode.INVALID_ARGUMENT, f"nonce must be {NONCE_BYTES} bytes"
            )
        red = rnd.reduction(req.part, req.attempt)
        await red.done.wait()
        red.add_nonce(sender, bytes(req.nonce))
        await red.proof_ready.wait()
        if red.proof is None:
            raise rpc.RpcError(rpc.StatusCode.NOT_FOUND, "no proof for that part")
        return red.proof

    async def _accepted_proofs(
        self, req: apb.AcceptedProofsRequest, ctx: rpc.CallContext
    ) -> apb.AcceptedProofs:
        """The proofs this peer was given in a round (accepted or refused), once it has
        judged every part's first proof (or the wait is over): a fellow member compares them
        with those it accepted (verify.cross_check). Not once every part is in: a member
        waiting out a fallback's deadline made the asker's shorter wait end with nothing."""
        rnd = await self._find_round(req.round_id)
        self._sender_index(rnd, ctx)
        with trio.move_on_after(self.config.cross_check_s):
            await rnd.judged.wait()
        return apb.AcceptedProofs(proofs=list(rnd.received.values()))

    # -- one round ---------------------------------------------------------------------------

    def _register(self, group: Group, numel: int, codec: CodecName) -> Round:
        me = group.index_of(self._me)
        if me is None:
            raise ValueError("this peer is not a member of the group")
        if group.round_id in self._rounds or group.round_id in self._stale:
            raise ValueError("round id already used")
        now = trio.current_time()
        for rid, old in list(self._rounds.items()):
            if old.finished_at is None:
                continue
            old.retire_copies()
            if now - old.finished_at > self.config.linger_s:
                del self._rounds[rid]
                self._stale[rid] = None
        while len(self._stale) > 4096:
            self._stale.popitem(last=False)
        rnd = self._rounds[group.round_id] = Round(group, me, numel, self.config, codec)
        event = self._registered.pop(group.round_id, None)
        if event is not None:
            event.set()
        return rnd

    async def allreduce(
        self,
        group: Group,
        tensor: torch.Tensor,
        weight: float,
        *,
        key: str = "default",
        codec: CodecName | None = None,
        out: torch.Tensor | None = None,
        feedback: bool = True,
    ) -> AllReduceResult:
        """Averages a flat float32 tensor with the group; never raises for peer failures.

        ``key`` names the error-feedback residual (one per distinct vector being averaged);
        ``feedback=False`` neither adds nor keeps one: for a vector whose mean must come out
        the same in groups that do not share members (a grid's upper levels, grid.py), where
        a member's residual would reach its own group's mean and no other's.
        ``codec`` overrides the configured one for this call (every member must agree).
        ``out`` (float32, the input's size, not sharing its memory) receives the average and
        is the result's tensor: a caller that averages every round saves a fresh tensor per
        round, whose pages the kernel must zero on first touch (4 x 100 M values on 2 cores:
        about half of all the CPU time a round took, and most of its round-to-round spread).
        """
        codec_name: CodecName = codec or self.config.codec
        if tensor.dim() != 1 or tensor.dtype != torch.float32:
            raise ValueError("allreduce takes a flat float32 tensor")
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError("weight must be finite and > 0")
        start = trio.current_time()
        local = tensor.detach().contiguous()
        result = self._output(local, out)  # every part is written by the exchange
        rnd = self._register(group, local.numel(), codec_name)

        # Whole-vector passes run in a worker thread, as the codecs do: in the trio thread they
        # held up every transfer this peer serves meanwhile (a 400 MB pass takes ~0.1 s).
        # One pass, part by part: the norms of this peer's own parts are the yardstick for
        # the reduced parts it obtains (Exchange.decode_part).
        norms = await offload.run_sync(part_norms, local, rnd.bounds)
        if not all(math.isfinite(n) for n in norms):
            raise ValueError("allreduce input contains NaN or infinity")
        # Error feedback: compress what we would have sent plus what earlier rounds lost.
        residual: torch.Tensor | None = None
        to_send = local
        if feedback and self.config.error_feedback and codec_name != "fp32":
            to_send, residual = await offload.run_sync(self._compensate, key, local)
        exchange = Exchange(
            self._link,
            rnd,
            local=local,
            to_send=to_send,
            residual=residual,
            result=result,
            weight=weight,
            key=key,
            local_norms=norms,
        )
        await exchange.run()
        if residual is not None:
            s, e = rnd.bounds[rnd.me]
            # A sparse codec's own part was encoded too (Exchange.sent_values), and a proved
            # round's was rounded to its committed form (verify.commit_own): both recorded
            # what they lost. Otherwise it went in exact: nothing to carry.
            if not rnd.sparse and not exchange.own_rounded:
                await offload.run_sync(residual[s:e].zero_)
            self._residuals.store(key, residual)
            if to_send is not local:
                self._spare[key] = to_send  # nothing refers to it any more: next round's buffer
        await exchange.settle_own_part()
        rnd.finished_at = trio.current_time()
        outcome = exchange.outcome(trio.current_time() - start)
        self._report(group, outcome)
        return outcome

    def _report(self, group: Group, outcome: AllReduceResult) -> None:
        if self._metrics is not None:
            failed, dropped = outcome.failed_parts, outcome.dropped
            kind = "failed" if failed else "degraded" if dropped else "ok"
            self._metrics.on_round(kind, outcome.duration_s, len(dropped))
        if outcome.dropped or outcome.failed_parts:
            log.warning(
                "round %s: dropped %s; parts kept local: %s",
                group.round_id.hex()[:12],
                sorted(p.short() for p in outcome.dropped),
                outcome.failed_parts,
            )

    @staticmethod
    def _output(local: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return torch.empty_like(local)
        if out.dtype != torch.float32 or out.shape != local.shape or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous float32 vector of {local.numel()} values")
        begin, size = local.data_ptr(), local.numel() * 4
        if begin < out.data_ptr() + size and out.data_ptr() < begin + size:
            raise ValueError("out must not overlap the input (it is read until the end)")
        return out

    def _compensate(self, key: str, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(local + residual, a buffer for the next residual), reusing last round's memory.

        The residual is taken out of the store for the round and stored again at its end, so
        a round cancelled midway forgets it (one round's correction lost) rather than adding
        it twice."""
        old = self._residuals.take(key)
        if old is not None and old.shape != local.shape:
            raise CompressionError(
                f"residual for {key!r} has shape {tuple(old.shape)}, input has {tuple(local.shape)}"
            )
        spare = self._spare.pop(key, None)
        if spare is None or spare.shape != local.shape:
            spare = torch.empty_like(local)
        if old is None:
            spare.copy_(local)
            return spare, torch.empty_like(local)
        torch.add(local, old, out=spare)
        return spare, old


async def allreduce_named(
    averager: Averager,
    group: Group,
    tensors: dict[str, torch.Tensor],
    weight: float,
    policy: CodecPolicy | None = None,
) -> tuple[dict[str, torch.Tensor], list[AllReduceResult]]:
    """Averages named tensors, each bucket of one codec as one flat all-reduce (concurrently).

    Every member must pass the same names and shapes (the run's model): the buckets are
    derived from them deterministically.
    """
    policy = policy or CodecPolicy()
    buckets: dict[CodecName, list[str]] = {}
    for name in sorted(tensors):
        buckets.setdefault(policy.codec_for(tensors[name]), []).append(name)
    averaged: dict[str, torch.Tensor] = {}
    results: list[AllReduceResult] = []

    async def one(codec: CodecName, names: list[str]) -> None:
        flat = torch.cat([tensors[n].detach().reshape(-1).float() for n in names])
        res = await averager.allreduce(
            sub_group(group, codec), flat, weight, key=f"bucket/{codec}", codec=codec
        )
        results.append(res)
        offset = 0
        for n in names:
            size = tensors[n].numel()
            averaged[n] = res.tensor[offset : offset + size].view_as(tensors[n])
            offset += size

    async with trio.open_nursery() as nursery:
        for codec, names in buckets.items():
            nursery.start_soon(one, codec, names)
    return averaged, results
