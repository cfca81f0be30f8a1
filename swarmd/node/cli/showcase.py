"""`swarmd demo`: a real run on this machine, with churn, and an honest summary.

Everything here is the real daemon: a `swarmd dht` bootstrap process and `swarmd join`
processes on loopback, talking gRPC to each other, training the built-in GPT on the built-in
corpus with DiLoCo and int8 all-reduce (or `--algo`: streaming DiLoCo, DeMo). Midway one peer
is SIGKILLed and a new one joins (it downloads the group's state). The summary is computed
from the peers' own JSON event lines. A `swarmd dashboard` process shows the run live while
it lasts (its URL is printed first).
"""

from __future__ import annotations

import signal
import sys
import tempfile
import time
from pathlib import Path

from swarmd.node.runtime.children import EventChild, stop_all

DEMO_RUN = """\
n_layer = 2
n_head = 4
n_embd = 128
block_size = 64
batch_size = 8
inner_steps = {inner_steps}
inner_lr = {inner_lr}
codec = "int8"
min_group_size = 2
algo = "{algo}"
"""
#: DeMo's sign steps move every parameter by lr each step (AdamW's steps are about that size
#: only when gradients are consistent), so it may want another lr than DiLoCo's inner AdamW.
DEMO_LR = {"demo": 0.0005}


#: What a joiner's `training` line's origin means, for the demo's line about the newcomer.
_ORIGINS = {
    "group": "it downloaded the group's state",
    "fresh": "the run was still at its seeded start, which it built itself",
    "saved": "it resumed from a state it had saved",
}


def _spawn(name: str, args: list[str], log_dir: Path) -> EventChild:
    return EventChild.spawn(name, [sys.executable, "-m", "swarmd.node.cli", *args], log_dir)


def _say(text: str) -> None:
    print(text, flush=True)


def start_dashboard(address: str, listen: str, root: Path) -> EventChild | None:
    """`swarmd dashboard` of the demo run on ``listen``; its URL is printed. The demo goes on
    without it if it cannot serve there (the port is taken, say)."""
    dashboard = _spawn(
        "dashboard", ["dashboard", "--run", "demo", "--peers", address, "--listen", listen], root
    )
    try:
        url = dashboard.first("dashboard", 30)["url"]
    except RuntimeError:
        _say(f"(no dashboard: it could not serve on {listen}; try --dashboard 127.0.0.1:0)")
        stop_all([dashboard.process], timeout=5)
        return None
    _say(f"dashboard: {url}  (open it in a browser while the demo runs)")
    return dashboard


def run_demo(
    peers: int = 3,
    duration_s: float = 150.0,
    inner_steps: int = 25,
    algo: str = "diloco",
    dashboard: str | None = "127.0.0.1:8080",
) -> int:
    _say(f"swarmd demo: a real {peers}-peer {algo} run on this machine for ~{duration_s:.0f}s.")
    _say("Every peer is a `swarmd join` process; they find each other through a `swarmd dht`")
    exchange = (
        "exchange top-k DCT coefficients of their momentum every step"
        if algo == "demo"
        else "average int8-compressed pseudo-gradients"
    )
    _say(f"bootstrap process and {exchange} over gRPC.\n")
    started: list[EventChild] = []
    with tempfile.TemporaryDirectory(prefix="swarmd-demo-") as tmp:
        root = Path(tmp)
        lr = DEMO_LR.get(algo, 0.002)
        (root / "run.toml").write_text(
            DEMO_RUN.format(inner_steps=inner_steps, inner_lr=lr, algo=algo)
        )
        try:
            boot = _spawn("bootstrap", ["dht", "--state-dir", str(root / "boot")], root)
            started.append(boot)
            address = boot.first("listening", 30)["address"]
            _say(f"bootstrap DHT node on {address}")
            board = start_dashboard(address, dashboard, root) if dashboard else None
            started += [board] if board else []

            def join(name: str, extra: list[str], seconds: float) -> EventChild:
                args = ["join", "--run", "demo", "--peers", address, "--log-format", "json"]
                args += ["--state-dir", str(root / name), "--duration", f"{seconds:.0f}"]
                peer = _spawn(name, args + extra, root)
                started.append(peer)
                return peer

            t0 = time.monotonic()
            first = join("peer0", ["--create-run", str(root / "run.toml")], duration_s)
            first.first("training", 60)
            crew = [first] + [join(f"peer{i}", [], duration_s) for i in range(1, peers)]
            for p in crew[1:]:
                p.first("training", 90)
            _say(f"{peers} peers training; watching outer rounds...")
            victim = crew[1]
            victim.first("outer_step", duration_s / 2)
            # The creator's first outer step too: its advert of a state past the seeded start
            # is stored before that line (and a joiner follows the creator), so the newcomer
            # downloads the group's state. A newcomer of a run still at round 0 builds that
            # state itself, and the demo would show no state sync (a loaded CI machine).
            first.first("outer_step", duration_s / 2)
            time.sleep(max(0.0, duration_s * 0.35 - (time.monotonic() - t0)))
            victim.process.send_signal(signal.SIGKILL)
            _say(f"[{time.monotonic() - t0:5.0f}s] killed {victim.name} (SIGKILL, no goodbye)")
            remaining = duration_s - (time.monotonic() - t0)
            newcomer = join(f"peer{peers}", [], max(30.0, remaining))
            origin = newcomer.first("training", 120).get("origin")
            _say(
                f"[{time.monotonic() - t0:5.0f}s] {newcomer.name} joined "
                f"({origin} start: {_ORIGINS.get(str(origin), 'see its log')})"
            )
            survivors = [p for p in crew if p is not victim] + [newcomer]
            for p in survivors:
                p.process.wait(timeout=duration_s + 180)
        finally:
            stop_all((p.process for p in started), timeout=15)
        return _summary(survivors, victim, newcomer, inner_steps, algo)


def _summary(
    survivors: list[EventChild],
    victim: EventChild,
    newcomer: EventChild,
    inner_steps: int,
    algo: str,
) -> int:
    params = next(
        (e["params"] for p in survivors for e in p.events if e.get("event") == "training"), 0
    )
    rounds = {p.name: [e for e in p.events if e.get("event") == "outer_step"] for p in survivors}
    vals = [
        e for p in survivors for e in p.events if e.get("event") in ("validation", "outer_step")
    ]
    start_loss = next((e["val_loss"] for e in vals if e.get("event") == "validation"), float("nan"))
    outer_vals = [e for e in vals if e.get("event") == "outer_step"]
    last = max(outer_vals, key=lambda e: e["time"], default=None)
    end_loss = last["val_loss"] if last else start_loss
    best_loss = min((e["val_loss"] for e in outer_vals), default=start_loss)
    # Everyone who averaged in a round must hold the same state after it. (A straggler's
    # last step taken alone after the others stopped is its own, and not compared.)
    averaged: dict[int, set[str]] = {}
    for evs in rounds.values():
        for e in evs:
            if e["status"] == "averaged" and e["group_size"] - e["dropped"] >= 2:
                averaged.setdefault(e["round"], set()).add(e["state_hash"])
    steps = sum(max((e.get("step", 0) for e in p.events), default=0) for p in [*survivors, victim])
    sent = sum(
        max((e.get("sent_bytes", 0) for e in p.events), default=0) for p in [*survivors, victim]
    )
    data_parallel = steps * params * 4 * 2  # ring all-reduce sends ~2x the gradient per step
    _say("\n== summary ==")
    what = {
        "demo": f"DeMo (top-k DCT momentum every step, groups of {inner_steps} steps)",
        "streaming-diloco": f"streaming DiLoCo H={inner_steps}, int8 pseudo-gradients",
    }.get(algo, f"DiLoCo H={inner_steps}, int8 pseudo-gradients")
    _say(f"model: {params / 1e6:.2f}M parameters, {what}")
    _say(
        f"validation loss: {start_loss:.3f} at start -> {end_loss:.3f} at the end "
        f"(best {best_loss:.3f})"
    )
    for name, evs in rounds.items():
        if evs:
            _say(
                f"  {name}: {len(evs)} outer rounds, last round {evs[-1]['round']} "
                f"(val {evs[-1]['val_loss']:.3f}, state {evs[-1]['state_hash'][:12]})"
            )
    origin = newcomer.last("training").get("origin")
    how = "state sync" if origin == "group" else f"{origin} start"
    _say(f"peers left: {victim.name} (killed); joined: {newcomer.name} ({how})")
    agree = bool(averaged) and all(len(hs) == 1 for hs in averaged.values())
    if not agree:
        for name, evs in rounds.items():
            for e in evs:
                _say(
                    f"  {name} round {e['round']}: {e['status']} group {e['group_size']} "
                    f"dropped {e['dropped']} state {e['state_hash'][:12]}"
                )
    _say(
        f"states after averaged rounds: {'identical' if agree else 'DIFFERENT'} across peers "
        f"({len(averaged)} rounds compared)"
    )
    if steps and params:
        _say(
            f"bytes sent by all peers: {sent / 2**20:.1f} MiB; data-parallel training would "
            f"have sent ~{data_parallel / 2**20:.0f} MiB for the same {steps} steps "
            f"({data_parallel / max(sent, 1):.0f}x more)"
        )
    ok = agree and end_loss < start_loss
    _say(f"\nresult: {'loss fell and the survivors agree' if ok else 'CHECK FAILED'}")
    return 0 if ok else 1
