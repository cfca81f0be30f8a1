"""One all-reduce call as this peer lives it: send every part to its reducer, reduce its own
part, and obtain every other part (from its reducer, a relay, or a fallback reducer).

An `Exchange` lasts one call; what outlives the call (throughput, error-feedback buffers,
the rounds other members still read from) stays in the `Averager`, which lends it through a
`Link`. The failure rules this code implements are in `allreduce`'s docstring.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Collection

import torch
import trio
from google.protobuf.message import DecodeError

from swarmd.compression import (
    CompressionError,
    DecodeLimits,
    Int8Codec,
    RawCodec,
    decode,
    decode_into,
    encode_segments,
    raw_segments,
)
from swarmd.node.averaging import verify
from swarmd.node.averaging.codecs import BYTES_PER_VALUE, Encoded, zstd_framed
from swarmd.node.averaging.config import AllReduceResult
from swarmd.node.averaging.link import Link
from swarmd.node.averaging.reduction import implausible_part, l2_norm
from swarmd.node.averaging.round import Round, finish_reduction
from swarmd.node.bans import Rejection
from swarmd.node.runtime import offload
from swarmd.protocol import averaging_pb2 as apb
from swarmd.protocol import rpc
from swarmd.protocol.framing import TensorMeta, payload_nbytes
from swarmd.protocol.identity import PeerId

log = logging.getLogger("swarmd.allreduce")

SERVICE = "swarmd.averaging.v1.Averager"
PUT_PART = rpc.method_path(SERVICE, "PutPart")
GET_PART = rpc.method_path(SERVICE, "GetPart")


class Exchange:
    """This peer's side of one all-reduce round; `run`, then `settle_own_part`, then `result`."""

    def __init__(
        self,
        link: Link,
        rnd: Round,
        *,
        local: torch.Tensor,
        to_send: torch.Tensor,
        residual: torch.Tensor | None,
        result: torch.Tensor,
        weight: float,
        key: str,
        local_norms: list[float],
    ) -> None:
        """``to_send`` is ``local`` plus the error-feedback residual; ``residual`` receives
        what this round's encoding loses (None: no error feedback). ``local_norms``: the
        L2 norm of each of ``local``'s parts, all finite."""
        self.link, self.rnd, self.key, self.weight = link, rnd, key, weight
        self.local, self.to_send, self.residual, self.result = local, to_send, residual, result
        self.local_norms = local_norms
        n = len(rnd.group.members)
        self.failed: list[int] = []
        self.recovered: list[int] = []
        self.dropped: set[int] = set()
        self.encoded_parts: dict[int, Encoded] = {}
        self.sent_codes: dict[int, torch.Tensor] = {}
        self.encoded_ready = {j: trio.Event() for j in range(n)}
        largest = max(rnd.part_numel(j) for j in range(n))
        self.bytes_per_part = largest * BYTES_PER_VALUE[rnd.codec_name] + 256
        self.phase_deadline = link.deadline(self.bytes_per_part * max(n - 1, 1))
        #: How long a member waits for a reduced part, and a reducer for the members' nonces.
        self.fetch_timeout = 2 * self.phase_deadline + link.deadline(self.bytes_per_part)
        #: (part, attempt) whose reducer acknowledged this peer's contribution.
        self.acked: set[tuple[int, int]] = set()
        #: (part, attempt) -> the reducer's commitment served with the part (PartServed).
        self.commitments: dict[tuple[int, int], bytes] = {}
        #: Parts whose reducer signed two different proofs (verify.cross_check).
        self.equivocations: set[int] = set()
        self.started = trio.current_time()
        #: Whether this peer's own part went into its reduction rounded (and its error
        #: feedback holds what that lost), not exact.
        self.own_rounded = False
        # int8 hands back what the receivers will lose while it quantises, chunk by chunk.
        self.fused_ef = (
            residual is not None
            and link.outgoing_encoder is None
            and isinstance(rnd.codec, Int8Codec)
        )

    async def run(self) -> None:
        rnd = self.rnd
        rnd.judging(sum(j != rnd.me and rnd.exchanged(j) for j in range(len(rnd.group.members))))
        async with trio.open_nursery() as nursery:
            for j in range(len(rnd.group.members)):
                if j != rnd.me and rnd.exchanged(j):
                    nursery.start_soon(self.prepare, j)
                    nursery.start_soon(self.send_part, j, 0, j)
                    nursery.start_soon(self.obtain, j)
            if rnd.exchanged(rnd.me):
                nursery.start_soon(self.reduce_own)
        rnd.obtained.set()
        if self.link.config.probes:
            found = await verify.cross_check(
                self.rnd, self.link, trio.current_time() - self.started
            )
            for j, attempt, witness in found:
                self.equivocated(j, attempt, witness)
        if self.equivocations:
            # Every member that saw the two signatures re-reduces the part without its
            # reducer, at the same fallback reducers: they end with the same values again.
            async with trio.open_nursery() as nursery:
                for j in sorted(self.equivocations):
                    nursery.start_soon(self.fall_back, j)
        # Every send has returned: the codes can serve the next round of this key.
        self.link.sent_codes.update(((self.key, j), codes) for j, codes in self.sent_codes.items())

    async def settle_own_part(self) -> None:
        """Serves this peer's reduced part to relays and writes it into the result."""
        rnd = self.rnd
        if not rnd.exchanged(rnd.me):
            rnd.direct[rnd.me].ready.set()
            return  # a client-mode member reduces nothing (its part is empty)
        own = rnd.reduction(rnd.me, 0)
        rnd.direct[rnd.me].encoded = own.encoded
        rnd.direct[rnd.me].ready.set()
        s, e = rnd.bounds[rnd.me]
        if own.decoded is not None:
            if own.decoded.data_ptr() != self.result[s:e].data_ptr():  # a robust reduction's
                await offload.run_sync(self.result[s:e].copy_, own.decoded)
        else:
            self.failed.append(rnd.me)
            self.result[s:e] = self.local[s:e]

    def left_out(self, used: Collection[int]) -> None:
        """A part holds the contributions of ``used``: every other member is dropped."""
        self.dropped.update(set(range(len(self.rnd.group.members))).difference(used))

    def outcome(self, duration_s: float) -> AllReduceResult:
        dropped = {self.rnd.group.members[i].peer_id for i in self.dropped - {self.rnd.me}}
        return AllReduceResult(
            self.result, dropped, sorted(self.failed), sorted(self.recovered), duration_s,
            whole=not self.dropped and not self.failed,
        )  # fmt: skip

    # -- sending -----------------------------------------------------------------------------

    def encode_part(self, j: int) -> Encoded:
        """Part j as the bytes its reducer receives; for error feedback, also what it loses,
        in `residual`."""
        rnd, residual, to_send = self.rnd, self.residual, self.to_send
        s, e = rnd.bounds[j]
        if self.fused_ef:
            assert isinstance(rnd.codec, Int8Codec) and residual is not None
            # Taken out for the round (a concurrent round of the same key gets its own) and
            # given back only once every send has returned.
            codes = self.link.sent_codes.pop((self.key, j), None)
            if codes is None or codes.numel() != e - s:
                codes = torch.empty(e - s, dtype=torch.int8)
            self.sent_codes[j] = codes
            fused = rnd.codec.encode_segments(to_send[s:e], residual[s:e], codes=codes)
            return zstd_framed(fused, rnd.zstd_level)
        liar, values = self.link.outgoing_encoder, to_send[s:e]
        # Raw values of this peer's checked input skip the codec's pass over them.
        raw = isinstance(rnd.codec, RawCodec) and to_send is self.local
        segments: Encoded = [liar(values)] if liar else zstd_framed(
            raw_segments(values) if raw else encode_segments(rnd.codec, values), rnd.zstd_level
        )  # fmt: skip
        if residual is not None:
            blob = b"".join(segments)
            limits = DecodeLimits(max_elements=e - s, max_bytes=len(blob) * 8 + 4096)
            try:
                torch.sub(to_send[s:e], decode(blob, limits), out=residual[s:e])
            except (CompressionError, RuntimeError):
                residual[s:e].zero_()  # a deliberately broken payload: nothing to carry
        return segments

    async def prepare(self, j: int) -> None:
        self.encoded_parts[j] = await offload.run_sync(self.encode_part, j)
        self.encoded_ready[j].set()

    def banned(self, member: int) -> bool:
        return self.link.bans.banned(self.rnd.group.members[member].peer_id)

    async def send_part(self, j: int, attempt: int, target: int) -> bool:
        await self.encoded_ready[j].wait()
        group = self.rnd.group
        info = apb.PartInfo(round_id=group.round_id, part=j, weight=self.weight, attempt=attempt)
        segments = self.encoded_parts[j]
        nbytes = payload_nbytes(segments)
        meta = TensorMeta("uint8", (nbytes,), info=info.SerializeToString())
        t0 = trio.current_time()
        try:
            await self.link.client.put_tensor(
                group.members[target].address,
                PUT_PART,
                meta,
                segments,
                apb.PartAck,
                timeout=self.phase_deadline,
                expect=group.members[target].peer_id,
            )
        except (rpc.RpcError, OSError) as exc:
            log.info("part %d to member %d failed: %s", j, target, exc)
            return False
        self.link.throughput.observe(nbytes, trio.current_time() - t0)
        self.link.count_bytes("sent", self.rnd.codec_name, nbytes)
        self.acked.add((j, attempt))
        return True

    # -- reducing ----------------------------------------------------------------------------

    def sent_values(self, j: int) -> torch.Tensor:
        """Part j as a reducer decodes this peer's bytes (encoding them first for its own
        part, which records the residual there too). A sparse codec's contribution must be
        this, at the part's own reducer and at a fallback reducer alike: the dense values
        would make that part of the result dense, and count twice what error feedback
        still carries."""
        s, e = self.rnd.bounds[j]
        if j not in self.encoded_parts:
            self.encoded_parts[j] = self.encode_part(j)
        blob = b"".join(self.encoded_parts[j])
        limits = DecodeLimits(max_elements=e - s, max_bytes=len(blob) * 8 + 4096)
        try:
            return decode(blob, limits)
        except CompressionError:
            return self.to_send[s:e]  # a test's deliberately broken encoder: reduce honestly

    async def reduce_own(self) -> None:
        rnd = self.rnd
        s, e = rnd.bounds[rnd.me]
        own = self.to_send[s:e]
        if rnd.sparse:
            own = await offload.run_sync(self.sent_values, rnd.me)
        await self.reduce(rnd.me, 0, own)

    async def reduce(self, j: int, attempt: int, own: torch.Tensor) -> None:
        rnd = self.rnd
        red = rnd.reduction(j, attempt)
        s, e = rnd.bounds[j]
        if self.link.config.probes:
            commit = functools.partial(verify.commit_own, rnd, self.link.config, j, attempt)
            committed, rounded = await offload.run_sync(commit, own, self.residual, self.to_send)
            red.committed, red.commitment, own = committed, committed.root, committed.values
            self.own_rounded = self.own_rounded or rounded
        # A banned member's calls are refused: waiting for its contribution would only run
        # the part into its deadline.
        red.expected -= {i for i in red.expected if i != rnd.me and self.banned(i)}
        red.add(rnd.me, own, self.weight)
        with trio.move_on_after(self.phase_deadline):
            await red.all_arrived.wait()
        await finish_reduction(red, rnd, self.result[s:e], self.link.config.reduction)
        # Not `red.expected`: a fallback's leaves out the failed reducers, also not in it.
        self.left_out(red.contributors)
        for index, why in red.rejected.items():
            if isinstance(why, Rejection):  # what it sent; a member that never came is not
                peer = rnd.group.members[index].peer_id
                self.link.bans.offence(peer, why, self.context(j), rnd.group.round_id.hex())
        try:
            await verify.prove(self.rnd, self.link, j, attempt, self.fetch_timeout)
        finally:
            red.sealed = True
            red.release()
            red.proof_ready.set()

    # -- obtaining ---------------------------------------------------------------------------

    async def fetch(
        self, target: int, j: int, attempt: int, relay: bool, timeout: float
    ) -> bytearray | None:
        rnd = self.rnd
        req = apb.GetPartRequest(round_id=rnd.group.round_id, part=j, attempt=attempt, relay=relay)
        t0 = trio.current_time()
        try:
            meta, data = await self.link.client.get_tensor(
                rnd.group.members[target].address,
                GET_PART,
                req,
                timeout=timeout,
                max_bytes=8 * rnd.part_numel(j) + 4096,
                expect=rnd.group.members[target].peer_id,
            )
            if not relay:
                served = apb.PartServed.FromString(meta.info)
                self.commitments[(j, attempt)] = bytes(served.own_commitment)
        except (rpc.RpcError, OSError, ValueError, DecodeError) as exc:
            log.info(
                "fetching part %d (attempt %d, relay=%s) from member %d failed: %s",
                j, attempt, relay, target, exc,
            )  # fmt: skip
            return None
        self.link.throughput.observe(len(data), trio.current_time() - t0)
        self.link.count_bytes("received", rnd.codec_name, len(data))
        return data

    def decode_part(self, j: int, attempt: int, blob: bytes | bytearray) -> Rejection | None:
        """Decodes part j straight into the result; why it is unusable, or None.

        Unusable includes implausible: a mean of contributions the reducer should have
        accepted (each within the outlier factor of the others) cannot be far larger than this
        peer's own contribution, nor non-finite. A reducer that scaled its part by -20 once
        took every honest member to loss 41-45; now its part is not applied (this peer keeps
        its own values there) and the evidence is logged. A sign flip at the same norm
        passes this check: the reducer's proof is what catches it (`check`)."""
        s, e = self.rnd.bounds[j]
        numel = e - s
        limits = DecodeLimits(max_elements=numel, max_bytes=8 * numel + 4096)
        try:
            # Non-finite values are found by the norm below, in the same pass.
            decode_into(blob, limits, self.result[s:e], finite=False)
        except CompressionError as exc:
            return Rejection(f"undecodable part: {exc}", "undecodable")
        got = l2_norm(self.result[s:e])
        own = self.to_send is self.local
        mine = self.local_norms[j] if own else l2_norm(self.to_send[s:e])
        why = implausible_part(got, mine, self.link.config.reduction.norm_outlier_factor)
        if why is not None:
            reducer = self.rnd.group.members[self.rnd.reducer_of(j, attempt)].peer_id.short()
            log.warning("%s: refused part from reducer %s: %s", self.context(j), reducer, why)
        return why

    async def obtain(self, j: int) -> None:
        rnd = self.rnd
        direct = await self.fetch(j, j, 0, False, self.fetch_timeout)
        if direct is None and not self.relays(j):
            # A pair: no relay. Its fallback re-reduced the part from this peer's values
            # alone while the reducer kept the pair's mean (CI, test_run_access: one failed
            # fetch split the states); the reducer is asked once more. A dead one fails again.
            direct = await self.fetch(j, j, 0, False, self.fetch_timeout)
        accepted = direct is not None and await self.accept(j, 0, direct, relayed=False)
        # Relays serve only a copy this peer accepted: decoded, and its reducer's proof held.
        rnd.judged_one(j, direct if accepted else None)
        if accepted:
            return
        self.recovered.append(j)
        if direct is None:
            # The reducer waits for this peer's nonce before it proves anything, and relays
            # serve only copies they checked against that proof: the nonce goes out meanwhile.
            proofs: list[tuple[apb.PartProof | str, bytes]] = []
            async with trio.open_nursery() as nursery:

                async def ask() -> None:
                    proofs.append(await self.request_proof(j, 0))

                nursery.start_soon(ask)
                relayed = await self.from_relays(j, self.fetch_timeout)
                if relayed is None:
                    nursery.cancel_scope.cancel()
            if relayed is not None and await self.accept(
                j, 0, relayed, relayed=True, early=proofs[0]
            ):
                return
        await self.fall_back(j)

    async def fall_back(self, j: int) -> None:
        """Part j from the fallback reducers in turn (reducing it here when it is this peer's
        turn); this peer's local values when none gives a part that holds."""
        rnd = self.rnd
        s, e = rnd.bounds[j]
        for attempt in range(1, rnd.attempts):
            target = rnd.reducer_of(j, attempt)
            if target == rnd.me:
                # The part's own value at the fallback reducer is its uncompressed local one
                # (a sparse codec's: what it sent, see `sent_values`).
                own = self.to_send[s:e]
                if rnd.sparse:
                    own = await offload.run_sync(self.sent_values, j)
                await self.reduce(j, attempt, own)
                decoded = rnd.reduction(j, attempt).decoded
                if decoded is not None:
                    if decoded.data_ptr() != self.result[s:e].data_ptr():
                        self.result[s:e] = decoded
                    return
            elif await self.send_part(j, attempt, target):
                blob = await self.fetch(target, j, attempt, False, self.fetch_timeout)
                if blob is not None and await self.accept(j, attempt, blob, relayed=False):
                    return
        self.failed.append(j)
        self.result[s:e] = self.local[s:e]

    async def accept(
        self,
        j: int,
        attempt: int,
        blob: bytes | bytearray,
        relayed: bool,
        early: tuple[apb.PartProof | str, bytes] | None = None,
    ) -> bool:
        """Decodes part j into the result and checks it; False leaves it to be replaced."""
        refused = await offload.run_sync(self.decode_part, j, attempt, blob)
        if refused is not None and not relayed:  # a relay's copy is the relay's doing
            self.blame(j, attempt, refused)
        if self.link.config.probes == 0:
            return refused is None
        # Asked even for a part already refused: the reducer waits for every contributor's
        # nonce before it proves anything (measured: a refused part cost each round 15 s).
        asked = early if early is not None else await self.request_proof(j, attempt)
        sent = self.claimed(j, attempt, relayed)
        verdict = await verify.check(self.rnd, self.link.config, j, attempt, blob, asked, sent)
        if refused is not None:
            return False
        why = verdict.why
        if why is None:
            if verdict.accepted is not None:
                self.rnd.accepted[(j, attempt)] = verdict.accepted
            self.left_out(verdict.used)  # as its proof says: alike for every member
            return True
        # The evidence a ban needs: who, which round and part, and what did not hold.
        log.warning(
            "round %s: refused part %d (attempt %d) from reducer %s: its proof %s",
            self.rnd.group.round_id.hex()[:12],
            j,
            attempt,
            self.rnd.group.members[self.rnd.reducer_of(j, attempt)].peer_id.short(),
            why,
        )
        if isinstance(why, Rejection):  # the proof came from the reducer, relayed bytes or not
            self.blame(j, attempt, why)
        return False

    async def request_proof(self, j: int, attempt: int) -> verify.Asked:
        # The reducer waits up to fetch_timeout for nonces, then makes one pass over the part
        # per contribution: about as long as a transfer of it.
        timeout = self.fetch_timeout + self.link.deadline(self.bytes_per_part)
        return await verify.request_proof(self.rnd, self.link.client, j, attempt, timeout)

    def claimed(self, j: int, attempt: int, relayed: bool) -> verify.Sent:
        """What this peer sent for part j, as its reducer's proof must account for it."""
        s, e = self.rnd.bounds[j]
        return verify.Sent(
            relayed=relayed,
            weight=self.weight,
            acked=(j, attempt) in self.acked,
            result=self.result[s:e],
            commitment=b"" if relayed else self.commitments.get((j, attempt), b""),
            values=self.to_send[s:e],
            lost=None if self.residual is None else self.residual[s:e],
            encoded=self.encoded_parts,
            part=j,
            own_codec=self.link.outgoing_encoder is None,
        )

    def equivocated(self, j: int, attempt: int, witness: PeerId) -> None:
        """Part j's reducer signed another proof for it, which ``witness`` accepted: the part
        is re-reduced without it (`run`), and the reducer banned."""
        if j in self.equivocations or attempt != 0:
            return
        self.equivocations.add(j)
        self.recovered.append(j)
        reducer = self.rnd.group.members[self.rnd.reducer_of(j, attempt)].peer_id
        log.warning(
            "round %s: reducer %s signed two different proofs for part %d (attempt %d); "
            "member %s accepted the other: part %d is re-reduced without it",
            self.rnd.group.round_id.hex()[:12],
            reducer.short(),
            j,
            attempt,
            witness.short(),
            j,
        )
        why = Rejection("signed two different proofs for one part", "false_data")
        self.blame(j, attempt, why)

    def context(self, j: int) -> str:
        return f"round {self.rnd.group.round_id.hex()[:12]}, part {j}"

    def blame(self, j: int, attempt: int, why: Rejection) -> None:
        """Evidence against part j's reducer in ``attempt`` (bans.py)."""
        reducer = self.rnd.group.members[self.rnd.reducer_of(j, attempt)].peer_id
        self.link.bans.offence(reducer, why, self.context(j), self.rnd.group.round_id.hex())

    def relays(self, j: int) -> list[int]:
        """The other reachable members but part j's reducer: those that may hold a copy."""
        rnd, members = self.rnd, range(len(self.rnd.group.members))
        return [i for i in members if i not in (j, rnd.me) and rnd.group.reachable(i)]

    async def from_relays(self, j: int, timeout: float) -> bytes | bytearray | None:
        """Asks the other members for the copy of part j they got from its reducer."""
        others = self.relays(j)
        found: list[bytes | bytearray] = []
        async with trio.open_nursery() as nursery:

            async def ask(i: int) -> None:
                blob = await self.fetch(i, j, 0, True, timeout)
                if blob is not None and not found:
                    found.append(blob)
                    nursery.cancel_scope.cancel()

            for i in others:
                nursery.start_soon(ask, i)
        return found[0] if found else None
