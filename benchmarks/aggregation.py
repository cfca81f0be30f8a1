"""What a robust aggregation rule costs a reducer per part, against the plain mean.

A reducer of an all-reduce part combines its members' contributions with the run's
`aggregation` (swarmd/node/averaging/reduction.py). This times that call alone, on random
contributions of the part size a run of --params parameters cut among --members reducers
gives, on this machine's CPU (torch threads as the daemon sets them: 1).

    python benchmarks/aggregation.py [--params 25e6] [--members 5] [--repeats 5]

Last line: mean_s=… trimmed_mean_s=… centered_clip_s=… part_values=… (median seconds per
part), and the same per whole round (every part this peer reduces).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import get_args

import torch

from swarmd.node.averaging.reduction import Aggregation, ReductionConfig, aggregate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--params", type=float, default=25e6, help="model parameters")
    p.add_argument("--members", type=int, default=5, help="group size (contributions per part)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(a.seed)
    part = int(a.params) // a.members
    values = [torch.randn(part, generator=gen) for _ in range(a.members)]
    weights = [float(w) for w in torch.randint(40, 60, (a.members,), generator=gen)]
    figures: dict[str, float] = {}
    for rule in get_args(Aggregation):
        config = ReductionConfig(aggregation=rule)
        out = torch.empty(part)
        times = []
        for _ in range(a.repeats):
            start = time.perf_counter()
            aggregate(values, weights, config, out=out)
            times.append(time.perf_counter() - start)
        figures[rule] = statistics.median(times)
        print(
            f"{rule:>14}: {figures[rule] * 1e3:8.1f} ms per part of {part:,} values "
            f"({figures[rule] / figures.get('mean', figures[rule]):.1f}x the mean)"
        )
    print(
        " ".join(f"{rule}_s={s:.4f}" for rule, s in figures.items())
        + f" part_values={part} members={a.members}"
    )


if __name__ == "__main__":
    main()
