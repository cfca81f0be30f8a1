"""State sync: a joining peer downloads the current global state from the peers that hold it.

Donors (donor.py) serve a snapshot (snapshot.py) in hashed chunks. The joiner here asks every
donor for its manifest, picks the state, and fetches chunks from several donors at once,
checking each chunk against the manifest as it arrives and refetching from another donor
whatever fails (which donor is asked, and for how long: donorpool.py). Every wait is bounded:
manifests by a timeout, each chunk by a timeout derived from the throughput measured so far,
backoffs by their length, and the whole download by ``deadline_s``, after which it raises
``StateSyncError`` saying what failed. A stalled donor therefore costs one chunk timeout, never
the download (hivemind's state download could hang on a donor that stopped answering).

Daemon usage::

    donor = StateDonor()                       # its service() goes into rpc.serve([...])
    snap = await offload.run_sync(      # after each outer step
        lambda: StateSnapshot.build(named_tensors, round=r, meta={"config": cfg_hash}))
    donor.publish(snap)
    dht.store(advert_key(run), donor.advert(my_address).to_bytes(), subkey=str(peer_id))

    # a joiner
    want, addresses = choose_donors(StateAdvert.from_bytes(v) for v in dht.get(advert_key(run)))
    snap = await download_state(client, addresses, deadline_s=300, want_hash=want)
    model.load_state_dict(snap.to_state_dict(), strict=False)
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import trio

from swarmd.node.runtime import offload
from swarmd.node.statesync.config import SyncConfig
from swarmd.node.statesync.donor import (
    DONOR_SERVICE,
    GET_CHUNK,
    GET_MANIFEST,
    AdvertError,
    DonorConfig,
    DonorStats,
    StateAdvert,
    StateDonor,
    advert_key,
    choose_donors,
)
from swarmd.node.statesync.donorpool import Donor, DonorPool
from swarmd.node.statesync.snapshot import (
    DEFAULT_CHUNK_BYTES,
    HASH_BYTES,
    Layout,
    Manifest,
    ManifestError,
    StateSnapshot,
    chunk_hash,
    layout_mismatch,
)
from swarmd.protocol import rpc
from swarmd.protocol import statesync_pb2 as pb
from swarmd.protocol.errors import ProtocolError
from swarmd.protocol.identity import PeerId

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DONOR_SERVICE",
    "GET_CHUNK",
    "GET_MANIFEST",
    "AdvertError",
    "DonorConfig",
    "DonorStats",
    "Manifest",
    "ManifestError",
    "StateAdvert",
    "StateDonor",
    "StateSnapshot",
    "StateSyncError",
    "SyncConfig",
    "SyncStats",
    "advert_key",
    "choose_donors",
    "download_state",
]

log = logging.getLogger("swarmd.statesync")


class StateSyncError(Exception):
    """The state could not be downloaded; ``failures`` lists what went wrong, per donor."""

    def __init__(self, message: str, failures: Sequence[str] = ()) -> None:
        self.failures = list(failures)
        shown = self.failures[-12:]
        detail = ""
        if shown:
            more = len(self.failures) - len(shown)
            detail = "; failures: " + "; ".join(shown) + (f" (+{more} earlier)" if more else "")
        super().__init__(message + detail)


@dataclass
class SyncStats:
    """What one download did; pass an instance to ``download_state`` to have it filled in."""

    state_hash: bytes = b""
    round: int = -1
    total_bytes: int = 0
    chunks_total: int = 0
    chunks_done: int = 0
    bytes_done: int = 0
    corrupt_chunks: int = 0
    busy_rejections: int = 0
    failed_fetches: int = 0
    elapsed_s: float = 0.0
    chunks_by_donor: dict[str, int] = field(default_factory=dict)
    #: Donors that sent a chunk off its manifest's hash: evidence for bans (node/bans.py).
    corrupt_donors: list[str] = field(default_factory=list)
    #: The derived bound of each chunk fetch that ran out: what silent donors cost.
    expired_timeouts_s: list[float] = field(default_factory=list)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_done / 1e6 / self.elapsed_s if self.elapsed_s > 0 else 0.0


class StateRefused(StateSyncError):
    """Every donor that answered serves a state that does not fit this peer's model: that
    state is unusable here, whatever the network does next (a retry would only refetch it)."""


class _Abort(Exception):
    """Internal: a fatal condition was recorded; the download nursery is being cancelled."""


class _Download:
    def __init__(
        self,
        client: rpc.TensorCaller,
        addresses: Sequence[str],
        parallel: int,
        config: SyncConfig,
        stats: SyncStats,
        on_progress: Callable[[int, int], None] | None,
        expect: Layout | None = None,
        peer_ids: Mapping[str, PeerId] | None = None,
    ) -> None:
        self.client = client
        self.expect = expect
        #: Address -> the peer id expected there (from its advert); see download_state.
        self.peer_ids = dict(peer_ids or {})
        #: Donors whose manifest did not fit `expect`.
        self.misfits = 0
        self.addresses = list(dict.fromkeys(addresses))
        self.parallel = parallel
        self.cfg = config
        self.stats = stats
        self.on_progress = on_progress
        self.failures: list[str] = []
        self.fatal: str | None = None
        self.pool = DonorPool(config)
        self.manifest: Manifest | None = None
        self.buf = bytearray()
        self.chunk_failures: Counter[int] = Counter()
        self.started = trio.current_time()
        self.last_log = self.started

    # -- manifests ----------------------------------------------------------------------------

    async def _fetch_manifest(
        self, address: str, want_hash: bytes | None, found: dict[str, tuple[Manifest, float]]
    ) -> None:
        start = trio.current_time()
        req = pb.GetManifestRequest(state_hash=want_hash or b"")
        try:
            with trio.fail_after(self.cfg.manifest_timeout_s):
                resp = await self.client.unary(
                    address, GET_MANIFEST, req, pb.GetManifestResponse, timeout=math.inf,
                    recipient=self.peer_ids.get(address),
                )  # fmt: skip
            manifest = Manifest.from_proto(resp.manifest)
        except trio.TooSlowError:
            self.failures.append(
                f"{address}: no manifest within {self.cfg.manifest_timeout_s:.1f}s"
            )
            return
        except (rpc.RpcError, ProtocolError) as exc:
            self.failures.append(f"{address}: manifest: {exc}")
            return
        if resp.state_hash != manifest.state_hash:
            self.failures.append(
                f"{address}: claims state {resp.state_hash.hex()[:16]} but its manifest hashes "
                f"to {manifest.state_hash.hex()[:16]}"
            )
            return
        why = None if self.expect is None else layout_mismatch(self.expect, manifest.layout)
        if why is not None:
            # Checked before anything is allocated: a manifest is the donor's word for how
            # much memory this peer sets aside (200 GiB declared killed joiners by MemoryError).
            log.warning(
                "state sync: refused %s's state %s: it does not fit this run's model (%s, "
                "%d B declared)",
                address,
                manifest.state_hash.hex()[:16],
                why,
                manifest.total_bytes,
            )
            self.failures.append(f"{address}: state does not fit this model: {why}")
            self.misfits += 1
            return
        found[address] = (manifest, trio.current_time() - start)

    async def _choose(self, want_hash: bytes | None) -> None:
        found: dict[str, tuple[Manifest, float]] = {}
        async with trio.open_nursery() as nursery:
            for address in self.addresses:
                nursery.start_soon(self._fetch_manifest, address, want_hash, found)
        if want_hash is not None:
            chosen = want_hash
        else:
            counts = Counter(m.state_hash for m, _ in found.values())
            rounds = {m.state_hash: m.round for m, _ in found.values()}
            if not counts:
                if self.misfits:
                    raise StateRefused("no donor's state fits this model", self.failures)
                raise StateSyncError("no donor answered with a manifest", self.failures)
            chosen = max(counts, key=lambda h: (rounds[h], counts[h], h))
        for address, (manifest, rtt) in found.items():
            if manifest.state_hash == chosen:
                self.manifest = manifest
                self.pool.add(address, rtt)
        if self.manifest is None:
            error = StateRefused if self.misfits else StateSyncError
            raise error(f"no donor serves state {chosen.hex()[:16]}", self.failures)
        m = self.manifest
        if m.total_bytes > self.cfg.max_state_bytes:
            raise StateSyncError(
                f"state {chosen.hex()[:16]} has {m.total_bytes} B, over this node's limit of "
                f"{self.cfg.max_state_bytes} B"
            )
        self.stats.state_hash, self.stats.round = chosen, m.round
        self.stats.total_bytes, self.stats.chunks_total = m.total_bytes, m.n_chunks
        log.info(
            "state sync: round %d (%s), %.1f MB in %d chunks from %d of %d donors",
            m.round,
            chosen.hex()[:16],
            m.total_bytes / 1e6,
            m.n_chunks,
            len(self.pool.donors),
            len(self.addresses),
        )

    # -- chunks -------------------------------------------------------------------------------

    def _abort(self, reason: str) -> _Abort:
        if self.fatal is None:
            self.fatal = reason
        return _Abort(reason)

    def _verify_and_store(self, index: int, data: bytearray) -> bool:
        """Runs in a worker thread: hashing 4 MiB takes milliseconds the event loop needs."""
        assert self.manifest is not None
        if chunk_hash(data) != self.manifest.chunk_hashes[index]:
            return False
        start, end = self.manifest.chunk_span(index)
        self.buf[start:end] = data
        return True

    def _failed(self, donor: Donor, index: int, reason: str, *, drop: bool = False) -> None:
        self.stats.failed_fetches += 1
        self.failures.append(f"{donor.address} chunk {index}: {reason}")
        self.chunk_failures[index] += 1
        self.pool.failed(donor, index, reason, drop=drop)
        if self.chunk_failures[index] >= self.cfg.max_chunk_failures:
            raise self._abort(f"chunk {index} failed {self.chunk_failures[index]} times")

    async def _fetch(self, index: int, donor: Donor) -> bool:
        assert self.manifest is not None
        start, end = self.manifest.chunk_span(index)
        nbytes = end - start
        req = pb.GetChunkRequest(state_hash=self.manifest.state_hash, index=index)
        timeout = self.pool.timeout(donor, nbytes)
        began = trio.current_time()
        try:
            with trio.fail_after(timeout):
                meta, data = await self.client.get_tensor(
                    donor.address, GET_CHUNK, req, timeout=math.inf, max_bytes=nbytes,
                    expect=self.peer_ids.get(donor.address),
                )  # fmt: skip
        except trio.TooSlowError:
            self.stats.expired_timeouts_s.append(timeout)
            self._failed(donor, index, f"no chunk within {timeout:.2f}s")
            return False
        except rpc.RpcError as exc:
            if exc.code is rpc.StatusCode.RESOURCE_EXHAUSTED:
                self.stats.busy_rejections += 1
                self.pool.refused(donor)
                return False
            gone = exc.code in (rpc.StatusCode.NOT_FOUND, rpc.StatusCode.OUT_OF_RANGE)
            self._failed(donor, index, str(exc), drop=gone)
            return False
        except ProtocolError as exc:
            self._failed(donor, index, f"malformed chunk stream: {exc}", drop=True)
            return False
        if meta.dtype != "uint8" or len(data) != nbytes:
            self._failed(donor, index, f"sent {len(data)} B of {meta.dtype}", drop=True)
            return False
        elapsed = trio.current_time() - began
        if not await offload.run_sync(self._verify_and_store, index, data):
            self.stats.corrupt_chunks += 1
            log.warning(
                "state sync: chunk %d from %s does not match the manifest's hash; refetching it "
                "from another donor",
                index,
                donor.address,
            )
            self._failed(donor, index, "sent a chunk whose hash does not match", drop=True)
            self.stats.corrupt_donors.append(donor.address)
            return False
        self.pool.delivered(donor, nbytes, elapsed)
        self.stats.chunks_by_donor[donor.address] = (
            self.stats.chunks_by_donor.get(donor.address, 0) + 1
        )
        self._done(nbytes)
        return True

    def _done(self, nbytes: int) -> None:
        s = self.stats
        s.chunks_done += 1
        s.bytes_done += nbytes
        now = trio.current_time()
        s.elapsed_s = now - self.started
        if self.on_progress is not None:
            self.on_progress(s.chunks_done, s.chunks_total)
        if s.chunks_done == s.chunks_total or now - self.last_log >= self.cfg.progress_interval_s:
            self.last_log = now
            log.info(
                "state sync: %d/%d chunks, %.1f/%.1f MB, %.1f MB/s",
                s.chunks_done,
                s.chunks_total,
                s.bytes_done / 1e6,
                s.total_bytes / 1e6,
                s.mb_per_s,
            )

    async def _worker(
        self,
        queue: trio.MemoryReceiveChannel[int],
        requeue: trio.MemorySendChannel[int],
        all_done: trio.CancelScope,
    ) -> None:
        async for index in queue:
            donor = await self.pool.pick(index)
            if donor is None:
                raise self._abort("no donor left that can serve the state")
            try:
                ok = await self._fetch(index, donor)
            finally:
                self.pool.release(donor)
            if not ok:
                requeue.send_nowait(index)
            elif self.stats.chunks_done == self.stats.chunks_total:
                all_done.cancel()

    async def run(self, want_hash: bytes | None) -> StateSnapshot:
        await self._choose(want_hash)
        manifest = self.manifest
        assert manifest is not None
        self.buf = bytearray(manifest.total_bytes)
        if manifest.n_chunks:
            send, recv = trio.open_memory_channel[int](math.inf)
            # Stagger the start so that concurrent joiners do not all begin at chunk 0.
            first = random.randrange(manifest.n_chunks)
            for i in range(manifest.n_chunks):
                send.send_nowait((first + i) % manifest.n_chunks)
            try:
                async with trio.open_nursery() as nursery:
                    for _ in range(self.parallel):
                        nursery.start_soon(self._worker, recv, send, nursery.cancel_scope)
            except BaseExceptionGroup as group:
                aborts, rest = group.split(_Abort)
                if rest is not None:
                    raise rest from None
                assert aborts is not None
                raise StateSyncError(
                    f"state sync failed after {self.stats.chunks_done}/{manifest.n_chunks} "
                    f"chunks: {self.fatal}",
                    self.failures,
                ) from None
        # Every chunk matched the manifest as it arrived; the manifest must be the state chosen.
        snapshot = StateSnapshot.from_buffer(manifest, self.buf, verify=False)
        if snapshot.state_hash != self.stats.state_hash:
            raise StateSyncError(
                f"assembled state {snapshot.state_hash.hex()[:16]} is not the state chosen, "
                f"{self.stats.state_hash.hex()[:16]}",
                self.failures,
            )
        self.stats.elapsed_s = trio.current_time() - self.started
        log.info(
            "state sync: got round %d (%s), %.1f MB in %.2fs (%.1f MB/s), %d corrupt chunks, "
            "%d failed and %d refused fetches",
            snapshot.round,
            snapshot.state_hash.hex()[:16],
            snapshot.total_bytes / 1e6,
            self.stats.elapsed_s,
            self.stats.mb_per_s,
            self.stats.corrupt_chunks,
            self.stats.failed_fetches,
            self.stats.busy_rejections,
        )
        return snapshot


async def download_state(
    client: rpc.TensorCaller,
    donors: Sequence[str],
    *,
    deadline_s: float,
    want_hash: bytes | None = None,
    parallel: int = 4,
    config: SyncConfig | None = None,
    stats: SyncStats | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    expect: Layout | None = None,
    peer_ids: Mapping[str, PeerId] | None = None,
) -> StateSnapshot:
    """Downloads a state from ``donors`` (addresses), verified chunk by chunk, within deadline_s.

    ``expect`` (the model's own `layout_of`) refuses, before allocating, any donor whose
    manifest lists other tensors, dtypes or shapes than this peer's model has. ``peer_ids``
    (address -> the peer id its signed advert names) addresses each donor's requests to that
    peer, so a server at the address that is someone else serves nothing.

    Without ``want_hash``, takes the newest round any donor serves (among equal rounds, the
    state most donors agree on). Raises StateSyncError when the deadline passes, no donor can
    serve the state, or a chunk keeps failing; ``on_progress(done, total)`` is called per chunk.
    """
    if deadline_s <= 0:
        raise ValueError("deadline_s must be positive")
    if parallel < 1:
        raise ValueError("parallel must be >= 1")
    if want_hash is not None and len(want_hash) != HASH_BYTES:
        raise ValueError(f"want_hash must have {HASH_BYTES} bytes")
    if not donors:
        raise StateSyncError("no donors given")
    cfg, counts = config or SyncConfig(), stats or SyncStats()
    job = _Download(client, donors, parallel, cfg, counts, on_progress, expect, peer_ids)
    with trio.move_on_after(deadline_s):
        return await job.run(want_hash)
    s = job.stats
    raise StateSyncError(
        f"state sync did not finish within its {deadline_s:.1f}s deadline "
        f"({s.chunks_done}/{s.chunks_total} chunks, {len(job.pool.donors)} donors)",
        job.failures,
    )
