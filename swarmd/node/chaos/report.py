"""The chaos run's report: a text summary of the invariants and a PNG timeline.

The timeline shows each peer's validation loss after its outer rounds (and the initial one),
with every fault shaded over its span and labelled with the peers it hit, so a loss spike or a
stall can be matched to the fault that caused it by eye.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from swarmd.node.chaos.invariants import Check

Record = dict[str, Any]

_COLOURS = {
    "kill": "#d62728",
    "pause": "#ff7f0e",
    "partition": "#9467bd",
    "latency": "#8c564b",
    "bandwidth": "#17becf",
    "clock_skew": "#bcbd22",
}


def figures(checks: list[Check]) -> dict[str, float]:
    return {k: v for c in checks for k, v in c.figures}


def text_report(records: list[Record], checks: list[Check]) -> str:
    start = next((r for r in records if r["type"] == "start"), {})
    faults = [r for r in records if r["type"] == "fault"]
    lines = [
        f"swarmd chaos: {start.get('peers', '?')} peers, {start.get('duration_s', 0):.0f}s of "
        f"chaos, seed {start.get('seed')}, {len(faults)} faults",
        "",
        "faults applied:",
    ]
    t0 = next((r["t"] for r in records if r["type"] == "chaos_begins"), 0.0)
    for r in faults:
        who = ",".join(f"peer{p}" for p in r["peers"])
        params = {
            k: v
            for k, v in r.items()
            if k not in ("t", "type", "kind", "peers", "at_s", "duration_s")
        }
        extra = " ".join(f"{k}={v}" for k, v in params.items())
        lines.append(
            f"  {r['t'] - t0:6.1f}s  {r['kind']:<10} {who:<16} {r['duration_s']:5.1f}s {extra}"
        )
    steps = [r for r in records if r["type"] == "peer" and r.get("event") == "outer_step"]
    by_status: dict[str, int] = {}
    for r in steps:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
    stage_rounds: dict[int, int] = {}
    for r in records:
        if r["type"] == "peer" and r.get("event") == "stage_round" and r.get("micro_batches"):
            stage_rounds[int(r["stage"])] = stage_rounds.get(int(r["stage"]), 0) + 1
    lines += [
        "",
        "outer steps by status: "
        + (", ".join(f"{k} {v}" for k, v in sorted(by_status.items())) or "none")
        + (
            "; stage rounds that trained, by stage: "
            + ", ".join(f"{k}: {v}" for k, v in sorted(stage_rounds.items()))
            if stage_rounds
            else ""
        ),
        "",
        "invariants:",
    ]
    for c in checks:
        lines.append(f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
    return "\n".join(lines)


def timeline_png(records: list[Record], path: Path) -> str | None:
    """Writes the PNG; returns why not if matplotlib is missing (pip install swarmd[chaos])."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'swarmd[chaos]')"
    t0 = next((r["t"] for r in records if r["type"] == "chaos_begins"), 0.0)
    peers = sorted({r["peer"] for r in records if r["type"] == "spawn" and r["peer"] >= 0})
    fig, ax = plt.subplots(figsize=(12, 5), dpi=100)
    faults = [r for r in records if r["type"] == "fault"]
    for lane, r in enumerate(faults):
        colour = _COLOURS.get(r["kind"], "grey")
        ax.axvspan(r["t"] - t0, r["t"] - t0 + r["duration_s"], color=colour, alpha=0.15, lw=0)
        ax.annotate(
            f"{r['kind']} {','.join(str(p) for p in r['peers'])}",
            xy=(r["t"] - t0, 1.0 - 0.05 * (lane % 6)),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            color=colour,
            va="top",
        )
    for p in peers:
        pts = [
            (r["t"] - t0, r["val_loss"])
            for r in records
            if r["type"] == "peer"
            and r["peer"] == p
            and r.get("event") in ("validation", "outer_step")
            and isinstance(r.get("val_loss"), int | float)
        ] + [  # SWARM: the last stage's training loss of each round
            (r["t"] - t0, r["loss"])
            for r in records
            if r["type"] == "peer"
            and r["peer"] == p
            and r.get("event") == "stage_round"
            and r.get("micro_batches")
            and isinstance(r.get("loss"), int | float)
            and r["loss"] > 0
        ]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker=".", ms=3, lw=1, label=f"peer{p}")
        for r in records:
            if r["type"] == "exit" and r["peer"] == p:
                ax.axvline(r["t"] - t0, color="black", lw=0.5, ls=":")
    ax.set_xlabel("seconds since chaos began (faults shaded; dotted: a process exited)")
    ax.set_ylabel("validation loss (SWARM: the last stage's training loss)")
    ax.set_title("swarmd chaos: loss per peer")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right", fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None
