"""hivemind's all-reduce on the data `benchmarks/allreduce.py` averages: the peer's figure
for issue 48, measured on the same machine in the same hour.

Runs in its own environment (hivemind pins its own protobuf and ships its own libp2p daemon,
so it does not go into swarmd's):

    python3 -m venv /tmp/hm && /tmp/hm/bin/pip install hivemind==1.1.12 torch
    /tmp/hm/bin/python benchmarks/hivemind_allreduce.py --peers 4 --mparams 100 --codec fp32

Each of --peers processes starts a hivemind DHT (the first is the others' initial peer) and a
DecentralizedAverager over one float32 tensor of --mparams million values (each peer's own,
seeded as allreduce.py's), in one group of all (target and min group size = peers). A round is
one `step()` on every peer, started together behind a barrier; its time is the slowest peer's.
--codec fp32 sends the values as they are (NoCompression), fp16 as float16 (hivemind's
Float16Compression), uniform8 as hivemind's 8-bit Uniform8BitQuantization (256 levels over
the whole tensor's range, not per block as swarmd's int8: its error on these values is far
larger; hivemind's blockwise 8-bit codec needs bitsandbytes).

Last line: peers=… mparams=… codec=… rounds=… round_s=… (the median round) max_err=…
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any


def _compression(codec: str) -> Any:
    from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization

    return {
        "fp32": NoCompression(),
        "fp16": Float16Compression(),
        "uniform8": Uniform8BitQuantization(),
    }[codec]


def _peer(
    rank: int,
    args: argparse.Namespace,
    maddrs: Any,
    barrier: Any,
    out: Any,
) -> None:
    import hivemind
    import torch

    initial = [] if rank == 0 else maddrs.get()
    dht = hivemind.DHT(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    if rank == 0:
        for _ in range(args.peers - 1):
            maddrs.put([str(a) for a in dht.get_visible_maddrs()])
    gen = torch.Generator().manual_seed(1000 + rank)
    values = torch.randn(args.mparams * 1_000_000, generator=gen)
    averager = hivemind.averaging.DecentralizedAverager(
        averaged_tensors=[values.clone()],
        dht=dht,
        prefix="bench",
        target_group_size=args.peers,
        min_group_size=args.peers,
        compression=_compression(args.codec),
        start=True,
    )
    times = []
    for _ in range(args.rounds):
        with averager.get_tensors() as tensors:
            tensors[0].copy_(values)
        barrier.wait()
        t0 = time.perf_counter()
        got = averager.step(timeout=args.timeout)
        times.append(time.perf_counter() - t0 if got is not None else float("nan"))
    with averager.get_tensors() as tensors:
        checksum = tensors[0][:1000].clone()
    out.put((rank, times, checksum, values[:1000].clone()))
    barrier.wait()
    averager.shutdown()
    dht.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--mparams", type=int, default=100)
    parser.add_argument("--codec", choices=("fp32", "fp16", "uniform8"), default="fp32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    # Forked before torch or hivemind is imported here: hivemind's averager starts a process
    # of its own, which a spawned child would have to pickle (and cannot).
    ctx = mp.get_context("fork")
    maddrs, out = ctx.Queue(), ctx.Queue()
    # A peer that fails breaks the barrier for the others (after the timeout), not hangs them.
    barrier = ctx.Barrier(args.peers, timeout=args.timeout)
    procs = [
        ctx.Process(target=_peer, args=(r, args, maddrs, barrier, out)) for r in range(args.peers)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=args.timeout * (args.rounds + 1)) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    import torch

    rounds = [max(r[1][i] for r in results) for i in range(args.rounds)]
    for i, s in enumerate(rounds):
        print(f"round {i}: {s:.3f} s", flush=True)
    # The exact mean of the peers' values (the first 1,000 of them), against each peer's.
    exact = torch.stack([r[3] for r in results]).mean(0)
    err = max(float((r[2] - exact).abs().max()) for r in results)
    # The first round pays connection set-up: the median of the rest.
    steady = rounds[1:] or rounds
    print(
        f"peers={args.peers} mparams={args.mparams} codec={args.codec} rounds={args.rounds} "
        f"round_s={statistics.median(steady):.3f} max_err={err:.3g}"
    )


if __name__ == "__main__":
    main()
