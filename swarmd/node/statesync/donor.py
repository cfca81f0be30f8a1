"""The donor side of state sync: serves snapshots in chunks, and advertises them in the DHT.

A donor is a training peer first. Serving joiners must never stall its training, so it serves a
bounded number of chunk streams at once and answers RESOURCE_EXHAUSTED beyond that, at once:
a queued request would hold a gRPC worker thread and the joiner's deadline, while an immediate
refusal lets the joiner ask another donor right away.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from swarmd.node.runkeys import advert_key as advert_key
from swarmd.node.statesync.snapshot import HASH_BYTES, MAX_STATE_BYTES, StateSnapshot
from swarmd.protocol import rpc
from swarmd.protocol import statesync_pb2 as pb
from swarmd.protocol.address import parse_address
from swarmd.protocol.errors import ProtocolError
from swarmd.protocol.framing import TensorMeta

log = logging.getLogger("swarmd.statesync")

DONOR_SERVICE = "swarmd.statesync.v1.StateDonor"
GET_MANIFEST = rpc.method_path(DONOR_SERVICE, "GetManifest")
GET_CHUNK = rpc.method_path(DONOR_SERVICE, "GetChunk")


@dataclass(frozen=True)
class DonorConfig:
    #: Chunk streams served at once. Each holds a gRPC worker thread and ~one chunk of bandwidth;
    #: a few saturate a link while leaving the training RPCs their threads.
    max_concurrent_chunks: int = 4
    #: How long the previous snapshot stays servable after ``publish`` replaces it, counted from
    #: its last request: joiners mid-download finish, and memory is freed once they are done.
    retain_previous_s: float = 60.0
    #: Safety net: a slot whose stream was never seen to end (which only a leaked reference can
    #: cause) is reclaimed after this long, so the bound can never wedge the donor shut.
    slot_lease_s: float = 300.0

    def __post_init__(self) -> None:
        if self.max_concurrent_chunks < 1:
            raise ValueError("DonorConfig.max_concurrent_chunks must be >= 1")
        if self.retain_previous_s < 0:
            raise ValueError("DonorConfig.retain_previous_s must be >= 0")
        if self.slot_lease_s <= 0:
            raise ValueError("DonorConfig.slot_lease_s must be positive")


@dataclass
class DonorStats:
    served_chunks: int = 0
    served_manifests: int = 0
    busy_rejections: int = 0


class StateDonor:
    """Serves the latest published snapshot (and the previous one while it is still wanted).

    ``publish`` is called from the daemon's trio thread; chunk slots are released from gRPC
    threads (when a stream's payload is dropped), hence the lock around the slot table.
    """

    def __init__(
        self, config: DonorConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or DonorConfig()
        #: Seconds, for how long a replaced state and a chunk's slot are kept (virtual time in
        #: the simulator).
        self.clock = clock
        self.stats = DonorStats()
        self._lock = threading.Lock()
        self._slots: dict[int, float] = {}
        self._next_slot = 0
        self._current: StateSnapshot | None = None
        self._current_response: pb.GetManifestResponse | None = None
        self._previous: StateSnapshot | None = None
        self._previous_used = 0.0

    # -- publishing ---------------------------------------------------------------------------

    def publish(self, snapshot: StateSnapshot) -> None:
        """Makes ``snapshot`` the state served from now on; build it off the event loop."""
        if self._current is not None and self._current.state_hash == snapshot.state_hash:
            return
        self._previous, self._previous_used = self._current, self.clock()
        self._current = snapshot
        self._current_response = pb.GetManifestResponse(
            manifest=snapshot.manifest.to_proto(), state_hash=snapshot.state_hash
        )
        log.info(
            "serving state round %d (%s, %.1f MB)",
            snapshot.round,
            snapshot.state_hash.hex()[:16],
            snapshot.total_bytes / 1e6,
        )

    @property
    def latest(self) -> StateSnapshot | None:
        return self._current

    @property
    def active_chunks(self) -> int:
        with self._lock:
            return len(self._slots)

    def advert(self, address: str) -> StateAdvert:
        """What to store in the DHT under ``advert_key(run)`` with this peer's id as sub-key."""
        if self._current is None:
            raise RuntimeError("nothing published yet")
        return StateAdvert.of(self._current, address)

    def _find(self, state_hash: bytes) -> StateSnapshot:
        current, previous = self._current, self._previous
        if current is None:
            raise rpc.RpcError(rpc.StatusCode.UNAVAILABLE, "this peer holds no state yet")
        if not state_hash or state_hash == current.state_hash:
            return current
        now = self.clock()
        if previous is not None and now - self._previous_used > self.config.retain_previous_s:
            self._previous = previous = None
        if previous is not None and state_hash == previous.state_hash:
            self._previous_used = now
            return previous
        raise rpc.RpcError(
            rpc.StatusCode.NOT_FOUND,
            f"state {state_hash.hex()[:16]} is not held here; latest is round {current.round} "
            f"({current.state_hash.hex()[:16]})",
        )

    # -- slots --------------------------------------------------------------------------------

    def _acquire(self) -> int:
        now = self.clock()
        with self._lock:
            if len(self._slots) >= self.config.max_concurrent_chunks:
                stale = [s for s, t in self._slots.items() if now - t > self.config.slot_lease_s]
                for slot in stale:
                    del self._slots[slot]
                if stale:
                    log.warning("reclaimed %d chunk slots whose streams never ended", len(stale))
            if len(self._slots) >= self.config.max_concurrent_chunks:
                self.stats.busy_rejections += 1
                raise rpc.RpcError(
                    rpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"serving {len(self._slots)} state chunks already; ask another donor",
                )
            slot = self._next_slot
            self._next_slot += 1
            self._slots[slot] = now
            return slot

    def _release(self, slot: int) -> None:
        with self._lock:
            self._slots.pop(slot, None)

    # -- service ------------------------------------------------------------------------------

    async def chunk_payload(self, snapshot: StateSnapshot, index: int) -> memoryview:
        """The bytes sent for one chunk; an override point for fault injection in tests."""
        return snapshot.chunk(index)

    async def _get_manifest(
        self, req: pb.GetManifestRequest, ctx: rpc.CallContext
    ) -> pb.GetManifestResponse:
        snapshot = self._find(req.state_hash)
        self.stats.served_manifests += 1
        if snapshot is self._current and self._current_response is not None:
            return self._current_response
        return pb.GetManifestResponse(
            manifest=snapshot.manifest.to_proto(), state_hash=snapshot.state_hash
        )

    async def _get_chunk(
        self, req: pb.GetChunkRequest, ctx: rpc.CallContext
    ) -> tuple[TensorMeta, memoryview]:
        snapshot = self._find(req.state_hash)
        if req.index >= snapshot.n_chunks:
            raise rpc.RpcError(
                rpc.StatusCode.OUT_OF_RANGE,
                f"chunk {req.index} requested; the state has {snapshot.n_chunks}",
            )
        slot = self._acquire()
        try:
            payload = await self.chunk_payload(snapshot, req.index)
            # The stream is sent from a gRPC thread after this handler returns; its end (done,
            # failed or cancelled) is when the payload view is dropped, which frees the slot.
            weakref.finalize(payload, self._release, slot)
        except BaseException:
            self._release(slot)
            raise
        self.stats.served_chunks += 1
        meta = TensorMeta("uint8", (payload.nbytes,), name=f"chunk/{req.index}")
        return meta, payload

    def service(self) -> rpc.Service:
        return rpc.Service(
            DONOR_SERVICE,
            [
                rpc.unary("GetManifest", pb.GetManifestRequest, self._get_manifest),
                rpc.tensor_out("GetChunk", pb.GetChunkRequest, self._get_chunk),
            ],
        )


# -- DHT advertisement ---------------------------------------------------------------------------


class AdvertError(ProtocolError):
    """A state advertisement read from the DHT is malformed; it is ignored."""


@dataclass(frozen=True)
class StateAdvert:
    """A donor's claim: "I serve state ``state_hash`` of ``round`` at ``address``"."""

    round: int
    state_hash: bytes
    address: str
    total_bytes: int
    #: Who signed the advert (its DHT sub-key, which only that key can write); not on the
    #: wire, filled in by the reader. Empty when unknown.
    owner: str = ""
    #: The advertiser says the state is also others' (its last round averaged in a group, or
    #: downloaded), not one it made alone. Only the run creator's word anchors a line; anyone's
    #: breaks a tie between states as many peers hold (`statesync/catchup.py`): a liar gains
    #: no more by it than by a state whose hash wins the tie-break.
    shared: bool = False
    #: The advertiser cannot be dialled (client mode): its state counts as held by it, but
    #: it is not a donor.
    client: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.round < 1 << 63:
            raise AdvertError(f"advert round {self.round} is out of range")
        if len(self.state_hash) != HASH_BYTES:
            raise AdvertError(f"advert state hash has {len(self.state_hash)} B, not {HASH_BYTES}")
        if not 0 <= self.total_bytes <= MAX_STATE_BYTES:
            raise AdvertError(f"advert state size {self.total_bytes} B is out of range")
        try:
            parse_address(self.address)
        except ValueError as exc:
            raise AdvertError(f"advert address: {exc}") from None

    @classmethod
    def of(
        cls, snapshot: StateSnapshot, address: str, *, shared: bool = False, client: bool = False
    ) -> StateAdvert:
        return cls(
            snapshot.round,
            snapshot.state_hash,
            address,
            snapshot.total_bytes,
            shared=shared,
            client=client,
        )

    def to_bytes(self) -> bytes:
        msg = pb.StateAdvert(
            round=self.round,
            state_hash=self.state_hash,
            address=self.address,
            total_bytes=self.total_bytes,
            shared=self.shared,
            client=self.client,
        )
        return msg.SerializeToString()

    @classmethod
    def from_bytes(cls, raw: bytes) -> StateAdvert:
        """Decodes a DHT value; raises AdvertError (never anything else) if it is malformed."""
        if len(raw) > 1024:
            raise AdvertError(f"state advert of {len(raw)} B is too large")
        msg = pb.StateAdvert()
        try:
            msg.ParseFromString(raw)
        except DecodeError as exc:
            raise AdvertError(f"state advert is not a StateAdvert message: {exc}") from None
        return cls(
            msg.round,
            msg.state_hash,
            msg.address,
            msg.total_bytes,
            shared=msg.shared,
            client=msg.client,
        )


def choose_donors(adverts: Iterable[StateAdvert]) -> tuple[bytes, list[str]]:
    """The state to fetch (newest round; among equals, the hash most donors agree on) and the
    addresses serving it; pass both to ``download_state(..., want_hash=...)``. Client-mode
    advertisers are not donors: nobody can dial them."""
    by_hash: dict[bytes, list[StateAdvert]] = {}
    for advert in adverts:
        if not advert.client:
            by_hash.setdefault(advert.state_hash, []).append(advert)
    if not by_hash:
        raise ValueError("no state adverts from a peer that can be dialled")
    best = max(by_hash, key=lambda h: (by_hash[h][0].round, len(by_hash[h]), h))
    return best, sorted({a.address for a in by_hash[best]})
