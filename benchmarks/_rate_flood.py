"""Issue 31's request flood: pings as fast as the server answers them, 8 in flight per peer.

Half the workers call as one identity each (the issue's "1,000 pings served in 0.6 s"), half
mint a fresh identity per call (what a per-identity limit alone would not stop). Runs in its
own process at the lowest CPU priority, like flood.Slowloris. Used by benchmarks/flood.py.
"""

from __future__ import annotations

import multiprocessing
import os

import trio

from swarmd.node.peer.service import PING
from swarmd.protocol import rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.identity import Identity


class PingFlood(multiprocessing.Process):
    def __init__(self, addresses: list[str], in_flight: int = 8) -> None:
        super().__init__(daemon=True)
        self.addresses, self.in_flight = addresses, in_flight
        self.halt = multiprocessing.Event()
        self._served = multiprocessing.Value("i", 0)
        self._refused = multiprocessing.Value("i", 0)

    @property
    def served(self) -> int:
        return int(self._served.value)

    @property
    def refused(self) -> int:
        """Calls answered RESOURCE_EXHAUSTED (a rate limit, or no free server slot)."""
        return int(self._refused.value)

    def run(self) -> None:
        os.nice(19)
        trio.run(self._main)

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            for address in self.addresses:
                greedy = rpc.RpcClient(Identity.generate())
                for w in range(self.in_flight):
                    nursery.start_soon(self._worker, address, greedy if w % 2 else None)
            await trio.to_thread.run_sync(self.halt.wait)
            nursery.cancel_scope.cancel()

    async def _worker(self, address: str, client: rpc.RpcClient | None) -> None:
        while True:
            caller = client or rpc.RpcClient(Identity.generate())
            try:
                await caller.unary(address, PING, pb.PingRequest(), pb.PingResponse, timeout=5)
                counter = self._served
            except rpc.RpcError as exc:
                counter = self._refused if exc.code is rpc.StatusCode.RESOURCE_EXHAUSTED else None
            finally:
                if client is None:
                    caller.close()
            if counter is not None:
                with counter.get_lock():
                    counter.value += 1
            await trio.sleep(0)
