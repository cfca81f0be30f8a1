"""`swarmd export` against a live 2-peer run, and a new run started from what it wrote
(`--init-weights`): real processes, the real DHT and state sync, the real `transformers`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from swarmd.node.peer.model import build_model, gpt_config
from swarmd.node.peer.runconfig import RunConfig
from swarmd.workloads.gpt import GPT
from tests.harness.join import join_cmd, start_bootstrap, stop_and_collect, wait_for
from tests.harness.processes import ProcessGroup, run_command, swarmd_cmd
from tests.harness.runs import TINY_RUN


def _export(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = swarmd_cmd("export", *args)
    return run_command(cmd, timeout=180)


def test_export_a_live_run_load_it_in_transformers_and_start_a_run_from_it(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    run = tmp_path / "run.toml"
    run.write_text(TINY_RUN)
    boot = start_bootstrap(processes, tmp_path)
    peers = [
        processes.start(join_cmd(tmp_path, "p0", boot, "--create-run", str(run), steps=2000)),
        processes.start(join_cmd(tmp_path, "p1", boot, steps=2000)),
    ]
    # Both past their second outer step (the steps read here count as reported too).
    steps = [wait_for(p, "outer_step", timeout=120) for p in peers for _ in range(2)]
    out = tmp_path / "out"
    done = _export("--run", "t", "--peers", boot, "--out", str(out))
    logs = [steps, *stop_and_collect(peers)]
    assert done.returncode == 0, done.stderr
    assert "chunks" in done.stderr and "wrote" in done.stdout

    weights = out / "model.safetensors"
    with safe_open(str(weights), "pt") as fh:
        meta = fh.metadata()
    exported = load_file(str(weights))
    assert meta["run"] == "t" and meta["state_hash"]
    # The exported state is one both peers reported (its hash), with its validation loss.
    reported = [
        e for events in logs for e in events
        if e["event"] == "outer_step" and e["state_hash"] == meta["state_hash"]
    ]  # fmt: skip
    assert reported, "the exported state is none the peers reported"
    val_loss = reported[0]["val_loss"]

    # transformers loads the directory as a stock GPT-2 with swarmd's logits.
    from transformers import AutoModelForCausalLM

    config = RunConfig.from_toml(run, name="t")
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ours = build_model(config, "cpu", weights).eval()
    assert isinstance(ours, GPT) and gpt_config(config) == ours.config
    tokens = torch.randint(0, 256, (2, config.block_size), generator=torch.Generator())
    with torch.no_grad():
        diff = (ours(tokens)[0] - hf(tokens).logits).abs().max()
    assert float(diff) < 1e-5, diff
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"

    # The peer's own saved state exports offline too (its last round, the same layout).
    offline = _export("--state-dir", str(tmp_path / "p0"), "--out", str(tmp_path / "off"))
    assert offline.returncode == 0, offline.stderr
    assert load_file(str(tmp_path / "off" / "model.safetensors")).keys() == exported.keys()

    # A new run from those weights starts at the exported state's validation loss.
    cmd = join_cmd(tmp_path, "q0", boot, "--create-run", str(run), "--init-weights", str(weights))
    cmd[cmd.index("--run") + 1] = "t2"
    fresh = processes.start(cmd)
    first = wait_for(fresh, "validation", timeout=120)
    assert abs(first["val_loss"] - val_loss) < 1e-5, (first["val_loss"], val_loss)
    # A joiner of that run gets the weights by state sync (its seeded init is not the run's).
    cmd = join_cmd(tmp_path, "q1", boot)
    cmd[cmd.index("--run") + 1] = "t2"
    joiner = processes.start(cmd)
    training = wait_for(joiner, "training", timeout=120)
    assert training["origin"] == "group", training
    joined = wait_for(joiner, "validation")["val_loss"]
    # ... the creator's line: a state the creator reported (it may have trained on meanwhile).
    creator_states = [first["val_loss"]] + [
        e["val_loss"] for e in stop_and_collect([fresh])[0] if e["event"] == "outer_step"
    ]
    assert min(abs(joined - v) for v in creator_states) < 1e-6, (joined, creator_states)


def test_export_says_why_when_it_cannot(processes: ProcessGroup, tmp_path: Path) -> None:
    boot = start_bootstrap(processes, tmp_path)
    unknown = _export("--run", "nobody", "--peers", boot, "--out", str(tmp_path / "o"))
    assert unknown.returncode == 1 and "no configuration in the DHT" in unknown.stderr
    empty = _export("--state-dir", str(tmp_path / "nothing"), "--out", str(tmp_path / "o"))
    assert empty.returncode == 1 and "no saved state" in empty.stderr
    assert not (tmp_path / "o").exists()
    usage = _export("--run", "t", "--out", str(tmp_path / "o"))
    assert usage.returncode == 2 and "--peers" in usage.stderr


def test_init_weights_that_do_not_fit_are_refused_before_anything_is_published(
    tmp_path: Path,
) -> None:
    from safetensors.torch import save_file

    run_file = tmp_path / "run.toml"
    run_file.write_text(TINY_RUN)
    bad = tmp_path / "bad.safetensors"
    save_file({"transformer.wte.weight": torch.zeros(3, 3)}, str(bad))
    cmd = swarmd_cmd(
        "join", "--run", "t", "--state-dir", str(tmp_path / "s"), "--create-run", str(run_file),
        "--init-weights", str(bad), "--peers", "127.0.0.1:1",
    )  # fmt: skip
    done = run_command(cmd, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--init-weights" in done.stderr and "missing" in done.stderr
