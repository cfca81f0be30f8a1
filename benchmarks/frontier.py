"""Loss against bytes for DiLoCo's outer codecs: a frontier, not one point (issue 26).

Runs the daemon (real `swarmd join` processes on loopback, bytes counted by the transport,
DHT and matchmaking included; benchmarks/convergence.py's runs) over a grid of points
(codec, its density / rank / bits, H) on the same seeds, token budget and shards as the
data-parallel baseline, and prints per point the mean loss gap to DDP and the bytes ratio
(DDP's bytes per peer over the point's), the Pareto-optimal points marked.

    python benchmarks/frontier.py --quick            # 3 points, 1 seed, 300 steps: minutes
    python benchmarks/frontier.py --seeds 0,1,2      # the default grid: hours on 2 cores
    python benchmarks/frontier.py --points int8:4:50,topk:0.015625:2:10 --seeds 0
    python benchmarks/frontier.py --points int8:3:35 --seeds 1,2 \
        --ddp-known 1=1.6177@4791.4,2=1.6367@4791.4   # DDP's rows from an earlier run

`--ddp-known SEED=LOSS@MIB,...` takes DDP's validation loss and MiB sent per peer for those
seeds from an earlier run of the same settings instead of running DDP again (the run is
deterministic: seed 0 scored 1.6321 in every run; it costs ten minutes a seed on 2 cores).

A point is `int8:BITS:H`, `topk:DENSITY:BITS:H` or `lowrank:RANK:H`. Every option of
convergence.py applies (model size, lr schedule, outer lr, --keep ...); the upload limit
defaults to none here (loss and bytes do not depend on it, wall time does).

Last line: `best_gap_at_400x=… best_gap_at_2000x=… ddp_loss=…`: the smallest mean gap over
the seeds among points whose mean bytes ratio is at least 400 (resp. 2000); nan if none is.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import convergence as conv

#: The default grid: int8 (4-bit codes, zstd) at three sync spacings, top-k at three
#: densities and two spacings, PowerSGD at two ranks. Chosen so the bytes ratios span about
#: 200x to 20,000x (int8 H=50 is about 430x; top-k 1/64 at 2 bits is ~25x fewer bytes a sync).
DEFAULT_POINTS = (
    "int8:4:25,int8:4:50,int8:4:100,"
    "topk:0.0625:2:10,topk:0.0625:2:25,topk:0.015625:2:10,topk:0.015625:2:25,"
    "topk:0.00390625:2:10,topk:0.00390625:2:25,"
    "lowrank:4:25,lowrank:16:25"
)
QUICK_POINTS = "int8:4:50,topk:0.015625:2:10,lowrank:16:25"


@dataclass(frozen=True)
class Point:
    codec: str
    options: tuple[tuple[str, float | int], ...]
    inner_steps: int

    @classmethod
    def parse(cls, text: str) -> Point:
        parts = text.split(":")
        try:
            if parts[0] == "int8" and len(parts) == 3:
                return cls("int8", (("int8_bits", int(parts[1])),), int(parts[2]))
            if parts[0] == "topk" and len(parts) == 4:
                opts = (("topk_density", float(parts[1])), ("topk_bits", int(parts[2])))
                return cls("topk", opts, int(parts[3]))
            if parts[0] == "lowrank" and len(parts) == 3:
                return cls("lowrank", (("lowrank_rank", int(parts[1])),), int(parts[2]))
        except ValueError:
            pass
        raise SystemExit(f"bad point {text!r}: int8:BITS:H, topk:DENSITY:BITS:H or lowrank:RANK:H")

    @property
    def name(self) -> str:
        values = ":".join(f"{v:g}" for _, v in self.options)
        return f"{self.codec}:{values}:{self.inner_steps}"

    def namespace(self, a: argparse.Namespace) -> argparse.Namespace:
        return argparse.Namespace(
            **(
                vars(a)
                | dict(self.options)
                | {"codec": self.codec, "inner_steps": self.inner_steps}
            )
        )


def pareto(rows: list[tuple[Point, float, float]]) -> set[str]:
    """Names of the points no other point beats on both gap (lower) and bytes ratio (higher)."""
    best = set()
    for p, gap, ratio in rows:
        if not any(
            (g <= gap and r >= ratio) and (g < gap or r > ratio) for q, g, r in rows if q != p
        ):
            best.add(p.name)
    return best


def best_gap(rows: list[tuple[Point, float, float]], at_least: float) -> float:
    gaps = [gap for _, gap, ratio in rows if ratio >= at_least and math.isfinite(gap)]
    return min(gaps) if gaps else math.nan


def known_ddp(text: str) -> dict[int, conv.Outcome]:
    """`SEED=LOSS@MIB,...` as DDP outcomes per seed (see the module's docstring)."""
    out: dict[int, conv.Outcome] = {}
    for item in filter(None, text.split(",")):
        try:
            seed, rest = item.split("=")
            loss, mib = rest.split("@")
            out[int(seed)] = conv.Outcome(float(loss), float(mib) * 2**20, 0.0, "earlier run")
        except ValueError:
            raise SystemExit(f"bad --ddp-known item {item!r}: SEED=LOSS@MIB") from None
    return out


def main() -> None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--quick", action="store_true")
    pre.add_argument("--points", default="")
    pre.add_argument("--ddp-known", default="")
    known, rest = pre.parse_known_args()
    if "-h" in rest or "--help" in rest:
        print(__doc__)
    defaults = ["--bandwidth-mbit", "0", "--algos", "ddp,diloco"]
    if known.quick:
        defaults += ["--steps", "300", "--eval-batches", "64"]
    sys.argv = [sys.argv[0], *defaults, *rest]
    a = conv.parse_args()
    torch.set_num_threads(1)
    points = [Point.parse(t) for t in (known.points or (QUICK_POINTS if known.quick else
                                                        DEFAULT_POINTS)).split(",")]  # fmt: skip
    print(
        f"frontier: {len(points)} points x seeds {a.seed_list}, {a.peers} peers x {a.steps} "
        f"steps; DDP the same budget",
        flush=True,
    )
    gaps: dict[str, list[float]] = {p.name: [] for p in points}
    ratios: dict[str, list[float]] = {p.name: [] for p in points}
    ddp_losses: list[float] = []
    earlier = known_ddp(known.ddp_known)
    timeout = 600 + 2.0 * a.steps
    with tempfile.TemporaryDirectory(prefix="swarmd-frontier-") as tmp:
        root = a.keep or Path(tmp)
        for seed in a.seed_list:
            s = conv.for_seed(a, seed)
            where = root / f"seed{seed}"
            (where / "ddp").mkdir(parents=True, exist_ok=True)
            ddp = earlier.get(seed) or conv.run_ddp(s, where / "ddp", timeout)
            ddp_losses.append(ddp.val_loss)
            print(f"seed {seed} [ddp] val {ddp.val_loss:.4f}", flush=True)
            for point in points:
                folder = where / point.name.replace(":", "_")
                folder.mkdir(parents=True, exist_ok=True)
                out = conv.run_diloco(point.namespace(s), folder, timeout, "diloco")
                gap = (out.val_loss - ddp.val_loss) / ddp.val_loss
                ratio = ddp.sent_per_peer / out.sent_per_peer
                gaps[point.name].append(gap)
                ratios[point.name].append(ratio)
                print(
                    f"seed {seed} [{point.name}] val {out.val_loss:.4f} gap {gap:+.1%} "
                    f"bytes_ratio {ratio:.0f} ({out.seconds:.0f} s; {out.detail})",
                    flush=True,
                )
    rows = [
        (p, sum(gaps[p.name]) / len(gaps[p.name]), sum(ratios[p.name]) / len(ratios[p.name]))
        for p in points
    ]
    front = pareto(rows)
    print(
        "\n| point (codec:setting:H) | mean gap to DDP | bytes ratio | Pareto |\n|---|---|---|---|"
    )
    for p, gap, ratio in sorted(rows, key=lambda row: row[2]):
        print(f"| {p.name} | {gap:+.1%} | {ratio:.0f} | {'*' if p.name in front else ''} |")
    ddp_loss = sum(ddp_losses) / len(ddp_losses)
    print(
        f"best_gap_at_400x={best_gap(rows, 400):.4f} best_gap_at_2000x={best_gap(rows, 2000):.4f} "
        f"ddp_loss={ddp_loss:.4f}"
    )


if __name__ == "__main__":
    main()
