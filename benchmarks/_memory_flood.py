"""Issue 31's memory flood: tensor calls that declare huge tensors and never send them.

Each of ``concurrent`` connections, from a fresh identity and one of a few source addresses
(127.0.0.2-5, so the bulk listener's per-address cap is not what stops it), signs a put of a
``declared_bytes`` tensor to one of the peers' tensor methods (PutPart, PutTensor), sends
only its header, and then holds the call open: on the bulk plane and over gRPC in turn. A
server that allocates the declared buffer on the header keeps that memory until the call's
deadline; one that checks first answers at once, and the stranger reopens with a new key.

Used by tests/adversarial/test_floods.py and benchmarks/flood.py. Runs in its own process at
the lowest CPU priority (like flood.Slowloris): on a 2-core machine it shares the peers' cores.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from collections.abc import Iterator

import trio

from swarmd.protocol import bulk, rpc
from swarmd.protocol.address import parse_address
from swarmd.protocol.framing import TensorMeta, header_frame
from swarmd.protocol.identity import Identity

#: What each call declares: the issue's 1.5 GiB, within the transport's 2 GiB tensor limit.
DECLARED_BYTES = 3 << 29
#: How long a call is held open when the server does not answer it.
HOLD_S = 20.0
SOURCES = [f"127.0.0.{i}" for i in range(2, 6)]


class MemoryFlood(multiprocessing.Process):
    def __init__(
        self, targets: list[tuple[str, str]], concurrent: int, declared: int = DECLARED_BYTES
    ) -> None:
        """``targets``: (peer address, tensor method path) pairs, taken in turn."""
        super().__init__(daemon=True)
        self.targets, self.concurrent, self.declared = targets, concurrent, declared
        self.halt = multiprocessing.Event()
        self._calls = multiprocessing.Value("i", 0)
        self._answered = multiprocessing.Value("i", 0)

    @property
    def calls(self) -> int:
        """Calls made: each one a fresh identity's huge declaration."""
        return int(self._calls.value)

    @property
    def answered(self) -> int:
        """Calls the server answered (refused) before their deadline."""
        return int(self._answered.value)

    def run(self) -> None:
        os.nice(19)
        trio.run(self._main)

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            for i in range(self.concurrent):
                nursery.start_soon(self._worker, i)
            await trio.to_thread.run_sync(self.halt.wait)
            nursery.cancel_scope.cancel()

    async def _worker(self, i: int) -> None:
        n = i
        while True:
            address, path = self.targets[n % len(self.targets)]
            client = rpc.RpcClient(Identity.generate())
            try:
                over_bulk = (n // len(self.targets)) % 2 == 0
                call = self._bulk_call if over_bulk else self._grpc_call
                answered = await call(client, address, path, SOURCES[i % len(SOURCES)])
            except (OSError, rpc.RpcError):
                answered = True  # refused at connect or hello: also an answer
            finally:
                client.close()
            with self._calls.get_lock():
                self._calls.value += 1
            if answered:
                with self._answered.get_lock():
                    self._answered.value += 1
            n += self.concurrent
            await trio.sleep(0.05)

    def _first(self, path: str) -> bytes:
        return header_frame(TensorMeta("uint8", (self.declared,), name=path))

    async def _bulk_call(self, client: rpc.RpcClient, address: str, path: str, src: str) -> bool:
        hello = await client._hello(address, 5.0)
        assert hello is not None and hello.bulk_port is not None
        first = self._first(path)
        signed, _mac = client._sign_tensor(path, first, hello)
        assert signed is not None
        request = bulk.encode_request(bulk.KIND_PUT, path, signed, first, HOLD_S * 3)
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with sock:
            await sock.bind((src, 0))
            await sock.connect((parse_address(address).host, hello.bulk_port))
            await sock.send(request)
            with trio.move_on_after(HOLD_S):
                await sock.recv(4096)  # an answer (a refusal: it sent no payload), or closed
                return True
        return False

    async def _grpc_call(self, client: rpc.RpcClient, address: str, path: str, src: str) -> bool:
        hello = await client._hello(address, 5.0)
        first = self._first(path)
        signed, _mac = client._sign_tensor(path, first, hello)
        assert signed is not None
        done = time.monotonic() + HOLD_S

        def frames() -> Iterator[bytes]:
            yield first
            while time.monotonic() < done and not self.halt.is_set():
                time.sleep(0.1)  # holds the stream open, sending nothing more

        call = client._channel(address).stream_unary(path)
        future = call.future(frames(), timeout=HOLD_S * 3, metadata=signed.to_metadata())
        start = time.monotonic()
        with trio.move_on_after(HOLD_S + 1):
            while not future.done():
                await trio.sleep(0.05)
        future.cancel()
        return time.monotonic() - start < HOLD_S
