"""Who may take part in a run: `open`, `secret` or `allowlist` (RunConfig.access).

Every DHT record and request is signed, so a peer always knows *who* calls; this module decides
whether that key belongs to the run. Three places enforce it:

* **The run's services** (all-reduce, DeMo gather, state donor, SWARM stages) are gated
  (`RunAccess.gate`, called by the transport once the caller is authenticated, before the
  method sees a byte): an outsider gets PERMISSION_DENIED.
* **Reads of the run's DHT keys** (matchmaking announcements, heartbeats, state adverts, the
  stage directory, progress) drop outsiders' entries (`DHTNode.owner_filter`), so an outsider
  never enters a group, is never asked for a state, is never routed a micro-batch.
* **The joiner** checks itself before it trains: a secret run needs the secret, an allowlisted
  run the creator's `swarmd run allow`, and says so instead of training alone.

`secret`: peers prove knowledge of a shared secret without sending it. A request carries
HMAC(k, signature) (SignedHeader.access), k derived from the run name and the secret: the
signature covers method, time, nonce, recipient and body, so the tag is good for that one
request, and a copied tag is a replay the nonce guard refuses. A peer's DHT entries are admitted
once it published its member token HMAC(k, peer id) under ``members_key``: only holders of
the secret can make one, and it is bound to the signer, so copying it is useless.

`allowlist`: the creator signs the list of admitted keys under ``access_key`` (its own sub-key:
nobody else can write it; other signers' entries are never read). `swarmd run allow|deny`
rewrites it. In every mode the list's `deny` entries are the run-wide bans the issue asks the
creator to be able to publish: a denied key is refused like an outsider. The creator is always
admitted.

Psyche's allowlists are ed25519 keys in on-chain state; hivemind has no access control beyond
a shared DHT prefix. We need neither a chain nor a coordinator: the creator's key is the root.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from swarmd.node.dht import DHTNode, Value
from swarmd.node.runkeys import CONFIG_TTL_S, access_key, config_key, members_key, run_prefixes
from swarmd.protocol import rpc
from swarmd.protocol.identity import PeerId

log = logging.getLogger("swarmd.access")

AccessMode = Literal["open", "secret", "allowlist"]
ACCESS_MODES: tuple[AccessMode, ...] = ("open", "secret", "allowlist")
#: The most keys an access list holds (allowed and denied together): ~45 bytes each in
#: JSON keeps the record well under the DHT's 1 MiB value bound.
MAX_LISTED = 10_000
#: Shortest secret accepted: a short one is guessed offline from any tag on the wire.
MIN_SECRET_BYTES = 16


class AccessError(ValueError):
    """A malformed access list or secret."""


@dataclass(frozen=True)
class AccessList:
    """The creator's signed record: keys admitted (allowlist runs) and keys banned (all)."""

    allow: frozenset[PeerId] = frozenset()
    deny: frozenset[PeerId] = frozenset()
    #: Milliseconds since the epoch at signing: a replica's older copy never replaces it.
    version: int = 0

    def __post_init__(self) -> None:
        if len(self.allow) + len(self.deny) > MAX_LISTED:
            raise AccessError(f"an access list holds at most {MAX_LISTED} keys")
        if self.allow & self.deny:
            raise AccessError("a key cannot be both allowed and denied")

    def to_bytes(self) -> bytes:
        doc = {
            "allow": sorted(str(p) for p in self.allow),
            "deny": sorted(str(p) for p in self.deny),
            "version": self.version,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> AccessList:
        try:
            doc = json.loads(raw)
            version = doc["version"]
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise AccessError("version must be a non-negative integer")
            return cls(_keys(doc["allow"]), _keys(doc["deny"]), version)
        except AccessError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise AccessError(f"malformed access list: {exc}") from None

    def allowing(self, peer: PeerId, now_ms: int) -> AccessList:
        return AccessList(self.allow | {peer}, self.deny - {peer}, max(now_ms, self.version + 1))

    def denying(self, peer: PeerId, now_ms: int) -> AccessList:
        return AccessList(self.allow - {peer}, self.deny | {peer}, max(now_ms, self.version + 1))


def _keys(items: object) -> frozenset[PeerId]:
    if not isinstance(items, list) or len(items) > MAX_LISTED:
        raise AccessError("allow and deny must be lists of peer ids")
    return frozenset(PeerId.from_string(str(x)) for x in items)


def derive_key(run: str, secret: bytes) -> bytes:
    """The run's HMAC key: the secret bound to the run's name, so one secret reused for two
    runs gives tags that do not carry over."""
    if len(secret) < MIN_SECRET_BYTES:
        raise AccessError(
            f"a run secret must be at least {MIN_SECRET_BYTES} bytes (got {len(secret)}); "
            "make one with `swarmd run secret`"
        )
    return hashlib.sha256(b"swarmd/access/v1\0" + run.encode() + b"\0" + secret).digest()


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


@dataclass
class RunAccess:
    """One peer's view of a run's access rules; `refresh` keeps it current from the DHT."""

    run: str
    mode: AccessMode
    creator: PeerId
    me: PeerId
    secret: bytes | None = None
    listed: AccessList = field(default_factory=AccessList)
    #: Secret runs: peers whose member token verified.
    members: set[PeerId] = field(default_factory=set)
    #: Method paths of the run's services: only these carry (and are checked for) a tag.
    paths: frozenset[str] = frozenset()
    #: Set when a key this peer does not know was refused or filtered: it may have been
    #: admitted since the last read, so the keeper re-reads soon (Peer._keep_access).
    missed: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ACCESS_MODES:
            raise AccessError(f"access must be one of {', '.join(ACCESS_MODES)}")
        if self.mode == "secret" and self.secret is None:
            raise AccessError(f"run {self.run!r} is secret: give its secret (--secret-file)")
        self._key = derive_key(self.run, self.secret) if self.secret is not None else b""
        self._run_keys = tuple(prefix.encode() for prefix in run_prefixes(self.run))
        self._open_keys = {
            k.encode() for k in (config_key(self.run), access_key(self.run), members_key(self.run))
        }

    # -- who is in -------------------------------------------------------------------------

    def admits(self, peer: PeerId) -> bool:
        """Whether ``peer`` takes part in this run, as far as this peer knows now."""
        if peer == self.creator:
            return True
        if peer in self.listed.deny:
            return False
        if peer == self.me or self.mode == "open":
            return True
        known = peer in (self.listed.allow if self.mode == "allowlist" else self.members)
        self.missed |= not known
        return known

    def listed_in(self) -> bool:
        """Whether the creator's list admits this peer itself (``admits`` always trusts its
        own entries, so that a peer never filters out its own records)."""
        if self.me == self.creator:
            return True
        if self.me in self.listed.deny:
            return False
        return self.mode != "allowlist" or self.me in self.listed.allow

    def member_token(self, peer: PeerId) -> bytes:
        return _mac(self._key, b"member", peer.raw)

    def request_tag(self, path: str, signature: bytes) -> bytes:
        """What this peer sends with a request to ``path`` (RpcClient.access_tag)."""
        if self.mode != "secret" or path not in self.paths:
            return b""
        return _mac(self._key, b"request", signature)

    def gate(self, ctx: rpc.CallContext) -> None:
        """The transport's check of every call to the run's services (rpc.Service.gate)."""
        peer = ctx.peer_id
        if peer is None:
            raise rpc.RpcError(rpc.StatusCode.PERMISSION_DENIED, "run calls must be signed")
        if peer in self.listed.deny and peer != self.creator:
            raise rpc.RpcError(
                rpc.StatusCode.PERMISSION_DENIED, f"{peer.short()} is banned from this run"
            )
        if self.mode == "allowlist" and not self.admits(peer):
            raise rpc.RpcError(
                rpc.StatusCode.PERMISSION_DENIED,
                f"{peer.short()} is not on run {self.run!r}'s allowlist",
            )
        if self.mode == "secret":
            want = _mac(self._key, b"request", ctx.signature)
            if not hmac.compare_digest(want, ctx.access):
                raise rpc.RpcError(
                    rpc.StatusCode.PERMISSION_DENIED,
                    f"no valid access tag for secret run {self.run!r}",
                )

    def dht_filter(self, key: bytes, owner: PeerId) -> bool:
        """DHTNode.owner_filter: entries of the run's keys only from admitted signers."""
        if key in self._open_keys or not key.startswith(self._run_keys):
            return True
        return self.admits(owner)

    # -- keeping current -------------------------------------------------------------------

    def take_list(self, entries: dict[str, Value]) -> None:
        """The creator's entry of the access key, if newer than the one held."""
        value = entries.get(str(self.creator))
        if value is None or value.owner != self.creator or not value.value:
            return
        try:
            found = AccessList.from_bytes(value.value)
        except AccessError as exc:
            log.warning("ignoring the creator's malformed access list: %s", exc)
            return
        if found.version > self.listed.version:
            self.listed = found

    def take_members(self, entries: Iterable[tuple[str, Value]]) -> None:
        if self.mode != "secret":
            return
        for subkey, value in entries:
            if subkey == str(value.owner) and hmac.compare_digest(
                value.value, self.member_token(value.owner)
            ):
                self.members.add(value.owner)

    def creator_token_mismatch(self, entries: dict[str, Value]) -> bool:
        """True when the creator's member token is there and does not verify: this peer's
        secret is not the run's."""
        value = entries.get(str(self.creator))
        return (
            self.mode == "secret"
            and value is not None
            and value.owner == self.creator
            and not hmac.compare_digest(value.value, self.member_token(self.creator))
        )

    async def publish_token(self, dht: DHTNode) -> None:
        if self.mode == "secret":
            await dht.store(
                members_key(self.run),
                self.member_token(self.me),
                dht.now() + CONFIG_TTL_S,
                str(self.me),
            )

    async def refresh(self, dht: DHTNode) -> dict[str, Value]:
        """Reads the creator's list and (secret runs) the member tokens; returns the tokens."""
        self.take_list(await dht.get_map(access_key(self.run), exhaustive=True))
        tokens: dict[str, Value] = {}
        if self.mode == "secret":
            tokens = await dht.get_map(members_key(self.run))
            self.take_members(tokens.items())
        return tokens


async def publish_list(dht: DHTNode, run: str, listed: AccessList) -> int:
    """Stores the creator's access list under its own sub-key (only the creator calls this)."""
    return await dht.store(
        access_key(run), listed.to_bytes(), dht.now() + CONFIG_TTL_S, str(dht.peer_id)
    )
