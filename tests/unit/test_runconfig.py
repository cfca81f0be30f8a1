"""Run configuration parsing and the daemon's atomic state file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import swarmd
from swarmd.node.peer.localstate import load_saved, save_state
from swarmd.node.peer.runconfig import RunConfig, RunConfigError


def test_round_trip_and_hash() -> None:
    config = RunConfig(name="r", inner_steps=7)
    again = RunConfig.from_json(config.to_json())
    assert again == config and again.hash == config.hash
    assert RunConfig(name="r", inner_steps=8).hash != config.hash


def test_other_version_is_refused_with_a_clear_message() -> None:
    raw = json.loads(RunConfig(name="r").to_json())
    raw["version"] = "0.0.1"
    with pytest.raises(
        RunConfigError, match=f"created with swarmd 0.0.1, this is swarmd {swarmd.__version__}"
    ):
        RunConfig.from_json(json.dumps(raw).encode())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bogus = 1", "unknown run option"),
        ("inner_steps = 0", "inner_steps must be a positive integer"),
        ("n_embd = 30\nn_head = 4", "divisible"),
        ('codec = "zip"', "codec"),
        ("int8_bits = 1", r"int8_bits must be an integer in \[2, 8\], got 1"),
        ("int8_bits = 16", r"int8_bits must be an integer in \[2, 8\], got 16"),
        ("int8_block_size = 0", r"int8_block_size must be an integer in \[1, 65536\]"),
        ('codec = "topk"\ntopk_density = 0.0', r"topk_density must be in \[1/4096, 1\]"),
        ('codec = "topk"\ntopk_density = 1.5', r"topk_density must be in \[1/4096, 1\]"),
        ('codec = "topk"\ntopk_density = "dense"', "topk_density must be a number"),
        ('codec = "topk"\ntopk_bits = 3', "topk_bits must be 1, 2, 4 or 8, got 3"),
        ('codec = "topk"\ntopk_bits = true', "topk_bits must be 1, 2, 4 or 8, got True"),
        ("data_shards = 0", r"data_shards must be an integer in \[1, 64\], got 0"),
        ("data_shards = 65", r"data_shards must be an integer in \[1, 64\], got 65"),
        ("data_shards = 4.0", r"data_shards must be an integer in \[1, 64\], got 4.0"),
        ("this is not toml", "not valid TOML"),
        ('algo = "pipedream"', "algo must be one of diloco, streaming-diloco, demo, swarm"),
        ('algo = "swarm"\nswarm_stages = 5', r"swarm_stages \(5\) must be at most n_layer"),
        ('algo = "swarm"\nswarm_round_s = 0', "swarm options: swarm_round_s must be"),
        ('algo = "swarm"\nswarm_activations = "int4"', "swarm options: swarm_activations must be"),
        ('algo = "swarm"\nswarm_inflight = 0', "swarm options: swarm_inflight must be"),
        ('algo = "swarm"\nswarm_swap = 1.5', r"swarm_swap must be a share in \[0, 1\]"),
        (
            'algo = "swarm"\nn_layer = 4\nswarm_stages = 3\nswarm_swap = 0.5',
            r"CheckFree\+\) needs .* cut \[1, 1, 2\]",
        ),
        ('algo = "demo"\ndemo_topk = 0', "demo options: .*topk"),
        ('algo = "demo"\ndemo_decay = 1.0', "demo options: .*decay"),
        ('algo = "demo"\ndemo_chunk = 2.5', "demo options: demo_chunk must be an integer"),
        ('algo = "demo"\ndemo_value_bits = 2', "demo options: .*value_bits must be one of"),
        (
            'algo = "streaming-diloco"\ninner_steps = 5\nfragments = 2',
            "H=5 must be divisible by fragments P=2",
        ),
        (
            'algo = "streaming-diloco"\ninner_steps = 8\nfragments = 4\noverlap_steps = 2',
            "τ=2 must be < H/P=2",
        ),
        ('algo = "streaming-diloco"\nmix_alpha = 1.5', r"α=1.5 must be in \[0, 1\]"),
        ('algo = "streaming-diloco"\nfragment_layout = "random"', "fragment_layout must be"),
        ('algo = "streaming-diloco"\neager = 1', "eager must be a bool"),
        ('lr_schedule = "linear"', "lr_schedule must be one of constant, cosine"),
        (
            'lr_schedule = "cosine"\nlr_warmup_steps = 100\nlr_decay_steps = 100',
            "lr_schedule options: a cosine schedule needs decay_steps > warmup_steps",
        ),
        ("lr_warmup_steps = -1", "warmup_steps must be an integer >= 0"),
        ("lr_final_ratio = 2.0", r"final_ratio must be in \[0, 1\]"),
        ('algo = "demo"\ncodec = "lowrank"', "codec lowrank factors DiLoCo's .* not demo's"),
        ('grouping = "mesh"', "grouping must be grid or flat, got 'mesh'"),
        ("total_steps = -36", "total_steps must be a non-negative integer, got -36"),
        ("inner_steps = 5\ntotal_steps = 12", r"total_steps \(12\) must be a multiple of inner_"),
        ('algo = "swarm"\ntotal_steps = 36', "total_steps needs a run clock"),
        ("inner_seconds = -5", r"inner_seconds must be >= 0 \(0: none\), got -5"),
        ("inner_seconds = inf", "inner_seconds must be >= 0"),
        ('inner_seconds = "1m"', "inner_seconds must be a number of seconds, got '1m'"),
        ("inner_seconds = true", "inner_seconds must be a number of seconds, got True"),
        (
            'algo = "streaming-diloco"\ninner_seconds = 60',
            "inner_seconds bounds plain DiLoCo's rounds; streaming-diloco paces its own",
        ),
    ],
)
def test_bad_run_files(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(RunConfigError, match=message):
        RunConfig.from_toml(path, name="r")


def test_malformed_json_is_refused() -> None:
    for raw in (b"{", b"[]", b'{"name": "r", "extra": 1}'):
        with pytest.raises(RunConfigError):
            RunConfig.from_json(raw)


def test_state_file_is_replaced_atomically_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    save_state(path, {"config_hash": "a", "global": {"x": torch.ones(3)}, "step": 1})
    save_state(path, {"config_hash": "a", "global": {"x": torch.zeros(3)}, "step": 2})
    loaded = load_saved(path, "a")
    assert loaded is not None and loaded["step"] == 2
    assert torch.equal(loaded["global"]["x"], torch.zeros(3))
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]
    assert load_saved(path, "other-config") is None
    path.write_bytes(b"torn")
    assert load_saved(path, "a") is None  # unreadable: start over, do not crash
    nan = torch.tensor([1.0, float("nan")])
    save_state(path, {"config_hash": "a", "global": {"x": nan}, "step": 3})
    assert load_saved(path, "a") is None  # non-finite: refused, never loaded
    save_state(path, {"config_hash": "a", "global": {"x": torch.ones(2)}, "local": {"m": nan}})
    assert load_saved(path, "a") is None


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunConfig(name="r").inner_steps = 3  # type: ignore[misc]


def test_streaming_options_are_part_of_the_signed_config() -> None:
    plain = RunConfig(name="r")
    stream = RunConfig(
        name="r", algo="streaming-diloco", inner_steps=48, fragments=4, overlap_steps=2
    )
    assert RunConfig.from_json(stream.to_json()) == stream
    assert len({plain.hash, stream.hash, dataclasses.replace(stream, eager=True).hash}) == 3
    settings = stream.streaming_config()
    assert (settings.fragments, settings.overlap_steps, settings.mix_alpha) == (4, 2, 0.5)
    assert settings.diloco.inner_steps == stream.inner_steps
    assert settings.diloco.on_failure == "defer" and plain.diloco_config().on_failure == "local"
    # DiLoCo ignores the streaming options, so a short H need not be divisible by them.
    assert RunConfig(name="r", inner_steps=5).algo == "diloco"


def test_streaming_run_file(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        'algo = "streaming-diloco"\ninner_steps = 12\nfragments = 3\noverlap_steps = 2\n'
        'mix_alpha = 0.25\nfragment_layout = "sequential"\neager = true\n'
    )
    config = RunConfig.from_toml(path, name="r")
    settings = config.streaming_config()
    assert settings.layout == "sequential" and settings.eager and settings.stride == 4


def test_topk_codec_is_accepted_with_its_options(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('codec = "topk"\ntopk_density = 0.01\ntopk_bits = 4')
    config = RunConfig.from_toml(path, name="r")
    assert (config.codec, config.topk_density, config.topk_bits) == ("topk", 0.01, 4)
    assert RunConfig.from_json(config.to_json()) == config


def test_inner_seconds_reach_the_diloco_optimiser(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("inner_steps = 2000\ninner_seconds = 90")
    config = RunConfig.from_toml(path, name="r")
    assert config.diloco_config().inner_seconds == 90.0
    assert RunConfig(name="r").diloco_config().inner_seconds == 0.0
