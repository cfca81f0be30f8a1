"""DeMo vs data-parallel in one process: the optimisation alone, no network, for sweeps.

benchmarks/convergence.py --algos ddp,demo is the benchmark of record (real `swarmd join`
processes, bytes counted by the transport, ~8 min a DeMo run on 2 cores). This script asks
the narrower question cheaply enough to sweep lr and top-k over seeds: how close does DeMo's
*optimisation* come to data-parallel AdamW at the same token budget? K peers share one set of
parameters (a sticky group keeps them identical); each has its own momentum δ and its own data
shard, its updates go through swarmd's wire codec (bf16 values, as on the wire), and every
peer's decoded updates are applied in the same order, as `DeMoStrategy` does. Same model,
data, shards, batches, initial weights and schedule as convergence.py / diloco_inprocess.py
at the same seed, so its DDP row (`diloco_inprocess.py --algo ddp`) is the baseline.

It also prints the bytes a peer would send per step (payload only) and the bytes ratio
against an fp32 gradient all-reduce as convergence.py counts DDP (2·(K−1)/K of the gradient
per step), the all-gather sending each payload to K − 1 members.

Last line: `algo=demo seed=… lr=… topk=… val_loss=… payload_bytes=… bytes_ratio=…`.
"""

from __future__ import annotations

import argparse
import time

import torch
from diloco_inprocess import Batches, lr_schedule

from swarmd.compression.sparse_wire import decode_sparse, encode_sparse
from swarmd.optim.demo import DeMoConfig
from swarmd.optim.demo_state import DeMoRun
from swarmd.workloads import GPT, GPTConfig, evaluate, load_source


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--peers", "-K", type=int, default=4)
    p.add_argument("--steps", type=int, default=1000, help="steps per peer")
    p.add_argument("--lr", type=float, default=5e-4, help="sign-SGD lr (under the schedule)")
    p.add_argument("--lr-schedule", default="cosine", choices=["constant", "cosine"])
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of --steps")
    p.add_argument("--topk", type=int, default=32, help="coefficients sent per block")
    p.add_argument("--chunk", type=int, default=64, help="block side")
    p.add_argument("--decay", type=float, default=0.999, help="momentum decay β")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument(
        "--value-bits", type=int, default=16, choices=[16, 8, 4],
        help="bits a sent value takes: 16 bf16, 8/4 integer codes with a scale per block",
    )  # fmt: skip
    p.add_argument(
        "--grad-clip", type=float, default=1.0,
        help="gradient norm bound before δ (0: none; the daemon clips at 1.0)",
    )  # fmt: skip
    p.add_argument(
        "--clip", type=float, default=2.0,
        help="each peer's coefficients clipped to this x the median norm (0: the paper's mean)",
    )  # fmt: skip
    p.add_argument(
        "--keep-opposed", action="store_true",
        help="keep a peer opposed to most others in the mean (default: left out)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--curve", type=int, default=0, help="print a curve point every N steps")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args()
    if a.steps < 1 or a.peers < 1 or a.topk < 1 or a.chunk < 1:
        p.error("--steps, --peers, --topk and --chunk must be positive")
    if a.warmup_steps is None:
        a.warmup_steps = a.steps // 20
    a.stripe = 0  # Batches: convergence.py's contiguous shards
    try:
        lr_schedule(a)
        demo_config(a)
    except ValueError as exc:
        p.error(str(exc))
    return a


def demo_config(a: argparse.Namespace) -> DeMoConfig:
    return DeMoConfig(
        lr=a.lr, compression_decay=a.decay, compression_topk=a.topk,
        compression_chunk=a.chunk, weight_decay=a.weight_decay, value_bits=a.value_bits,
        clip_to_median=a.clip, drop_opposed=not a.keep_opposed,
    )  # fmt: skip


def main() -> None:
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    source = load_source("builtin")
    gpt = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=a.block_size)
    batches = Batches(a, source)
    val = source.validation_batches(a.batch_size, a.block_size)
    model = GPT(gpt, seed=a.seed)
    # One DeMoRun per peer over the same parameters: each keeps its own δ (prepare touches
    # only δ and the gradients); the group's step is applied once, by the first.
    clip = a.grad_clip or None
    runs = [DeMoRun(model, demo_config(a), lr_schedule(a), clip) for _ in range(a.peers)]
    layout = runs[0].opt.layout()
    started, payload = time.monotonic(), 0
    for step in range(a.steps):
        gathered = []
        for i, run in enumerate(runs):
            run.step = step
            run.gradients(batches(i, step))
            wire = encode_sparse(run.prepare(), run.opt.config.value_dtype)
            payload = len(wire)
            gathered.append(decode_sparse(wire, layout, len(wire)))
        runs[0].apply(gathered)
        if a.curve and (step + 1) % a.curve == 0:
            print(f"step {step + 1}: val(32 batches) {evaluate(model, val[:32]):.4f}", flush=True)
    loss = evaluate(model, val)
    k = a.peers
    ddp_per_step = 2 * (k - 1) / k * 4 * runs[0].numel
    ratio = ddp_per_step / ((k - 1) * payload) if k > 1 else float("nan")
    print(f"demo seed {a.seed} lr {a.lr}: {time.monotonic() - started:.0f} s", flush=True)
    print(
        f"algo=demo seed={a.seed} lr={a.lr} topk={a.topk} value_bits={a.value_bits} "
        f"clip={a.grad_clip} median_clip={a.clip} drop_opposed={not a.keep_opposed} "
        f"val_loss={loss:.4f} "
        f"payload_bytes={payload} bytes_ratio={ratio:.1f}"
    )


if __name__ == "__main__":
    main()
