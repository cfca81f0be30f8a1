"""Publishes what a hostile or odd run looks like in the DHT, for the dashboard's tests.

argv[1]: a bootstrap address. Each record is signed by its own key, as a real peer's would be,
and stored for an hour (a config for a day, as a creator stores it); prints {"event":
"published", ...} once all are stored, then stays (its nodes hold the records) until killed.
Runs:
- "empty": a valid config, no peer;
- "twins": two keys each publish a config (an impostor);
- "evil": a config with markup and bad types; three heartbeating peers whose records carry
  markup (kept: it is text), NaN (refused) and a 5000-character name (refused).

argv[2] "strangers" publishes only run "strangers" instead: its creator and two honest peers
at round 5 with one state, and 60 throwaway identities whose heartbeats, progress records
and state adverts claim rounds up to 2^63 - 1 (issue 47, item 6).
"""

from __future__ import annotations

import json
import sys
from contextlib import AsyncExitStack

import trio

from swarmd.node.dht import DHTNode, open_dht
from swarmd.node.dht.records import sign_record
from swarmd.node.dht.values import key_bytes
from swarmd.node.runkeys import CONFIG_TTL_S, advert_key, config_key, peers_key, progress_key
from swarmd.protocol import statesync_pb2
from swarmd.protocol.identity import Identity

XSS = '<img src=x onerror="window.__xss=1">'
SCRIPT = "<script>window.__xss=2</script>"
GOOD_CONFIG = {"name": "empty", "algo": "diloco", "model": "builtin", "n_layer": 2}
EVIL_CONFIG = (
    '{"name": "evil", "algo": ' + json.dumps(XSS) + ', "model": ' + json.dumps(SCRIPT) + ", "
    '"n_layer": NaN, "n_embd": "128", "n_head": true, "version": "' + "v" * 300 + '"}'
).encode()


#: The strangers run: its honest peers' round and state, and how many strangers.
HONEST_ROUND, HONEST_STATE, STRANGERS = 5, bytes(range(32)), 60


def record(name: str, loss: str = "2.5", round_no: int = 1) -> bytes:
    """A progress record as raw JSON text, so NaN can be written as JSON never would."""
    return (
        '{"step": 7, "round": ' + str(round_no) + ', "loss": ' + loss + ', "val_loss": 3.0, '
        '"tokens_per_s": 10.0, '
        '"device": "<b>cpu</b>", "name": ' + json.dumps(name) + ', "sent_bytes": 1, '
        '"received_bytes": 2, "group_size": 3, "last_outer": "averaged", "algo": "diloco", '
        '"params": 1000}'
    ).encode()


async def put(node: DHTNode, key: str, value: bytes) -> None:
    """Stores for an hour; a config for CONFIG_TTL_S, as its creator does (its age is read
    from that)."""
    ttl = CONFIG_TTL_S if key.endswith("/config") else 3600.0
    stored = await node.store(key, value, node.now() + ttl, str(node.peer_id))
    assert stored > 0, f"nobody stored {key}"


async def strangers(boot: str) -> None:
    """One node stores every identity's records, each signed by its own key as that peer
    would sign it (63 nodes of one address ran into the DHT's per-address request rates)."""
    async with open_dht(Identity.generate(), bootstrap=[boot]) as (node, _):
        run = "strangers"
        identities = [Identity.generate() for _ in range(3 + STRANGERS)]
        expires = node.now() + 3600.0
        records = [
            sign_record(
                identities[0], key_bytes(config_key(run)),
                json.dumps({**GOOD_CONFIG, "name": run}).encode(), node.now() + CONFIG_TTL_S,
                key_bytes(str(identities[0].peer_id)),
            )
        ]  # fmt: skip
        for i, identity in enumerate(identities):
            claim = HONEST_ROUND if i < 3 else (1 << 63) - 1 - i
            state = HONEST_STATE if i < 3 else i.to_bytes(32, "big")
            advert = statesync_pb2.StateAdvert(round=claim, state_hash=state)
            for key, value in (
                (peers_key(run), f"127.0.0.1:{1000 + i}".encode()),
                (progress_key(run), record(f"p{i}", round_no=claim)),
                (advert_key(run), advert.SerializeToString()),
            ):
                sub = key_bytes(str(identity.peer_id))
                records.append(sign_record(identity, key_bytes(key), value, expires, sub))
        stored = await node._replicator.replicate(records)
        assert all(n > 0 for n in stored), stored
        honest = [str(p.peer_id) for p in identities[:3]]
        print(json.dumps({"event": "published", "honest": honest}))
        sys.stdout.flush()
        await trio.sleep_forever()


async def main(boot: str) -> None:
    async with AsyncExitStack() as stack:
        nodes = [
            (await stack.enter_async_context(open_dht(Identity.generate(), bootstrap=[boot])))[0]
            for _ in range(6)
        ]
        creator, impostor, markup, nan, long_name, _spare = nodes
        await put(creator, config_key("empty"), json.dumps(GOOD_CONFIG).encode())
        await put(creator, config_key("twins"), json.dumps(GOOD_CONFIG).encode())
        await put(impostor, config_key("twins"), json.dumps(GOOD_CONFIG).encode())
        await put(creator, config_key("evil"), EVIL_CONFIG)
        await put(markup, peers_key("evil"), XSS.encode())
        await put(markup, progress_key("evil"), record(SCRIPT))
        await put(nan, peers_key("evil"), b"127.0.0.1:2")
        await put(nan, progress_key("evil"), record("nan", loss="NaN"))
        await put(long_name, peers_key("evil"), b"127.0.0.1:3")
        await put(long_name, progress_key("evil"), record("A" * 5000))
        ids = {"markup": str(markup.peer_id), "nan": str(nan.peer_id)}
        print(json.dumps({"event": "published", **ids, "long": str(long_name.peer_id)}))
        sys.stdout.flush()
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(strangers if sys.argv[2:] == ["strangers"] else main, sys.argv[1])
