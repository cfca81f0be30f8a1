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
  contributions. Since nobody had the original, everyone ends with the re-reduced bytes;
* nothing ever raises into the trainer: a part that cannot be averaged at all keeps the
  local values and is reported in `failed_parts`.

Deadlines come from measured throughput (an EWMA over completed transfers), never from a
hand-tuned constant: expected transfer time times a slack factor, plus a floor for latency.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import trio

from swarmd.compression import (
    CodecId,
    CompressionError,
    DecodeLimits,
    HalfCodec,
    HalfConfig,
    Int8Codec,
    Int8Config,
    RawCodec,
    ResidualStore,
    ZstdConfig,
    decode,
    decode_into,
    encode_segments,
    peek_header,
    zstd_compress,
)
from swarmd.compression.codec import Codec
from swarmd.node.averaging.reduction import (
    ReductionConfig,
    aggregate,
    check_contribution,
    l2_norm,
    norm_outliers,
)
from swarmd.node.metrics import Metrics
from swarmd.protocol import averaging_pb2 as apb
from swarmd.protocol import rpc
from swarmd.protocol.framing import RECEIVE_BUFFERS, TensorMeta, payload_nbytes
from swarmd.protocol.identity import PeerId

log = logging.getLogger("swarmd.allreduce")

SERVICE = "swarmd.averaging.v1.Averager"
PUT_PART = rpc.method_path(SERVICE, "PutPart")
GET_PART = rpc.method_path(SERVICE, "GetPart")

CodecName = Literal["fp32", "fp16", "int8"]
#: fetch(member, part, attempt, relay, timeout) -> the encoded part, or None on failure
_Fetch = Callable[[int, int, int, bool, float], Awaitable[bytes | bytearray | None]]
_BYTES_PER_VALUE: dict[str, float] = {"fp32": 4.0, "fp16": 2.0, "int8": 1.02}
#: An encoded payload in pieces (codec header, then views of tensors' memory): sent and
#: served without joining the pieces into one buffer first.
Encoded = list[bytes | memoryview]


def _decode_contribution(data: bytearray, limits: DecodeLimits) -> tuple[torch.Tensor, bytearray]:
    """A received part's values and the buffer behind them (recycled after the reduction).

    INT8 parts are dequantised into a recycled float32 buffer, and the payload goes back to
    the pool at once; raw fp32 values are the payload itself, seen as floats."""
    header = peek_header(data, limits)
    if header.codec == CodecId.INT8 and len(header.shape) == 1 and header.numel > 0:
        backing = RECEIVE_BUFFERS.take(4 * header.numel)
        try:
            decode_into(data, limits, torch.frombuffer(backing, dtype=torch.float32))
        except CompressionError:
            RECEIVE_BUFFERS.give(backing)
            raise
        RECEIVE_BUFFERS.give(data)
        return torch.frombuffer(backing, dtype=torch.float32), backing
    return decode(data, limits), data


def make_codec(name: CodecName, int8_block_size: int = 256, int8_bits: int = 8) -> Codec:
    if name == "fp32":
        return RawCodec()
    if name == "fp16":
        return HalfCodec(HalfConfig("float16"))
    if name == "int8":
        return Int8Codec(Int8Config(int8_block_size, int8_bits))
    raise ValueError(f"unknown codec {name!r}")


def zstd_framed(segments: Encoded, level: int | None) -> Encoded:
    """The encoded part in one zstd frame (lossless; receivers detect it by its header), or
    as it was when ``level`` is None."""
    if level is None:
        return segments
    return [zstd_compress(b"".join(segments), ZstdConfig(level))]


@dataclass(frozen=True)
class Member:
    peer_id: PeerId
    address: str
    #: Announced bandwidth in bytes/s; parts are sized in proportion.
    bandwidth: float = 1e8

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"member bandwidth must be finite and > 0, got {self.bandwidth}")


@dataclass(frozen=True)
class Group:
    """Who averages together in one round. Members must be in the same order on every peer."""

    round_id: bytes
    members: tuple[Member, ...]

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError("a group needs at least one member")
        ids = [m.peer_id for m in self.members]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate member in group")
        if not 1 <= len(self.round_id) <= 64:
            raise ValueError("round_id must be 1..64 bytes")

    def index_of(self, peer_id: PeerId) -> int | None:
        for i, m in enumerate(self.members):
            if m.peer_id == peer_id:
                return i
        return None


def part_bounds(numel: int, bandwidths: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous spans proportional to bandwidth, covering [0, numel) exactly."""
    total = sum(bandwidths)
    bounds, start, acc = [], 0, 0.0
    for i, b in enumerate(bandwidths):
        acc += b
        end = numel if i == len(bandwidths) - 1 else round(numel * acc / total)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass(frozen=True)
class AllReduceConfig:
    codec: CodecName = "int8"
    #: int8: values sharing one fp32 scale (see Int8Config). Larger blocks spend fewer bytes
    #: on scales and, with ``zstd_level``, leave codes that entropy-code better (on a DiLoCo
    #: pseudo-gradient: 256 → 3.94x vs fp32, 4096 with zstd → 4.35x), at a coarser step that
    #: error feedback carries into the next round.
    int8_block_size: int = 256
    #: int8: code range in bits (see Int8Config.bits): below 8 only pays with ``zstd_level``.
    int8_bits: int = 8
    #: zstd level for a lossless frame around every lossy-coded part (int8 and fp16), or None.
    #: Costs about 3 ms per MB at level 3; fp32 parts are never framed (mantissas are noise).
    zstd_level: int | None = None
    #: Carry each peer's compression error into its next contribution (no effect for fp32).
    error_feedback: bool = True
    reduction: ReductionConfig = field(default_factory=ReductionConfig)
    #: Deadlines: floor + slack x (bytes / measured throughput).
    min_deadline_s: float = 5.0
    max_deadline_s: float = 600.0
    deadline_slack: float = 4.0
    #: Throughput assumed before anything was measured (bytes/s); deliberately modest.
    initial_throughput: float = 50e6
    #: How long a finished round keeps serving its parts to slower members.
    linger_s: float = 60.0
    #: Messages for a round this peer has not registered yet wait this long for it.
    unknown_round_wait_s: float = 5.0
    max_pending_rounds: int = 64

    def __post_init__(self) -> None:
        if self.codec not in _BYTES_PER_VALUE:
            raise ValueError(f"unknown codec {self.codec!r}; expected fp32, fp16 or int8")
        Int8Config(self.int8_block_size, self.int8_bits)  # raises ValueError with the reason
        if self.zstd_level is not None:
            ZstdConfig(self.zstd_level)
        if not 0 < self.min_deadline_s <= self.max_deadline_s:
            raise ValueError("need 0 < min_deadline_s <= max_deadline_s")
        if self.deadline_slack < 1 or self.initial_throughput <= 0:
            raise ValueError("deadline_slack must be >= 1 and initial_throughput > 0")
        if self.linger_s < 0 or self.unknown_round_wait_s < 0 or self.max_pending_rounds < 1:
            raise ValueError("linger_s, unknown_round_wait_s must be >= 0, max_pending_rounds >= 1")


@dataclass
class AllReduceResult:
    tensor: torch.Tensor
    #: Members left out of at least one part (never sent, sent garbage, stalled, died).
    dropped: set[PeerId]
    #: Parts that could not be averaged at all: they hold this peer's own values.
    failed_parts: list[int]
    #: Parts obtained from a relay or a fallback reducer rather than from their reducer.
    recovered_parts: list[int]
    duration_s: float

    @property
    def ok(self) -> bool:
        return not self.failed_parts


class Throughput:
    """EWMA of bytes/s over completed transfers: the basis of every deadline."""

    def __init__(self, initial: float) -> None:
        self.value = initial
        self._measured = False

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes < (1 << 16) or seconds <= 0:
            return  # tiny transfers measure latency, not bandwidth
        rate = nbytes / seconds
        self.value = rate if not self._measured else 0.7 * self.value + 0.3 * rate
        self._measured = True


class _Reduction:
    """One part being reduced at this peer (its own part, or a fallback attempt)."""

    def __init__(self, numel: int, expected: set[int]) -> None:
        self.numel = numel
        self.expected = expected
        self.values: dict[int, torch.Tensor] = {}
        #: The received payloads behind `values` (raw fp32 values are views of them): handed
        #: back to the receive pool once the part is reduced.
        self.buffers: list[bytearray] = []
        self.weights: dict[int, float] = {}
        self.rejected: dict[int, str] = {}
        self.all_arrived = trio.Event()
        self.done = trio.Event()
        self.encoded: Encoded | None = None
        self.decoded: torch.Tensor | None = None
        self.contributors: set[int] = set()

    def add(self, index: int, value: torch.Tensor | None, weight: float, why: str = "") -> None:
        if value is None:
            self.rejected[index] = why
        else:
            self.values[index] = value
            self.weights[index] = weight
        if self.expected <= set(self.values) | set(self.rejected):
            self.all_arrived.set()


class _Outcome:
    """What this peer obtained for a part straight from its reducer (relays serve only this)."""

    def __init__(self) -> None:
        self.ready = trio.Event()
        #: The bytes as received; relays serve them until the round is retired.
        self.received: bytearray | None = None
        self.encoded: Encoded | None = None


class _Round:
    def __init__(
        self, group: Group, me: int, numel: int, config: AllReduceConfig, codec: CodecName
    ) -> None:
        self.codec_name = codec
        self.codec = make_codec(codec, config.int8_block_size, config.int8_bits)
        self.zstd_level = None if codec == "fp32" else config.zstd_level
        self.group = group
        self.me = me
        self.numel = numel
        self.bounds = part_bounds(numel, [m.bandwidth for m in group.members])
        self.reductions: dict[tuple[int, int], _Reduction] = {}
        self.direct = {j: _Outcome() for j in range(len(group.members))}
        self.finished_at: float | None = None
        self.config = config

    def part_numel(self, part: int) -> int:
        start, end = self.bounds[part]
        return end - start

    def reducer_of(self, part: int, attempt: int) -> int:
        return (part + attempt) % len(self.group.members)

    def reduction(self, part: int, attempt: int) -> _Reduction:
        key = (part, attempt)
        red = self.reductions.get(key)
        if red is None:
            n = len(self.group.members)
            # A fallback reducer expects everyone but the reducers that already failed.
            failed = {self.reducer_of(part, a) for a in range(attempt)}
            expected = set(range(n)) - failed
            red = self.reductions[key] = _Reduction(self.part_numel(part), expected)
        return red


class Averager:
    """Runs all-reduce rounds for this daemon and serves other members' requests."""

    def __init__(
        self,
        client: rpc.RpcClient,
        me: PeerId,
        config: AllReduceConfig | None = None,
        metrics: Metrics | None = None,
        *,
        outgoing_encoder: Callable[[torch.Tensor], bytes] | None = None,
    ) -> None:
        """``outgoing_encoder`` replaces the codec for this peer's own contributions; tests
        inject a lying peer with it (NaN, wrong shapes, huge values)."""
        self.config = config or AllReduceConfig()
        self._metrics = metrics
        self._outgoing_encoder = outgoing_encoder
        self._client = client
        self._me = me
        self._residuals = ResidualStore()
        #: Per error-feedback key, last round's compensated vector: its memory is reused for
        #: the next one (fresh pages cost more than the arithmetic on them).
        self._spare: dict[str, torch.Tensor] = {}
        #: Per error-feedback key and part, the int8 codes of the part this peer sent last
        #: round: every send has finished when a round returns, so the next round reuses them
        #: (3 x 25 MB of fresh pages per round in the 4 x 100 M benchmark, ~8% of its CPU).
        self._sent_codes: dict[tuple[str, int], torch.Tensor] = {}
        self.throughput = Throughput(self.config.initial_throughput)
        self._rounds: OrderedDict[bytes, _Round] = OrderedDict()
        self._registered: dict[bytes, trio.Event] = {}
        self._stale: OrderedDict[bytes, None] = OrderedDict()

    # -- service -----------------------------------------------------------------------------

    def service(self) -> rpc.Service:
        return rpc.Service(
            SERVICE,
            [
                rpc.tensor_in("PutPart", self._put_part),
                rpc.tensor_out("GetPart", apb.GetPartRequest, self._get_part),
            ],
        )

    async def _find_round(self, round_id: bytes) -> _Round:
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

    def _sender_index(self, rnd: _Round, ctx: rpc.CallContext) -> int:
        index = rnd.group.index_of(ctx.peer_id) if ctx.peer_id is not None else None
        if index is None:
            raise rpc.RpcError(rpc.StatusCode.PERMISSION_DENIED, "sender is not in this group")
        return index

    async def _put_part(
        self, meta: TensorMeta, data: bytearray, ctx: rpc.CallContext
    ) -> apb.PartAck:
        info = apb.PartInfo()
        try:
            info.ParseFromString(meta.info)
        except Exception:
            raise rpc.RpcError(rpc.StatusCode.INVALID_ARGUMENT, "malformed PartInfo") from None
        rnd = await self._find_round(info.round_id)
        sender = self._sender_index(rnd, ctx)
        n = len(rnd.group.members)
        if info.part >= n or info.attempt >= n or rnd.reducer_of(info.part, info.attempt) != rnd.me:
            raise rpc.RpcError(
                rpc.StatusCode.FAILED_PRECONDITION, "this peer does not reduce that part"
            )
        red = rnd.reduction(info.part, info.attempt)
        if red.done.is_set():
            raise rpc.RpcError(rpc.StatusCode.FAILED_PRECONDITION, "part already reduced (late)")
        if sender in red.values or sender in red.rejected:
            raise rpc.RpcError(rpc.StatusCode.ALREADY_EXISTS, "duplicate contribution")
        if not (math.isfinite(info.weight) and info.weight > 0):
            red.add(sender, None, 0.0, f"bad weight {info.weight}")
            raise rpc.RpcError(rpc.StatusCode.INVALID_ARGUMENT, "weight must be finite and > 0")
        limits = DecodeLimits(max_elements=red.numel, max_bytes=4 * red.numel + 4096)
        try:
            value, backing = await trio.to_thread.run_sync(_decode_contribution, data, limits)
        except CompressionError as exc:
            red.add(sender, None, 0.0, f"undecodable: {exc}")
            raise rpc.RpcError(rpc.StatusCode.INVALID_ARGUMENT, f"bad part: {exc}") from None
        if red.done.is_set():  # the deadline passed while we decoded
            raise rpc.RpcError(rpc.StatusCode.FAILED_PRECONDITION, "part already reduced (late)")
        why = check_contribution(value, red.numel)
        if why is not None:
            red.add(sender, None, 0.0, why)
            raise rpc.RpcError(rpc.StatusCode.INVALID_ARGUMENT, f"bad part: {why}")
        red.add(sender, value, info.weight)
        red.buffers.append(backing)
        self._count_bytes("received", rnd.codec_name, len(data))
        return apb.PartAck(received_bytes=len(data))

    async def _get_part(
        self, req: apb.GetPartRequest, ctx: rpc.CallContext
    ) -> tuple[TensorMeta, Encoded]:
        rnd = await self._find_round(req.round_id)
        self._sender_index(rnd, ctx)
        n = len(rnd.group.members)
        if req.part >= n or req.attempt >= n:
            raise rpc.RpcError(rpc.StatusCode.INVALID_ARGUMENT, "no such part")
        encoded: Encoded | None
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
        if encoded is None:
            raise rpc.RpcError(rpc.StatusCode.NOT_FOUND, "this peer has no copy of that part")
        nbytes = payload_nbytes(encoded)
        self._count_bytes("sent", rnd.codec_name, nbytes)
        return TensorMeta("uint8", (nbytes,)), encoded

    # -- one round ---------------------------------------------------------------------------

    def _deadline(self, nbytes: float) -> float:
        cfg = self.config
        expected = nbytes / max(self.throughput.value, 1.0)
        return min(cfg.max_deadline_s, cfg.min_deadline_s + cfg.deadline_slack * expected)

    def _register(self, group: Group, numel: int, codec: CodecName) -> _Round:
        me = group.index_of(self._me)
        if me is None:
            raise ValueError("this peer is not a member of the group")
        if group.round_id in self._rounds or group.round_id in self._stale:
            raise ValueError("round id already used")
        now = time.monotonic()
        for rid, old in list(self._rounds.items()):
            if old.finished_at is None:
                continue
            # Relay copies go back to the pool as soon as this peer starts another round: a
            # member still fetching relays of the old round is late, and has fallbacks. Kept
            # for the whole linger, they made every round of a busy peer allocate its receive
            # buffers afresh (measured, 4 x 100M fp32 back to back: 3.6-6.0 s per round with
            # cold buffers, 1.8 s warm).
            for outcome in old.direct.values():
                if outcome.received is not None:  # nothing but relays ever read it
                    RECEIVE_BUFFERS.give(outcome.received)
                    outcome.received = None
            if now - old.finished_at > self.config.linger_s:
                del self._rounds[rid]
                self._stale[rid] = None
        while len(self._stale) > 4096:
            self._stale.popitem(last=False)
        rnd = self._rounds[group.round_id] = _Round(group, me, numel, self.config, codec)
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
    ) -> AllReduceResult:
        """Averages a flat float32 tensor with the group; never raises for peer failures.

        ``key`` names the error-feedback residual (one per distinct vector being averaged);
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
        start = time.monotonic()
        local = tensor.detach().contiguous()
        result = self._output(local, out)  # every part is written below
        rnd = self._register(group, local.numel(), codec_name)
        n, me = len(group.members), rnd.me
        failed: list[int] = []
        recovered: list[int] = []
        dropped: set[int] = set()

        # Whole-vector passes run in a worker thread, as the codecs do: in the trio thread they
        # held up every transfer this peer serves meanwhile (a 400 MB pass takes ~0.1 s).
        if not math.isfinite(await trio.to_thread.run_sync(l2_norm, local)):
            raise ValueError("allreduce input contains NaN or infinity")
        # Error feedback: compress what we would have sent plus what earlier rounds lost.
        use_ef = self.config.error_feedback and codec_name != "fp32"
        if use_ef:
            to_send, residual = await trio.to_thread.run_sync(self._compensate, key, local)
        else:
            to_send, residual = local, None
        encoded_parts: dict[int, Encoded] = {}
        sent_codes: dict[int, torch.Tensor] = {}
        encoded_ready = {j: trio.Event() for j in range(n)}
        largest = max(rnd.part_numel(j) for j in range(n))
        bytes_per_part = largest * _BYTES_PER_VALUE[codec_name] + 256
        phase_deadline = self._deadline(bytes_per_part * max(n - 1, 1))
        liar = self._outgoing_encoder
        # int8 hands back what the receivers will lose while it quantises, chunk by chunk.
        fused_ef = residual is not None and liar is None and isinstance(rnd.codec, Int8Codec)

        def encode_part(j: int) -> Encoded:
            """Part j as the bytes its reducer receives; for error feedback, also what it
            loses, in `residual`."""
            s, e = rnd.bounds[j]
            if fused_ef:
                assert isinstance(rnd.codec, Int8Codec) and residual is not None
                # Taken out for the round (a concurrent round of the same key gets its own) and
                # given back only once every send has returned.
                codes = self._sent_codes.pop((key, j), None)
                if codes is None or codes.numel() != e - s:
                    codes = torch.empty(e - s, dtype=torch.int8)
                sent_codes[j] = codes
                fused = rnd.codec.encode_segments(to_send[s:e], residual[s:e], codes=codes)
                return zstd_framed(fused, rnd.zstd_level)
            segments: Encoded = (
                [liar(to_send[s:e])]
                if liar
                else zstd_framed(encode_segments(rnd.codec, to_send[s:e]), rnd.zstd_level)
            )
            if residual is not None:
                blob = b"".join(segments)
                limits = DecodeLimits(max_elements=e - s, max_bytes=len(blob) * 8 + 4096)
                try:
                    torch.sub(to_send[s:e], decode(blob, limits), out=residual[s:e])
                except (CompressionError, RuntimeError):
                    residual[s:e].zero_()  # a deliberately broken payload: nothing to carry
            return segments

        async def prepare(j: int) -> None:
            encoded_parts[j] = await trio.to_thread.run_sync(encode_part, j)
            encoded_ready[j].set()

        async def send_part(j: int, attempt: int, target: int) -> bool:
            await encoded_ready[j].wait()
            info = apb.PartInfo(round_id=group.round_id, part=j, weight=weight, attempt=attempt)
            segments = encoded_parts[j]
            nbytes = payload_nbytes(segments)
            meta = TensorMeta("uint8", (nbytes,), info=info.SerializeToString())
            t0 = time.monotonic()
            try:
                await self._client.put_tensor(
                    group.members[target].address,
                    PUT_PART,
                    meta,
                    segments,
                    apb.PartAck,
                    timeout=phase_deadline,
                )
            except (rpc.RpcError, OSError) as exc:
                log.info("part %d to member %d failed: %s", j, target, exc)
                return False
            self.throughput.observe(nbytes, time.monotonic() - t0)
            self._count_bytes("sent", codec_name, nbytes)
            return True

        async def fetch(
            target: int, j: int, attempt: int, relay: bool, timeout: float
        ) -> bytearray | None:
            req = apb.GetPartRequest(round_id=group.round_id, part=j, attempt=attempt, relay=relay)
            t0 = time.monotonic()
            try:
                _, data = await self._client.get_tensor(
                    group.members[target].address,
                    GET_PART,
                    req,
                    timeout=timeout,
                    max_bytes=8 * rnd.part_numel(j) + 4096,
                )
            except (rpc.RpcError, OSError, ValueError) as exc:
                log.info(
                    "fetching part %d (attempt %d, relay=%s) from member %d failed: %s",
                    j,
                    attempt,
                    relay,
                    target,
                    exc,
                )
                return None
            self.throughput.observe(len(data), time.monotonic() - t0)
            self._count_bytes("received", rnd.codec_name, len(data))
            return data

        async def reduce(j: int, attempt: int, own: torch.Tensor) -> None:
            red = rnd.reduction(j, attempt)
            s, e = rnd.bounds[j]
            red.add(me, own, weight)
            with trio.move_on_after(phase_deadline):
                await red.all_arrived.wait()
            await self._finish_reduction(red, rnd, result[s:e])
            dropped.update(red.expected - red.contributors)

        def decode_part(j: int, blob: bytes | bytearray) -> bool:
            """Decodes part j straight into the result; False if it is unusable."""
            s, e = rnd.bounds[j]
            numel = e - s
            try:
                decode_into(
                    blob, DecodeLimits(max_elements=numel, max_bytes=8 * numel + 4096), result[s:e]
                )
            except CompressionError:
                return False
            return True

        async def obtain(j: int) -> None:
            s, e = rnd.bounds[j]
            fetch_timeout = 2 * phase_deadline + self._deadline(bytes_per_part)
            direct = await fetch(j, j, 0, False, fetch_timeout)
            rnd.direct[j].received = direct
            blob: bytes | bytearray | None = direct
            rnd.direct[j].ready.set()
            if blob is None:
                recovered.append(j)
                blob = await self._from_relays(rnd, j, fetch, fetch_timeout)
            attempt = 1
            while blob is None and attempt < n:
                target = rnd.reducer_of(j, attempt)
                if target == me:
                    # The part's own value at the fallback reducer is its uncompressed local one.
                    await reduce(j, attempt, to_send[s:e])
                    decoded = rnd.reduction(j, attempt).decoded
                    if decoded is not None:
                        if decoded.data_ptr() != result[s:e].data_ptr():
                            result[s:e] = decoded
                        return
                elif await send_part(j, attempt, target):
                    blob = await fetch(target, j, attempt, False, fetch_timeout)
                attempt += 1
            if blob is None or not await trio.to_thread.run_sync(decode_part, j, blob):
                failed.append(j)
                result[s:e] = local[s:e]

        async with trio.open_nursery() as nursery:
            for j in range(n):
                if j != me:
                    nursery.start_soon(prepare, j)
                    nursery.start_soon(send_part, j, 0, j)
                    nursery.start_soon(obtain, j)
            s, e = rnd.bounds[me]
            nursery.start_soon(reduce, me, 0, to_send[s:e])

        # Every send has returned: the codes can serve the next round of this key.
        self._sent_codes.update(((key, j), codes) for j, codes in sent_codes.items())
        if residual is not None:
            s, e = rnd.bounds[me]
            await trio.to_thread.run_sync(residual[s:e].zero_)  # it never crossed the wire
            self._residuals.store(key, residual)
            if to_send is not local:
                self._spare[key] = to_send  # nothing refers to it any more: next round's buffer
        own = rnd.reduction(me, 0)
        rnd.direct[me].encoded = own.encoded
        rnd.direct[me].ready.set()
        s, e = rnd.bounds[me]
        if own.decoded is not None:
            if own.decoded.data_ptr() != result[s:e].data_ptr():  # a robust reduction's
                await trio.to_thread.run_sync(result[s:e].copy_, own.decoded)
        else:
            failed.append(me)
            result[s:e] = local[s:e]
        rnd.finished_at = time.monotonic()
        dropped.discard(me)
        outcome = AllReduceResult(
            tensor=result,
            dropped={group.members[i].peer_id for i in dropped},
            failed_parts=sorted(failed),
            recovered_parts=sorted(recovered),
            duration_s=time.monotonic() - start,
        )
        if self._metrics is not None:
            kind = "failed" if failed else "degraded" if dropped else "ok"
            self._metrics.on_round(kind, outcome.duration_s, len(dropped))
        if outcome.dropped or failed:
            log.warning(
                "round %s: dropped %s; parts kept local: %s",
                group.round_id.hex()[:12],
                sorted(p.short() for p in outcome.dropped),
                outcome.failed_parts,
            )
        return outcome

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

    def _count_bytes(self, direction: str, codec: str, nbytes: int) -> None:
        if self._metrics is not None:
            self._metrics.on_averaging_bytes(direction, codec, nbytes)

    async def _from_relays(
        self, rnd: _Round, j: int, fetch: _Fetch, timeout: float
    ) -> bytes | bytearray | None:
        """Asks the other members for the copy of part j they got from its reducer."""
        others = [i for i in range(len(rnd.group.members)) if i not in (j, rnd.me)]
        found: list[bytes | bytearray] = []
        async with trio.open_nursery() as nursery:

            async def ask(i: int) -> None:
                blob = await fetch(i, j, 0, True, timeout)
                if blob is not None and not found:
                    found.append(blob)
                    nursery.cancel_scope.cancel()

            for i in others:
                nursery.start_soon(ask, i)
        return found[0] if found else None

    async def _finish_reduction(self, red: _Reduction, rnd: _Round, out: torch.Tensor) -> None:
        """Drops outliers, aggregates, encodes once; every member gets exactly these bytes.

        `out` is this peer's slice of its result for the part: lossy codecs aggregate and
        decode there (no fresh 100 MB tensor per round, whose first touch, the kernel zeroing
        its pages, was half of all-reduce's CPU time), and `red.decoded` is then `out`."""
        if red.done.is_set():
            return
        values = dict(red.values)
        for index, why in norm_outliers(values, self.config.reduction).items():
            red.rejected[index] = why
            del values[index]
        for index, why in red.rejected.items():
            log.warning(
                "dropped member %s from a part: %s", rnd.group.members[index].peer_id.short(), why
            )
        order = sorted(values)
        if order:
            # Only lossless parts need the correctly rounded (float64) mean.
            reduced = await trio.to_thread.run_sync(
                functools.partial(
                    aggregate,
                    [values[i] for i in order],
                    [red.weights[i] for i in order],
                    self.config.reduction,
                    exact=rnd.codec_name == "fp32",
                    # fp32's encoding is a view of `reduced`, served to members after this
                    # peer's round ends: it must not be the caller's result.
                    out=None if rnd.codec_name == "fp32" else out,
                )
            )
            if isinstance(rnd.codec, Int8Codec):
                # Quantised in place: `reduced` (`out`, or a robust reduction's own tensor)
                # becomes what members decode, with no joined copy and no decoding pass.
                encode = functools.partial(rnd.codec.encode_segments, reduced, decoded=reduced)
                encoded = await trio.to_thread.run_sync(encode)
                red.decoded = reduced
            else:
                encoded = await trio.to_thread.run_sync(encode_segments, rnd.codec, reduced)
                if rnd.codec_name == "fp32":
                    red.decoded = reduced  # lossless: what members decode is exactly this
                else:
                    # `reduced` is encoded: overwrite `out` with what members decode (from the
                    # bytes before the lossless zstd frame: no need to inflate them).
                    blob = b"".join(encoded)
                    limits = DecodeLimits(max_elements=red.numel, max_bytes=len(blob) * 8 + 4096)
                    await trio.to_thread.run_sync(decode_into, blob, limits, out)
                    red.decoded = out
            red.encoded = encoded
            if rnd.zstd_level is not None:
                red.encoded = await trio.to_thread.run_sync(zstd_framed, encoded, rnd.zstd_level)
        red.contributors = set(order)
        # The contributions are never read again (relays serve the encoded result): free them.
        # `values` too: fp32 contributions are views of their receive buffers, and a buffer
        # still viewed is refused by the pool (measured: every round then allocated its 3 x
        # 100 MB of contributions afresh, 0.14 CPU-s in `take` alone, more in page faults).
        red.values.clear()
        values.clear()
        for buf in red.buffers:
            RECEIVE_BUFFERS.give(buf)
        red.buffers.clear()
        red.done.set()


@dataclass(frozen=True)
class CodecPolicy:
    """Which codec each tensor travels with: small and 1-D tensors (biases, norms, embeddings'
    positions) are cheap and sensitive, so they stay fp32; large matrices use ``large``."""

    large: CodecName = "int8"
    small: CodecName = "fp32"
    #: Tensors with fewer elements than this, or of one dimension, count as small.
    small_numel: int = 1 << 16

    def __post_init__(self) -> None:
        for name in (self.large, self.small):
            if name not in _BYTES_PER_VALUE:
                raise ValueError(f"unknown codec {name!r}")
        if self.small_numel < 0:
            raise ValueError("small_numel must be >= 0")

    def codec_for(self, tensor: torch.Tensor) -> CodecName:
        return self.small if tensor.dim() <= 1 or tensor.numel() < self.small_numel else self.large


def sub_group(group: Group, bucket: str) -> Group:
    """The same members under a round id of their own, one per codec bucket."""
    rid = hashlib.sha256(group.round_id + b"/" + bucket.encode()).digest()
    return Group(rid, group.members)


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
