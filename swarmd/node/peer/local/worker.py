"""A local rank other than 0: `python -m swarmd.node.peer.local.worker SPEC` (started by rank 0).

It builds the run's model on its own device, joins the local process group and then only
follows rank 0's commands (protocol.py): it opens no socket to another machine and writes
nothing to disk, so killing it can never leave anything half-written. It exits when rank 0
says stop, when a collective fails (rank 0 gone), or when its parent process is gone.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FileStore

from swarmd.node.peer.local.module import training_module
from swarmd.node.peer.local.protocol import (
    Op,
    WorkerSpec,
    batch_index,
    broadcast_params,
    gather_digests,
    receive_command,
)
from swarmd.node.peer.model import build_model
from swarmd.node.peer.runconfig import RunConfig
from swarmd.optim.diloco import DiLoCoConfig, build_inner_optimizer, trainable
from swarmd.optim.diloco import train_step as optimizer_step
from swarmd.optim.statedicts import load_inner_state
from swarmd.workloads import load_source

#: Exit code of a rank whose parent (rank 0, the peer) is gone.
EXIT_ORPHANED = 3


def _exit_with_parent(parent: int) -> None:
    """A rank outlives nothing: when rank 0 dies (SIGKILL leaves no time to stop us) the
    collective we wait in may not fail for the whole timeout (NCCL), so watch the parent."""
    while True:
        if os.getppid() != parent:
            os._exit(EXIT_ORPHANED)
        time.sleep(0.5)


def inner_config(config: RunConfig) -> DiLoCoConfig:
    """The inner optimiser's settings for the run's algorithm (the DiLoCo family's)."""
    if config.algo == "streaming-diloco":
        return config.streaming_config().diloco
    return config.diloco_config()


def run_worker(spec: WorkerSpec, rank: int, world: int, store_path: str) -> int:
    torch.set_num_threads(1)
    config = RunConfig.from_json(spec.run_config.encode())
    local = spec.local
    if local.workers != world:
        raise ValueError(f"WORLD_SIZE {world} but the spec has {local.workers} ranks")
    device = local.rank_device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build_model(config, str(device))
    names, params = trainable(model)
    dcfg = inner_config(config)
    optimizer = build_inner_optimizer(params, dcfg) if spec.optimizer else None
    if optimizer is not None and spec.inner_state:
        state = torch.load(spec.inner_state, weights_only=True)
        load_inner_state(names, params, optimizer, state)
    source = load_source(config.data)
    timeout = datetime.timedelta(seconds=local.timeout_s)
    store = FileStore(store_path, world)
    store.set_timeout(timeout)
    store.set(f"ready/{rank}", "1")
    dist.init_process_group(
        local.backend, store=store, rank=rank, world_size=world, timeout=timeout
    )
    module = training_module(model, device, local.precision, compile_model=local.compile, ddp=True)
    comm = device if local.backend == "nccl" else torch.device("cpu")
    while True:
        op, step, lr = receive_command(comm)
        if op == Op.STOP:
            break
        if op == Op.SYNC:
            broadcast_params(params)
            continue
        if op == Op.DIGEST:
            gather_digests(params, comm)
            continue
        index = batch_index(step, rank, world)
        x, y = source.train_batch(
            spec.shard, config.data_shards, config.batch_size, config.block_size, config.seed,
            index,
        )  # fmt: skip
        if op == Op.INNER:
            assert optimizer is not None, "rank 0 asked for optimizer steps it said it won't take"
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer_step(module, params, optimizer, dcfg.grad_clip, (x, y))
        else:  # GRADS: DDP's backward averages them into rank 0's; ours are not needed after
            model.train()
            _, loss = module(x.to(device), y.to(device))
            torch.autograd.backward(loss)
            for p in params:
                p.grad = None
    dist.destroy_process_group()
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m swarmd.node.peer.local.worker SPEC (started by swarmd join)")
        return 2
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    rank = int(os.environ["RANK"])
    try:
        return run_worker(
            WorkerSpec.read(Path(argv[0])),
            rank,
            int(os.environ["WORLD_SIZE"]),
            os.environ["SWARMD_LOCAL_STORE"],
        )
    except Exception as exc:
        print(f"swarmd: local rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
