"""A real peer process for sticky-group all-gather tests (algorithms/demo/gather.py).

argv[1] is JSON: {"index", "hash" (optional: the state hash it sends, default "same")}.
Prints {"address", "peer_id", "pid"} once serving. Then, for a line
{"group": name, "members": [[peer_id, address, client?], ...], "steps": n, "payload_bytes": b},
starts that group and gathers n steps, printing for each
{"step", "senders": {peer_id: payload digest}, "late", "dropped", "agree", "seconds"}.
Every payload is derived from (sender index, step), so the test can check each one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from typing import Any

import trio

from swarmd.node.algorithms.demo.gather import GatherConfig, Gatherer
from swarmd.node.averaging.group import Group, Member
from swarmd.protocol import rpc
from swarmd.protocol.identity import Identity, PeerId


def payload(index: int, step: int, nbytes: int) -> bytes:
    seed = hashlib.sha256(f"{index}/{step}".encode()).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


async def main(cfg: dict[str, Any]) -> None:
    identity = Identity.generate()
    client = rpc.RpcClient(identity)
    gatherer = Gatherer(
        client, identity.peer_id, GatherConfig(min_deadline_s=1.0, max_deadline_s=8.0)
    )
    state_hash = hashlib.sha256(cfg.get("hash", "same").encode()).digest()
    async with (
        rpc.serve([gatherer.service()], "127.0.0.1", 0, identity=identity) as server,
        trio.open_nursery() as nursery,
    ):
        print(
            json.dumps(
                {
                    "address": str(server.address),
                    "peer_id": str(identity.peer_id),
                    "pid": os.getpid(),
                }
            ),
            flush=True,
        )
        while line := await trio.to_thread.run_sync(sys.stdin.readline):
            cmd = json.loads(line)
            # [peer_id, address] or [peer_id, address, client]: a client-mode member.
            members = tuple(
                Member(PeerId.from_string(m[0]), m[1], client=len(m) > 2 and bool(m[2]))
                for m in cmd["members"]
            )
            group = Group(hashlib.sha256(cmd["group"].encode()).digest(), members)
            gatherer.start(group, 0, nursery)
            for step in range(cmd["steps"]):
                own = payload(cfg["index"], step, cmd["payload_bytes"])
                result = await gatherer.gather(own, state_hash)
                out = {
                    "step": result.step,
                    "senders": {str(p): digest(d) for p, d in result.payloads.items()},
                    "late": [str(p) for p in result.late],
                    "dropped": [str(p) for p in result.dropped],
                    "agree": result.agree(identity.peer_id),
                    "seconds": result.seconds,
                }
                print(json.dumps(out), flush=True)
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    trio.run(main, json.loads(sys.argv[1]))
