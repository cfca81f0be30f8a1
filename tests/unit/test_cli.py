"""CLI behaviour in-process: options from flags, TOML and SWARMD_* variables; clear errors."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from swarmd.node import cli
from swarmd.protocol.address import Address, parse_address


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["version"]) == 0
    assert capsys.readouterr().out.startswith("swarmd 0.")


def test_identity_create_and_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["identity", "create", "--state-dir", str(tmp_path)]) == 0
    created = capsys.readouterr().out
    assert stat.S_IMODE((tmp_path / "identity.key").stat().st_mode) == 0o600
    assert cli.main(["identity", "show", "--state-dir", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    peer_id = created.split("peer id: ")[1].split()[0]
    assert f"peer id: {peer_id}" in shown
    assert cli.main(["identity", "create", "--state-dir", str(tmp_path)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert cli.main(["identity", "show", "--state-dir", str(tmp_path / "none")]) == 1
    assert "swarmd identity create" in capsys.readouterr().err


def test_state_dir_from_env_and_toml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env_dir, toml_dir = tmp_path / "env", tmp_path / "toml"
    config = tmp_path / "swarmd.toml"
    config.write_text(f'[show]\nstate-dir = "{toml_dir}"\n[create]\nstate-dir = "{toml_dir}"\n')
    assert cli.main(["--config", str(config), "identity", "create"]) == 0
    assert (toml_dir / "identity.key").exists()
    monkeypatch.setenv("SWARMD_STATE_DIR", str(env_dir))
    assert cli.main(["--config", str(config), "identity", "create"]) == 0  # env beats file
    assert (env_dir / "identity.key").exists()
    flag_dir = tmp_path / "flag"
    assert cli.main(["identity", "create", "--state-dir", str(flag_dir)]) == 0  # flag beats env
    assert (flag_dir / "identity.key").exists()
    capsys.readouterr()
    assert cli.main(["--config", str(tmp_path / "missing.toml"), "version"]) == 2
    assert "does not exist" in capsys.readouterr().err
    config.write_text("this is = = not toml")
    assert cli.main(["--config", str(config), "version"]) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_bad_env_value_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SWARMD_COUNT", "many")
    assert cli.main(["ping", "127.0.0.1:1"]) == 2
    assert "--count" in capsys.readouterr().err


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    with pytest.raises(SystemExit) as info:
        cli.main(["ping", "nohost"])
    assert info.value.code == 2
    assert "expected HOST:PORT" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:80", Address("127.0.0.1", 80)),
        ("[::1]:9", Address("::1", 9)),
        ("example.org:7000", Address("example.org", 7000)),
    ],
)
def test_parse_address(text: str, expected: Address) -> None:
    assert parse_address(text) == expected
    assert parse_address(str(expected)) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("host", "expected HOST:PORT"),
        (":80", "expected HOST:PORT"),
        ("h:x", "not a number"),
        ("h:70000", "65535"),
        ("h:0", "1..65535"),
        ("::1:80", "IPv6"),
        ("[zz]:1", "not an IPv6"),
        ("[::1]80", r"expected \[IPv6\]:PORT"),
    ],
)
def test_parse_address_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_address(text)


def test_join_refuses_a_data_shard_out_of_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["join", "--run", "r", "--state-dir", str(tmp_path), "--data-shard", "64"]
    assert cli.main(argv) == 2
    assert "data_shard must be in [0, 64), got 64" in capsys.readouterr().err


def test_join_refuses_a_bulk_port_out_of_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["join", "--run", "r", "--state-dir", str(tmp_path), "--bulk-port", "70000"]
    assert cli.main(argv) == 2
    assert "bulk_port must be in [0, 65535], got 70000" in capsys.readouterr().err


def test_join_refuses_a_device_it_does_not_know(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["join", "--run", "r", "--state-dir", str(tmp_path), "--device", "gpu"]
    assert cli.main(argv) == 2
    assert "unknown device 'gpu'; use auto, cpu, cuda, cuda:N or mps" in capsys.readouterr().err
    monkeypatch.setenv("SWARMD_DEVICE", "tpu")  # the environment reaches the same check
    assert cli.main(argv[:-2]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err


def test_the_cli_offers_every_algorithm_a_run_can_use() -> None:
    from swarmd.node.cli.parser import ALGORITHMS as OFFERED
    from swarmd.node.peer.runconfig import ALGORITHMS

    assert OFFERED == ALGORITHMS


def test_join_refuses_a_public_name_it_could_not_publish(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["join", "--run", "r", "--state-dir", str(tmp_path), "--public-name"]
    assert cli.main([*argv, "x" * 65]) == 2
    assert "public_name is longer than 64 characters" in capsys.readouterr().err
    assert cli.main([*argv, "bell\a"]) == 2
    assert "public_name holds control characters" in capsys.readouterr().err


def test_dashboard_options_and_no_torch() -> None:
    """`swarmd dashboard` serves on 127.0.0.1:8080 by default and never imports torch (its
    modules are meant for a machine that does not train)."""
    from swarmd.node.cli.parser import build_parser

    args = build_parser().parse_args(["dashboard", "--run", "r", "--peers", "127.0.0.1:1"])
    assert args.listen == Address("127.0.0.1", 8080) and args.poll == 2.0
    code = (
        "import sys\n"
        "import swarmd.node.cli.app, swarmd.node.dashboard.server\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
