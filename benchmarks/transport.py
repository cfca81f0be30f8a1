"""Tensor throughput of swarmd's transport (rpc.py) against a raw TCP socket, two processes.

Both sides do the same useful work: the sender streams a 256 MiB float32 tensor from its memory,
the receiver ends with the whole tensor in one buffer of its own. The swarmd path adds framing,
a signed request header, gRPC/HTTP2 and the hop into the receiver's trio loop.

Last line: transport_GBps=... socket_GBps=... ratio=...
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time

import torch
import trio

from swarmd.protocol import rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.framing import TensorMeta
from swarmd.protocol.identity import Identity
from swarmd.protocol.tensors import tensor_meta, tensor_payload

SERVICE = "swarmd.bench.Transport"
SINK = rpc.method_path(SERVICE, "Sink")


async def serve_rpc() -> None:
    async def sink(meta: TensorMeta, data: bytearray, ctx: rpc.CallContext) -> pb.TensorAck:
        return pb.TensorAck(received_bytes=len(data))

    service = rpc.Service(SERVICE, [rpc.tensor_in("Sink", sink)])
    config = rpc.TransportConfig(max_message_bytes=32 << 20)  # accepts any --chunk-kib we use
    async with rpc.serve([service], "127.0.0.1", 0, config=config) as server:
        print(json.dumps({"address": str(server.address)}), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)  # until the parent closes our stdin


def serve_socket(nbytes: int, rounds: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(json.dumps({"address": f"127.0.0.1:{listener.getsockname()[1]}"}), flush=True)
    for _ in range(rounds):
        conn, _ = listener.accept()
        with conn:
            buf = bytearray(nbytes)  # the receiver's tensor, like the assembler's buffer
            view, got = memoryview(buf), 0
            while got < nbytes:
                n = conn.recv_into(view[got:], min(nbytes - got, 1 << 22))
                if n == 0:
                    raise SystemExit("sender went away")
                got += n
            conn.sendall(b"k")


def start(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())["address"]


def bench_rpc(tensor: torch.Tensor, rounds: int, config: rpc.TransportConfig) -> list[float]:
    proc, address = start(["--serve-rpc"])
    meta, payload = tensor_meta(tensor), tensor_payload(tensor)

    async def main() -> list[float]:
        client = rpc.RpcClient(Identity.generate(), config)
        rates = []
        try:
            for _ in range(rounds):
                start_t = time.perf_counter()
                ack = await client.put_tensor(
                    address, SINK, meta, payload, pb.TensorAck, timeout=120
                )
                rates.append(meta.nbytes / (time.perf_counter() - start_t) / 1e9)
                assert ack.received_bytes == meta.nbytes
        finally:
            client.close()
        return rates

    try:
        return trio.run(main)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)


def bench_socket(tensor: torch.Tensor, rounds: int) -> list[float]:
    payload = tensor_payload(tensor)
    proc, address = start(["--serve-socket", str(payload.nbytes), str(rounds)])
    host, port = address.rsplit(":", 1)
    rates = []
    try:
        for _ in range(rounds):
            start_t = time.perf_counter()
            with socket.create_connection((host, int(port))) as conn:
                conn.sendall(payload)
                if conn.recv(1) != b"k":
                    raise SystemExit("receiver failed")
            rates.append(payload.nbytes / (time.perf_counter() - start_t) / 1e9)
    finally:
        proc.wait(timeout=30)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="tensor size in MiB (default 256)")
    parser.add_argument("--rounds", type=int, default=5, help="transfers per method (default 5)")
    parser.add_argument(
        "--chunk-kib", type=int, default=1024, help="bytes per stream frame (default 1024 KiB)"
    )
    parser.add_argument("--serve-rpc", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-socket", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_rpc:
        trio.run(serve_rpc)
        return
    if args.serve_socket:
        serve_socket(*args.serve_socket)
        return
    chunk = args.chunk_kib << 10
    config = rpc.TransportConfig(chunk_bytes=chunk, max_message_bytes=max(4 << 20, 2 * chunk))
    tensor = torch.randn(args.mib * (1 << 20) // 4)
    # Interleave so that machine noise hits both methods alike; report medians.
    rpc_rates: list[float] = []
    sock_rates: list[float] = []
    for _ in range(args.rounds):
        sock_rates += bench_socket(tensor, 1)
        rpc_rates += bench_rpc(tensor, 1, config)
    print(
        f"tensor: {args.mib} MiB float32, {args.rounds} transfers each, loopback, 2 processes, "
        f"{args.chunk_kib} KiB frames"
    )
    print("swarmd rpc GB/s:", " ".join(f"{r:.2f}" for r in rpc_rates))
    print("raw socket GB/s:", " ".join(f"{r:.2f}" for r in sock_rates))
    t, s = statistics.median(rpc_rates), statistics.median(sock_rates)
    print(f"transport_GBps={t:.3f} socket_GBps={s:.3f} ratio={t / s:.3f}")


if __name__ == "__main__":
    main()
