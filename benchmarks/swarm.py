"""SWARM pipeline throughput and rebalancing on loopback, and its loss against one process.

Real `swarmd join` processes: a `swarmd dht` bootstrap, `len(--slowdown)` stage servers and
`--trainers` trainers, `algo = "swarm"` with 2 stages of the built-in GPT. The servers start
deliberately unbalanced (all but one on stage 0, one on stage 1), so stage 1 is the
bottleneck until rebalancing moves a server there.

Unequal devices on a few CPU cores: each server runs with `--slowdown X` (its own factor from
the list): each compute holds the server's device X times the fastest that kind of compute
took on this machine, so it serves at 1/X of its CPU speed while its real compute uses about
1/X of a core (a fixed emulated time, not X times each compute's own, which contention on the
shared cores would have inflated X-fold).

Figures:
- `throughput_tokens_s`: tokens the trainers completed per second before the first move
  (the unbalanced pipeline); `rebalanced_tokens_s` after it (from the mover's first round on
  its new stage to the end).
- `ideal_tokens_s`: what the same servers would reach in the best assignment of servers to
  stages, from each server's own measured rate (micro-batches/s, published in its stage
  records; stages are of near-equal cost here), times tokens per micro-batch.
- `efficiency`, `rebalanced_efficiency`: the two throughputs over the ideal.
- `loss_end`: validation loss of the pipeline's final model (each stage's saved state, from
  the server with the latest round); `baseline_loss`: the same model trained in one process
  on the same micro-batches (each trainer's shard in its order, the trainers interleaved),
  one AdamW step at the same lr per pipeline round, each on the mean gradient of as many
  micro-batches as the pipeline's rounds averaged; `loss_start`: the seeded init's.
  Differences the pipeline has and the baseline lacks: stale gradients (a micro-batch's
  forward may use last round's parameters), fp16 activations, int8 gradient averaging.

The last line: `throughput_tokens_s=… rebalanced_tokens_s=… ideal_tokens_s=… efficiency=…
rebalanced_efficiency=… loss_start=… loss_end=… baseline_loss=… loss_gap=…`.

On 2 cores the host itself saturates (each server spends 12-69% of a core on RPCs, bundle
checks and rounds beside its emulated device): with fewer micro-batches in flight per trainer
(8), latency, not the devices, bounded the pipeline (0.68-0.76 of the ideal after the move);
16 in flight reached 0.82-0.88.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from swarmd.node.runtime.children import EventChild, stop_all
from swarmd.optim.stage import PARAM_PREFIX
from swarmd.workloads import GPT, GPTConfig, evaluate, load_source

RUN = """\
n_layer = 4
n_head = 4
n_embd = 128
block_size = 64
batch_size = 8
inner_lr = 0.002
data_shards = 8
algo = "swarm"
swarm_stages = 2
swarm_round_s = {round_s}
swarm_rebalance_s = {rebalance_s}
swarm_inflight = {inflight}
"""
STAGES = 2
VALIDATION_BATCHES = 16


def _join(root: Path, name: str, boot: str, seconds: float, *extra: str) -> EventChild:
    argv = [sys.executable, "-m", "swarmd.node.cli", "join", "--run", "bench",
            "--peers", boot, "--log-format", "json", "--progress-interval", "2",
            "--state-dir", str(root / name), "--duration", f"{seconds:.0f}", *extra]  # fmt: skip
    return EventChild.spawn(name, argv, root)


def _rate(trainers: list[EventChild], t0: float, t1: float) -> float:
    """Micro-batches per second the trainers completed between wall times t0 and t1."""
    total = 0.0
    for t in trainers:
        points = [(e["time"], e["step"]) for e in t.events if e.get("event") == "progress"]
        inside = [p for p in points if t0 <= p[0] <= t1]
        if len(inside) >= 2:
            (a, sa), (b, sb) = inside[0], inside[-1]
            total += (sb - sa) / (b - a) if b > a else 0.0
    return total


def _ideal(rates: list[float]) -> float:
    """The best pipeline rate over every assignment of servers to stages."""
    best = 0.0
    for assign in itertools.product(range(STAGES), repeat=len(rates)):
        totals = [
            sum(r for r, s in zip(rates, assign, strict=True) if s == k) for k in range(STAGES)
        ]
        best = max(best, min(totals))
    return best


def _model(seed: int) -> GPT:
    return GPT(
        GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, tie_weights=False), seed=seed
    )


def _pipeline_model(root: Path, names: list[str], seed: int) -> tuple[GPT, int]:
    """The pipeline's final model (each stage's saved state from its latest server) and the
    last stage's round in it."""
    model = _model(seed)
    stages = model.stages(STAGES)
    last_round = 0
    for s, module in enumerate(stages):
        found = []
        for name in names:
            path = root / name / f"stage{s}-state.pt"
            if path.exists():
                state = torch.load(path, weights_only=True)["global"]
                found.append((int(state["round"]), state))
        if not found:
            raise SystemExit(f"no saved state of stage {s}")
        last_round, state = max(found, key=lambda f: f[0])
        with torch.no_grad():
            for pname, p in module.named_parameters():
                p.copy_(state[PARAM_PREFIX + pname])
    return model, last_round


def _baseline(seed: int, shards: list[int], steps: list[int], lr: float) -> GPT:
    """One process: the trainers' micro-batches interleaved (each trainer's in its order),
    one AdamW step per pipeline round on the mean gradient of as many micro-batches as that
    round of the last stage averaged (`steps`), each stage's gradient clipped to norm 1 as
    the stages clip theirs (a pipeline has no global norm)."""
    source = load_source("builtin")
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    order = ((shard, i) for i in itertools.count() for shard in shards)
    for size in steps:
        opt.zero_grad()
        for _ in range(size):
            shard, i = next(order)
            x, y = source.train_batch(shard, 8, 8, 64, 0, i)
            _, loss = model(x, y)
            assert loss is not None
            (loss / size).backward()
        for stage in model.stages(STAGES):  # the stages' rule: each stage's norm clipped
            torch.nn.utils.clip_grad_norm_(stage.parameters(), 1.0)
        opt.step()
    return model


def _val(model: GPT) -> float:
    source = load_source("builtin")
    return evaluate(model, source.validation_batches(8, 64, max_batches=VALIDATION_BATCHES))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--duration", type=float, default=150.0, help="trainers' seconds")
    ap.add_argument("--slowdown", default="8,8,8,8", help="one factor per stage server")
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--inflight", type=int, default=16)
    ap.add_argument("--round-s", type=float, default=3.0)
    ap.add_argument("--rebalance-s", type=float, default=30.0)
    ap.add_argument("--quick", action="store_true", help="80 s of training")
    args = ap.parse_args()
    duration = 80.0 if args.quick else args.duration
    slowdowns = [float(x) for x in args.slowdown.split(",")]
    shards = list(range(args.trainers))
    started: list[EventChild] = []
    with tempfile.TemporaryDirectory(prefix="swarmd-bench-") as tmp:
        root = Path(tmp)
        (root / "run.toml").write_text(
            RUN.format(round_s=args.round_s, rebalance_s=args.rebalance_s, inflight=args.inflight)
        )
        try:
            boot_child = EventChild.spawn(
                "boot",
                [sys.executable, "-m", "swarmd.node.cli", "dht", "--state-dir", str(root / "boot")],
                root,
            )
            started.append(boot_child)
            boot = boot_child.first("listening", 30)["address"]
            names = [f"server{i}" for i in range(len(slowdowns))]
            servers = []
            for i, (name, x) in enumerate(zip(names, slowdowns, strict=True)):
                stage = "1" if i == len(names) - 1 else "0"
                extra = ["--create-run", str(root / "run.toml")] if i == 0 else []
                servers.append(
                    _join(
                        root,
                        name,
                        boot,
                        duration + 120,
                        "--role",
                        "server",
                        "--stage",
                        stage,
                        "--slowdown",
                        f"{x}",
                        *extra,
                    )
                )
                if i == 0:
                    servers[0].first("stage", 120)
            started += servers
            for s in servers[1:]:
                s.first("stage", 120)
            trainers = [
                _join(
                    root, f"trainer{k}", boot, duration, "--role", "trainer", "--data-shard", str(k)
                )
                for k in shards
            ]
            started += trainers
            for t in trainers:
                t.process.wait(timeout=duration + 180)
            time.sleep(2 * args.round_s)
        finally:
            stop_all((c.process for c in started), timeout=20)
        report = _report(root, names, servers, trainers, shards, args.round_s)
    print(
        " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in report.items())
    )


def _report(
    root: Path,
    names: list[str],
    servers: list[EventChild],
    trainers: list[EventChild],
    shards: list[int],
    round_s: float,
) -> dict[str, Any]:
    tokens_per_mb = 8 * 64
    moves = [e for s in servers for e in s.events if e.get("event") == "rebalance"]
    progress = [e["time"] for t in trainers for e in t.events if e.get("event") == "progress"]
    begin, end = min(progress), max(progress)
    first_move = min((e["time"] for e in moves), default=end)
    settled = first_move + 3 * round_s
    before = _rate(trainers, begin + 2 * round_s, first_move)
    after = _rate(trainers, settled, end) if moves else before
    rates = []
    for s in servers:
        rounds = [e for e in s.events if e.get("event") in ("stage_round", "stage")]
        rates.append(rounds[-1]["rate"] if rounds else 0.0)
    ideal = _ideal(rates)
    done = [next(e for e in t.events if e.get("event") == "trainer_done") for t in trainers]
    counts = [d["micro_batches"] for d in done]
    pipeline, saved_round = _pipeline_model(root, names, 0)
    # The last stage's stepping rounds up to the one its saved state holds, and how many
    # micro-batches each averaged (its servers' counts together).
    per_round: dict[int, int] = {}
    for s in servers:
        for e in s.events:
            last = e.get("event") == "stage_round" and e["stage"] == STAGES - 1
            if last and e["round"] <= saved_round:
                per_round[e["round"]] = per_round.get(e["round"], 0) + e["micro_batches"]
    steps = [per_round[r] for r in sorted(per_round) if per_round[r] > 0]
    loss_start = _val(_model(0))
    loss_end = _val(pipeline)
    baseline = _val(_baseline(0, shards, steps, 0.002))
    for e in moves:
        print(json.dumps({k: e[k] for k in ("source", "target", "before", "after")}), flush=True)
    print(f"server rates (micro-batches/s): {rates}; trainers' micro-batches: {counts}; "
          f"last stage's rounds in its saved state: {len(steps)}, {sum(steps)} micro-batches; "
          f"tokens/s {before * tokens_per_mb:.0f} before the first move, "
          f"{after * tokens_per_mb:.0f} after", flush=True)  # fmt: skip
    return {
        "throughput_tokens_s": before * tokens_per_mb,
        "rebalanced_tokens_s": after * tokens_per_mb,
        "ideal_tokens_s": ideal * tokens_per_mb,
        "efficiency": before / ideal if ideal else math.nan,
        "rebalanced_efficiency": after / ideal if ideal else math.nan,
        "moves": len(moves),
        "loss_start": loss_start,
        "loss_end": loss_end,
        "baseline_loss": baseline,
        "loss_gap": (loss_end - baseline) / baseline,
    }


if __name__ == "__main__":
    main()
