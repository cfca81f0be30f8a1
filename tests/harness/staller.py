"""Identities that heartbeat in a run and never join a group (issue 46's staller attack):
``staller.py BOOT RUN COUNT KEY_DIR``. Each is its own DHT node with its own key, announcing
itself under the run's peers key as a live peer does, and doing nothing else. Prints one
JSON line once every heartbeat is stored, then runs until killed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import trio

from swarmd.node.dht import open_dht
from swarmd.node.peer.membership import MembershipTimings
from swarmd.node.runkeys import peers_key
from swarmd.protocol.identity import Identity


async def _stall(boot: str, run: str, key_dir: Path, task_status: trio.TaskStatus[None]) -> None:
    identity = Identity.load_or_create(key_dir)
    async with open_dht(identity, bootstrap=[boot]) as (node, server):
        address = f"127.0.0.1:{server.address.port}".encode()
        async with node.announce(peers_key(run), address, ttl=MembershipTimings().heartbeat_ttl_s):
            task_status.started()
            await trio.sleep_forever()


async def main(boot: str, run: str, count: int, key_dir: Path) -> None:
    async with trio.open_nursery() as nursery:
        for k in range(count):
            await nursery.start(_stall, boot, run, key_dir / str(k))
        print(json.dumps({"stallers": count}), flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
