"""DiLoCo vs data-parallel training at the same token budget, with the bytes each really sent.

Both runs are real processes on loopback talking through swarmd's transport:

  (a) data-parallel baseline: `--peers` workers (benchmarks/ddp_worker.py) form one group through
      a `swarmd dht` bootstrap, then every step all-reduce their fp32 gradient with swarmd's
      butterfly all-reduce and take the same AdamW step.
  (b) DiLoCo: a `swarmd dht` bootstrap and `--peers` `swarmd join` processes (the daemon users
      run), H inner AdamW steps between outer steps, pseudo-gradients all-reduced in the run's
      codec (int8 with error feedback by default).
  (c) streaming DiLoCo: the same daemon with `algo = "streaming-diloco"`: P fragments, each
      synced every H steps at its own offset, its round started τ steps early and overlapped
      with training, merged with mixing factor α.

(b) and (c) run with each peer's upload limited (`--bandwidth-mbit`, through the transport's
fault-injection pacing, SWARMD_FAULTS) so that waiting for the network shows; (a) runs
unlimited (it would take hours otherwise; its loss and bytes do not depend on the limit).

Both use the built-in GPT on the built-in corpus, the same per-peer batch and the same number
of steps per peer (the same token budget), the same AdamW settings, and the same initial
weights. Bytes are what each process's transport counted as sent — request and response
bodies, signed headers, DHT, heartbeats and matchmaking included — averaged over the peers.
Final validation loss is computed here, from the final parameters (the DiLoCo peers' saved
global state, the DDP workers' weights) on the same held-out batches.

Streaming figures: `peak_bytes_ratio` is the largest single sync's bytes (what a peer sent
while one round was on the wire: matchmaking and all-reduce) of DiLoCo over that of streaming
DiLoCo; `compute_utilisation` is 1 − (time the trainer waited for the network / wall time),
summed over the streaming peers (`diloco_utilisation`: the same for plain DiLoCo).

(d) DeMo (`--algos ddp,demo`): the same daemon with `algo = "demo"`, sign-SGD at `--demo-lr`
under the same schedule, the group re-formed every `--demo-inner-steps` steps.

The last line is `ddp_loss=… diloco_loss=… loss_gap=… bytes_ratio=… streaming_loss=…
peak_bytes_ratio=… compute_utilisation=… diloco_utilisation=… demo_loss=… demo_bytes_ratio=…
loss_gap_max=…` (runs not made are nan): with `--seeds`,
each figure is the mean over the seeds (a line per seed comes before it) and loss_gap_max the
largest gap of one seed.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from swarmd.node.peer.options import NUM_SHARDS
from swarmd.node.runtime.children import EventChild as Child
from swarmd.node.runtime.children import stop_all
from swarmd.optim.schedule import LrSchedule
from swarmd.workloads import GPT, DeviceError, GPTConfig, evaluate, load_source, resolve_device

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--peers", "-K", type=int, default=4, help="DiLoCo peers / DDP workers")
    p.add_argument("--steps", type=int, default=1000, help="steps per peer (token budget)")
    p.add_argument(
        "--inner-steps", "-H", type=int, default=50,
        help="DiLoCo H (default 50: 20 outer steps of 1000 steps; with 4-bit codes about the "
        "bytes of H=100 with 8-bit ones, bytes_ratio 428-438). The gap to DDP is set by H: "
        "in-process at seed 1, H=50, 20 and 5 leave 14.6%%, 8.5%% and 4.4%% "
        "(benchmarks/convergence.md)",
    )  # fmt: skip
    p.add_argument("--codec", default="int8", choices=["int8", "fp16", "fp32", "topk", "lowrank"])
    p.add_argument(
        "--lowrank-rank", type=int, default=4,
        help="DiLoCo lowrank: rank of each 2-D tensor's PowerSGD factors (lowrank_rank)",
    )  # fmt: skip
    p.add_argument(
        "--topk-density", type=float, default=1 / 32,
        help="DiLoCo topk: share of each chunk of 4096 values sent (the run option topk_density)",
    )  # fmt: skip
    p.add_argument(
        "--topk-bits", type=int, default=2, choices=[1, 2, 4, 8],
        help="DiLoCo topk: bits per sent value (the run option topk_bits)",
    )  # fmt: skip
    p.add_argument(
        "--int8-block-size", type=int, default=4096,
        help="DiLoCo int8: values per scale (the run option int8_block_size)",
    )  # fmt: skip
    p.add_argument(
        "--int8-bits", type=int, default=4,
        help="DiLoCo int8: code range in bits (the run option int8_bits; 4 with zstd halves "
        "the bytes of a sync)",
    )  # fmt: skip
    p.add_argument(
        "--zstd", action=argparse.BooleanOptionalAction, default=True,
        help="DiLoCo: zstd frame around each int8 part (the run option zstd)",
    )  # fmt: skip
    p.add_argument("--batch-size", type=int, default=8, help="per peer, per step")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW lr (baseline and inner)")
    p.add_argument(
        "--lr-schedule", default="cosine", choices=["constant", "cosine"],
        help="inner lr (and the baseline's): cosine down to 10%% at --steps (default; the "
        "DiLoCo paper's recipe), or constant. A constant 2e-3 left DDP at 1.66-1.82 over "
        "seeds 0-3; cosine with a 50-step warm-up 1.6177 at seed 1 (constant: 1.8176)",
    )  # fmt: skip
    p.add_argument(
        "--warmup-steps", type=int, default=None,
        help="linear lr warm-up steps (default: 5%% of --steps, 50 of 1000)",
    )  # fmt: skip
    p.add_argument(
        "--outer-lr", type=float, default=0.5,
        help="outer Nesterov lr (the daemon's default is the paper's 0.7)",
    )  # fmt: skip
    p.add_argument(
        "--outer-momentum", type=float, default=0.75,
        help="outer Nesterov momentum (the daemon's default is the paper's 0.9). Measured "
        "in-process at 1000 steps, whole held-out split, DDP 1.8183: H=50 with lr/momentum "
        "0.5/0.75 gives DiLoCo 1.8495, 0.4/0.8 1.8696, 0.5/0.9 1.9632; H=100 with 0.7/0.5 "
        "1.8989, 0.4/0.8 1.9424. Too few outer steps for the momentum to build, or too "
        "large a steady step lr/(1 - momentum), both cost loss",
    )  # fmt: skip
    p.add_argument(
        "--eval-batches", type=int, default=0,
        help="validation batches (of --batch-size x --block-size) to evaluate on; 0: the whole "
        "held-out split (410 batches, 419 K tokens, about 15 s). The first 32 are one "
        "contiguous stretch of the corpus: two DiLoCo runs scored 2.2707 and 2.2707 on them, "
        "1.8961 and 1.8721 on the whole split",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="initial weights and batch order")
    p.add_argument(
        "--seeds", default="",
        help="comma-separated seeds to run one after the other (overrides --seed); the last "
        "line then gives each figure's mean over them and loss_gap_max. One seed is not "
        "enough to judge a setting: with a constant lr the gap was 1.6%% at seed 0, 14.8%%, "
        "16.7%% and 10.0%% at seeds 1-3",
    )  # fmt: skip
    p.add_argument(
        "--device", default="auto",
        help="where every peer and worker trains (swarmd join --device; default: auto, the "
        "first CUDA GPU if torch sees one)",
    )  # fmt: skip
    p.add_argument("--fragments", "-P", type=int, default=4, help="streaming: fragments")
    p.add_argument(
        "--streaming-inner-steps", type=int, default=100,
        help="streaming: H (divisible by --fragments; fragment f syncs every H steps at offset "
        "f*H/P); plain DiLoCo's H=50 is not divisible by P=4",
    )  # fmt: skip
    p.add_argument("--overlap-steps", type=int, default=5, help="streaming: τ")
    p.add_argument("--mix-alpha", type=float, default=0.5, help="streaming: α")
    p.add_argument(
        "--fragment-layout", default="balanced", choices=["strided", "sequential", "balanced"],
        help="streaming: how parameters split into fragments (balanced: the lowest peak)",
    )  # fmt: skip
    p.add_argument(
        "--bandwidth-mbit", type=float, default=5.0,
        help="upload limit per DiLoCo/streaming peer in Mbit/s (0: none); at 5, plain "
        "DiLoCo's trainer waits about 10%% of the time for its syncs (at 20, about 5%%)",
    )  # fmt: skip
    p.add_argument(
        "--algos", default="ddp,diloco,streaming",
        help="which runs, comma-separated from ddp, diloco, streaming, demo",
    )  # fmt: skip
    p.add_argument(
        "--demo-lr", type=float, default=3e-3,
        help="demo: sign-SGD lr (cosine); 3e-3 was the best of 1e-3 to 4e-3 (demo_inprocess.py)",
    )  # fmt: skip
    p.add_argument("--demo-topk", type=int, default=32, help="demo: coefficients per block")
    p.add_argument("--demo-chunk", type=int, default=64, help="demo: block side")
    p.add_argument(
        "--demo-value-bits", type=int, default=4, choices=[16, 8, 4],
        help="demo: bits a sent value takes (16 bf16; 8/4 integer codes, a scale per block)",
    )  # fmt: skip
    p.add_argument(
        "--demo-inner-steps", type=int, default=50,
        help="demo: steps between group re-formations (state published, joiners let in)",
    )  # fmt: skip
    p.add_argument(
        "--data-shards", type=int, default=None,
        help="shards the training split is cut into (the run option data_shards; default: "
        "one per peer). With 64, each holds about 125 K tokens, which 1000 steps of 8 x 128 "
        "pass over 8 times, and data-parallel training overfits its shards",
    )  # fmt: skip
    p.add_argument(
        "--shards", default="",
        help="comma-separated training shards (of --data-shards) of peer/worker 0, 1, ...; "
        "default: a sample seeded by --seed. Every method reads the same shards: shards "
        "differ a lot (validation loss of one method moved by 0.3 with the shard draw), so "
        "comparing methods on shards drawn from random peer ids compared data, not methods",
    )  # fmt: skip
    p.add_argument("--keep", type=Path, help="keep logs and states in this directory")
    a = p.parse_args()
    try:
        resolve_device(a.device)
    except DeviceError as exc:
        p.error(str(exc))
    if a.warmup_steps is None:
        a.warmup_steps = a.steps // 20
    try:
        LrSchedule(a.lr_schedule, a.warmup_steps, a.steps if a.lr_schedule == "cosine" else 0)
    except ValueError as exc:
        p.error(f"--lr-schedule {a.lr_schedule} --warmup-steps {a.warmup_steps}: {exc}")
    if a.streaming_inner_steps % a.fragments:
        p.error("--streaming-inner-steps must be divisible by --fragments")
    if a.data_shards is None:
        a.data_shards = min(a.peers, NUM_SHARDS)
    if not 1 <= a.data_shards <= NUM_SHARDS:
        p.error(f"--data-shards must be in [1, {NUM_SHARDS}]")
    if a.shards:
        shards = [int(x) for x in a.shards.split(",")]
        if len(shards) != a.peers or not all(0 <= x < a.data_shards for x in shards):
            p.error(f"--shards needs {a.peers} shards in [0, {a.data_shards})")
    try:
        a.seed_list = [int(x) for x in a.seeds.split(",")] if a.seeds else [a.seed]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {a.seeds!r}")
    return a


def for_seed(a: argparse.Namespace, seed: int) -> argparse.Namespace:
    """The options of one seed's runs: its seed and the training shards of each peer."""
    if a.shards:
        shards = [int(x) for x in a.shards.split(",")]
    elif a.data_shards >= a.peers:
        shards = random.Random(seed).sample(range(a.data_shards), a.peers)
    else:
        shards = [i % a.data_shards for i in range(a.peers)]
    return argparse.Namespace(**(vars(a) | {"seed": seed, "shard_list": shards}))


def swarmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarmd.node.cli", *args]


def bootstrap(root: Path, started: list[Child]) -> str:
    boot = Child.spawn("bootstrap", swarmd("dht", "--state-dir", str(root / "boot")), root)
    started.append(boot)
    return str(boot.first("listening", 60)["address"])


def wait_all(children: list[Child], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for c in children:
        code = c.process.wait(timeout=max(1.0, deadline - time.monotonic()))
        if code != 0:
            raise RuntimeError(f"{c.name} exited with {code}; see its log")


def model_config(a: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, block_size=a.block_size
    )  # fmt: skip


def validation(a: argparse.Namespace, model: torch.nn.Module) -> float:
    source = load_source("builtin")
    batches = source.validation_batches(a.batch_size, a.block_size, a.eval_batches or None)
    return evaluate(model, batches)


@dataclass
class Outcome:
    val_loss: float
    sent_per_peer: float
    seconds: float
    detail: str
    #: DiLoCo runs: 1 - waited / wall over all peers, and the largest sync's bytes.
    utilisation: float = math.nan
    peak_sync_bytes: int = 0


def run_ddp(a: argparse.Namespace, root: Path, timeout: float) -> Outcome:
    started: list[Child] = []
    try:
        address = bootstrap(root, started)
        t0 = time.monotonic()
        workers = []
        for i in range(a.peers):
            argv = [
                sys.executable, str(HERE / "ddp_worker.py"), "--bootstrap", address,
                "--world", str(a.peers), "--steps", str(a.steps), "--lr", str(a.lr),
                "--batch-size", str(a.batch_size), "--block-size", str(a.block_size),
                "--n-layer", str(a.n_layer), "--n-head", str(a.n_head),
                "--n-embd", str(a.n_embd), "--seed", str(a.seed),
                "--eval-batches", "1", "--shard", str(a.shard_list[i]),
                "--data-shards", str(a.data_shards), "--lr-schedule", a.lr_schedule,
                "--warmup-steps", str(a.warmup_steps), "--decay-steps", str(a.steps),
                "--save", str(root / f"ddp{i}.pt"), "--device", a.device,
            ]  # fmt: skip
            workers.append(Child.spawn(f"ddp{i}", argv, root))
        started += workers
        for w in workers:
            w.first("group", 300)
        print(f"  [ddp] group of {a.peers} formed; training {a.steps} steps", flush=True)
        reporter = threading.Thread(target=_report, args=("ddp", workers[0], "progress"))
        reporter.start()
        wait_all(workers, timeout)
        reporter.join()
        done = [w.last("done") for w in workers]
        if len({d["param_hash"] for d in done}) != 1:
            raise RuntimeError("DDP workers ended with different parameters")
        sent = sum(d["sent_bytes"] for d in done) / len(done)
        model = GPT(model_config(a))
        model.load_state_dict(torch.load(root / "ddp0.pt", weights_only=True))
        return Outcome(validation(a, model), sent, time.monotonic() - t0, "all workers identical")
    finally:
        stop_all((c.process for c in started), timeout=15)


def _report(name: str, child: Child, kind: str) -> None:
    """Echoes a child's progress so a long run shows it is alive."""
    seen = 0
    while child.process.poll() is None:
        time.sleep(5)
        fresh = [
            e for e in child.events[seen:]
            if e.get("event") == kind and e.get("loss", e.get("val_loss")) is not None
        ]  # fmt: skip
        seen = len(child.events)
        for e in fresh[-1:]:
            loss = e.get("loss", e.get("val_loss", math.nan))
            where = f"step {e['step']}" if "step" in e else f"round {e.get('round')}"
            print(
                f"  [{name}] {where} loss {loss:.3f}"
                + (f" sent {e['sent_bytes'] / 2**20:.1f} MiB" if "sent_bytes" in e else ""),
                flush=True,
            )


RUN_TOML = """\
n_layer = {n_layer}
n_head = {n_head}
n_embd = {n_embd}
block_size = {block_size}
batch_size = {batch_size}
inner_steps = {inner_steps}
inner_lr = {lr}
outer_lr = {outer_lr}
outer_momentum = {outer_momentum}
lr_schedule = "{lr_schedule}"
lr_warmup_steps = {warmup_steps}
lr_decay_steps = {steps}
codec = "{codec}"
int8_block_size = {int8_block_size}
int8_bits = {int8_bits}
zstd = {zstd_toml}
topk_density = {topk_density}
topk_bits = {topk_bits}
lowrank_rank = {lowrank_rank}
target_group_size = {peers}
min_group_size = 2
seed = {seed}
data_shards = {data_shards}
algo = "{algo}"
fragments = {fragments}
overlap_steps = {overlap_steps}
mix_alpha = {mix_alpha}
fragment_layout = "{fragment_layout}"
demo_topk = {demo_topk}
demo_chunk = {demo_chunk}
demo_value_bits = {demo_value_bits}
"""


def run_diloco(a: argparse.Namespace, root: Path, timeout: float, algo: str) -> Outcome:
    """A run of the daemon: DiLoCo, streaming DiLoCo or DeMo (`algo`)."""
    name = {"streaming-diloco": "streaming"}.get(algo, algo)
    options = vars(a) | {"algo": algo, "zstd_toml": "true" if a.zstd else "false"}
    if algo == "streaming-diloco":
        options["inner_steps"] = a.streaming_inner_steps
    if algo == "demo":
        options |= {"inner_steps": a.demo_inner_steps, "lr": a.demo_lr}
    if algo != "diloco" and a.codec == "lowrank":  # lowrank averages whole models only
        print(f"# {algo}: codec int8 (lowrank is DiLoCo's only)", flush=True)
        options["codec"] = "int8"
    (root / "run.toml").write_text(RUN_TOML.format(**options))
    env = {}
    if a.bandwidth_mbit > 0:
        (root / "faults.json").write_text(
            json.dumps({"bandwidth_bytes_s": a.bandwidth_mbit * 1e6 / 8})
        )
        env["SWARMD_FAULTS"] = str(root / "faults.json")
    started: list[Child] = []
    try:
        address = bootstrap(root, started)
        t0 = time.monotonic()

        def join(i: int, extra: list[str]) -> Child:
            argv = swarmd(
                "join", "--run", "convergence", "--peers", address, "--log-format", "json",
                "--state-dir", str(root / f"peer{i}"), "--max-steps", str(a.steps),
                "--progress-interval", "10", "--data-shard", str(a.shard_list[i]),
                "--device", a.device, *extra,
            )  # fmt: skip
            child = Child.spawn(f"peer{i}", argv, root, env)
            started.append(child)
            return child

        # All start at once (the others wait for the creator's config in the DHT), so all
        # begin from the seeded init and nobody's first round is spent alone.
        peers = [join(0, ["--create-run", str(root / "run.toml")])]
        peers += [join(i, []) for i in range(1, a.peers)]
        for p in peers:
            p.first("training", 180)
        print(f"  [{name}] {a.peers} peers training {a.steps} steps", flush=True)
        reporter = threading.Thread(target=_report, args=(name, peers[0], "outer_step"))
        reporter.start()
        wait_all(peers, timeout)
        reporter.join()
        sent = sum(p.last("stopped")["sent_bytes"] for p in peers) / len(peers)
        rounds = [e for p in peers for e in p.events if e.get("event") == "outer_step"]
        statuses: dict[str, int] = {}
        for e in rounds:
            statuses[e["status"]] = statuses.get(e["status"], 0) + 1
        final = [p.last("outer_step")["state_hash"] for p in peers]
        agree = len(set(final)) == 1
        stops = [p.last("stopped") for p in peers]
        utilisation = 1.0 - sum(e["wait_s"] for e in stops) / sum(e["wall_s"] for e in stops)
        averaged = [e for e in rounds if e["status"] == "averaged"]
        peak_event = max(averaged, key=lambda e: e.get("sync_bytes", 0), default={})
        peak = int(peak_event.get("sync_bytes", 0))
        peak_parts = ", ".join(
            f"{m} {v / 1e3:.1f} KB"
            for m, v in sorted(peak_event.get("sync_by_method", {}).items(), key=lambda kv: -kv[1])
        )
        model = GPT(model_config(a), seed=a.seed)
        # The saved global parameters (`global.<name>`; tied weights appear once).
        state = torch.load(root / "peer0" / "state.pt", weights_only=True)["global"]
        with torch.no_grad():
            for pname, param in model.named_parameters():
                param.copy_(state[f"global.{pname}"])
        # Where the bytes went: the all-reduce's parts, and everything else (DHT: matchmaking,
        # heartbeats, state adverts; pings), per peer.
        by_method: dict[str, float] = {}
        for e in stops:
            for method, nbytes in e.get("sent_by_method", {}).items():
                by_method[method] = by_method.get(method, 0) + nbytes / len(stops)
        parts = sum(v for m, v in by_method.items() if "/swarmd.averaging." in m)
        detail = (
            f"outer steps by status {statuses}; final states "
            f"{'identical' if agree else 'DIFFERENT'} across peers; trainer waited "
            f"{1 - utilisation:.1%} of its time; largest sync {peak / 1e6:.3f} MB ({peak_parts}); "
            f"per peer "
            f"{parts / 1e6:.3f} MB all-reduce parts + {(sent - parts) / 1e3:.1f} KB other ("
            + ", ".join(
                f"{m.rsplit('/', 1)[-1]} {v / 1e3:.1f} KB"
                for m, v in sorted(by_method.items(), key=lambda kv: -kv[1])
                if "/swarmd.averaging." not in m
            )
            + ")"
        )
        return Outcome(validation(a, model), sent, time.monotonic() - t0, detail, utilisation, peak)
    finally:
        stop_all((c.process for c in started), timeout=15)


FIGURES = (
    "ddp_loss", "diloco_loss", "loss_gap", "bytes_ratio", "streaming_loss", "peak_bytes_ratio",
    "compute_utilisation", "diloco_utilisation", "demo_loss", "demo_bytes_ratio",
)  # fmt: skip


def run_seed(a: argparse.Namespace, algos: set[str], root: Path) -> dict[str, float]:
    """One seed's runs, each method in a folder of `root`; returns the last line's figures."""
    print(
        f"seed {a.seed}: training shards {a.shard_list} of {a.data_shards} (the same for every "
        f"method); validation loss at init "
        f"{validation(a, GPT(model_config(a), seed=a.seed)):.4f} (nats/byte)",
        flush=True,
    )
    # Generous: a step costs well under a second here even with 4 processes on 2 cores.
    timeout = 600 + 2.0 * a.steps
    ddp = dil = stream = demo = None
    if "ddp" in algos:
        (root / "ddp").mkdir(parents=True, exist_ok=True)
        ddp = run_ddp(a, root / "ddp", timeout)
        print(
            f"  [ddp] val {ddp.val_loss:.4f}, {ddp.sent_per_peer / 2**20:.1f} MiB sent per "
            f"peer, {ddp.seconds:.0f} s ({ddp.detail})",
            flush=True,
        )
    for algo in ("diloco", "streaming", "demo"):
        if algo not in algos:
            continue
        (root / algo).mkdir(parents=True, exist_ok=True)
        run = "streaming-diloco" if algo == "streaming" else algo
        out = run_diloco(a, root / algo, timeout, run)
        print(
            f"  [{algo}] val {out.val_loss:.4f}, {out.sent_per_peer / 2**20:.2f} MiB sent "
            f"per peer, {out.seconds:.0f} s ({out.detail})",
            flush=True,
        )
        if algo == "diloco":
            dil = out
        elif algo == "demo":
            demo = out
        else:
            stream = out
    nan = math.nan
    ddp_loss = ddp.val_loss if ddp else nan
    dil_loss = dil.val_loss if dil else nan
    return {
        "ddp_loss": ddp_loss,
        "diloco_loss": dil_loss,
        "loss_gap": (dil_loss - ddp_loss) / ddp_loss,
        "bytes_ratio": ddp.sent_per_peer / dil.sent_per_peer if ddp and dil else nan,
        "streaming_loss": stream.val_loss if stream else nan,
        "peak_bytes_ratio": (
            dil.peak_sync_bytes / stream.peak_sync_bytes
            if dil and stream and stream.peak_sync_bytes
            else nan
        ),
        "compute_utilisation": stream.utilisation if stream else nan,
        "diloco_utilisation": dil.utilisation if dil else nan,
        "demo_loss": demo.val_loss if demo else nan,
        "demo_bytes_ratio": ddp.sent_per_peer / demo.sent_per_peer if ddp and demo else nan,
    }


def line(figures: dict[str, float]) -> str:
    digits = {"bytes_ratio": 1, "peak_bytes_ratio": 2, "demo_bytes_ratio": 1}
    return " ".join(
        f"{k}={v:.{digits.get(k, 3 if 'utilisation' in k else 4)}f}" for k, v in figures.items()
    )


def main() -> None:
    a = parse_args()
    torch.set_num_threads(1)
    algos = {x.strip() for x in a.algos.split(",") if x.strip()}
    if unknown := algos - {"ddp", "diloco", "streaming", "demo"}:
        raise SystemExit(f"unknown --algos {sorted(unknown)}")
    params = GPT(model_config(a)).num_params()
    tokens = a.steps * a.peers * a.batch_size * a.block_size
    print(
        f"convergence: built-in GPT {params / 1e6:.2f}M params on the built-in corpus; "
        f"{a.peers} peers x {a.steps} steps x {a.batch_size} x {a.block_size} = {tokens:,} "
        f"tokens per method; lr {a.lr} {a.lr_schedule} (warm-up {a.warmup_steps}); "
        f"DiLoCo H={a.inner_steps}, {a.codec}"
        f"{f' block {a.int8_block_size} {a.int8_bits} bits' if a.codec == 'int8' else ''}"
        f"{f' density {a.topk_density:.4g} {a.topk_bits} bits' if a.codec == 'topk' else ''}"
        f"{f' rank {a.lowrank_rank}' if a.codec == 'lowrank' else ''}"
        f"{' + zstd' if a.zstd else ''}, outer lr "
        f"{a.outer_lr} momentum {a.outer_momentum}; streaming H={a.streaming_inner_steps} "
        f"P={a.fragments} τ={a.overlap_steps} α={a.mix_alpha} {a.fragment_layout}; "
        f"seeds {a.seed_list}",
        flush=True,
    )
    if algos - {"ddp"}:
        print(f"DiLoCo runs: upload limited to {a.bandwidth_mbit:g} Mbit/s per peer", flush=True)
    runs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="swarmd-conv-") as tmp:
        root = a.keep or Path(tmp)
        for seed in a.seed_list:
            # One seed keeps the folders it always had; several get one folder each.
            where = root if len(a.seed_list) == 1 else root / f"seed{seed}"
            runs.append(run_seed(for_seed(a, seed), algos, where))
            if len(a.seed_list) > 1:
                print(f"seed {seed}: {line(runs[-1])}", flush=True)
    mean = {k: sum(r[k] for r in runs) / len(runs) for k in FIGURES}
    gaps = [r["loss_gap"] for r in runs]
    mean["loss_gap_max"] = math.nan if any(map(math.isnan, gaps)) else max(gaps)
    print(line(mean))


if __name__ == "__main__":
    main()
