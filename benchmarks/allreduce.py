"""Butterfly all-reduce between separate processes on loopback, against a raw-socket bound.

Each of P worker processes holds M million random fp32 values (seeded by its index) and runs
rounds of swarmd's all-reduce (swarmd/node/averaging/allreduce.py) with the others. The group
is formed each round through the DHT (swarmd/node/averaging/matchmaking.py, every worker runs a
DHT node), and that time is reported separately as matchmaking_s, not included in round_s.

bound_s is the bytes-on-wire lower bound: the part bytes that crossed loopback in the last
round (every peer sends (P-1)/P of its vector in each of the two phases, at the codec's size:
counted as sent, so a zstd frame's saving counts) divided by the best throughput of one raw
TCP socket stream carrying random bytes, measured five times before the rounds and five after.
ratio is round_s / bound_s; cpu_s the CPU seconds of one round in all processes together
(median); raw_cpu_s the CPU seconds the same bytes cost over the raw socket stream (both
ends, median of the ten measurements), and cpu_ratio = cpu_s / raw_cpu_s.

Last line: peers=… mparams=… codec=… form=… probes=… round_s=… matchmaking_s=… max_err=…
bound_s=… ratio=… cpu_s=… raw_cpu_s=… cpu_ratio=…
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time

import torch
import trio

from swarmd.node.algorithms.loop import ZSTD_LEVEL
from swarmd.node.averaging.allreduce import AllReduceConfig, Averager, Member
from swarmd.node.averaging.matchmaking import MatchmakingConfig, form_group
from swarmd.node.cli.app import THP_ENV
from swarmd.node.dht import open_dht
from swarmd.node.runkeys import round_key
from swarmd.node.runtime.heap import settle_heap
from swarmd.protocol import rpc
from swarmd.protocol.identity import Identity


def data_for(index: int, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + index)
    return torch.randn(numel, generator=gen)


def true_mean_max_err(result: torch.Tensor, peers: int, numel: int) -> float:
    """Max |result - mean| computed in float64 chunks (weights are all 1)."""
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(peers)]
    err, step = 0.0, 1 << 22
    for start in range(0, numel, step):
        n = min(step, numel - start)
        acc = torch.zeros(n, dtype=torch.float64)
        for g in gens:
            acc += torch.randn(n, generator=g)
        err = max(err, float((result[start : start + n].double() - acc / peers).abs().max()))
    return err


async def worker(
    index: int, numel: int, codec: str, chunk: int, bootstrap: str, probes: int, form: str
) -> None:
    identity = Identity.generate()
    transport = rpc.TransportConfig(chunk_bytes=chunk, max_message_bytes=max(4 << 20, 2 * chunk))
    client = rpc.RpcClient(identity, transport)
    bits, block, zstd = (int(x) for x in form.split("/"))
    config = AllReduceConfig(
        codec=codec,  # type: ignore[arg-type]
        probes=probes,
        int8_bits=bits,
        int8_block_size=block,
        zstd_level=ZSTD_LEVEL if zstd else None,
    )
    sent = _SentBytes()
    averager = Averager(client, identity.peer_id, config, sent)  # type: ignore[arg-type]
    local = data_for(index, numel)
    # The average lands in the same buffer every round, as a trainer that averages every round
    # would keep it: a fresh 400 MB result per round costs the kernel zeroing its pages.
    average = torch.empty_like(local)
    async with open_dht(
        identity,
        bootstrap=[bootstrap] if bootstrap else [],
        transport=transport,
        extra_services=[averager.service()],
    ) as (dht, server):
        me = Member(identity.peer_id, str(server.address))
        print(json.dumps({"address": str(server.address)}), flush=True)
        while line := await trio.to_thread.run_sync(sys.stdin.readline):
            cmd = json.loads(line)
            # Matchmaking: every worker announces itself for this round in the DHT and the
            # group is committed by its leader, exactly as the daemon does.
            config = MatchmakingConfig(
                target_group_size=cmd["peers"], min_group_size=cmd["peers"], gather_s=30.0
            )
            t0 = time.monotonic()
            group = await form_group(dht, round_key("bench", cmd["round"]), me, config)
            matchmaking = time.monotonic() - t0
            assert group is not None and len(group.members) == cmd["peers"]
            t0, cpu0, faults0 = time.monotonic(), time.process_time(), minor_faults()
            sent.nbytes = 0
            result = await averager.allreduce(group, local, 1.0, out=average)
            elapsed, cpu = time.monotonic() - t0, time.process_time() - cpu0
            out = {
                "round_s": elapsed,
                "cpu_s": cpu,
                "faults": minor_faults() - faults0,
                "matchmaking_s": matchmaking,
                "ok": result.ok,
                "sent": sent.nbytes,
                "dropped": len(result.dropped),
            }
            if cmd.get("check"):
                out["max_err"] = await trio.to_thread.run_sync(
                    true_mean_max_err, result.tensor, cmd["peers"], numel
                )
            print(json.dumps(out), flush=True)
    client.close()


class _SentBytes:
    """The Averager's metrics hooks, counting the part bytes this peer sends (a compressed
    round's wire bytes are known only once encoded)."""

    def __init__(self) -> None:
        self.nbytes = 0

    def on_averaging_bytes(self, direction: str, codec: str, nbytes: int) -> None:
        if direction == "sent":
            self.nbytes += nbytes

    def on_round(self, kind: str, duration_s: float, dropped: int) -> None:
        pass


def minor_faults() -> int:
    """Page faults so far (first touches of fresh memory: on this machine's VM, zeroing a
    fresh 400 MB costs ~1 CPU-s, so they show where a round allocates)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def socket_gbps(nbytes: int, tries: int = 5) -> tuple[list[float], list[float]]:
    """One socket stream's throughput on loopback, ``tries`` times, and the CPU seconds per
    GB it cost both ends together (sender and receiver are threads of this process, so
    process time counts both). The payload is random bytes that were written (an untouched
    buffer reads the kernel's shared zero page)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def receive() -> None:
        conn, _ = listener.accept()
        with conn:
            buf = bytearray(1 << 22)
            got = 0
            while got < nbytes:
                n = conn.recv_into(buf)
                if n == 0:
                    break
                got += n
            conn.sendall(b"k")

    payload = memoryview(bytearray(os.urandom(nbytes)))
    rates, cpu_per_gb = [], []
    for _ in range(tries):
        thread = threading.Thread(target=receive)
        cpu0 = time.process_time()
        thread.start()
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(payload)
            conn.recv(1)
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
        thread.join()
        cpu_per_gb.append((time.process_time() - cpu0) / (nbytes / 1e9))
    listener.close()
    return rates, cpu_per_gb


WORKER_CMD = [__file__]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--mparams", type=float, default=100, help="millions of fp32 values")
    parser.add_argument("--codec", choices=["fp32", "fp16", "int8"], default="fp32")
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="rounds to time (the median is reported); the first one or two pay for "
        "first-touch allocations, which a daemon pays once",
    )
    parser.add_argument("--chunk-kib", type=int, default=1024, help="stream frame size")
    parser.add_argument(
        "--probes",
        type=int,
        default=AllReduceConfig.probes,
        help="random probes each reducer's proof is checked on (0: reducers are trusted)",
    )
    parser.add_argument("--bits", type=int, default=8, help="int8 codec: bits per code")
    parser.add_argument("--block", type=int, default=256, help="int8 codec: values per scale")
    parser.add_argument(
        "--zstd",
        action="store_true",
        help="a zstd frame around each part (the run's default codec is --codec int8 "
        "--bits 3 --block 4096 --zstd)",
    )
    parser.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(1)
        i, n, codec, chunk, bootstrap, probes, form = args.worker
        settle_heap()  # as `swarmd` does before its main loop
        trio.run(worker, int(i), int(n), codec, int(chunk), bootstrap, int(probes), form)
        return
    form = f"{args.bits}/{args.block}/{int(args.zstd)}"
    numel = int(args.mparams * 1e6)

    def spawn(i: int, bootstrap: str) -> subprocess.Popen[str]:
        command = [*WORKER_CMD, "--worker", str(i), str(numel), args.codec]
        command += [str(args.chunk_kib << 10), bootstrap, str(args.probes), form]
        return subprocess.Popen(
            [sys.executable, *command],
            # Huge pages for torch's large tensors, as `swarmd` sets for itself (cli.THP_ENV).
            env={**os.environ, THP_ENV: os.environ.get(THP_ENV, "1")},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    # The raw socket is measured before the workers start and after they exit: within one hour
    # on this VM a stream ran at 1.4-3.9 GB/s, slowest right after the workers freed their GBs.
    rates, raw_cpu = socket_gbps(256 << 20)
    first = spawn(0, "")
    first_address = json.loads(first.stdout.readline())["address"]  # type: ignore[union-attr]
    procs = [first] + [spawn(i, first_address) for i in range(1, args.peers)]
    try:
        for p in procs[1:]:
            json.loads(p.stdout.readline())  # type: ignore[union-attr]
        round_times, mm_times, cpu_times, errs = [], [], [], []
        for r in range(args.rounds):
            check = r == args.rounds - 1
            cmd = json.dumps({"round": r, "check": check, "peers": args.peers})
            for p in procs:
                p.stdin.write(cmd + "\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
            outs = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
            if not all(o["ok"] and o["dropped"] == 0 for o in outs):
                print(f"round {r} degraded: {outs}")
            round_times.append(max(o["round_s"] for o in outs))
            mm_times.append(max(o["matchmaking_s"] for o in outs))
            cpu_times.append(sum(o["cpu_s"] for o in outs))
            print(
                f"round {r}: all-reduce {round_times[-1]:.2f} s, matchmaking {mm_times[-1]:.2f} s "
                f"(slowest peer); {cpu_times[-1]:.2f} CPU-s and "
                f"{sum(o['faults'] for o in outs)} page faults in all peers' processes",
                flush=True,
            )
            if check:
                errs = [o["max_err"] for o in outs]
                last_sent = sum(o["sent"] for o in outs)
    finally:
        for p in procs:
            if p.stdin:
                p.stdin.close()
        for i, p in enumerate(procs):
            if p.wait(timeout=60) != 0:
                print(f"worker {i} exited with code {p.returncode} after its rounds")
    # The part bytes every peer sent in the last round: contributions and served parts.
    wire = float(last_sent)
    after, after_cpu = socket_gbps(256 << 20)
    rates, raw_cpu = rates + after, raw_cpu + after_cpu
    gbps = max(rates)  # a bound: the best the machine showed
    bound = wire / (gbps * 1e9)
    # What moving the round's bytes over raw sockets costs in CPU on this machine this hour:
    # the VM's speed swings about 2x between hours, and the round's CPU with it.
    raw_cpu_s = wire / 1e9 * statistics.median(raw_cpu)
    print(
        f"raw socket {gbps:.2f} GB/s (best of {', '.join(f'{r:.2f}' for r in rates)}); "
        f"{wire / 1e9:.3f} GB crossed loopback in the last round, "
        f"{raw_cpu_s:.2f} CPU-s over raw sockets"
    )
    print(f"median CPU seconds per round, all peers together: {statistics.median(cpu_times):.2f}")
    print(
        f"peers={args.peers} mparams={args.mparams:g} codec={args.codec} form={form} "
        f"probes={args.probes} round_s={statistics.median(round_times):.3f} "
        f"matchmaking_s={statistics.median(mm_times):.3f} "
        f"max_err={max(errs):.3g} bound_s={bound:.3f} "
        f"ratio={statistics.median(round_times) / bound:.2f} "
        f"cpu_s={statistics.median(cpu_times):.2f} raw_cpu_s={raw_cpu_s:.2f} "
        f"cpu_ratio={statistics.median(cpu_times) / raw_cpu_s:.2f}"
    )


if __name__ == "__main__":
    main()
