"""One round's state at this peer: the parts it reduces, what it obtained from each reducer,
and the reducer's last step (drop outliers, aggregate, encode once).

The reducer encodes its result once and serves those same bytes to every member, so all
survivors of a round end with identical values for the part.
"""

from __future__ import annotations

import functools
import logging

import torch
import trio

from swarmd.compression import (
    DecodeLimits,
    Int8Codec,
    decode_into,
    encode_segments,
    raw_segments,
)
from swarmd.node.averaging.codecs import (
    CodecName,
    Encoded,
    make_codec,
    result_codec,
    zstd_framed,
)
from swarmd.node.averaging.commit import Committed
from swarmd.node.averaging.config import AllReduceConfig
from swarmd.node.averaging.group import Group, part_bounds
from swarmd.node.averaging.reduction import (
    ReductionConfig,
    aggregate,
    clip_weights,
    norm_outliers,
    opposed_outliers,
    weight_outliers,
)
from swarmd.node.runtime import offload
from swarmd.protocol import averaging_pb2 as apb
from swarmd.protocol.framing import RECEIVE_BUFFERS

log = logging.getLogger("swarmd.allreduce")


class Reduction:
    """One part being reduced at this peer (its own part, or a fallback attempt)."""

    def __init__(self, numel: int, expected: set[int], me: int) -> None:
        self.numel = numel
        self.me = me
        self.expected = expected
        self.values: dict[int, torch.Tensor] = {}
        #: The received payloads behind `values` (raw fp32 values are views of them): handed
        #: back to the receive pool once the part is reduced.
        self.buffers: list[bytearray] = []
        self.weights: dict[int, float] = {}
        #: The L2 norms of `values` known already (a received part's, from its decoding).
        self.norms: dict[int, float] = {}
        self.rejected: dict[int, str] = {}
        self.all_arrived = trio.Event()
        self.done = trio.Event()
        self.encoded: Encoded | None = None
        self.decoded: torch.Tensor | None = None
        self.contributors: set[int] = set()
        #: The contributions aggregated, kept until the proof is made (see proof.py).
        self.used: dict[int, torch.Tensor] = {}
        #: Members' nonces for the proof, accepted until it is sealed; `nonces_in` is set once
        #: every other contributor's has arrived.
        self.nonces: dict[int, bytes] = {}
        self.nonces_in = trio.Event()
        self.sealed = False
        #: This peer's own contribution as committed (commit.py), kept until the proof is made;
        #: its root is served with the part's bytes.
        self.committed: Committed | None = None
        self.commitment = b""
        self.proof: apb.PartProof | None = None
        self.proof_ready = trio.Event()
        #: An fp32 part's reduced values, or an unframed int8 part's codes: a pooled
        #: buffer, served (through memoryviews of it, which the pool sees) until the round
        #: is retired (`Round.retire_copies`).
        self.served: bytearray | None = None

    def add_nonce(self, index: int, nonce: bytes) -> None:
        """Called only once the part is reduced (`done`): the contributors are known, and a
        member cannot seal the proof early by asking before the others could."""
        if self.sealed or index in self.nonces or index == self.me:
            return
        self.nonces[index] = nonce
        if self.has_all_nonces():
            self.nonces_in.set()

    def has_all_nonces(self) -> bool:
        return self.contributors - {self.me} <= set(self.nonces)

    def release(self) -> None:
        """Hands the contributions' buffers back: the proof, or the lack of one, is settled.
        fp32 contributions are views of their receive buffers, and a buffer still viewed is
        refused by the pool (measured: every round then allocated its 3 x 100 MB of
        contributions afresh, 0.14 CPU-s in `take` alone, more in page faults)."""
        self.values.clear()
        self.used.clear()
        if self.committed is not None and self.committed.buffer is not None:
            RECEIVE_BUFFERS.give(self.committed.buffer)
        self.committed = None
        for buf in self.buffers:
            RECEIVE_BUFFERS.give(buf)
        self.buffers.clear()

    def add(self, index: int, value: torch.Tensor | None, weight: float, why: str = "") -> None:
        if value is None:
            self.rejected[index] = why
        else:
            self.values[index] = value
            self.weights[index] = weight
        if self.expected <= set(self.values) | set(self.rejected):
            self.all_arrived.set()


class Outcome:
    """What this peer obtained for a part straight from its reducer (relays serve only this)."""

    def __init__(self) -> None:
        self.ready = trio.Event()
        #: The bytes as received; relays serve them until the round is retired.
        self.received: bytearray | None = None
        self.encoded: Encoded | None = None


class Round:
    def __init__(
        self, group: Group, me: int, numel: int, config: AllReduceConfig, codec: CodecName
    ) -> None:
        self.codec_name = codec
        self.codec = make_codec(codec, config.int8_block_size, config.int8_bits, config.topk)
        self.result_codec = result_codec(codec, self.codec)
        #: A sparse codec's contributions are what a member sent, even at the reducer itself:
        #: its own values, dense, would make its part of the result dense (exchange.py).
        self.sparse = codec == "topk"
        self.zstd_level = None if codec == "fp32" else config.zstd_level
        self.group = group
        self.me = me
        self.numel = numel
        self.bounds = part_bounds(numel, group.bandwidths())
        self._servers = group.servers
        self._server_pos = {member: i for i, member in enumerate(self._servers)}
        self.reductions: dict[tuple[int, int], Reduction] = {}
        self.direct = {j: Outcome() for j in range(len(group.members))}
        self.finished_at: float | None = None
        self.config = config
        #: The proofs this peer accepted: what verify.cross_check compares.
        self.accepted: dict[tuple[int, int], apb.AcceptedProof] = {}
        #: Every proof this peer was given, accepted or refused, served to fellow members once
        #: `judged` is set. A refused proof signed by its reducer is evidence as well: an
        #: equivocator told one member a story it accepted and another the honest proof of a
        #: forged part, which that member refused; served accepted proofs only, nobody held
        #: two signed proofs to compare, and the members ended the round on two states
        #: (tests/unit/test_sim_liars.py, seed 5: both honest members' next round alone).
        self.received: dict[tuple[int, int], apb.AcceptedProof] = {}
        #: Set once this peer has judged every part's first proof (fallbacks may go on):
        #: a member waiting for its answer must not wait out this peer's fallback deadlines.
        self.judged = trio.Event()
        self._unjudged = 0
        self.obtained = trio.Event()

    def judging(self, parts: int) -> None:
        """This peer will judge ``parts`` parts' first proofs."""
        self._unjudged = parts
        if parts <= 0:
            self.judged.set()

    def judged_one(self, j: int, received: bytearray | None) -> None:
        """Part j's first proof is judged: ``received`` is what relays may serve of it (the
        copy from its reducer, if this peer accepted it)."""
        self.direct[j].received = received
        self.direct[j].ready.set()
        self._unjudged -= 1
        if self._unjudged <= 0:
            self.judged.set()

    def retire_copies(self) -> None:
        """Stops serving what this finished round holds and hands its buffers back to the
        pool: relay copies, and the reduced parts' buffers (`Reduction.served`).

        Called when this peer starts another round: a member still fetching the old round's
        parts then is late, and has fallbacks. Kept for the whole linger, they made every
        round of a busy peer allocate and zero its buffers afresh (4 x 100M fp32 back to
        back: relays 3.6-6.0 s per round cold, 1.8 s warm; the reduced part, a fresh 100 MB
        per peer, a fifth of all the round's CPU in the kernel zeroing its pages). A send
        still in flight holds memoryviews of its buffer, and the pool refuses it then."""
        for outcome in self.direct.values():
            if outcome.received is not None:  # nothing but relays ever read it
                RECEIVE_BUFFERS.give(outcome.received)
                outcome.received = None
        for (part, _), red in self.reductions.items():
            if red.served is None:
                continue
            red.encoded = red.decoded = None
            if part == self.me:
                self.direct[part].encoded = None
            RECEIVE_BUFFERS.give(red.served)
            red.served = None

    def part_numel(self, part: int) -> int:
        start, end = self.bounds[part]
        return end - start

    @property
    def attempts(self) -> int:
        """How many reducers a part can have: its own, then each other reachable member."""
        return len(self._servers)

    def reducer_of(self, part: int, attempt: int) -> int:
        """Part `part`'s reducer at `attempt`: its member, then the next reachable members in
        turn. A client-mode member's part is empty and nobody reduces it (its own index)."""
        pos = self._server_pos.get(part)
        if pos is None:
            return part
        return self._servers[(pos + attempt) % len(self._servers)]

    def exchanged(self, part: int) -> bool:
        """Whether part `part` travels at all: a client-mode member's is empty."""
        return self.group.reachable(part)

    def reduction(self, part: int, attempt: int) -> Reduction:
        key = (part, attempt)
        red = self.reductions.get(key)
        if red is None:
            n = len(self.group.members)
            # A fallback reducer expects everyone but the reducers that already failed.
            failed = {self.reducer_of(part, a) for a in range(attempt)}
            expected = set(range(n)) - failed
            red = self.reductions[key] = Reduction(self.part_numel(part), expected, self.me)
        return red


async def finish_reduction(
    red: Reduction, rnd: Round, out: torch.Tensor, config: ReductionConfig
) -> None:
    """Drops outliers, aggregates, encodes once; every member gets exactly these bytes.

    `out` is this peer's slice of its result for the part: lossy codecs aggregate and
    decode there (no fresh 100 MB tensor per round, whose first touch, the kernel zeroing
    its pages, was half of all-reduce's CPU time), and `red.decoded` is then `out`."""
    if red.done.is_set():
        return
    values = dict(red.values)
    for index, outlier in norm_outliers(values, config, own=rnd.me, known=red.norms).items():
        red.rejected[index] = outlier
        del values[index]
    for index, outlier in weight_outliers({i: red.weights[i] for i in values}, config).items():
        red.rejected[index] = outlier
        del values[index]
    for index, outlier in opposed_outliers(values, config).items():
        red.rejected[index] = outlier
        del values[index]
    for index, why in red.rejected.items():
        # The evidence a ban needs: who, which round and part, and what was wrong.
        log.warning(
            "dropped member %s from part of round %s: %s",
            rnd.group.members[index].peer_id.short(),
            rnd.group.round_id.hex()[:12],
            why,
        )
    order = sorted(values)
    weights = clip_weights({i: red.weights[i] for i in order}, config)
    if order:
        # fp32's encoding is a view of `reduced`, served to members after this peer's round
        # ends: it must not be the caller's result, and goes to a pooled buffer instead.
        served = RECEIVE_BUFFERS.take(4 * red.numel) if rnd.codec_name == "fp32" else None
        target = torch.frombuffer(served, dtype=torch.float32) if served else out
        # Only lossless parts need the correctly rounded (float64) mean.
        reduced = await offload.run_sync(
            functools.partial(
                aggregate,
                [values[i] for i in order],
                [weights[i] for i in order],
                config,
                exact=rnd.codec_name == "fp32",
                out=target,
            )
        )
        # A robust reduction returns a tensor of its own: the buffer then serves nothing.
        holds = served if served and reduced.data_ptr() == target.data_ptr() else None
        if served and holds is None:
            RECEIVE_BUFFERS.give(served)
        await _encode_result(red, rnd, reduced, out, holds)
    red.contributors = set(order)
    red.values.clear()
    red.used = values  # read once more, for the proof; then `release`d
    red.done.set()


async def _encode_result(
    red: Reduction, rnd: Round, reduced: torch.Tensor, out: torch.Tensor, served: bytearray | None
) -> None:
    """`red.encoded`, the reduced part as every member gets it, and `red.decoded`, what they
    decode from it. ``served``: the pooled buffer an fp32 part was reduced into, if it was.
    """
    if isinstance(rnd.codec, Int8Codec):
        # Quantised in place: `reduced` (`out`, or a robust reduction's own tensor) becomes
        # what members decode, with no joined copy and no decoding pass. The codes go to a
        # pooled buffer (fresh ones cost the kernel zeroing 25 MB a round): served as views
        # of it when sent as they are, given back once a zstd frame holds them.
        codes_buf = RECEIVE_BUFFERS.take(red.numel)
        codes = torch.frombuffer(codes_buf, dtype=torch.int8) if red.numel else None
        encode = functools.partial(rnd.codec.encode_segments, reduced, decoded=reduced, codes=codes)
        encoded = [*(await offload.run_sync(encode))[:2], memoryview(codes_buf)]
        red.decoded, red.served = reduced, codes_buf
    elif rnd.codec_name == "fp32":
        # A mean of finite contributions (their norms were checked) is finite: the codec's
        # own pass over the values is spared.
        encoded = raw_segments(reduced)
        red.decoded = reduced  # lossless: what members decode is exactly this
        if served is not None:
            # Served as views of the buffer itself: the pool sees a send in flight.
            encoded, red.served = [encoded[0], memoryview(served)], served
    else:
        encoded = await offload.run_sync(encode_segments, rnd.result_codec, reduced)
        # `reduced` is encoded: overwrite `out` with what members decode (from the bytes
        # before the lossless zstd frame: no need to inflate them).
        blob = b"".join(encoded)
        limits = DecodeLimits(max_elements=red.numel, max_bytes=len(blob) * 8 + 4096)
        await offload.run_sync(decode_into, blob, limits, out)
        red.decoded = out
    if rnd.zstd_level is None:
        red.encoded = encoded
        return
    red.encoded = await offload.run_sync(zstd_framed, encoded, rnd.zstd_level)
    del encoded  # its views of the codes: the frame is what is served
    if red.served is not None and rnd.codec_name != "fp32":
        RECEIVE_BUFFERS.give(red.served)
        red.served = None
