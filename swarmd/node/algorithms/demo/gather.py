"""All-gather in a sticky group: every member's payload to every member, every step (DeMo).

DeMo syncs each inner step, so a group cannot be matched through the DHT each time (seconds
per round on the internet): it is formed once (matchmaking.py) and reused, step after step,
until a member fails or the strategy regroups to let newcomers in. A step:

1. every member sends its payload to every other member (PutGather, a tensor on the bulk
   plane, tagged with the group, the step and optionally its state hash);
2. it waits for the others' payloads for that step until an adaptive deadline: a multiple of
   the recent median time to hear everyone, never less than ``min_deadline_s``;
3. it returns what arrived. A member late at the deadline is named in ``late``; one late
   ``max_strikes`` steps in a row is dropped from the group (``dropped``), and the strategy
   regroups.

Payloads may arrive for steps ahead of this member's (a faster peer) within ``window`` steps;
they wait in a bounded inbox. Each step's payloads are checked on arrival, before their
buffer exists (``_admit``): a member of this group, a step in the window, at most
``max_payload_bytes``, once.

Client-mode members (nobody can dial them: behind NAT) push their payloads to the reachable
members and pull every other payload (``GetGathered``): a reachable sender's from the sender,
a client's from a reachable member that holds it. Reachable members push only to reachable
ones and keep each step's set for the window, so a client can pull it a little later. Every
payload is signed by its sender (gather_sign.py): a relayed one cannot be altered.

Agreement: when every payload arrives (the common case) every member applies the same set.
A payload that reached some members and not others before their deadlines makes their sets
differ; nothing but consensus could prevent that, and a round of consensus per step would
double its latency. Instead each payload can carry its sender's state hash (every
``hash_every`` steps): a member whose hash differs from the others' learns it at the next
checked step (``GatherResult.agree``) and re-syncs (the strategy downloads a state).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections import deque
from dataclasses import dataclass, field

import trio
from google.protobuf.message import DecodeError

from swarmd.node.algorithms.demo.gather_sign import check_signed, signed_info
from swarmd.node.averaging.group import Group, Member
from swarmd.node.bans import Bans, Rejection
from swarmd.node.metrics import Metrics
from swarmd.protocol import averaging_pb2 as apb
from swarmd.protocol import rpc
from swarmd.protocol.framing import TensorMeta
from swarmd.protocol.identity import PeerId

log = logging.getLogger("swarmd.gather")
#: Refusals that mean "not yet": the member has not reached this group or step, or is away.
_RETRY = frozenset(
    {
        rpc.StatusCode.FAILED_PRECONDITION,
        rpc.StatusCode.UNAVAILABLE,
        rpc.StatusCode.DEADLINE_EXCEEDED,
    }
)

SERVICE = "swarmd.averaging.v1.Gather"
PUT_GATHER = rpc.method_path(SERVICE, "PutGather")
GET_GATHERED = rpc.method_path(SERVICE, "GetGathered")
#: A payload as it travels: its bytes and the (signed) GatherInfo it came with.
Signed = tuple[bytes, apb.GatherInfo]


@dataclass(frozen=True)
class GatherConfig:
    #: A step never waits less than this for the others (a first step, a fast LAN).
    min_deadline_s: float = 2.0
    max_deadline_s: float = 60.0
    #: The deadline is this multiple of the recent median time to hear everyone.
    deadline_factor: float = 3.0
    #: Steps ahead of ours a payload may arrive for (a faster member); older ones are refused.
    window: int = 4
    max_payload_bytes: int = 64 << 20
    #: Consecutive late steps after which a member is dropped from the group.
    max_strikes: int = 2

    def __post_init__(self) -> None:
        if not 0 < self.min_deadline_s <= self.max_deadline_s or self.deadline_factor < 1:
            raise ValueError("GatherConfig needs 0 < min_deadline_s <= max_deadline_s, factor >= 1")
        if self.window < 1 or self.max_payload_bytes < 1 or self.max_strikes < 1:
            raise ValueError("GatherConfig needs window, max_payload_bytes, max_strikes >= 1")


@dataclass
class GatherResult:
    step: int
    #: Every payload that arrived in time, this member's own included, by sender.
    payloads: dict[PeerId, bytes]
    #: Members whose payload did not arrive by the deadline.
    late: list[PeerId]
    #: Members dropped from the group after this step (late max_strikes steps in a row).
    dropped: list[PeerId]
    #: Senders' state hashes, where they sent one.
    hashes: dict[PeerId, bytes]
    seconds: float

    def agree(self, own: PeerId) -> bool | None:
        """Whether this member's state hash is the one most members sent (ties: the lowest
        hash wins, the same on every member); None when no hash came with this step."""
        if own not in self.hashes or len(self.hashes) < 2:
            return None
        counts: dict[bytes, int] = {}
        for h in self.hashes.values():
            counts[h] = counts.get(h, 0) + 1
        best = min(counts, key=lambda h: (-counts[h], h))
        return self.hashes[own] == best


@dataclass
class _Session:
    group: Group
    #: Where sends run: they outlive their step (a member that heard everyone goes on while
    #: its payload still travels to one that has not), each bounded by its step's deadline.
    nursery: trio.Nursery
    step: int = 0
    inbox: dict[int, dict[PeerId, Signed]] = field(default_factory=dict)
    arrived: dict[int, trio.Event] = field(default_factory=dict)
    #: This member's own payload of each step not yet decided, and each decided step's set
    #: (own included) for the last `window` steps: what client-mode members pull.
    mine: dict[int, Signed] = field(default_factory=dict)
    kept: dict[int, dict[PeerId, Signed]] = field(default_factory=dict)
    #: Set (and replaced) whenever a payload arrives or a step is decided: pulls wait on it.
    changed: trio.Event = field(default_factory=trio.Event)
    strikes: dict[PeerId, int] = field(default_factory=dict)
    #: Members that refused our payload as not of their group: they dropped us (we were late
    #: while paused, say). Not waited for again and dropped at once: waiting out deadlines
    #: for them kept a resumed peer 9 s a step in a group that no longer had it (`swarmd
    #: chaos`, a DeMo run with a paused peer).
    left: set[PeerId] = field(default_factory=set)

    def event(self, step: int) -> trio.Event:
        return self.arrived.setdefault(step, trio.Event())

    def touch(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def receive(self, step: int, sender: PeerId, signed: Signed) -> None:
        """``sender``'s payload for ``step`` arrived (pushed, or pulled by a client)."""
        self.inbox.setdefault(step, {})[sender] = signed
        self.event(step).set()
        self.touch()

    def held(self, step: int, sender: PeerId, me: PeerId) -> Signed | None:
        """``sender``'s payload for ``step`` as this member has it, if it does."""
        if sender == me and step in self.mine:
            return self.mine[step]
        return self.inbox.get(step, {}).get(sender) or self.kept.get(step, {}).get(sender)


class Gatherer:
    """One member's side of the sticky group's all-gather: its service and its steps."""

    def __init__(
        self,
        client: rpc.TensorCaller,
        me: PeerId,
        config: GatherConfig | None = None,
        metrics: Metrics | None = None,
        bans: Bans | None = None,
    ):
        self.client = client
        self.me = me
        if client.identity is None or client.identity.peer_id != me:
            raise ValueError("the gatherer signs with its client's identity, which must be me")
        self.identity = client.identity
        #: This peer's bans (shared with the averager): a banned member's payloads are
        #: refused and not waited for; an undecodable payload bans its sender (DeMo).
        self.bans = bans
        self.config = config or GatherConfig()
        self._metrics = metrics
        self._session: _Session | None = None
        self._times: deque[float] = deque(maxlen=16)

    def service(self) -> rpc.Service:
        return rpc.Service(
            SERVICE,
            [
                rpc.tensor_in("PutGather", self._put, admit=self._admit),
                rpc.tensor_out("GetGathered", apb.GetGatheredRequest, self._get_gathered),
            ],
        )

    def _banned(self, peer: PeerId) -> bool:
        return self.bans is not None and self.bans.banned(peer)

    @property
    def group(self) -> Group | None:
        return None if self._session is None else self._session.group

    def start(self, group: Group, step: int, nursery: trio.Nursery) -> None:
        """Begins (or replaces) the sticky group; ``step`` is the next step to gather; sends
        run in ``nursery`` (one that lives as long as the group is used)."""
        if group.index_of(self.me) is None:
            raise ValueError("this peer is not a member of the group")
        self.stop()
        self._session = _Session(group, nursery, step)

    def stop(self) -> None:
        if self._session is not None:
            self._session.touch()  # pulls waiting on it answer now: not in that group
        self._session = None

    def deadline(self) -> float:
        cfg = self.config
        if not self._times:
            return cfg.max_deadline_s / 2
        guess = cfg.deadline_factor * statistics.median(self._times)
        return min(cfg.max_deadline_s, max(cfg.min_deadline_s, guess))

    # -- serving ----------------------------------------------------------------------------

    def _caller(self, group_id: bytes, ctx: rpc.CallContext) -> tuple[_Session, PeerId]:
        """The session of ``group_id`` and the caller, another member not banned."""
        session = self._session
        if session is None or group_id != session.group.round_id:
            raise rpc.RpcError(rpc.StatusCode.FAILED_PRECONDITION, "not in that group (now)")
        sender = ctx.peer_id
        if sender is None or session.group.index_of(sender) is None or sender == self.me:
            raise rpc.RpcError(rpc.StatusCode.PERMISSION_DENIED, "sender is not in this group")
        if self._banned(sender):
            raise rpc.RpcError(rpc.StatusCode.PERMISSION_DENIED, "sender is banned by this peer")
        return session, sender

    def _place(self, info: apb.GatherInfo, ctx: rpc.CallContext) -> tuple[_Session, PeerId]:
        session, sender = self._caller(info.group_id, ctx)
        first, end = session.step, session.step + self.config.window
        if not first <= info.step < end:
            raise rpc.RpcError(
                rpc.StatusCode.FAILED_PRECONDITION, f"step {info.step} is outside [{first}, {end})"
            )
        if sender in session.inbox.get(info.step, {}):
            raise rpc.RpcError(rpc.StatusCode.ALREADY_EXISTS, "duplicate payload for this step")
        return session, sender

    @staticmethod
    def _info(meta: TensorMeta) -> apb.GatherInfo:
        info = apb.GatherInfo()
        try:
            info.ParseFromString(meta.info)
        except Exception:
            raise rpc.RpcError(rpc.StatusCode.INVALID_ARGUMENT, "malformed GatherInfo") from None
        if len(info.state_hash) > 64 or len(info.sender_key) > 32 or len(info.signature) > 64:
            raise rpc.RpcError(rpc.StatusCode.INVALID_ARGUMENT, "hash, key or signature too long")
        return info

    async def _admit(self, meta: TensorMeta, ctx: rpc.CallContext) -> None:
        """Before the payload's buffer exists: the right group, step, sender and size."""
        self._place(self._info(meta), ctx)
        if meta.dtype != "uint8" or meta.nbytes > self.config.max_payload_bytes:
            raise rpc.RpcError(
                rpc.StatusCode.INVALID_ARGUMENT,
                f"payload of {meta.nbytes} B (at most {self.config.max_payload_bytes} B of uint8)",
            )

    async def _put(self, meta: TensorMeta, data: bytearray, ctx: rpc.CallContext) -> apb.GatherAck:
        info = self._info(meta)
        session, sender = self._place(info, ctx)  # again: the session may have moved on
        why = check_signed(info, data, sender)
        if why is not None:
            raise rpc.RpcError(rpc.StatusCode.INVALID_ARGUMENT, why)
        session.receive(info.step, sender, (bytes(data), info))
        return apb.GatherAck()

    async def _get_gathered(
        self, req: apb.GetGatheredRequest, ctx: rpc.CallContext
    ) -> tuple[TensorMeta, list[memoryview]]:
        """A client-mode member pulls ``sender``'s payload for ``step``: answered once this
        member has it; NOT_FOUND once this member decided the step without it."""
        session, _ = self._caller(req.group_id, ctx)
        try:
            sender = PeerId(bytes(req.sender))
        except ValueError:
            raise rpc.RpcError(rpc.StatusCode.INVALID_ARGUMENT, "malformed sender id") from None
        step, window = req.step, self.config.window
        if step >= session.step + window:
            raise rpc.RpcError(rpc.StatusCode.FAILED_PRECONDITION, f"step {step} is ahead")
        with trio.move_on_after(self.config.max_deadline_s):
            while session is self._session:
                held = session.held(step, sender, self.me)
                if held is not None:
                    data, info = held
                    meta = TensorMeta("uint8", (len(data),), info=info.SerializeToString())
                    return meta, [memoryview(data)]
                if step < session.step:
                    raise rpc.RpcError(rpc.StatusCode.NOT_FOUND, "not in this member's set")
                await session.changed.wait()
            raise rpc.RpcError(rpc.StatusCode.FAILED_PRECONDITION, "not in that group (now)")
        raise rpc.RpcError(rpc.StatusCode.DEADLINE_EXCEEDED, "step not decided yet")

    # -- a step -----------------------------------------------------------------------------

    async def gather(self, payload: bytes, state_hash: bytes = b"") -> GatherResult:
        """Sends ``payload`` for the session's current step to every other member and returns
        what arrived by the deadline; the session moves to the next step."""
        session = self._session
        if session is None:
            raise RuntimeError("gather() before start()")
        step, group = session.step, session.group
        others = [m for m in group.members if m.peer_id != self.me]
        client = any(m.client for m in group.members if m.peer_id == self.me)
        deadline = self.deadline()
        start = trio.current_time()
        info = signed_info(self.identity, group.round_id, step, payload, state_hash)
        session.mine[step] = (payload, info)
        session.touch()
        meta = TensorMeta("uint8", (len(payload),), info=info.SerializeToString())
        heard_all_at: float | None = None
        for member in others:
            # Nobody can dial a client-mode member: it pulls instead.
            if not member.client:
                session.nursery.start_soon(self._send, session, member, meta, payload, deadline)
            if client:
                session.nursery.start_soon(self._pull, session, step, member, deadline)
        with trio.move_on_after(deadline):
            while not all(
                m.peer_id in session.inbox.get(step, {})
                or m.peer_id in session.left
                or self._banned(m.peer_id)
                for m in others
            ):
                event = session.event(step)
                await event.wait()
                session.arrived[step] = trio.Event()
            heard_all_at = trio.current_time() - start
        got = session.inbox.pop(step, {})
        session.arrived.pop(step, None)
        if heard_all_at is not None:
            self._times.append(heard_all_at)
        return self._result(session, step, payload, state_hash, got, trio.current_time() - start)

    async def _send(
        self, session: _Session, member: Member, meta: TensorMeta, payload: bytes, timeout: float
    ) -> None:
        """Retries while the member is not there yet (it starts the group or reaches this step
        a little after us: FAILED_PRECONDITION) or unreachable, until the step's deadline;
        other refusals are final."""
        with trio.move_on_after(timeout):
            if not await self._send_until_taken(member, meta, payload, timeout):
                session.left.add(member.peer_id)
                session.event(session.step).set()

    async def _send_until_taken(
        self, member: Member, meta: TensorMeta, payload: bytes, timeout: float
    ) -> bool:
        """False if the member refused us as not of its group (it dropped us)."""
        pause = 0.05
        while True:
            try:
                await self.client.put_tensor(
                    member.address,
                    PUT_GATHER,
                    meta,
                    payload,
                    apb.GatherAck,
                    timeout=timeout,
                    expect=member.peer_id,
                )
                return True
            except (rpc.RpcError, OSError) as exc:
                code = exc.code if isinstance(exc, rpc.RpcError) else rpc.StatusCode.UNAVAILABLE
                if code not in _RETRY:
                    log.info("gather payload to %s refused: %s", member.peer_id.short(), exc)
                    return code != rpc.StatusCode.PERMISSION_DENIED
            await trio.sleep(pause)
            pause = min(2 * pause, 0.5)

    async def _pull(self, session: _Session, step: int, sender: Member, timeout: float) -> None:
        """A client-mode member's copy of ``sender``'s payload for ``step``: from the sender
        if it is reachable, else (or if it is gone) from the other reachable members in turn,
        until one has it or the step's deadline. A source that relays a payload its sender
        did not sign is banned; one that says it decided the step without it is not asked
        again."""
        group = session.group
        sources = [sender] * (not sender.client) + [
            m for m in group.members if not m.client and m.peer_id not in (sender.peer_id, self.me)
        ]
        req = apb.GetGatheredRequest(group_id=group.round_id, step=step, sender=sender.peer_id.raw)
        pause = 0.05
        with trio.move_on_after(timeout):
            while sources:
                for source in list(sources):
                    outcome = await self._pull_from(source, req, sender.peer_id, timeout)
                    if isinstance(outcome, tuple):
                        if session is self._session and session.step == step:
                            session.receive(step, sender.peer_id, outcome)
                        return
                    if outcome == "final":
                        sources.remove(source)
                await trio.sleep(pause)
                pause = min(2 * pause, 0.5)

    async def _pull_from(
        self, source: Member, req: apb.GetGatheredRequest, sender: PeerId, timeout: float
    ) -> Signed | str:
        """The payload, or "final" (this source will not have it), or "retry"."""
        try:
            meta, data = await self.client.get_tensor(
                source.address,
                GET_GATHERED,
                req,
                timeout=timeout,
                max_bytes=self.config.max_payload_bytes,
                expect=source.peer_id,
            )
            info = apb.GatherInfo.FromString(meta.info)
        except (rpc.RpcError, OSError, ValueError, DecodeError) as exc:
            code = exc.code if isinstance(exc, rpc.RpcError) else rpc.StatusCode.UNAVAILABLE
            return "retry" if code in _RETRY else "final"
        why = check_signed(info, data, sender)
        if why is None and (info.group_id != req.group_id or info.step != req.step):
            why = "a payload of another group or step"
        if why is not None:
            relay = source.peer_id
            log.warning("gather: %s passed on %s's payload: %s", relay.short(), sender.short(), why)
            if self.bans is not None:
                self.bans.offence(relay, Rejection(f"relayed payload: {why}", "false_data"))
            return "final"
        return bytes(data), info

    def _result(
        self,
        session: _Session,
        step: int,
        payload: bytes,
        state_hash: bytes,
        got: dict[PeerId, Signed],
        seconds: float,
    ) -> GatherResult:
        payloads = {self.me: payload} | {p: data for p, (data, _) in got.items()}
        hashes = {p: bytes(i.state_hash) for p, (_, i) in got.items() if i.state_hash}
        if state_hash:
            hashes[self.me] = state_hash
        late = [m.peer_id for m in session.group.members if m.peer_id not in payloads]
        dropped = []
        for m in session.group.members:
            if m.peer_id in session.left and m.peer_id in late:
                dropped.append(m.peer_id)
            elif m.peer_id in late:
                session.strikes[m.peer_id] = session.strikes.get(m.peer_id, 0) + 1
                if session.strikes[m.peer_id] >= self.config.max_strikes:
                    dropped.append(m.peer_id)
            else:
                session.strikes.pop(m.peer_id, None)
        if late:
            log.info("gather step %d: late %s", step, [p.short() for p in late])
        if dropped:
            kept = tuple(m for m in session.group.members if m.peer_id not in dropped)
            session.group = dataclasses.replace(session.group, members=kept)
            log.warning("gather: dropped %s from the group", [p.short() for p in dropped])
        session.step = step + 1
        for old in [s for s in session.inbox if s <= step]:  # nothing older is wanted now
            del session.inbox[old]
        if any(m.client for m in session.group.members):
            session.kept[step] = {self.me: session.mine[step]} | got
        session.mine.pop(step, None)
        for old in [s for s in session.kept if s <= step - self.config.window]:
            del session.kept[old]
        session.touch()
        if self._metrics is not None:
            self._metrics.on_gather(len(late), seconds, len(dropped))
        return GatherResult(step, payloads, late, dropped, hashes, seconds)
