"""DiLoCo vs data-parallel in one process: the optimisation alone, no network, for sweeps.

benchmarks/convergence.py is the benchmark of record: real `swarmd join` processes, real
compression, bytes counted by the transport. This script asks a narrower question, cheaply
enough to sweep: how close can DiLoCo's *optimisation* come to data-parallel training at the
same token budget, whatever the bytes? It runs K replicas of the built-in GPT in lockstep with
swarmd's own `DiLoCo` (inner AdamW, Nesterov outer step), averages their pseudo-gradients in
memory (optionally sent through the int8 or top-k codec with error feedback first), and
compares with one model trained on the K replicas' batches concatenated (what an fp32
all-reduce of gradients computes). Same data, shards, batches and initial weights as
convergence.py at the same seed.

`-H` takes a comma-separated list: the lengths of the first rounds, the last one repeating
(`-H 10,20,50`: rounds of 10, 20, then 50 steps). `--curve N` prints the validation loss on the
first 32 held-out batches every N rounds (steps, for DDP).

Last line: `algo=… seed=… val_loss=… syncs=…`.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import struct
import time
from collections.abc import Callable

import torch

from swarmd.compression.codec import Codec
from swarmd.compression.int8 import Int8Codec, Int8Config
from swarmd.compression.topk import TopKCodec, TopKConfig
from swarmd.compression.wire import DecodeLimits
from swarmd.node.averaging.codecs import result_codec
from swarmd.optim import DiLoCoConfig
from swarmd.optim.diloco import DiLoCo, build_inner_optimizer, train_step
from swarmd.optim.schedule import SCHEDULES, LrSchedule
from swarmd.workloads import GPT, GPTConfig, TokenSource, evaluate, load_source
from swarmd.workloads.data import Batch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--algo", default="diloco", choices=["diloco", "ddp"])
    p.add_argument("--peers", "-K", type=int, default=4)
    p.add_argument("--steps", type=int, default=1000, help="steps per replica")
    p.add_argument("--inner-steps", "-H", default="50", help="round lengths, the last repeats")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW lr (baseline and inner)")
    p.add_argument("--lr-schedule", default="cosine", choices=SCHEDULES)
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of --steps")
    p.add_argument("--outer-lr", type=float, default=0.5)
    p.add_argument("--outer-momentum", type=float, default=0.75)
    p.add_argument(
        "--bits", type=int, default=0,
        help="send each pseudo-gradient through swarmd's int8 codec with error feedback, codes "
        "of this many bits in blocks of 4096 (the daemon's path); 0: exact fp32 mean",
    )  # fmt: skip
    p.add_argument(
        "--topk", type=float, default=0.0,
        help="send each pseudo-gradient as swarmd's top-k codec instead (this density of each "
        "chunk of 4096, --topk-bits bits a value), the mean served back as the daemon's "
        "reducers serve it (every nonzero at 8 bits); 0: not top-k",
    )  # fmt: skip
    p.add_argument("--topk-bits", type=int, default=2, choices=[1, 2, 4, 8])
    p.add_argument(
        "--ef-decay", type=float, default=1.0,
        help="the residual is scaled by this before the next round's pseudo-gradient is added "
        "(SparseLoCo's beta; 1: plain error feedback)",
    )  # fmt: skip
    p.add_argument(
        "--stripe", type=int, default=0,
        help="deal the training split to the shards in stripes of this many tokens (IID-ish "
        "shards) instead of contiguous quarters",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-embd", type=int, default=128, help="model width (the built-in: 128)")
    p.add_argument("--n-layer", type=int, default=4, help="model depth (the built-in: 4)")
    p.add_argument("--curve", type=int, default=0, help="print a curve point every N rounds")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args()
    try:
        a.rounds = [int(x) for x in a.inner_steps.split(",")]
    except ValueError:
        p.error(f"-H must be comma-separated integers, got {a.inner_steps!r}")
    if not a.rounds or min(a.rounds) < 1 or a.steps < 1 or a.peers < 1:
        p.error("-H lengths, --steps and --peers must be positive")
    if not 0 <= a.bits <= 8 or a.bits == 1:
        p.error("--bits must be 0 or in [2, 8]")
    if not 0 <= a.topk <= 1 or (a.topk and a.bits):
        p.error("--topk must be in (0, 1], and not with --bits")
    if not 0 <= a.ef_decay <= 1:
        p.error("--ef-decay must be in [0, 1]")
    if a.warmup_steps is None:
        a.warmup_steps = a.steps // 20
    try:
        lr_schedule(a)
    except ValueError as exc:
        p.error(str(exc))
    return a


class Batches:
    """Replica i's batch at a step: convergence.py's (contiguous shards), or striped shards."""

    def __init__(self, a: argparse.Namespace, source: TokenSource) -> None:
        self.a, self.source = a, source
        self.shards = random.Random(a.seed).sample(range(a.peers), a.peers)

    def __call__(self, i: int, step: int) -> Batch:
        a, shard = self.a, self.shards[i]
        if not a.stripe:
            return self.source.train_batch(shard, a.peers, a.batch_size, a.block_size, a.seed, step)
        mine = torch.arange(shard, self.source.train_tokens.numel() // a.stripe, a.peers)
        key = hashlib.blake2b(struct.pack("<qqq", a.seed, shard, step), digest_size=7).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(key, "big"))
        pick = mine[torch.randint(0, mine.numel(), (a.batch_size,), generator=gen)]
        offsets = torch.randint(0, a.stripe - a.block_size - 1, (a.batch_size,), generator=gen)
        idx = (pick * a.stripe + offsets)[:, None] + torch.arange(a.block_size + 1)[None]
        window = self.source.train_tokens[idx].long()
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


class Link:
    """What the replicas' pseudo-gradients go through before they are averaged: nothing (the
    exact fp32 mean), or the daemon's codec with one error-feedback residual per replica (each
    daemon keeps its own), optionally decayed by `--ef-decay` before each round's
    pseudo-gradient is added (SparseLoCo's e <- beta * e + delta). A top-k mean is re-encoded
    as the daemon's reducers serve it. Counts the bytes of one contribution, for a rough
    per-round figure (the daemon benchmark is the record of bytes)."""

    def __init__(self, a: argparse.Namespace, replicas: int) -> None:
        self.codec: Codec | None = None
        self.served: Codec | None = None
        if a.bits:
            self.codec = Int8Codec(Int8Config(4096, a.bits))
        elif a.topk:
            topk = TopKCodec(TopKConfig(4096, a.topk, a.topk_bits))
            self.codec, self.served = topk, result_codec("topk", topk)
        self.decay = a.ef_decay
        self.residuals: list[torch.Tensor | None] = [None] * replicas
        self.sent_bytes = 0
        self.rounds = 0

    def _through(self, codec: Codec, x: torch.Tensor) -> tuple[int, torch.Tensor]:
        data = codec.encode(x)
        return len(data), codec.decode(data, DecodeLimits.for_tensor(x)).to(torch.float32)

    def mean(self, pgs: list[torch.Tensor]) -> torch.Tensor:
        if self.codec is None:
            return torch.stack(pgs).mean(0)
        sent = []
        for i, pg in enumerate(pgs):
            residual = self.residuals[i]
            x = pg.float() if residual is None else pg.float() + self.decay * residual
            size, decoded = self._through(self.codec, x)
            self.residuals[i] = x - decoded
            self.sent_bytes += size
            sent.append(decoded)
        self.rounds += 1
        mean = torch.stack(sent).mean(0)
        return mean if self.served is None else self._through(self.served, mean)[1]


def lr_schedule(a: argparse.Namespace) -> LrSchedule:
    """convergence.py's: warm-up, then (cosine) down to 10% at the last step."""
    return LrSchedule(a.lr_schedule, a.warmup_steps, a.steps if a.lr_schedule == "cosine" else 0)


def run_ddp(
    a: argparse.Namespace, gpt: GPTConfig, batches: Batches, point: Callable[[int, GPT], None]
) -> GPT:
    model = GPT(gpt, seed=a.seed)
    cfg = DiLoCoConfig(inner_lr=a.lr)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_inner_optimizer(params, cfg)
    schedule = lr_schedule(a)
    for step in range(a.steps):
        xs, ys = zip(*(batches(i, step) for i in range(a.peers)), strict=True)
        schedule.apply(opt, a.lr, step)
        train_step(model, params, opt, cfg.grad_clip, (torch.cat(xs), torch.cat(ys)))
        if a.curve and (step + 1) % a.curve == 0:
            point(step + 1, model)
    return model


def main() -> None:
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    source = load_source("builtin")
    gpt = GPTConfig(n_layer=a.n_layer, n_head=4, n_embd=a.n_embd, block_size=a.block_size)
    batches = Batches(a, source)
    val = source.validation_batches(a.batch_size, a.block_size)
    started = time.monotonic()

    def point(step: int, model: GPT) -> None:
        print(f"step {step}: val(32 batches) {evaluate(model, val[:32]):.4f}", flush=True)

    syncs = 0
    if a.algo == "ddp":
        model = run_ddp(a, gpt, batches, point)
    else:
        schedule = lr_schedule(a)
        cfg = DiLoCoConfig(
            inner_steps=max(a.rounds), inner_lr=a.lr, outer_lr=a.outer_lr,
            outer_momentum=a.outer_momentum, lr_schedule=schedule,
        )  # fmt: skip
        replicas = [DiLoCo(GPT(gpt, seed=a.seed), cfg) for _ in range(a.peers)]
        link = Link(a, len(replicas))
        step = 0
        while step < a.steps:
            h = min(a.rounds[min(syncs, len(a.rounds) - 1)], a.steps - step)
            for _ in range(h):
                for i, rep in enumerate(replicas):
                    # The schedule runs on the run's step (the -H list breaks round x H).
                    schedule.apply(rep.inner_optimizer, a.lr, step)
                    train_step(rep.model, rep._params, rep.inner_optimizer, cfg.grad_clip,
                               batches(i, step))  # fmt: skip
                step += 1
            pgs = [rep.pseudo_gradient() for rep in replicas]
            mean = link.mean(pgs)
            for rep, pg in zip(replicas, pgs, strict=True):
                rep.apply_outer(pg, mean)
            syncs += 1
            if a.curve and syncs % a.curve == 0:
                point(step, replicas[0].model)
        model = replicas[0].model  # every replica holds the same global parameters
    loss = evaluate(model, val)
    print(f"{a.algo} seed {a.seed}: {time.monotonic() - started:.0f} s", flush=True)
    if a.algo == "diloco" and link.rounds:
        kb = link.sent_bytes / link.rounds / a.peers / 1000
        print(f"one contribution: {kb:.1f} KB a round (before zstd)", flush=True)
    print(f"algo={a.algo} seed={a.seed} val_loss={loss:.4f} syncs={syncs}")


if __name__ == "__main__":
    main()
