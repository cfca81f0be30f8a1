"""A stage server's RPC side: Forward, Backward and Last calls, and Fetch for their results.

Every peer serves the Stage service (services are fixed when the server starts, before the
run's algorithm is known); it answers FAILED_PRECONDITION until a SWARM strategy attaches a
stage, and for a stage it does not hold (a server that moved), so a trainer with an old
directory learns at once and asks another server.

A call is two transfers on the tensor plane: the caller puts its bundle (Forward, Backward,
Last), the server computes and keeps the answer in a bounded outbox, and the caller fetches
it (Fetch, by the call's id). The transport has no call that sends a tensor both ways; this
costs one more round trip per hop (a few ms on loopback, one RTT on a wide-area link) and is
the place to save one (a bulk-plane "call" kind).

Everything received is checked before compute (wire.decode: sizes, finiteness; then shapes
against this stage's: batch at most the run's, sequence at most its block, width its model's,
token ids below its vocabulary). Compute is one call at a time (one device); at most
`MAX_WAITING` calls wait for it, beyond that a call is refused RESOURCE_EXHAUSTED so the
trainer goes elsewhere instead of queueing behind a slow server. Answers not fetched within
`OUTBOX_TTL_S` are dropped, and the outbox holds at most `OUTBOX_BYTES`.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import trio

from swarmd.node.algorithms.swarm import route, wire
from swarmd.node.peer.net import PeerNet, SocketNet
from swarmd.node.runtime import offload
from swarmd.optim.stage import StageTrainer
from swarmd.protocol import rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.calls import CallContext, RpcError, StatusCode
from swarmd.protocol.framing import Payload, TensorMeta

STAGE_SERVICE = "swarmd.v1.Stage"
FORWARD = rpc.method_path(STAGE_SERVICE, "Forward")
BACKWARD = rpc.method_path(STAGE_SERVICE, "Backward")
LAST = rpc.method_path(STAGE_SERVICE, "Last")
FETCH = rpc.method_path(STAGE_SERVICE, "Fetch")
#: An end stage's edge layers (embedding, head), live or a neighbour's copy (CheckFree+).
PART = rpc.method_path(STAGE_SERVICE, "Part")
#: Backward and Last computed and answered, nothing accumulated: a trainer checking what
#: another server of the stage answered (audit.py).
CHECK_BACKWARD = rpc.method_path(STAGE_SERVICE, "CheckBackward")
CHECK_LAST = rpc.method_path(STAGE_SERVICE, "CheckLast")

MAX_WAITING = 64
OUTBOX_TTL_S = 60.0
OUTBOX_BYTES = 256 << 20
#: Seconds of compute a call's measured time is averaged over (see `StageJob.observe`).
RATE_WINDOW_S = 5.0
MAX_CALL_ID = 64

T = TypeVar("T")

log = logging.getLogger("swarmd.swarm")


@dataclass(frozen=True)
class StageShape:
    """What this stage's inputs may look like (from the run config)."""

    batch: int
    block: int
    width: int
    vocab: int


@dataclass
class StageJob:
    """A stage this peer serves: its trainer and how its calls are checked and answered."""

    trainer: StageTrainer
    shape: StageShape
    activations: str = "fp16"
    #: >= 1: emulates a device this many times slower than this machine: each compute holds
    #: the device for `slowdown` times the fastest this kind of compute has taken here
    #: (benchmarks emulate unequal GPUs on a few CPU cores this way; a fixed time, not a
    #: multiple of each compute's own, so contention on the real cores is not amplified).
    slowdown: float = 1.0
    #: Seconds per call of each kind (a moving average, see `observe`), once measured.
    seconds: dict[str, float] = field(default_factory=dict)
    #: Calls of each kind measured so far.
    samples: dict[str, int] = field(default_factory=dict)
    #: The fastest each kind of compute took (what `slowdown` multiplies).
    fastest: dict[str, float] = field(default_factory=dict)
    #: Called with each applied micro-batch's call id (--swarm-audit: tests check exactly-once).
    on_applied: Callable[[str], None] | None = None
    #: Longest a call should wait for the device: beyond it, refused before compute
    #: (RESOURCE_EXHAUSTED), so that a trainer never times out on a call this server will
    #: still compute (and apply) after it went elsewhere.
    max_wait_s: float = 10.0
    #: The stage state the parameters are now (its published hash), or empty while a step or
    #: a download has changed them and the new state is not published yet: every answer's
    #: ack names it, and trainers compare two servers' answers only when it is the same.
    version: bytes = b""

    @property
    def index(self) -> int:
        return self.trainer.index

    def observe(self, kind: str, seconds: float) -> None:
        """Averages call times over the last ~RATE_WINDOW_S of compute (the mean of all of
        them until then). Servers move by these rates (rebalance.py), and a per-call average
        (the last ~5 calls, 0.1 s at 50 calls/s) swung 3x between equal servers on a busy
        2-core host (28-99 micro-batches/s): the move rule's 1.25 margin was noise, a second
        server left a stage that one move had balanced (CI)."""
        n = self.samples[kind] = self.samples.get(kind, 0) + 1
        old = self.seconds.get(kind, seconds)
        share = max(1.0 / n, -math.expm1(-seconds / RATE_WINDOW_S))
        self.seconds[kind] = old + share * (seconds - old)

    def emulated_s(self, kind: str, took: float) -> float:
        """How long this compute holds the device (see `slowdown`)."""
        if self.slowdown <= 1:
            return took
        fastest = self.fastest[kind] = min(self.fastest.get(kind, took), took)
        return max(took, self.slowdown * fastest)

    @property
    def per_call_s(self) -> float:
        """Mean seconds of one call's compute (0 before any was measured)."""
        known = [self.seconds[k] for k in ("forward", "backward", "last") if k in self.seconds]
        return sum(known) / len(known) if known else 0.0

    @property
    def rate(self) -> float:
        """Micro-batches per second (forward + backward, or the last stage's one call)."""
        t = self.trainer
        kinds = ("last",) if t.last_stage else ("forward", "backward")
        if not all(k in self.seconds for k in kinds):
            return 0.0
        return 1.0 / max(sum(self.seconds[k] for k in kinds), 1e-6)


class StageHost:
    """The Stage service of one peer, and the stage it serves now (if any)."""

    def __init__(self, net: PeerNet | None = None) -> None:
        #: The clocks and the device a compute is timed by (peer/net.py).
        self.net: PeerNet = net or SocketNet()
        self.job: StageJob | None = None
        self._device = trio.CapacityLimiter(1)
        self._waiting = 0
        #: (caller, call id) -> (deadline, answer bundle)
        self._outbox: collections.OrderedDict[tuple[str, str], tuple[float, list[memoryview]]]
        self._outbox = collections.OrderedDict()
        self._outbox_bytes = 0
        #: Copies of a neighbouring end stage's edge layers this server keeps (CheckFree+):
        #: "stage/edge" -> (that stage's round, the flat parameters).
        self.copies: dict[str, tuple[int, torch.Tensor]] = {}
        self._part_limiter = trio.CapacityLimiter(1)
        self._part_calls = 0

    # -- what the strategy does ------------------------------------------------------------

    def attach(self, job: StageJob | None) -> None:
        """Serves `job` from now on (None: no stage)."""
        self.job = job

    @property
    def queue(self) -> int:
        """Calls waiting for or holding this peer's compute."""
        return self._waiting

    async def compute(
        self,
        kind: str,
        fn: Callable[[], T],
        job: StageJob | None = None,
        then: Callable[[T], None] | None = None,
    ) -> T:
        """Runs `fn` on the device (one at a time), timing it for `job`'s rate (default: the
        served one's); used for calls and for the strategy's own work on a stage (take,
        apply). `then` runs right after `fn`, before anything that can be cancelled: what a
        call computed (and applied) is answered even if its caller's deadline passes while
        an emulated slow device still holds it."""
        job = job or self.job
        async with self._device:
            t0 = time.perf_counter()
            out = await offload.run_sync(fn)
            took, elapsed = self.net.device_s(kind, time.perf_counter() - t0)
            if then is not None:
                then(out)
            if job is not None:
                held = job.emulated_s(kind, took)
                if kind in ("forward", "backward", "last"):
                    job.observe(kind, held)
                await trio.sleep(held - elapsed)
            elif took > elapsed:
                await trio.sleep(took - elapsed)
        return out

    # -- the service -----------------------------------------------------------------------

    def service(self) -> rpc.Service:
        return rpc.Service(
            STAGE_SERVICE,
            [
                rpc.tensor_in("Forward", self._forward, admit=self._admit),
                rpc.tensor_in("Backward", self._backward, admit=self._admit),
                rpc.tensor_in("Last", self._last, admit=self._admit),
                rpc.tensor_in("CheckBackward", self._check_backward, admit=self._admit),
                rpc.tensor_in("CheckLast", self._check_last, admit=self._admit),
                rpc.tensor_out("Fetch", pb.TensorRequest, self._fetch),
                rpc.tensor_out("Part", pb.TensorRequest, self._part),
            ],
        )

    def _job_for(self, meta: TensorMeta) -> tuple[StageJob, str]:
        """The served stage a call names, and the part of it (route.py)."""
        job = self.job
        if job is None:
            raise RpcError(StatusCode.FAILED_PRECONDITION, "this peer serves no stage")
        try:
            hop = route.parse(meta.name)
        except ValueError as exc:
            raise RpcError(StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if hop.stage != job.index:
            raise RpcError(
                StatusCode.FAILED_PRECONDITION,
                f"this peer serves stage {job.index}, not {meta.name[:8]!r}",
            )
        try:
            job.trainer.part(hop.part)
        except ValueError as exc:  # swapped calls to a run without CheckFree+, or a stranger
            raise RpcError(StatusCode.INVALID_ARGUMENT, str(exc)) from None
        return job, hop.part

    async def _admit(self, meta: TensorMeta, ctx: CallContext) -> None:
        job, _ = self._job_for(meta)
        s = job.shape
        cells = s.batch * s.block
        limit = 1024 + cells * (2 * 4 * s.width + 2 * 8)  # two fp32 hidden + two int64
        if meta.dtype != "uint8" or len(meta.shape) != 1 or meta.shape[0] > limit:
            raise RpcError(
                StatusCode.INVALID_ARGUMENT,
                f"a stage call is a uint8 bundle of at most {limit} B",
            )
        if not 0 < len(meta.info) <= MAX_CALL_ID:
            raise RpcError(StatusCode.INVALID_ARGUMENT, "a stage call names its call id")
        if not admits(self._waiting, job.per_call_s, job.max_wait_s):
            raise RpcError(StatusCode.RESOURCE_EXHAUSTED, "stage server busy")

    def _inputs(self, job: StageJob, tensors: list[torch.Tensor], what: str, part: str) -> None:
        """Checks the stage's (or part's) input, the first tensor."""
        s = job.shape
        x = tensors[0]
        if job.trainer.takes_tokens(part):
            wire.expect(tensors[:1], [(None, None)], what)
            if x.dtype != torch.int64 or bool((x < 0).any()) or bool((x >= s.vocab).any()):
                raise wire.WireError(f"{what}: token ids must be int64 in [0, {s.vocab})")
        else:
            wire.expect(tensors[:1], [(None, None, s.width)], what)
            if x.dtype != torch.float32:
                raise wire.WireError(f"{what}: hidden states must be floats")
        if not (1 <= x.shape[0] <= s.batch and 1 <= x.shape[1] <= s.block):
            raise wire.WireError(
                f"{what}: batch {x.shape[0]} x length {x.shape[1]} exceeds {s.batch} x {s.block}"
            )

    def _decode(
        self, job: StageJob, data: bytearray, count: int, what: str, part: str
    ) -> list[torch.Tensor]:
        try:
            tensors = wire.decode(data)
            if len(tensors) != count:
                raise wire.WireError(f"{what}: expected {count} tensors, got {len(tensors)}")
            self._inputs(job, tensors, what, part)
        except wire.WireError as exc:
            raise RpcError(StatusCode.INVALID_ARGUMENT, str(exc)) from None
        return tensors

    async def _run(
        self,
        job: StageJob,
        meta: TensorMeta,
        ctx: CallContext,
        kind: str,
        fn: Callable[[], torch.Tensor | list[torch.Tensor] | None],
        applies: bool,
    ) -> pb.TensorAck:
        """Computes a call on `job` (the stage it was admitted for, even if the peer switched
        stage meanwhile); a failure of the micro-batch itself (non-finite, out of range, a
        shape the stage's layers refuse) is INVALID_ARGUMENT and nothing of it is applied.
        The ack names the stage round and state whose parameters computed the answer (a
        round's step holds the device too, so it cannot come between the compute and this
        read)."""
        computed_in, version = 0, b""

        def guarded() -> torch.Tensor | list[torch.Tensor] | None:
            try:
                out = fn()
            except (ValueError, RuntimeError) as exc:
                raise RpcError(StatusCode.INVALID_ARGUMENT, f"{kind}: {exc}"[:300]) from None
            if applies and job.trainer.left_out is not None:
                # Logged, not banned: a trainer relays the gradient a later stage's server
                # answered, so an outsized one is not proof against it (a first version
                # banned, and banned an honest trainer relaying a lying server's x(-20)).
                log.warning(
                    "stage %d: left a micro-batch of %s out of the round's sum: %s",
                    job.index, str(ctx.peer_id)[:10], job.trainer.left_out,
                )  # fmt: skip
            return out

        def answer(out: torch.Tensor | list[torch.Tensor] | None) -> None:
            nonlocal computed_in, version
            computed_in, version = job.trainer.round, job.version
            if out is not None:
                tensors = out if isinstance(out, list) else [out]
                self._post(ctx, meta.info, wire.encode(tensors, job.activations))
            if applies and job.on_applied is not None:
                job.on_applied(meta.info.decode(errors="replace"))

        self._waiting += 1
        try:
            await self.compute(kind, guarded, job, then=answer)
        finally:
            self._waiting -= 1
        return pb.TensorAck(received_bytes=meta.shape[0], round=computed_in, state=version)

    async def _forward(self, meta: TensorMeta, data: bytearray, ctx: CallContext) -> pb.TensorAck:
        job, part = self._job_for(meta)
        if job.trainer.last_stage and part != "blocks":
            raise RpcError(StatusCode.INVALID_ARGUMENT, "the last stage takes Last, not Forward")
        (x,) = self._decode(job, data, 1, "Forward", part)
        return await self._run(
            job,
            meta,
            ctx,
            _kind("forward", part),
            lambda: job.trainer.forward(x, wire.MAX_ABS, part),
            False,
        )

    async def _backward(self, meta: TensorMeta, data: bytearray, ctx: CallContext) -> pb.TensorAck:
        return await self._backward_call(meta, data, ctx, apply=True)

    async def _check_backward(
        self, meta: TensorMeta, data: bytearray, ctx: CallContext
    ) -> pb.TensorAck:
        return await self._backward_call(meta, data, ctx, apply=False)

    async def _last(self, meta: TensorMeta, data: bytearray, ctx: CallContext) -> pb.TensorAck:
        return await self._last_call(meta, data, ctx, apply=True)

    async def _check_last(
        self, meta: TensorMeta, data: bytearray, ctx: CallContext
    ) -> pb.TensorAck:
        return await self._last_call(meta, data, ctx, apply=False)

    async def _backward_call(
        self, meta: TensorMeta, data: bytearray, ctx: CallContext, apply: bool
    ) -> pb.TensorAck:
        job, part = self._job_for(meta)
        if job.trainer.last_stage and part != "blocks":
            raise RpcError(StatusCode.INVALID_ARGUMENT, "the last stage takes Last, not Backward")
        x, grad = self._decode(job, data, 2, "Backward", part)
        if grad.dtype != torch.float32 or grad.dim() != 3 or grad.shape[:2] != x.shape[:2]:
            raise RpcError(StatusCode.INVALID_ARGUMENT, "Backward: gradient does not fit input")
        return await self._run(
            job,
            meta,
            ctx,
            _kind("backward", part),
            lambda: job.trainer.backward(x, grad, wire.MAX_ABS, part, apply, str(ctx.peer_id)),
            apply,
        )

    async def _last_call(
        self, meta: TensorMeta, data: bytearray, ctx: CallContext, apply: bool
    ) -> pb.TensorAck:
        job, part = self._job_for(meta)
        if not job.trainer.last_stage or part == "blocks":
            raise RpcError(StatusCode.INVALID_ARGUMENT, f"{meta.name[:8]} does not end the model")
        x, targets = self._decode(job, data, 2, "Last", part)
        bad = targets.dtype != torch.int64 or targets.shape != x.shape[:2]
        if bad or bool((targets < 0).any()) or bool((targets >= job.shape.vocab).any()):
            raise RpcError(StatusCode.INVALID_ARGUMENT, "Last: targets must match the input")

        def step() -> list[torch.Tensor]:
            loss, grad = job.trainer.last(x, targets, wire.MAX_ABS, part, apply, str(ctx.peer_id))
            out = [torch.tensor(loss, dtype=torch.float32)]
            return out if grad is None else [*out, grad]

        return await self._run(job, meta, ctx, _kind("last", part), step, apply)

    # -- the outbox --------------------------------------------------------------------------

    def _post(self, ctx: CallContext, call: bytes, answer: list[memoryview]) -> None:
        now = self.net.monotonic()
        while self._outbox and (
            next(iter(self._outbox.values()))[0] < now or self._outbox_bytes > OUTBOX_BYTES
        ):
            _, (_, old) = self._outbox.popitem(last=False)
            self._outbox_bytes -= sum(v.nbytes for v in old)
        key = (str(ctx.peer_id), call.hex())
        replaced = self._outbox.pop(key, None)
        if replaced is not None:  # a call id used again: its old answer goes
            self._outbox_bytes -= sum(v.nbytes for v in replaced[1])
        self._outbox[key] = (now + OUTBOX_TTL_S, answer)
        self._outbox_bytes += sum(v.nbytes for v in answer)

    async def _fetch(self, req: pb.TensorRequest, ctx: CallContext) -> tuple[TensorMeta, Payload]:
        entry = self._outbox.pop((str(ctx.peer_id), req.name), None)
        if entry is None:
            raise RpcError(StatusCode.NOT_FOUND, "no answer for that call (expired or taken)")
        answer = entry[1]
        nbytes = sum(v.nbytes for v in answer)
        self._outbox_bytes -= nbytes
        return TensorMeta("uint8", (nbytes,), name="answer"), answer

    async def _part(self, req: pb.TensorRequest, ctx: CallContext) -> tuple[TensorMeta, Payload]:
        """An end stage's edge layers (`stage/edge`): live from a server of that stage, else
        the copy a neighbour keeps; answered as (round, values in rows of EDGE_ROW). Built in
        a worker thread (the live copy waits for the stage's lock), one at a time, at most
        MAX_PART_CALLS waiting: each answer is a copy of the layers in memory."""
        job, name = self.job, req.name
        live = job is not None and name == f"{job.index}/edge" and job.trainer.has_edge
        if not live and name not in self.copies:
            raise RpcError(StatusCode.NOT_FOUND, f"this server holds no {name[:16]!r}")
        if self._part_calls >= MAX_PART_CALLS:
            raise RpcError(StatusCode.RESOURCE_EXHAUSTED, "too many copies asked for at once")

        def build() -> list[memoryview]:
            if live and job is not None:
                rnd, flat = job.trainer.round, job.trainer.edge_vector()
            else:
                rnd, flat = self.copies[name]
            return wire.encode([torch.tensor([rnd], dtype=torch.int64), rows(flat)], "fp32")

        self._part_calls += 1
        try:
            async with self._part_limiter:
                answer = await offload.run_sync(build)
        except KeyError:  # the copy went meanwhile (the server moved)
            raise RpcError(StatusCode.NOT_FOUND, f"this server holds no {name[:16]!r}") from None
        finally:
            self._part_calls -= 1
        return TensorMeta("uint8", (sum(v.nbytes for v in answer),), name="part"), answer


#: `Part` calls one server answers or queues at a time.
MAX_PART_CALLS = 4
#: Values per row of an edge copy on the wire (a bundle's dimension is bounded by MAX_DIM).
EDGE_ROW = 4096


def admits(waiting: int, per_call_s: float, max_wait_s: float) -> bool:
    """Whether a call is taken when `waiting` calls wait for or hold the device: at most
    MAX_WAITING, and the new one's expected wait within `max_wait_s` (beyond it the caller is
    better served elsewhere than after its own timeout)."""
    return waiting < MAX_WAITING and (waiting + 1) * per_call_s <= max_wait_s


def rows(flat: torch.Tensor) -> torch.Tensor:
    """`flat` as rows of EDGE_ROW values, zero-padded (the receiver knows the size)."""
    n = flat.numel()
    out = torch.zeros((n + EDGE_ROW - 1) // EDGE_ROW * EDGE_ROW, dtype=torch.float32)
    out[:n] = flat
    return out.view(-1, EDGE_ROW)


def _kind(kind: str, part: str) -> str:
    """What a compute is timed as: a part's calls are not the stage's rate."""
    return f"{kind}-{part}" if part else kind
