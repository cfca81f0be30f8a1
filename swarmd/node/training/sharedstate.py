"""The state a group holds in common: published after every round, downloaded by joiners,
taken over by a peer that fell behind.

Any strategy whose peers keep one global state (DiLoCo, streaming DiLoCo; DeMo's parameters and
momentum) uses this component: it serves the state to joiners (the donor), advertises it in the
DHT with its hash and age, saves it atomically to disk, chooses the state to start from, and
catches a peer up when its state is no longer the group's. What the state *is* belongs to the
strategy's optimiser (`SyncedState`); this module never looks inside it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

import torch
import trio

from swarmd.node.statesync.catchup import state_to_take
from swarmd.node.statesync.donor import StateAdvert, advert_key, choose_donors
from swarmd.node.statesync.download import StateSyncError, download_state
from swarmd.node.statesync.snapshot import StateSnapshot
from swarmd.node.training.context import PeerContext
from swarmd.node.training.localstate import STATE_FILE, load_saved, save_state
from swarmd.optim.streaming import state_age

log = logging.getLogger("swarmd.daemon")

#: How long a state advert lives in the DHT without a newer round refreshing it.
ADVERT_TTL_S = 120.0
#: The whole download of a group's state, from every donor together.
SYNC_DEADLINE_S = 120.0
#: How long a peer whose last round was its own waits for the other live peers' adverts of
#: that round before it decides whose state to follow (see `_await_adverts_of`), and how
#: often it looks.
LONE_WAIT_S = 10.0
LONE_POLL_S = 0.2


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


class SharedState:
    """One peer's view of the group's state: its own copy's hash and when it was last shared."""

    def __init__(self, peer: PeerContext, opt: SyncedState) -> None:
        self.peer = peer
        self.opt = opt
        #: Hash of the global state this peer last published (None before its first): the
        #: matchmaking key carries it, so only peers holding the very same state average.
        self.last_hash: bytes | None = None
        #: The state's age when this peer's state was last also others' (averaged in a group,
        #: or downloaded); what it did after that it did alone and does not compare with the
        #: group's.
        self.shared_round = 0

    def snapshot(self) -> StateSnapshot:
        return StateSnapshot.build(
            self.opt.state_dict(), round=self.opt.age, meta={"config": self.peer.config.hash}
        )

    def averaged(self, status: str, group_size: int, dropped: int) -> None:
        """Records an outer step: shared with the group, unless the all-reduce dropped everyone
        else."""
        if status == "averaged" and group_size - dropped > 1:
            self.shared_round = self.opt.age

    async def publish(self, step: int) -> StateSnapshot:
        """Serves the new global state to joiners, advertises it, and saves it to disk."""
        peer = self.peer
        snap = await trio.to_thread.run_sync(self.snapshot)
        self.last_hash = snap.state_hash
        peer.donor.publish(snap)
        await peer.dht.store(
            advert_key(peer.config.name),
            StateAdvert.of(snap, peer.address).to_bytes(),
            peer.dht.now() + ADVERT_TTL_S,
            subkey=str(peer.identity.peer_id),
        )
        state = {
            "config_hash": peer.config.hash,
            "global": self.opt.state_dict(),
            "local": self.opt.local_state_dict(),
            "step": step,
        }
        await trio.to_thread.run_sync(save_state, peer.opts.state_dir / STATE_FILE, state)
        return snap

    async def adverts(self) -> list[StateAdvert]:
        """The other peers' state adverts (malformed ones are skipped)."""
        adverts: list[StateAdvert] = []
        me = str(self.peer.identity.peer_id)
        for peer, value in (await self.peer.dht.get_map(advert_key(self.peer.config.name))).items():
            if peer == me:
                continue
            try:
                adverts.append(StateAdvert.from_bytes(value.value))
            except ValueError:
                continue
        return adverts

    async def _sync_from_group(self, adverts: list[StateAdvert]) -> bool:
        """Downloads the state most donors advertise and loads it; False if that failed."""
        want, donors = choose_donors(adverts)
        try:
            snap = await download_state(
                self.peer.client, donors, deadline_s=SYNC_DEADLINE_S, want_hash=want
            )
        except StateSyncError as exc:
            log.warning("state sync failed (%s); going on with this peer's state", exc)
            return False
        if snap.meta.get("config") != self.peer.config.hash:
            log.warning("donors' state belongs to another config; ignoring it")
            return False
        await trio.to_thread.run_sync(self.opt.load_state_dict, snap.to_state_dict())
        self.shared_round = self.opt.age
        self.peer.out.event(
            "state_synced",
            f"downloaded the group's state (round {snap.round}) from {len(donors)} donor(s)",
            round=snap.round,
        )
        return True

    async def take_initial(self) -> tuple[str, int]:
        """Loads the newest state: the group's, else ours, else the seeded init. Returns where
        it came from and the inner step to resume the data order at."""
        adverts = await self.adverts()
        saved = load_saved(self.peer.opts.state_dir / STATE_FILE, self.peer.config.hash)
        saved_round = state_age(saved["global"]) if saved else -1
        if saved is None and adverts and max(a.round for a in adverts) == 0:
            # Round 0 is the seeded init, which this peer builds itself bit for bit: a run's
            # first peers would otherwise each download the whole state (parameters and
            # momentum, 8 bytes a parameter) for nothing. The hash proves it is the same.
            want, _ = choose_donors(adverts)
            mine = await trio.to_thread.run_sync(self.snapshot)
            if mine.state_hash == want:
                return self._started("fresh", 0)
        if (
            adverts
            and max(a.round for a in adverts) > saved_round
            and await self._sync_from_group(adverts)
        ):
            return self._started("group", int(saved.get("step", 0)) if saved else 0)
        if saved is not None:
            await trio.to_thread.run_sync(self.opt.load_state_dict, saved["global"])
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

    async def catch_up(self) -> bool:
        """A peer that missed a round (no group, a late join) holds a state nobody else has;
        it takes the group's instead of drifting apart forever. True if it did.

        Averaging pseudo-gradients cannot bring diverged global parameters back together, so a
        peer whose state is not the group's takes the group's state before its outer step (its
        inner steps of this round are dropped)."""
        if self.last_hash is None:
            return False
        adverts = await self.adverts()
        if self.opt.age > self.shared_round:
            adverts = await self._await_adverts_of(self.opt.age, adverts)
        want = state_to_take(adverts, self.opt.age, self.last_hash, self.shared_round)
        if want is None:
            return False
        return await self._sync_from_group([a for a in adverts if a.state_hash == want])

    async def _await_adverts_of(self, age: int, adverts: list[StateAdvert]) -> list[StateAdvert]:
        """Waits (at most LONE_WAIT_S) until every other live peer advertises a state of `age`
        or newer; returns the adverts then.

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
        deadline = trio.current_time() + LONE_WAIT_S
        while trio.current_time() < deadline:
            others = await self.peer.live.count() - 1
            if sum(a.round >= age for a in adverts) >= others:
                break
            await trio.sleep(LONE_POLL_S)
            adverts = await self.adverts()
        return adverts
