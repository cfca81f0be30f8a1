"""A state-sync donor process for tests: serves a deterministic snapshot built from a seed.

Usage: python statesync_donor.py [--seed N] [--round R] [--mb M] [--chunk-kib K]
           [--chunk-delay S] [--corrupt-chunk I ...] [--max-concurrent C] [--also "OPTIONS" ...]
(--corrupt-chunk -1 corrupts every chunk; each --also serves one more donor from this process.)
Prints one JSON line {"address", "state_hash", "round", "n_chunks", "pid", "donors": [...]} once
listening (the first donor's fields, then every donor's); serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal

import torch
import trio

from swarmd.node.statesync.download import DonorConfig, StateDonor, StateSnapshot
from swarmd.protocol import rpc


def make_state(seed: int, mb: float) -> dict[str, torch.Tensor]:
    """Parameters and outer-optimizer buffers of a made-up model, identical for equal seeds."""
    gen = torch.Generator().manual_seed(seed)
    n = int(mb * 1e6) // 4 // 3
    return {
        "embed.weight": torch.randn(n, generator=gen),
        "block.0.weight": torch.randn(n // 2, 2, generator=gen).to(torch.bfloat16),
        "block.0.bias": torch.randn(7, generator=gen).to(torch.float16),
        "outer.momentum.embed.weight": torch.randn(n, generator=gen),
        "outer.step": torch.tensor(seed, dtype=torch.int64),
        "empty": torch.empty(0, 3),
    }


class FaultyDonor(StateDonor):
    def __init__(self, config: DonorConfig, delay: float, corrupt: set[int]) -> None:
        super().__init__(config)
        self.delay = delay
        self.corrupt = corrupt

    async def chunk_payload(self, snapshot: StateSnapshot, index: int) -> memoryview:
        if self.delay:
            await trio.sleep(self.delay)
        view = await super().chunk_payload(snapshot, index)
        if index in self.corrupt or -1 in self.corrupt:
            bad = bytearray(view)
            bad[len(bad) // 2] ^= 0xFF
            return memoryview(bad)
        return view


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--round", type=int, default=1)
    p.add_argument("--mb", type=float, default=32.0)
    p.add_argument("--chunk-kib", type=int, default=1024)
    p.add_argument("--chunk-delay", type=float, default=0.0)
    p.add_argument("--corrupt-chunk", type=int, action="append", default=[])
    p.add_argument("--max-concurrent", type=int, default=4)
    p.add_argument(
        "--also",
        action="append",
        default=[],
        help="options of another donor served by this process on its own port",
    )
    return p


async def serve_donor(
    args: argparse.Namespace, *, task_status: trio.TaskStatus[dict[str, object]]
) -> None:
    snapshot = StateSnapshot.build(
        make_state(args.seed, args.mb),
        round=args.round,
        meta={"config": "test"},
        chunk_bytes=args.chunk_kib * 1024,
    )
    config = DonorConfig(max_concurrent_chunks=args.max_concurrent)
    donor = FaultyDonor(config, args.chunk_delay, set(args.corrupt_chunk))
    donor.publish(snapshot)
    async with rpc.serve([donor.service()], "127.0.0.1", 0) as server:
        task_status.started(
            {
                "address": str(server.address),
                "state_hash": snapshot.state_hash.hex(),
                "round": snapshot.round,
                "n_chunks": snapshot.n_chunks,
            }
        )
        await trio.sleep_forever()


async def main(args: argparse.Namespace) -> None:
    """Serves the donor of ``args`` and those of ``--also``; they share the process, not ports
    (starting a process costs seconds of importing torch, a tight budget on 2 cores)."""
    async with trio.open_nursery() as nursery:
        donors = [await nursery.start(serve_donor, args)]
        for extra in args.also:
            donors.append(await nursery.start(serve_donor, parser().parse_args(shlex.split(extra))))
        print(json.dumps({**donors[0], "pid": os.getpid(), "donors": donors}), flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main, parser().parse_args())
