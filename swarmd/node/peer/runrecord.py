"""The run config in the DHT: each creator signs it under its own peer id; a joiner reads one.

Every DHT record is signed, but a plain key is last-writer-wins: any stranger could replace
the run's config with one of their own. So the config lives in the key's sub-key map, one
entry per signer, under the signer's own peer id (a node refuses an entry whose sub-key names
another key). A joiner takes the entry of the creator it was told (``--creator``); told none,
it takes the only entry there is, and refuses to guess when several keys claim the run.

What a config may make a joiner do is bounded anyway: it names a model and data, and those
are loaded only if the joiner's own user allowed them (swarmd/workloads/allowed.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from swarmd.node.dht import DHTNode
from swarmd.node.peer.options import JoinError
from swarmd.node.peer.runconfig import CONFIG_TTL_S, RunConfig, config_key
from swarmd.protocol.identity import PeerId


@dataclass(frozen=True)
class Claim:
    """A run config as one key signed it."""

    raw: bytes
    creator: PeerId


async def publish_config(dht: DHTNode, config: RunConfig) -> int:
    """Stores the config under this peer's id; the DHT re-publishes it while the peer runs."""
    return await dht.store(
        config_key(config.name), config.to_json(), dht.now() + CONFIG_TTL_S, str(dht.peer_id)
    )


async def claims(dht: DHTNode, run: str) -> list[Claim]:
    """Every signer's config for the run (empty: no run of that name is known)."""
    entries = await dht.peers(config_key(run), exhaustive=True)
    return [Claim(v.value, owner) for owner, v in sorted(entries.items())]


def choose(found: list[Claim], run: str, creator: PeerId | None) -> Claim | None:
    """The creator's claim (None: not in the DHT yet), or JoinError when it is ambiguous."""
    if creator is not None:
        return next((c for c in found if c.creator == creator), None)
    if len(found) > 1:
        keys = ", ".join(str(c.creator) for c in found)
        raise JoinError(
            f"{len(found)} different keys publish a config for run {run!r} ({keys}); "
            "all but one are impostors: ask the run's creator for their peer id (printed when "
            "they created it) and join with --creator ID"
        )
    return found[0] if found else None
