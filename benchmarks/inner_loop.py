"""The inner loop's speed: tokens/s and model FLOPs utilisation, bare and inside `swarmd join`.

For each model size: the bare loop is DiLoCo's inner step (forward, backward, clip, AdamW)
on the built-in corpus, through the same module `swarmd join` trains with (precision,
torch.compile, and with --local-workers N the same local ranks: this process is rank 0 and
starts ranks 1..N-1 as the daemon does). Then, for the sizes given to --daemon, one `swarmd
join` peer (1 peer, no group: its outer steps are a group of one) trains the same model with
the same options, and its steady tokens/s is read from its progress events (the first
round, with start-up and compilation, is left out). daemon_overhead = daemon tokens/s ÷
bare tokens/s: what the daemon's thread hops, per-step bookkeeping, outer steps (pseudo-
gradient, state publish and save, validation) cost the trainer.

MFU = tokens/s × FLOPs per token ÷ (peak × ranks), with FLOPs per token = 6 × (parameters
that multiply: all but the position table) + 12 × layers × width × sequence (attention's
score and value products, forward and backward), as in the PaLM paper's appendix. The peak
is the datasheet's dense bf16 (or tf32 for fp32 runs) rate of the GPU, named in the output;
on a CPU there is no datasheet figure, so the peak is a measured fp32 matrix product on the
same threads (said in the output): read CPU MFU as "fraction of what this core's GEMM does".

Last line: `tokens_s=… mfu=… daemon_overhead=…` for the last size measured (the largest, in
the default order), plus the device, precision and sizes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from swarmd.node.peer.local.attach import attach_local
from swarmd.node.peer.local.config import LocalConfig, choose_precision
from swarmd.node.peer.model import build_model
from swarmd.node.peer.runconfig import RunConfig
from swarmd.node.peer.strategy import LocalTarget
from swarmd.optim.diloco import DiLoCo, trainable
from swarmd.workloads import load_source, resolve_device

#: Model shapes: (n_layer, n_head, n_embd, block_size, batch_size). `default` is the run
#: config's default model; `125m` is ~126M parameters with byte tokens (GPT-2 small's
#: parameter count; the byte vocabulary makes its 38M-parameter embedding unnecessary).
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "default": (4, 4, 128, 128, 8),
    "20m": (6, 8, 512, 512, 16),
    "125m": (10, 16, 1024, 1024, 16),
}

#: Dense bf16 / tf32 peaks from the vendors' datasheets (FLOP/s), by device name.
GPU_PEAKS: dict[str, tuple[float, float]] = {
    "H200": (989.4e12, 494.7e12),
    "H100": (989.4e12, 494.7e12),
    "A100": (312e12, 156e12),
}


@dataclass
class Result:
    size: str
    params: int
    tokens_s: float
    mfu: float
    daemon_tokens_s: float | None = None

    @property
    def overhead(self) -> float | None:
        return None if self.daemon_tokens_s is None else self.daemon_tokens_s / self.tokens_s


def run_config(size: str, inner_steps: int) -> RunConfig:
    n_layer, n_head, n_embd, block, batch = SIZES[size]
    return RunConfig(
        name="inner-loop",
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        block_size=block,
        batch_size=batch,
        inner_steps=inner_steps,
        min_group_size=1,
    )


def flops_per_token(config: RunConfig, params: int) -> float:
    matmul_params = params - config.block_size * config.n_embd  # the position table
    return 6.0 * matmul_params + 12.0 * config.n_layer * config.n_embd * config.block_size


def peak_flops(device: torch.device, precision: str) -> tuple[float, str]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (bf16, tf32) in GPU_PEAKS.items():
            if key in name:
                rate = bf16 if precision == "bf16" else tf32
                return rate, f"{name} datasheet dense {precision} {rate / 1e12:.0f} TFLOP/s"
        raise SystemExit(f"no datasheet peak known for {name!r}; add it to GPU_PEAKS")
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    reps, t0 = 20, time.perf_counter()
    for _ in range(reps):
        a @ b
    rate = 2 * n**3 * reps / (time.perf_counter() - t0)
    threads = torch.get_num_threads()
    return rate, f"CPU: measured fp32 {n}^3 GEMM on {threads} thread(s), {rate / 1e9:.1f} GFLOP/s"


def bare(size: str, args: argparse.Namespace, local: LocalConfig, work: Path) -> Result:
    config = run_config(size, inner_steps=10**9)  # no outer step: the inner loop alone
    device = resolve_device(args.device)
    model = build_model(config, str(device))
    opt = DiLoCo(model, config.diloco_config())
    _, params = trainable(model)
    target = LocalTarget(model, params, opt, 0, opt.local_state_dict())
    ranks = attach_local(target, local, config, work / f"bare-{size}")
    source = load_source(config.data)
    try:

        def step(i: int) -> None:
            index = i if ranks is None else ranks.data_index(i)
            opt.inner_step(
                source.train_batch(
                    0, config.data_shards, config.batch_size, config.block_size, config.seed, index
                )
            )

        for i in range(args.warmup):
            step(i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for i in range(args.warmup, args.warmup + args.steps):
            step(i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
    finally:
        if ranks is not None:
            ranks.close()
    tokens = args.steps * config.batch_size * config.block_size * local.workers
    tokens_s = tokens / elapsed
    peak, _ = args.peak
    mfu = tokens_s * flops_per_token(config, opt.numel) / (peak * local.workers)
    return Result(size, opt.numel, tokens_s, mfu)


def daemon(size: str, args: argparse.Namespace, local: LocalConfig, work: Path) -> float:
    """Steady tokens/s of one `swarmd join` peer training this size alone."""
    config = run_config(size, inner_steps=args.inner_steps)
    run_dir = work / f"daemon-{size}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.toml").write_text(
        "".join(
            f"{k} = {v}\n"
            for k, v in {
                "n_layer": config.n_layer,
                "n_head": config.n_head,
                "n_embd": config.n_embd,
                "block_size": config.block_size,
                "batch_size": config.batch_size,
                "inner_steps": config.inner_steps,
                "min_group_size": 1,
            }.items()
        )
    )
    swarmd = [sys.executable, "-m", "swarmd.node.cli"]
    boot = subprocess.Popen(
        [*swarmd, "dht", "--listen", "127.0.0.1:0", "--state-dir", str(run_dir / "boot")],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert boot.stdout is not None
        address = json.loads(boot.stdout.readline())["address"]
        cmd = [
            *swarmd, "join", "--run", "inner-loop", "--peers", address,
            "--create-run", str(run_dir / "run.toml"), "--state-dir", str(run_dir / "peer"),
            "--log-format", "json", "--progress-interval", str(args.progress_interval),
            "--duration", str(args.daemon_seconds), "--device", args.device,
            "--precision", local.precision, "--local-workers", str(local.workers),
            *(["--compile"] if local.compile else []),
        ]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.daemon_seconds + 600)
        if out.returncode != 0:
            raise SystemExit(f"swarmd join failed ({out.returncode}):\n{out.stderr[-3000:]}")
        events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    finally:
        boot.terminate()
        boot.wait(timeout=10)
    # Steady state: from the first progress line after the first outer step (start-up, the
    # first publish and validation, compilation and allocator warm-up are behind it; every
    # cost after it recurs each round) to the last line.
    kinds = [e["event"] for e in events]
    if "outer_step" not in kinds:
        raise SystemExit("no outer step in the daemon's run; raise --daemon-seconds")
    after = kinds.index("outer_step")
    progress = [e for e in events[after:] if e["event"] == "progress"]
    if len(progress) < 3:
        raise SystemExit(f"too few progress events ({len(progress)}); raise --daemon-seconds")
    first, last = progress[0], progress[-1]
    tokens = (last["step"] - first["step"]) * config.batch_size * config.block_size
    return tokens * local.workers / (last["time"] - first["time"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("--local-workers", type=int, default=1)
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument(
        "--sizes", default="default", help=f"comma-separated, of {', '.join(SIZES)}"
    )
    parser.add_argument(
        "--daemon",
        default="default",
        help="comma-separated sizes to also run inside swarmd join ('' for none)",
    )
    parser.add_argument("--steps", type=int, default=200, help="timed steps of the bare loop")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--inner-steps", type=int, default=50, help="H of the daemon's run")
    parser.add_argument("--daemon-seconds", type=float, default=60.0)
    parser.add_argument("--progress-interval", type=float, default=5.0)
    parser.add_argument(
        "--repeats", type=int, default=3, help="bare/daemon pairs per --daemon size (medians)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # as `swarmd join` does
    device = resolve_device(args.device)
    local = LocalConfig(
        workers=args.local_workers,
        device=str(device),
        precision=choose_precision(args.precision, device),
        compile=args.compile,
    )
    args.peak = peak_flops(device, local.precision)
    print(f"# peak: {args.peak[1]}; {local.workers} rank(s), {local.precision}"
          f"{', compiled' if local.compile else ''}")  # fmt: skip
    daemon_sizes = {s for s in args.daemon.split(",") if s}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            # Bare and daemon runs alternate --repeats times and each side's median is kept:
            # on a shared machine the rate drifts by several percent over minutes (seen here:
            # 6858 then 6388 tokens/s for the same bare loop), as much as the overhead.
            bares, daemons = [], []
            for _ in range(args.repeats if size in daemon_sizes else 1):
                bares.append(bare(size, args, local, Path(tmp)))
                print(
                    f"{size:>8}: {bares[-1].params / 1e6:7.2f}M params  bare "
                    f"{bares[-1].tokens_s:10.0f} tokens/s  mfu {bares[-1].mfu:.3f}",
                    flush=True,
                )
                if size in daemon_sizes:
                    daemons.append(daemon(size, args, local, Path(tmp)))
                    print(f"{size:>8}: swarmd join {daemons[-1]:10.0f} tokens/s", flush=True)
            res = sorted(bares, key=lambda r: r.tokens_s)[len(bares) // 2]
            if daemons:
                res.daemon_tokens_s = statistics.median(daemons)
                print(f"{size:>8}: median overhead ratio {res.overhead:.3f}", flush=True)
            results.append(res)
    last = results[-1]
    overhead = last.overhead
    overheads = [r.overhead for r in results if r.overhead is not None]
    print(
        f"tokens_s={last.tokens_s:.0f} mfu={last.mfu:.4f} "
        f"daemon_overhead={overhead if overhead is None else round(overhead, 4)} "
        f"min_daemon_overhead={round(min(overheads), 4) if overheads else None} "
        f"size={last.size} params={last.params} device={device.type} "
        f"precision={local.precision} compile={int(local.compile)} workers={local.workers} "
        f"median_mfu={statistics.median(r.mfu for r in results):.4f}"
    )


if __name__ == "__main__":
    main()
