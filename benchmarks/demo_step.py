"""DeMo's step time against a local AdamW step, and where a DeMo step's time goes.

A DeMo step is the same forward and backward as an AdamW step, then, instead of AdamW's
update: `prepare` (fold the gradient into δ, blockwise DCT, top-k, error feedback), encoding
the payload (`sparse_wire`), the exchange (the sticky group's all-gather: `Gatherer` over
real loopback sockets, K members in this process), decoding the K − 1 payloads received, and
`apply` (average the coefficients, inverse DCT, sign step). Each phase is timed on its own
over the same batches; the exchange is timed with payloads of the size `prepare` produced.
On loopback the exchange is the transport's own cost (framing, signatures, copies), not a
WAN's latency: add the group's round-trip time for that. All K members run in this one
process and thread, so it is the whole group's CPU work for a step: an upper bound on one
member's.

Last line: `adamw_step_ms=… demo_step_ms=… overhead=… fwd_bwd_ms=… adamw_update_ms=…
prepare_ms=… encode_ms=… exchange_ms=… decode_ms=… apply_ms=… params=… payload_bytes=…`
(overhead: DeMo step ÷ AdamW step − 1).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import trio

from swarmd.compression.sparse_wire import decode_sparse, encode_sparse
from swarmd.node.algorithms.demo.gather import GatherConfig, Gatherer
from swarmd.node.averaging.group import Group, Member
from swarmd.optim import DiLoCoConfig
from swarmd.optim.demo import DeMoConfig
from swarmd.optim.demo_state import DeMoRun
from swarmd.optim.diloco import build_inner_optimizer
from swarmd.optim.schedule import LrSchedule
from swarmd.protocol import rpc
from swarmd.protocol.identity import Identity
from swarmd.workloads import GPT, GPTConfig, load_source


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--peers", "-K", type=int, default=4, help="group size of the exchange")
    p.add_argument("--steps", type=int, default=20, help="timed steps (after 3 warm-up)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--topk", type=int, default=32)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args()
    if min(a.peers, a.steps, a.n_layer, a.n_embd, a.n_head) < 1 or a.peers < 2:
        p.error("sizes must be positive and --peers at least 2")
    return a


def median_ms(fn: Callable[[], object], steps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


async def exchange_ms(peers: int, payload: bytes, steps: int) -> float:
    """Median wall time of a whole group's all-gather step (every member sends to every
    other and waits for all), K members on loopback in this process."""
    ids = [Identity.generate() for _ in range(peers)]
    clients = [rpc.RpcClient(i) for i in ids]
    config = GatherConfig(min_deadline_s=5.0, max_deadline_s=30.0)
    gatherers = [Gatherer(c, i.peer_id, config) for c, i in zip(clients, ids, strict=True)]
    times: list[float] = []
    async with trio.open_nursery() as nursery:
        servers = [await nursery.start(_serve, g, i) for g, i in zip(gatherers, ids, strict=True)]
        members = tuple(Member(i.peer_id, a) for i, a in zip(ids, servers, strict=True))
        for g in gatherers:
            g.start(Group(b"b" * 32, members), 0, nursery)
        for step in range(steps + 3):
            t0 = time.perf_counter()
            async with trio.open_nursery() as group:
                for g in gatherers:
                    group.start_soon(g.gather, payload)
            if step >= 3:
                times.append(time.perf_counter() - t0)
        nursery.cancel_scope.cancel()
    for c in clients:
        c.close()
    return 1000 * statistics.median(times)


async def _serve(gatherer: Gatherer, identity: Identity, task_status: trio.TaskStatus[str]) -> None:
    async with rpc.serve([gatherer.service()], "127.0.0.1", 0, identity=identity) as server:
        task_status.started(str(server.address))
        await trio.sleep_forever()


def main() -> None:
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    source = load_source("builtin")
    gpt = GPTConfig(n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, block_size=a.block_size)
    batch = source.train_batch(0, 4, a.batch_size, a.block_size, 0, 0)
    model = GPT(gpt, seed=0)
    run = DeMoRun(
        model,
        DeMoConfig(lr=5e-4, compression_topk=a.topk, compression_chunk=a.chunk),
        LrSchedule("constant", 0, 0),
    )
    layout = run.opt.layout()
    params = [p for p in model.parameters() if p.requires_grad]
    adamw = build_inner_optimizer(params, DiLoCoConfig(inner_lr=2e-3))

    fwd_bwd = median_ms(lambda: run.gradients(batch), a.steps)
    adamw_update = median_ms(adamw.step, a.steps)  # gradients left by run.gradients
    updates = run.prepare()
    prepare = median_ms(run.opt.prepare, a.steps)
    wire = encode_sparse(updates)
    encode = median_ms(lambda: encode_sparse(updates), a.steps)
    decoded = decode_sparse(wire, layout, len(wire))
    decode = (a.peers - 1) * median_ms(lambda: decode_sparse(wire, layout, len(wire)), a.steps)
    apply = median_ms(lambda: run.opt.apply([decoded] * a.peers), a.steps)
    exchange = trio.run(exchange_ms, a.peers, wire, a.steps)

    adamw_step = fwd_bwd + adamw_update
    demo_step = fwd_bwd + prepare + encode + exchange + decode + apply
    numel = sum(p.numel() for p in params)
    print(
        f"{numel / 1e6:.2f}M parameters, group of {a.peers}, payload {len(wire) / 1024:.1f} KiB "
        f"({len(wire) / (4 * numel):.4f} of fp32), {torch.get_num_threads()} torch threads"
    )
    print(
        f"adamw_step_ms={adamw_step:.1f} demo_step_ms={demo_step:.1f} "
        f"overhead={demo_step / adamw_step - 1:.3f} fwd_bwd_ms={fwd_bwd:.1f} "
        f"adamw_update_ms={adamw_update:.2f} prepare_ms={prepare:.2f} encode_ms={encode:.2f} "
        f"exchange_ms={exchange:.2f} decode_ms={decode:.2f} apply_ms={apply:.2f} "
        f"params={numel} payload_bytes={len(wire)}"
    )


if __name__ == "__main__":
    main()
