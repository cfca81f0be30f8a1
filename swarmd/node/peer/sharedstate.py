"""The state a group holds in common: published after every round, downloaded by joiners,
taken over by a peer that fell behind.

Any strategy whose peers keep one global state (DiLoCo, streaming DiLoCo; DeMo's parameters and
momentum) uses this component: it serves the state to joiners (the donor), advertises it in the
DHT with its hash and age, saves it atomically to disk, chooses the state to start from, and
catches a peer up when its state is no longer the group's. What the state *is* belongs to the
strategy's optimiser (`SyncedState`); this module never looks inside it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Protocol

import torch
import trio

from swarmd.node.bans import Rejection
from swarmd.node.peer.context import PeerContext
from swarmd.node.peer.localstate import (
    STATE_FILE,
    SaveError,
    load_saved,
    remove_stale_temps,
    save_state,
)
from swarmd.node.runtime import offload
from swarmd.node.statesync.catchup import state_to_take
from swarmd.node.statesync.donor import StateAdvert, advert_key, choose_donors
from swarmd.node.statesync.download import (
    StateRefused,
    StateSyncError,
    SyncStats,
    download_state,
)
from swarmd.node.statesync.snapshot import StateSnapshot, layout_of
from swarmd.node.statesync.vet import nonfinite, worse_than_ours
from swarmd.optim.streaming import state_age
from swarmd.protocol.identity import PeerId

log = logging.getLogger("swarmd.daemon")

#: States a joiner refuses (unloadable) before it settles for its own; each costs a download.
MAX_REFUSED_TRIES = 3
#: How many of its own past state hashes a peer remembers (32 B each).
PAST_STATES = 1024


class SyncedState(Protocol):
    """What a strategy's optimiser offers for its state to be shared (DiLoCo, StreamingDiLoCo)."""

    @property
    def age(self) -> int:
        """How far along the run the global state is (rounds; turns in streaming DiLoCo)."""
        ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None: ...

    def local_state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_local_state_dict(self, state: Mapping[str, torch.Tensor]) -> None: ...


#: (offered state) -> (its loss, the loss of the state this peer holds), on the same batches.
Judge = Callable[[Mapping[str, torch.Tensor]], tuple[float, float]]


def _advertisers(adverts: Iterable[StateAdvert], state_hash: bytes) -> dict[str, PeerId]:
    """Address -> the peer id whose signed advert names it, for the donors of ``state_hash``."""
    out: dict[str, PeerId] = {}
    for advert in adverts:
        if advert.state_hash == state_hash and advert.owner:
            try:
                out[advert.address] = PeerId.from_string(advert.owner)
            except ValueError:
                continue
    return out


class SharedState:
    """One peer's view of the group's state: its own copy's hash and when it was last shared."""

    def __init__(
        self, peer: PeerContext, opt: SyncedState, judge: Judge | None = None, *, scope: str = ""
    ) -> None:
        self.peer = peer
        self.opt = opt
        self.timings = peer.timings.state
        #: What part of the run's state this is ("": all of it; SWARM: one stage's, "stage2"):
        #: its adverts and its file are its own, so a stage's joiner finds that stage's donors.
        self.key = advert_key(peer.config.name, scope)
        self.path = peer.opts.state_dir / (f"{scope}-{STATE_FILE}" if scope else STATE_FILE)
        #: Measures an offered state against this peer's own before it is loaded (the
        #: strategy knows the model and data); None skips that check.
        self.judge = judge
        #: Whether the last save failed (said once, not every round, until one succeeds).
        self.save_failing = False
        #: Set while no save runs in the background (`publish(..., background=)`).
        self._saved = trio.Event()
        self._saved.set()
        remove_stale_temps(self.path)
        #: Hash of the global state this peer last published (None before its first): the
        #: matchmaking key carries it, so only peers holding the very same state average.
        self.last_hash: bytes | None = None
        #: The state's age when this peer's state was last also others' (averaged in a group,
        #: or downloaded); what it did after that it did alone and does not compare with the
        #: group's.
        self.shared_round = 0
        #: Peers whose state this peer has shared: members it averaged with, donors it took a
        #: state from. Only their adverts can make a running peer replace its parameters: two
        #: fresh keys advertising round 1,000,000 once made every honest peer of a run adopt
        #: their scrambled state (validation loss 3.6 -> 89).
        self.met: set[str] = set()
        #: States found unusable (see `_sync_from_group`): never fetched again.
        self.refused: set[bytes] = set()
        self.ignored: set[tuple[str, bytes]] = set()
        #: Whether this process has shared a state with others yet (averaged in a group or
        #: downloaded): only then does its advert say "shared". A state resumed from disk was
        #: the group's once, maybe long ago; a creator advertising it as shared would pull
        #: every peer back to it (catchup.py's anchor).
        self.proven = False
        #: Hashes of the states this peer published, newest last (bounded): a creator's state
        #: among them is the creator running late on this peer's own line, not another line.
        self.past: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        #: The run creator's peer id (None for the creator itself): its advert anchors which
        #: state is the group's when groups that never met hold different ones (catchup.py).
        creator = peer.creator
        self.is_creator = creator == peer.identity.peer_id
        self.creator = str(creator) if creator and not self.is_creator else None

    def snapshot(self, state: dict[str, torch.Tensor] | None = None) -> StateSnapshot:
        """What joiners download of the global state (`state`, the optimiser's `state_dict`
        if already taken; it is copied in)."""
        return StateSnapshot.build(
            self.opt.state_dict() if state is None else state,
            round=self.opt.age,
            meta={"config": self.peer.config.hash},
        )

    def averaged(self, status: str, group_size: int, dropped: int) -> None:
        """Records an outer step: shared unless the all-reduce dropped everyone else."""
        if status == "averaged" and group_size - dropped > 1:
            self.shared_round = self.opt.age
            self.proven = True

    def meet(self, peers: Iterable[PeerId]) -> None:
        """Peers this one just averaged with (the all-reduce's survivors)."""
        self.met.update(str(p) for p in peers if p != self.peer.identity.peer_id)

    async def publish(self, step: int, *, background: trio.Nursery | None = None) -> StateSnapshot:
        """Serves the new global state to joiners, advertises it, and saves it to disk; with
        `background`, the save (of copies taken now) runs there while the caller trains on,
        and `saved()` says when it is done. One save runs at a time: a publish waits for the
        previous save first. A 126M-parameter state is ~2.5 GB with the AdamW moments: its
        write and fsync held a GPU trainer longer than its round's compute."""
        peer = self.peer
        # One copy of the global state serves both the snapshot (which copies it into its own
        # buffer) and the save: two state_dict() calls copied 1 GB twice at 126M parameters.
        global_state = await offload.run_sync(self.opt.state_dict)
        snap = await offload.run_sync(self.snapshot, global_state)
        self.last_hash = snap.state_hash
        self.past[snap.state_hash] = None
        while len(self.past) > PAST_STATES:
            self.past.popitem(last=False)
        peer.donor.publish(snap)
        shared = self.proven and self.opt.age <= self.shared_round
        await peer.dht.store(
            self.key,
            StateAdvert.of(snap, peer.address, shared=shared, client=peer.client_mode).to_bytes(),
            peer.dht.now() + self.timings.advert_ttl_s,
            subkey=str(peer.identity.peer_id),
        )
        await self.saved()
        state = {
            "config_hash": peer.config.hash,
            # `swarmd export --state-dir` reads the model's shape from it.
            "config": peer.config.to_json().decode(),
            "global": global_state,
            "local": await offload.run_sync(self.opt.local_state_dict),
            "step": step,
        }
        if background is None:
            await self._save(state)
        else:
            self._saved = trio.Event()
            background.start_soon(self._save_in_background, state)
        return snap

    async def saved(self) -> None:
        """Returns once no save is running (at once when none was started)."""
        await self._saved.wait()

    async def _save_in_background(self, state: dict[str, Any]) -> None:
        try:
            await self._save(state)
        finally:
            self._saved.set()

    async def _save(self, state: dict[str, Any]) -> None:
        try:
            await offload.run_sync(save_state, self.path, state)
        except SaveError as exc:
            # Training goes on: the state lives in memory and in the group; a restart resumes
            # from the last good file (or the group's newer state).
            if not self.save_failing:
                log.error("%s; the last saved state is kept and training goes on", exc)
            self.save_failing = True
        else:
            if self.save_failing:
                log.info("saved the state to %s again", self.path)
            self.save_failing = False

    async def adverts(self, *, known_only: bool = False) -> list[StateAdvert]:
        """The other peers' state adverts (malformed ones are skipped); ``known_only``: just
        those of peers this one has met and the run's creator, when it has met any (a peer
        that never averaged nor downloaded is where a joiner is, and reads them all)."""
        adverts: list[StateAdvert] = []
        me = str(self.peer.identity.peer_id)
        entries = await self.peer.dht.get_map(self.key)
        for peer, value in entries.items():
            if peer == me:
                continue
            try:
                advert = StateAdvert.from_bytes(value.value)
            except ValueError:
                continue
            if self._stranger(peer, known_only):
                self._ignore_stranger(peer, advert)
                continue
            if advert.state_hash in self.refused or self._banned(peer):
                continue
            adverts.append(dataclasses.replace(advert, owner=peer))
        return adverts

    async def sync_to(self, adverts: list[StateAdvert]) -> bool:
        """Downloads and loads the state these adverts name (a strategy that decides itself
        whose state to follow); False if that failed."""
        return await self._sync_from_group(adverts)

    def _stranger(self, peer: str, known_only: bool) -> bool:
        """Whether `adverts(known_only=...)` leaves this peer's adverts out as a stranger's."""
        return known_only and bool(self.met) and peer not in self.met and peer != self.creator

    async def awaited(
        self, among: Collection[str] | None = None, known_only: bool = False
    ) -> set[str]:
        """The other live peers (of ``among``, if given) whose adverts `adverts(known_only=...)`
        can show (not a stranger's, nor a banned peer's): what a wait for adverts waits for."""
        me = str(self.peer.identity.peer_id)
        live = {str(p) for p in await self.peer.live.addresses()} - {me}
        if among is not None:
            live &= set(among)
        return {p for p in live if not self._stranger(p, known_only) and not self._banned(p)}

    def _banned(self, peer: str) -> bool:
        try:
            return self.peer.averager.bans.banned(PeerId.from_string(peer))
        except ValueError:
            return True  # not a peer id at all

    async def _sync_from_group(self, adverts: list[StateAdvert]) -> bool:
        """Downloads the state most donors advertise and loads it; False if that failed.

        A state that cannot be loaded (not this model's layout, non-finite values) is refused
        for good: its hash goes into `refused`, and `adverts` leaves it out from then on."""
        want, donors = choose_donors(adverts)  # callers pass states a reachable peer serves
        stats, peer_ids = SyncStats(), _advertisers(adverts, want)
        try:
            snap = await download_state(
                self.peer.client,
                donors,
                deadline_s=self.timings.sync_deadline_s,
                want_hash=want,
                expect=layout_of(self.opt.state_dict()),
                peer_ids=peer_ids,
                stats=stats,
            )
        except StateRefused as exc:
            self._refuse(want, donors, str(exc))
            return False
        except StateSyncError as exc:
            log.warning("state sync failed (%s); going on with this peer's state", exc)
            return False
        finally:  # a chunk off its manifest's hash is its donor's own signed bytes
            corrupt = Rejection("a state chunk off its manifest's hash", "false_data")
            for address in stats.corrupt_donors:
                if address in peer_ids:
                    self.peer.averager.bans.offence(peer_ids[address], corrupt, "state sync")
        if snap.meta.get("config") != self.peer.config.hash:
            self._refuse(want, donors, "it belongs to another run config")
            return False
        state, by_creator = snap.to_state_dict(), self.creator in set(map(str, peer_ids.values()))
        why = await offload.run_sync(self._unusable, state, not by_creator)
        if why is not None:
            self._refuse(want, donors, why)
            return False
        await offload.run_sync(self.opt.load_state_dict, state)
        self.shared_round = self.opt.age
        self.proven = True
        self.met.update(a.owner for a in adverts if a.state_hash == want and a.owner)
        self.peer.out.event(
            "state_synced",
            f"downloaded the group's state (round {snap.round}) from {len(donors)} donor(s)",
            round=snap.round,
        )
        return True

    def _unusable(self, state: Mapping[str, torch.Tensor], judge: bool) -> str | None:
        """Why a downloaded state must not be loaded (worker thread), or None. No loss check
        (``judge``) of the creator's state: its signed advert is as trusted as its config,
        and its honest line can be far worse on this peer's batches (docs: Trust model)."""
        why = nonfinite(state)
        if why is None and judge and self.judge is not None:
            why = worse_than_ours(*self.judge(state))
        return why

    def _ignore_stranger(self, peer: str, advert: StateAdvert) -> None:
        """Says once per advert that a peer this one never averaged with was not followed."""
        seen = (peer, advert.state_hash)
        if seen not in self.ignored and advert.round > self.opt.age:
            self.ignored.add(seen)
            log.warning(
                "ignored the state advert of %s (round %d, state %s, at %s): a running peer "
                "follows only peers it has averaged with or downloaded from",
                peer[:10],
                advert.round,
                advert.state_hash.hex()[:16],
                advert.address,
            )

    def _refuse(self, state_hash: bytes, donors: list[str], why: str) -> None:
        self.refused.add(state_hash)
        log.warning(
            "refused state %s advertised by %s: %s; this peer will not fetch it again",
            state_hash.hex()[:16],
            ", ".join(donors),
            why,
        )

    async def take_initial(self) -> tuple[str, int]:
        """Loads the newest state: the group's, else ours, else the seeded init. Returns where
        it came from and the inner step to resume the data order at."""
        # Quorum counts every holder; only states a reachable peer serves can be taken (else a
        # newer state only clients hold would have this peer download an older one instead).
        adverts = [
            a
            for a in held_by_several(
                await self.adverts(), self.peer.config.state_quorum, anchor=self.creator
            )
            if not a.client
        ]
        saved = load_saved(self.path, self.peer.config.hash)
        saved_round = state_age(saved["global"]) if saved else -1
        if saved is None and adverts and max(a.round for a in adverts) == 0:
            # Round 0 is the seeded init, which this peer builds itself bit for bit: a run's
            # first peers would otherwise each download the whole state (parameters and
            # momentum, 8 bytes a parameter) for nothing. The hash proves it is the same.
            want, _ = choose_donors(adverts)
            mine = await offload.run_sync(self.snapshot)
            if mine.state_hash == want:
                return self._started("fresh", 0)
        for _ in range(MAX_REFUSED_TRIES):
            if not adverts or max(a.round for a in adverts) <= saved_round:
                break
            if await self._sync_from_group(adverts):
                return self._started("group", int(saved.get("step", 0)) if saved else 0)
            if not self.refused & {a.state_hash for a in adverts}:
                break  # the network failed, not the state: go on with this peer's own
            adverts = [a for a in adverts if a.state_hash not in self.refused]
        if saved is not None:
            await offload.run_sync(self.opt.load_state_dict, saved["global"])
            self.opt.load_local_state_dict(saved["local"])
            self.peer.out.event(
                "resumed", f"resumed from saved state (round {saved_round})", round=saved_round
            )
            return self._started("saved", int(saved.get("step", 0)))
        return self._started("fresh", 0)

    def _started(self, origin: str, step: int) -> tuple[str, int]:
        # Whatever this peer starts from, it has not diverged from anyone yet.
        self.shared_round = self.opt.age
        return origin, step

    async def catch_up(self, publishers: Collection[PeerId] = frozenset()) -> bool:
        """A peer that missed a round (no group, a late join) holds a state nobody else has;
        it takes the group's instead of drifting apart forever. True if it did. A peer whose
        last round was its own first waits (at most `lone_wait_s`) for the others' states of
        that round: those of ``publishers`` (a grid round's roster, which it carried) if
        given, else of every live peer.

        Averaging pseudo-gradients cannot bring diverged global parameters back together, so a
        peer whose state is not the group's takes the group's state before its outer step (its
        inner steps of this round are dropped)."""
        if self.last_hash is None:
            return False
        known = await self._knows_someone_live()
        adverts = await self.adverts(known_only=known)
        if self.opt.age > self.shared_round:
            adverts = await self._await_adverts_of(self.opt.age, adverts, publishers, known)
        # A client-mode peer's state cannot be downloaded: deciding to take one would fail
        # every round (nor can a creator behind NAT anchor the run's line).
        adverts = [a for a in adverts if not a.client]
        anchor = next((a for a in adverts if a.owner == self.creator), None)
        # Donors come from every advert read: the anchor may be the only holder of its state,
        # which the filter below leaves out of the decision's other rules, not out of the sync.
        donors = adverts
        if not known:
            # The creator's state counts alone (its config is the one this peer runs): a
            # joiner whose first download failed (refused while the run's peers had not yet
            # read that it was allowed) trained alone for a whole run without this.
            adverts = held_by_several(adverts, anchor=self.creator)
        want = state_to_take(
            adverts,
            self.opt.age,
            self.last_hash,
            self.shared_round,
            anchor,
            self.past.keys(),
            i_anchor=self.is_creator and self.proven,
        )
        if want is None:
            return False
        return await self._sync_from_group([a for a in donors if a.state_hash == want])

    async def _knows_someone_live(self) -> bool:
        """Whether a peer this one has met (averaged with, downloaded from) still heartbeats.

        If none does, it stands where a joiner stands, and follows what a joiner would: a
        state several peers hold, or the creator's. Following only the peers it had met, the
        creator's only partner, killed with the creator, trained alone for the rest of a run
        while the two peers that had joined meanwhile averaged together: it had never met
        them, and under load it came late to the one roll call it could have (CI, the
        creator-kill grid test: 17 lone rounds)."""
        if not self.met:
            return False
        live = {str(p) for p in await self.peer.live.addresses()}
        return bool(self.met & live)

    async def _await_adverts_of(
        self,
        age: int,
        adverts: list[StateAdvert],
        publishers: Collection[PeerId] = (),
        known_only: bool = True,
    ) -> list[StateAdvert]:
        """Waits (at most `lone_wait_s`) until every other live peer whose adverts it reads
        (of ``publishers``, if given) advertises a state of `age` or newer; returns the
        adverts then.

        Waiting for every live peer, two peers that came late to a grid round's roll call
        waited for each other, each sitting the round out: both waited all of `lone_wait_s`,
        and the next round's roll call waited for them (10 s stalls at the start of 6-peer
        runs). The roster's members are the ones that publish the round's state.

        A peer whose last round was its own (it came late to a round the others had already
        formed) holds a state of the same age as the group's but its own: in streaming DiLoCo
        a deferred fragment round moves the turn. The others publish their state of that age
        only when their round ends, which with overlap and eager updates is after this peer
        begins its next round. Deciding on the adverts of that moment, it kept its own state
        and matchmade alone under a key nobody else would use, while the others waited for it
        (it is live) until their gather deadline: 10 s stalls, twice, seen in CI. Once their
        adverts are in it takes the group's state and meets the group's next round under the
        group's key. If the whole group failed the round, their adverts show this peer's very
        state and it keeps it."""
        deadline = trio.current_time() + self.timings.lone_wait_s
        among = {str(p) for p in publishers} if publishers else None
        while trio.current_time() < deadline:
            # Waiting for a stranger's advert too (a liar it never averaged with), an honest
            # member whose partner was left out of a part sat out all of `lone_wait_s`, and
            # missed the run's last round (CI, issue 47's weightflip test; test_sim_liars).
            awaited = await self.awaited(among, known_only)
            if awaited <= {a.owner for a in adverts if a.round >= age}:
                break
            await trio.sleep(self.timings.lone_poll_s)
            adverts = await self.adverts(known_only=known_only)
        return adverts


def held_by_several(
    adverts: list[StateAdvert], at_least: int = 2, anchor: str | None = None
) -> list[StateAdvert]:
    """The adverts of states at least ``at_least`` keys hold (or ``anchor``, the run creator,
    holds): what a peer that has met nobody yet may follow. One stranger alone is not a group
    (seen: the liar of a pair, dropped from every round, advertised its wrecked state and the
    honest peer took it on a hash tie-break). A joiner's start uses the run's `state_quorum`."""
    holders: dict[bytes, set[str]] = {}
    for a in adverts:
        holders.setdefault(a.state_hash, set()).add(a.owner)
    return [
        a
        for a in adverts
        if len(holders[a.state_hash]) >= at_least
        or (anchor is not None and anchor in holders[a.state_hash])
    ]
