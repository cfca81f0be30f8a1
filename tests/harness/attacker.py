"""The attacker: a stranger on the run's DHT, built from swarmd's own modules and a throwaway
key. Tests mount attacks with it against real peer processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio

from swarmd.node.dht import open_dht
from swarmd.node.peer.runconfig import CONFIG_TTL_S, RunConfig, config_key
from swarmd.protocol.identity import Identity


def forged_config(name: str, **changes: Any) -> bytes:
    """A run config as JSON, with fields a well-behaved creator would never set."""
    raw = json.loads(RunConfig(name=name).to_json())
    raw.update(changes)
    return json.dumps(raw).encode()


def publish_config(boot: str, key_dir: Path, run: str, raw: bytes) -> None:
    """Stores ``raw`` as run ``run``'s config, signed by the attacker's own key."""
    publish_own(boot, key_dir, config_key(run), raw)


def publish_own(boot: str, key_dir: Path, key: str, raw: bytes) -> None:
    """Stores ``raw`` under ``key`` in the attacker's own sub-key, signed by its own key."""

    async def publish() -> None:
        identity = Identity.load_or_create(key_dir)
        async with open_dht(identity, bootstrap=[boot]) as (node, _server):
            expires = node.now() + CONFIG_TTL_S
            await node.store(key, raw, expires, str(identity.peer_id))

    trio.run(publish)
