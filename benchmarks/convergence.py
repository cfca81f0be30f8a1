"""DiLoCo vs data-parallel AdamW at the same token budget, with the traffic each would need.

All peers are SIMULATED IN-PROCESS, one after another on this machine: this measures the
optimiser (loss per token, bytes per peer), not wall-clock speed-up or the network.

  (a) baseline: data-parallel AdamW. K workers each compute a gradient on their own shard's
      batch and the gradients are averaged every step; with equal batch sizes that is exactly
      one AdamW step on the K batches concatenated, which is how it is computed here.
      Traffic: every step, the full fp32 gradient.
  (b) DiLoCo: K peers, H inner AdamW steps each, then the pseudo-gradients are averaged
      (weighted by samples, in-process mean) and applied with outer Nesterov SGD.
      Traffic: every H steps, the full pseudo-gradient in fp32.
  (c) DiLoCo + int8: as (b), but each peer's pseudo-gradient goes through swarmd's int8 codec
      with error feedback and the reduced average goes back through int8 once more, as the
      butterfly all-reduce does. Traffic: the encoded bytes, measured.

Bytes are per peer, one full vector sent per sync (the all-reduce's send volume differs by a
constant factor that is the same for all three). The last line is `key=value` pairs.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch

from swarmd.compression import DecodeLimits, ErrorFeedback, Int8Codec
from swarmd.optim import DiLoCo, DiLoCoConfig
from swarmd.workloads import GPT, GPTConfig, TokenSource, builtin_corpus, evaluate

Batch = tuple[torch.Tensor, torch.Tensor]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=160, help="inner steps per peer (token budget)")
    p.add_argument("--inner-steps", "-H", type=int, default=16, help="DiLoCo H")
    p.add_argument("--peers", "-K", type=int, default=4, help="simulated peers / DP workers")
    p.add_argument("--batch-size", type=int, default=8, help="per peer, per step")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=96)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW lr (baseline and inner)")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=40, help="steps between progress lines")
    p.add_argument("--corpus-mib", type=int, default=8, help="built-in corpus size")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-int8", action="store_true", help="skip run (c)")
    return p.parse_args()


class Run:
    """Shared plumbing: data, evaluation, progress lines."""

    def __init__(self, args: argparse.Namespace, source: TokenSource, name: str) -> None:
        self.args = args
        self.source = source
        self.name = name
        self.val = source.validation_batches(args.batch_size, args.block_size, args.eval_batches)
        self.config = GPTConfig(
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_embd=args.n_embd,
            block_size=args.block_size,
        )
        self.start = time.perf_counter()

    def batch(self, peer: int, step: int) -> Batch:
        a = self.args
        return self.source.train_batch(peer, a.peers, a.batch_size, a.block_size, a.seed, step)

    def progress(self, step: int, model: torch.nn.Module, train_loss: float) -> float:
        loss = evaluate(model, self.val)
        print(
            f"  [{self.name}] step {step:5d}  train {train_loss:.3f}  val {loss:.3f}  "
            f"({time.perf_counter() - self.start:.0f} s)",
            flush=True,
        )
        return loss


def run_baseline(args: argparse.Namespace, source: TokenSource) -> tuple[float, int]:
    run = Run(args, source, "data-parallel")
    model = GPT(run.config, seed=args.seed)
    params = list(model.parameters())
    nparams = sum(p.numel() for p in params)
    cfg = DiLoCoConfig()  # same AdamW hyper-parameters as DiLoCo's inner optimiser
    opt = torch.optim.AdamW(
        params, lr=args.lr, betas=cfg.inner_betas, eps=cfg.inner_eps,
        weight_decay=cfg.inner_weight_decay,
    )  # fmt: skip
    loss_value = math.nan
    for step in range(args.steps):
        batches = [run.batch(i, step) for i in range(args.peers)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        _, loss = model(x, y)
        assert loss is not None
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        if cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        loss_value = float(loss.detach())
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            run.progress(step + 1, model, loss_value)
    final = run.progress(args.steps, model, loss_value)
    return final, args.steps * nparams * 4


Reducer = Callable[[list[torch.Tensor], list[float]], list[torch.Tensor]]


def weighted_mean(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    total = sum(weights)
    out = torch.zeros_like(tensors[0])
    for t, w in zip(tensors, weights, strict=True):
        out.add_(t, alpha=w / total)
    return out


def run_diloco(args: argparse.Namespace, source: TokenSource, int8: bool) -> tuple[float, int]:
    run = Run(args, source, "diloco+int8" if int8 else "diloco")
    config = DiLoCoConfig(
        inner_steps=args.inner_steps,
        inner_lr=args.lr,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
    )
    peers = [DiLoCo(GPT(run.config, seed=args.seed), config) for _ in range(args.peers)]
    codec = Int8Codec()
    feedback = [ErrorFeedback(codec) for _ in peers]
    sent_bytes = 0  # by peer 0; every peer sends the same amount

    def sync() -> None:
        nonlocal sent_bytes
        pgs = [p.pseudo_gradient() for p in peers]
        weights = [p.weight() for p in peers]
        if int8:
            decoded = []
            for i, (ef, pg) in enumerate(zip(feedback, pgs, strict=True)):
                blob, dec = ef.encode_with_decoded("pseudo_grad", pg)
                decoded.append(dec)
                if i == 0:
                    sent_bytes += len(blob)
            mean = weighted_mean(decoded, weights)
            back = codec.encode(mean)  # the reducer sends the average back, encoded once
            mean = codec.decode(back, DecodeLimits.for_tensor(mean))
        else:
            mean = weighted_mean(pgs, weights)
            sent_bytes += pgs[0].numel() * 4
        for p, pg in zip(peers, pgs, strict=True):
            p.apply_outer(pg, mean)

    loss_value = math.nan
    for step in range(args.steps):
        losses = [p.inner_step(run.batch(i, step)) for i, p in enumerate(peers)]
        loss_value = sum(losses) / len(losses)
        if peers[0].should_sync():
            sync()
            assert all(torch.equal(p.global_flat(), peers[0].global_flat()) for p in peers)
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            run.progress(step + 1, peers[0].model, loss_value)  # local model of peer 0
    if peers[0].steps_since_sync:
        sync()  # a last partial round, so every run ends on a global model
    final = run.progress(args.steps, peers[0].model, loss_value)
    return final, sent_bytes


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    source = builtin_corpus(args.corpus_mib << 20)
    nparams = GPT(
        GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                  block_size=args.block_size)
    ).num_params()  # fmt: skip
    tokens = args.steps * args.peers * args.batch_size * args.block_size
    print(
        f"convergence: {args.peers} peers SIMULATED IN-PROCESS on {args.threads} thread(s); "
        f"built-in GPT {nparams / 1e6:.2f}M params; {source!r}"
    )
    print(
        f"token budget {tokens:,} per method ({args.steps} steps x {args.peers} peers x "
        f"{args.batch_size} x {args.block_size}); DiLoCo H={args.inner_steps}, "
        f"outer lr {args.outer_lr} momentum {args.outer_momentum}; lr {args.lr}",
        flush=True,
    )
    t0 = time.perf_counter()
    base_loss, base_bytes = run_baseline(args, source)
    dl_loss, dl_bytes = run_diloco(args, source, int8=False)
    if args.no_int8:
        q_loss, q_bytes = math.nan, 0
    else:
        q_loss, q_bytes = run_diloco(args, source, int8=True)
    print(f"validation loss (nats/byte): data-parallel {base_loss:.4f}  diloco {dl_loss:.4f}  "
          f"diloco+int8 {q_loss:.4f}")  # fmt: skip
    print(
        f"bytes sent per peer: data-parallel {base_bytes / 1e6:.1f} MB  diloco fp32 "
        f"{dl_bytes / 1e6:.2f} MB ({base_bytes / dl_bytes:.0f}x less)  diloco int8 "
        + (f"{q_bytes / 1e6:.2f} MB ({base_bytes / q_bytes:.0f}x less)" if q_bytes else "skipped")
    )
    print(f"total time {time.perf_counter() - t0:.0f} s (peers simulated in-process)")
    ratio = base_bytes / (q_bytes or dl_bytes)
    print(
        f"baseline_loss={base_loss:.4f} diloco_loss={dl_loss:.4f} "
        f"diloco_int8_loss={q_loss:.4f} bytes_ratio={ratio:.1f}"
    )


if __name__ == "__main__":
    main()
