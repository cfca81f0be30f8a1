"""One data-parallel worker for benchmarks/convergence.py: the baseline DiLoCo is measured against.

Data-parallel training the way a swarm would have to do it without DiLoCo: every step each
worker computes a gradient on its own shard's batch, the group all-reduces it in fp32 through
swarmd's own transport (the same gRPC, the same butterfly all-reduce, the same signed
requests as `swarmd join`), and every worker applies the same AdamW step. The group forms once
through the DHT, like a torch process group, and then keeps its membership.

It prints JSON lines on stdout: `listening`, `group`, `progress`, and `done` with the final
validation loss, a hash of the parameters and the bytes this process put on the wire as its
transport counted them (bodies, signed headers, DHT and matchmaking traffic).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import trio

from swarmd.node.averaging.allreduce import AllReduceConfig, Averager, Group, Member
from swarmd.node.averaging.matchmaking import MatchmakingConfig, form_group
from swarmd.node.averaging.reduction import ReductionConfig
from swarmd.node.dht import DHTNode
from swarmd.node.metrics import Metrics
from swarmd.node.peer.options import NUM_SHARDS
from swarmd.optim import DiLoCoConfig
from swarmd.optim.schedule import SCHEDULES, LrSchedule
from swarmd.protocol import rpc
from swarmd.protocol.identity import Identity
from swarmd.workloads import GPT, GPTConfig, evaluate, load_source, resolve_device
from swarmd.workloads.data import shard_for_peer


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--bootstrap", required=True, help="HOST:PORT of a `swarmd dht` node")
    p.add_argument("--world", type=int, required=True, help="workers in the group")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--n-layer", type=int, required=True)
    p.add_argument("--n-head", type=int, required=True)
    p.add_argument("--n-embd", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard", type=int, help="training shard (default: the peer id's)")
    p.add_argument(
        "--data-shards", type=int, default=NUM_SHARDS, help="shards the training split is cut into"
    )
    p.add_argument("--lr-schedule", default="constant", choices=SCHEDULES)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--decay-steps", type=int, default=0, help="cosine: steps to the lowest lr")
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--save", type=Path, help="write the final parameters here (torch.save)")
    p.add_argument("--device", default="auto", help="where the model trains (swarmd join's)")
    return p.parse_args()


class Trainer:
    """Model, optimiser and data of one worker; everything here runs in a worker thread."""

    def __init__(self, args: argparse.Namespace, shard: int) -> None:
        self.args = args
        self.shard = shard
        gpt = GPTConfig(
            n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
            block_size=args.block_size,
        )  # fmt: skip
        self.device = resolve_device(args.device)
        # The same initial weights on every worker (built on the CPU, whatever the device).
        self.model = GPT(gpt, seed=args.seed).to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        cfg = DiLoCoConfig()  # the very AdamW settings DiLoCo's inner optimiser uses
        self.clip = cfg.grad_clip
        self.opt = torch.optim.AdamW(
            self.params, lr=args.lr, betas=cfg.inner_betas, eps=cfg.inner_eps,
            weight_decay=cfg.inner_weight_decay,
        )  # fmt: skip
        self.source = load_source("builtin")
        # The schedule DiLoCo's inner optimiser follows (over its run's steps: these).
        self.schedule = LrSchedule(args.lr_schedule, args.warmup_steps, args.decay_steps)

    def gradient(self, step: int) -> tuple[torch.Tensor, float]:
        a = self.args
        x, y = self.source.train_batch(
            self.shard, a.data_shards, a.batch_size, a.block_size, a.seed, step
        )
        self.model.train()
        _, loss = self.model(x.to(self.device), y.to(self.device))
        assert loss is not None
        self.opt.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        grads = [p.grad.reshape(-1) for p in self.params if p.grad is not None]
        flat = torch.cat(grads).to(device="cpu", dtype=torch.float32)  # what the wire carries
        return flat, float(loss.detach())

    def apply(self, mean: torch.Tensor, step: int) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            assert p.grad is not None
            p.grad.copy_(mean[offset : offset + n].view_as(p))
            offset += n
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.schedule.apply(self.opt, self.args.lr, step)
        self.opt.step()

    def validate(self) -> float:
        a = self.args
        return evaluate(
            self.model, self.source.validation_batches(a.batch_size, a.block_size, a.eval_batches)
        )

    def param_hash(self) -> str:
        h = hashlib.sha256()
        for p in self.params:
            h.update(p.detach().cpu().numpy().tobytes())
        return h.hexdigest()


async def main(args: argparse.Namespace, state_dir: Path) -> None:
    identity = Identity.load_or_create(state_dir)
    metrics = Metrics()
    transport = rpc.TransportConfig(max_concurrent_rpcs=32)
    client = rpc.RpcClient(identity, transport, metrics)
    dht = DHTNode(identity, client)
    # Data-parallel training is lockstep: a worker slowed by a busy CPU is waited for, not
    # dropped (the daemon's DiLoCo rounds instead drop stragglers after 5 s).
    # Nor are its gradients judged: per-part gradient norms of workers on different shards
    # differ by more than the daemon's 10x-the-median outlier bound early in training (seen:
    # 15.5 against a median of 1.37), and a baseline averages everything it is given.
    lockstep = AllReduceConfig(
        codec="fp32",
        min_deadline_s=120.0,
        unknown_round_wait_s=120.0,
        reduction=ReductionConfig(norm_outlier_factor=math.inf),
    )
    averager = Averager(client, identity.peer_id, lockstep, metrics)
    trainer = await trio.to_thread.run_sync(
        Trainer,
        args,
        shard_for_peer(identity.peer_id.raw, args.data_shards)
        if args.shard is None
        else args.shard,
    )
    try:
        async with (
            rpc.serve(
                [dht.service(), averager.service()], "127.0.0.1", 0,
                config=transport, observer=metrics, identity=identity,
            ) as server,
            trio.open_nursery() as nursery,
        ):  # fmt: skip
            emit("listening", address=str(server.address))
            await nursery.start(dht.run, server.address.port, [args.bootstrap])
            me = Member(identity.peer_id, str(server.address))
            mm = MatchmakingConfig(
                target_group_size=args.world, min_group_size=args.world,
                gather_s=120.0, commit_wait_s=130.0,
            )  # fmt: skip
            group = await form_group(dht, "ddp-baseline/group", me, mm)
            if group is None or len(group.members) != args.world:
                raise SystemExit(f"ddp worker: no group of {args.world} formed")
            emit("group", size=len(group.members))
            start = time.monotonic()
            for step in range(args.steps):
                grad, loss = await trio.to_thread.run_sync(trainer.gradient, step)
                # A fresh round id per step: the same members, and a late message from an
                # earlier step is refused as stale.
                rid = hashlib.sha256(group.round_id + step.to_bytes(8, "big")).digest()
                result = await averager.allreduce(
                    Group(rid, group.members), grad, float(args.batch_size), key="grad",
                    codec="fp32",
                )  # fmt: skip
                if result.dropped or result.failed_parts:
                    raise SystemExit(f"ddp worker: step {step} lost peers; the baseline is void")
                await trio.to_thread.run_sync(trainer.apply, result.tensor, step)
                if (step + 1) % 50 == 0:
                    emit(
                        "progress", step=step + 1, loss=loss, sent_bytes=metrics.sent_total,
                        seconds=round(time.monotonic() - start, 1),
                    )  # fmt: skip
            val = await trio.to_thread.run_sync(trainer.validate)
            if args.save is not None:
                torch.save({k: v.cpu() for k, v in trainer.model.state_dict().items()}, args.save)
            emit(
                "done", val_loss=val, param_hash=trainer.param_hash(),
                sent_bytes=metrics.sent_total, received_bytes=metrics.received_total,
                seconds=round(time.monotonic() - start, 1),
            )  # fmt: skip
            # Linger so the others' last all-gather can still read from this worker.
            await trio.sleep(3.0)
            nursery.cancel_scope.cancel()
    finally:
        client.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    arguments = parse_args()
    with tempfile.TemporaryDirectory(prefix="swarmd-ddp-") as tmp:
        trio.run(main, arguments, Path(tmp))
    # As `swarmd` does (cli.entry): skip interpreter finalisation, where grpcio's threads
    # sometimes abort a process that finished cleanly.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
