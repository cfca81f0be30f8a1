"""Publishes what a hostile or odd run looks like in the DHT, for the dashboard's tests.

argv[1]: a bootstrap address. Each record is signed by its own key, as a real peer's would be,
and stored for an hour (a config for a day, as a creator stores it); prints {"event":
"published", ...} once all are stored, then stays (its nodes hold the records) until killed.
Runs:
- "empty": a valid config, no peer;
- "twins": two keys each publish a config (an impostor);
- "evil": a config with markup and bad types; three heartbeating peers whose records carry
  markup (kept: it is text), NaN (refused) and a 5000-character name (refused).
"""

from __future__ import annotations

import json
import sys
from contextlib import AsyncExitStack

import trio

from swarmd.node.dht import DHTNode, open_dht
from swarmd.node.runkeys import CONFIG_TTL_S, config_key, peers_key, progress_key
from swarmd.protocol.identity import Identity

XSS = '<img src=x onerror="window.__xss=1">'
SCRIPT = "<script>window.__xss=2</script>"
GOOD_CONFIG = {"name": "empty", "algo": "diloco", "model": "builtin", "n_layer": 2}
EVIL_CONFIG = (
    '{"name": "evil", "algo": ' + json.dumps(XSS) + ', "model": ' + json.dumps(SCRIPT) + ", "
    '"n_layer": NaN, "n_embd": "128", "n_head": true, "version": "' + "v" * 300 + '"}'
).encode()


def record(name: str, loss: str = "2.5") -> bytes:
    """A progress record as raw JSON text, so NaN can be written as JSON never would."""
    return (
        '{"step": 7, "round": 1, "loss": ' + loss + ', "val_loss": 3.0, "tokens_per_s": 10.0, '
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
    trio.run(main, sys.argv[1])
