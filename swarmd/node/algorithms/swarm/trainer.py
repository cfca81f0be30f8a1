"""A SWARM trainer: drives micro-batches of its data through one server per stage.

Forward goes stage 0, 1, ..., S-2 (each answer is the next stage's input), then the last
stage's Last call computes the loss and its input's gradient; backward goes S-2, ..., 0, each
call sending the hop's input again with the gradient (servers recompute: stateless backward).
The trainer keeps each hop's input until its backward is done, so its memory is `inflight`
micro-batches x S hidden states; nothing is held on a server between calls.

Every hop picks its server afresh (router.py), so a micro-batch's backward may run on another
server of the stage than its forward did. A hop that fails (refused, timed out, server gone)
is retried on another server of the same stage; only that hop is redone, never the whole
micro-batch, so a micro-batch is counted once whatever fails. A stage with no live server
pauses the trainer: it says so once, then re-reads the directory every second until a server
appears (or the peer is stopped).
"""

from __future__ import annotations

import logging
import math
import random
import secrets
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import trio

from swarmd.node.algorithms.swarm import audit, directory, wire
from swarmd.node.algorithms.swarm.config import SwarmConfig
from swarmd.node.algorithms.swarm.directory import StageRecord
from swarmd.node.algorithms.swarm.route import Hop, route, swap_for
from swarmd.node.algorithms.swarm.router import Choice, Router
from swarmd.node.algorithms.swarm.stage_service import (
    BACKWARD,
    CHECK_BACKWARD,
    CHECK_LAST,
    FETCH,
    FORWARD,
    LAST,
)
from swarmd.node.algorithms.swarm.timings import SwarmTimings
from swarmd.optim.grad_bound import GradientRefused, NormBound
from swarmd.protocol import rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.errors import ProtocolError
from swarmd.protocol.framing import TensorMeta
from swarmd.protocol.identity import PeerId

log = logging.getLogger("swarmd.swarm")

#: Servers one hop may fail on before its micro-batch is given up.
MAX_ATTEMPTS = 8
#: What a second server is asked when a hop is audited: the same call for Forward (it
#: applies nothing), the Check call for those that apply the micro-batch's gradients.
CHECKS = {FORWARD: FORWARD, BACKWARD: CHECK_BACKWARD, LAST: CHECK_LAST}
#: The least a trainer accepts an answer to be (more: 8x the request's bytes).
ANSWER_LIMIT = 64 << 20

T = TypeVar("T")
Batch = tuple[torch.Tensor, torch.Tensor]
#: Reads the run's stage directory (directory.read, bound to the peer's DHT and run).
ReadDirectory = Callable[[], Awaitable[dict[PeerId, StageRecord]]]
#: One try of a hop at a chosen server: (the server, the try's number) -> its answer.
Attempt = Callable[[Choice, int], Awaitable[T]]
#: (event kind, text, fields): the peer's progress output.
Say = Callable[..., None]


@dataclass
class TrainerStats:
    done: int = 0
    retries: int = 0
    #: Micro-batches given up (MicroBatchFailed).
    failed: int = 0
    tokens: int = 0
    loss: float = math.nan
    #: Hops compared with a second server's answer (audit.py), second answers computed from
    #: another stage state (not compared), and servers caught lying.
    audits: int = 0
    unmatched: int = 0
    caught: int = 0
    #: Completed micro-batch sequence numbers (each exactly once), kept only when asked
    #: (`keep_completed`: an audit; a long run would keep them all).
    completed: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Answer:
    """A stage server's answer to one call."""

    tensors: list[torch.Tensor]
    peer: PeerId
    #: The stage round and state whose parameters computed it (the server's ack says; an
    #: empty state: parameters changed and not yet published).
    round: int
    state: bytes = b""

    def comparable(self, other: Answer) -> bool:
        """Both computed from one published stage state: honest answers then agree."""
        return bool(self.state) and (self.round, self.state) == (other.round, other.state)


class NoOtherServer(Exception):
    """No trusted server of the stage is left once the excluded ones are taken out."""


class MicroBatchFailed(Exception):
    """A micro-batch that no server can train: refused as malformed (INVALID_ARGUMENT: out of
    range, not finite) or failed by MAX_ATTEMPTS servers in a row. It is dropped, counted and
    reported; the trainer goes on with the next."""


class SwarmTrainer:
    def __init__(
        self,
        client: rpc.TensorCaller,
        read_directory: ReadDirectory,
        config: SwarmConfig,
        say: Say,
        *,
        keep_completed: bool = False,
        rng: random.Random | None = None,
        timings: SwarmTimings | None = None,
    ) -> None:
        """`read_directory` and `rng` are seams for the simulator (sim/swarm.py), which runs
        this trainer's routing against modelled stage servers; time is trio's clock, so
        virtual there."""
        self.client, self.config = client, config
        self.timings = timings or SwarmTimings()
        self._read_directory = read_directory
        self.say = say
        self.router = Router(rng, clock=trio.current_time)
        self.stats = TrainerStats()
        self._keep_completed = keep_completed
        self._records: list[dict[PeerId, StageRecord]] = []
        self._read_at = -math.inf
        self._read_lock = trio.Lock()
        self._nonce = secrets.token_hex(4) if rng is None else rng.randbytes(4).hex()
        self._rng = rng or random.Random()
        #: Per stage and call: the norms of its servers' answers (grad_bound.py), each
        #: server held to the others'; an outsized answer is audited.
        self._answers: dict[tuple[int, str], NormBound] = {}
        self._waiting_for: set[int] = set()

    async def servers(self, stage: int, *, fresh: bool = False) -> dict[PeerId, StageRecord]:
        """The stage's serving servers, from a directory read at most `directory_ttl_s` old."""
        async with self._read_lock:
            if fresh or trio.current_time() - self._read_at > self.timings.directory_ttl_s:
                records = await self._read_directory()
                self._records = directory.by_stage(records, self.config.stages)
                self._read_at = trio.current_time()
        return {p: r for p, r in self._records[stage].items() if r.state == "serving"}

    async def micro_batch(self, seq: int, batch: Batch) -> float:
        """Trains one micro-batch through the pipeline (its hops in order, or some stages
        swapped: route.py); returns its loss."""
        x, y = batch
        mb = f"{self._nonce}-{seq}"
        c = self.config
        hops = route(c.stages, swap_for(seq, c.stages, c.swap))
        *through, last = hops
        inputs = [x]
        for hop in through:
            (h,) = await self.checked(hop, FORWARD, [inputs[-1]], f"{mb}/f", answer=1, like=x)
            inputs.append(h)
        out = await self.checked(
            last, LAST, [inputs[-1], y], f"{mb}/l", answer=2 if through else 1, like=x
        )
        loss = float(out[0])
        if not math.isfinite(loss):
            raise wire.WireError("the last stage answered a non-finite loss")
        grad = out[1] if through else None
        for i in range(len(through) - 1, -1, -1):
            assert grad is not None
            got = await self.checked(
                through[i], BACKWARD, [inputs[i], grad], f"{mb}/b", answer=int(i > 0), like=x
            )
            grad = got[0] if got else None
        self.stats.done += 1
        if self._keep_completed:
            self.stats.completed.append(seq)
        self.stats.tokens += x.numel()
        self.stats.loss = loss
        return loss

    async def checked(
        self,
        hop: Hop,
        path: str,
        tensors: list[torch.Tensor],
        call: str,
        *,
        answer: int,
        like: torch.Tensor,
    ) -> list[torch.Tensor]:
        """A hop; a share of them (`audit`), and every answer far larger than the stage's
        other servers' lately, asked again of a second server of the stage (Forward as is;
        Backward and Last as their Check calls, which apply nothing) and the answers
        compared, a third server deciding when the two disagree (audit.py). A liar that took
        the hop is distrusted and the hop made again elsewhere: its gradients went only to
        the liar, and an outsized gradient is not relayed to the stage before (whose servers
        would only leave it out, not knowing who lied)."""
        got = await self.call(hop, path, tensors, call, answer=answer, like=like)
        out, first = got.tensors, got.peer
        if not answer or self.config.audit <= 0:
            return out
        drawn = self._rng.random() < self.config.audit
        if not self._outsized(hop.stage, path, out, first) and not drawn:
            return out
        check = CHECKS[path]

        async def opinion(suffix: str, exclude: set[PeerId]) -> Answer:
            return await self.call(
                hop, check, tensors, call + suffix, answer=answer, like=like, exclude=exclude
            )

        try:
            other = await opinion("a", {first})
        except NoOtherServer:
            return out  # the stage has one (trusted) server: nothing to compare with
        if not other.comparable(got):
            self.stats.unmatched += 1  # computed with other parameters: not comparable
            return out
        self.stats.audits += 1
        second, by = other.tensors, other.peer
        if audit.agree_all(out, second):
            return out
        try:
            decider = await opinion("b", {first, by})
        except NoOtherServer:
            return self._undecided(hop, out, second, "and no third server can tell which lied")
        if not decider.comparable(got):
            return self._undecided(hop, out, second, "and the third server is in another state")
        third = decider.tensors
        odd = audit.odd_one_out(out, second, third)
        if odd is None:
            return self._undecided(hop, out, second, "and a third agrees with neither or both")
        liar = (first, by)[odd]
        self.router.distrust(liar, audit.DISTRUST_S)
        self.stats.caught += 1
        gap = audit.distance_all((out, second)[odd], third)
        self.say(
            "stage_liar",
            f"stage {hop.stage} server {str(liar)[:12]} answered a {path.rsplit('/', 1)[-1]} "
            f"{gap:.3g} apart from two other servers of the stage; this trainer leaves it out "
            f"for {audit.DISTRUST_S:.0f} s",
            stage=hop.stage,
            server=str(liar),
            distance=round(gap, 6),
        )
        if odd == 1:
            return out
        if path == FORWARD:
            return third  # nothing was applied: the honest answer stands in
        redo = await self.call(hop, path, tensors, call + "c", answer=answer, like=like)
        return redo.tensors

    def _outsized(self, stage: int, path: str, out: list[torch.Tensor], server: PeerId) -> bool:
        """Whether an answer is beyond CLIP x the norm of other servers' answers lately."""
        norm = math.sqrt(sum(float(t.double().square().sum()) for t in out))
        try:
            return (
                self._answers.setdefault((stage, path), NormBound()).factor(norm, str(server)) < 1
            )
        except GradientRefused:
            return True

    def _undecided(
        self, hop: Hop, out: list[torch.Tensor], second: list[torch.Tensor], why: str
    ) -> list[torch.Tensor]:
        """Two answers apart and nobody to decide: said, and the hop goes on with the first
        (dropping it would not stop a liar, and honest servers a round apart can differ)."""
        gap = audit.distance_all(out, second)
        self.say(
            "stage_disagree",
            f"stage {hop.stage}: two servers answered {gap:.3g} apart {why}",
            stage=hop.stage,
            distance=round(gap, 6),
        )
        return out

    async def call(
        self,
        hop: Hop,
        path: str,
        tensors: list[torch.Tensor],
        call: str,
        *,
        answer: int,
        like: torch.Tensor,
        exclude: Collection[PeerId] = (),
    ) -> Answer:
        """One hop, retried on the stage's other servers (not `exclude`) until one answers;
        the answer, who gave it, and from which stage round and state."""
        payload = wire.encode(tensors, self.config.activations)
        nbytes = sum(v.nbytes for v in payload)

        async def attempt(choice: Choice, n: int) -> tuple[list[torch.Tensor], int, bytes]:
            # A swapped micro-batch calls an end stage twice each way: the part is in the id.
            call_id = f"{call}{hop.name}.{n}".encode()
            meta = TensorMeta("uint8", (nbytes,), name=hop.name, info=call_id)
            ack = await self.client.put_tensor(
                choice.address, path, meta, payload, pb.TensorAck, expect=choice.peer
            )
            limit = max(ANSWER_LIMIT, 8 * nbytes)
            out = await self._fetch(choice, call_id, limit) if answer else []
            _check_answer(out, answer, like, hop.stage)
            return out, ack.round, bytes(ack.state)

        (out, computed_in, state), peer = await self.routed(hop.stage, attempt, exclude)
        return Answer(out, peer, computed_in, state)

    async def routed(
        self, stage: int, attempt: Attempt[T], exclude: Collection[PeerId] = ()
    ) -> tuple[T, PeerId]:
        """Tries `attempt` on the stage's servers, as the router picks them, until one
        answers: a server that refuses for load is rested and asked again later, one that
        fails or times out is banned and another is tried (MAX_ATTEMPTS at most); a stage
        with no server is waited for, unless servers are excluded (an audit's second or third
        opinion): then NoOtherServer."""
        tries = 0
        while True:
            if tries >= MAX_ATTEMPTS:
                raise MicroBatchFailed(f"stage {stage}: {tries} servers in a row failed it")
            servers = await self.servers(stage, fresh=tries > 0)
            for peer in exclude:
                servers.pop(peer, None)
            choice = self.router.pick(servers, drawn=bool(exclude))
            if choice is None:
                if exclude:
                    raise NoOtherServer(stage)
                await self._wait_for(stage)
                continue
            rest = self.router.rest_s(choice.peer)
            if rest > 0:
                # Every server of the stage rests after failures (a dead one stays in the
                # directory until its record lapses): wait rather than spin on it.
                await trio.sleep(min(rest, self.timings.wait_poll_s))
                continue
            if stage in self._waiting_for:
                self._waiting_for.discard(stage)
                self.say("stage_back", f"stage {stage} is served again", stage=stage)
            self.router.started(choice.peer)
            t0 = trio.current_time()
            try:
                with trio.fail_after(self.config.call_timeout_s):
                    out = await attempt(choice, tries)
            except rpc.RpcError as exc:
                if exc.code is rpc.StatusCode.RESOURCE_EXHAUSTED:
                    # Refused before any compute (its queue is full, or this trainer called
                    # it too often): nothing was applied; rest a moment, ask again.
                    self.router.busy(choice.peer)
                    await trio.sleep(self.timings.busy_s)
                    continue
                if exc.code is rpc.StatusCode.INVALID_ARGUMENT:
                    # The server refused the micro-batch itself (out of range, not finite):
                    # every server of the stage would. Nothing of it was applied there.
                    self.router.released(choice.peer)
                    raise MicroBatchFailed(f"stage {stage} refused it: {exc.details}") from None
                tries += 1
                self._failed(stage, choice.peer, exc)
                continue
            except (wire.WireError, trio.TooSlowError, ProtocolError) as exc:
                tries += 1
                self._failed(stage, choice.peer, exc)
                continue
            self.router.succeeded(choice.peer, trio.current_time() - t0)
            return out, choice.peer

    async def _fetch(self, choice: Choice, call_id: bytes, limit: int) -> list[torch.Tensor]:
        """The answer of a call the server took. A refusal for rate is waited out at the same
        server: only it holds the answer, and asking another would apply the micro-batch's
        gradients twice (a server that is gone took its gradients with it)."""
        rest = self.timings.busy_s
        while True:
            try:
                _, data = await self.client.get_tensor(
                    choice.address,
                    FETCH,
                    pb.TensorRequest(name=call_id.hex()),
                    expect=choice.peer,
                    max_bytes=limit,
                )
                return wire.decode(data)
            except rpc.RpcError as exc:
                if exc.code is not rpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
            await trio.sleep(rest)
            rest = min(2 * rest, 1.0)

    def _failed(self, stage: int, peer: PeerId, exc: BaseException) -> None:
        ban = self.router.failed(peer)
        self.stats.retries += 1
        self.say(
            "stage_retry",
            f"stage {stage} call to {str(peer)[:12]} failed ({_why(exc)}); retrying on another "
            f"server (that one rests {ban:.0f} s)",
            stage=stage,
            server=str(peer),
            why=_why(exc),
        )

    async def _wait_for(self, stage: int) -> None:
        if stage not in self._waiting_for:
            self._waiting_for.add(stage)
            self.say(
                "stage_missing",
                f"waiting: no live server serves stage {stage} of {self.config.stages}",
                stage=stage,
            )
        await trio.sleep(self.timings.wait_poll_s)


def _why(exc: BaseException) -> str:
    if isinstance(exc, rpc.RpcError):
        return f"{exc.code.name}: {exc.details[:120]}"
    if isinstance(exc, trio.TooSlowError):
        return "timed out"
    return str(exc)[:120]


def _check_answer(out: list[torch.Tensor], count: int, like: torch.Tensor, stage: int) -> None:
    """A server's answer must be what was asked: `count` tensors, hidden states or gradients
    of the micro-batch's (batch, length, *) shape, a scalar loss first from the last stage."""
    if len(out) != count:
        raise wire.WireError(f"stage {stage} answered {len(out)} tensors, expected {count}")
    for t in out:
        if t.dim() == 0:
            continue
        if t.dim() != 3 or t.shape[:2] != like.shape[:2] or t.dtype != torch.float32:
            raise wire.WireError(f"stage {stage} answered a tensor of shape {tuple(t.shape)}")
