"""Run access (issue 28): a secret run and an allowlisted run keep outsiders out of every run
RPC and every group, on real `swarmd join` processes; the creator's `swarmd run allow|deny`
admits and bans keys run-wide.

Before: any key that found the run in the DHT could join its groups, reduce parts of honest
peers' updates and serve them states.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from swarmd.node.access import AccessList, RunAccess
from swarmd.node.peer.lifecycle import ACCESS_REFRESH_S
from swarmd.node.runkeys import access_key
from swarmd.node.statesync.donor import DONOR_SERVICE
from swarmd.protocol import rpc
from swarmd.protocol import statesync_pb2 as spb
from swarmd.protocol.identity import Identity, PeerId
from tests.harness.attacker import publish_own
from tests.harness.join import events_until_exit, join_cmd, start_bootstrap, wait_for
from tests.harness.processes import Proc, ProcessGroup, run_command, swarmd_cmd
from tests.harness.runs import TINY_RUN

GET_MANIFEST = rpc.method_path(DONOR_SERVICE, "GetManifest")
GET_CHUNK = rpc.method_path(DONOR_SERVICE, "GetChunk")


def _call(address: str, identity: Identity, secret: bytes | None = None) -> list[str]:
    """The status of a state-donor call over gRPC (unary) and over the bulk plane (a tensor
    stream), made as ``identity`` with the access tag of ``secret`` (if any)."""

    async def main() -> list[str]:
        client = rpc.RpcClient(identity)
        if secret is not None:
            access = RunAccess("t", "secret", identity.peer_id, identity.peer_id, secret)
            access.paths = frozenset({GET_MANIFEST, GET_CHUNK})
            client.access_tag = access.request_tag
        codes = []
        try:
            for call in (
                client.unary(address, GET_MANIFEST, spb.GetManifestRequest(), spb.Manifest),
                client.get_tensor(address, GET_CHUNK, spb.GetChunkRequest(state_hash=b"x" * 32)),
            ):
                try:
                    await call
                    codes.append("OK")
                except rpc.RpcError as exc:
                    codes.append(exc.code.name)
        finally:
            client.close()
        return codes

    return trio.run(main)


def _outer(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "outer_step"]


def _steps(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Each outer step as (round, status, group size, hash prefix): what a failure shows."""
    return [
        (e["round"], e["status"], e["group_size"], str(e["state_hash"])[:8]) for e in _outer(events)
    ]


def _refused(proc: Proc) -> str:
    proc.process.wait(timeout=120)
    time.sleep(0.2)  # the stderr pump
    stderr = "".join(proc.stderr_tail)
    assert proc.process.returncode == 2, stderr
    return stderr


@pytest.mark.timeout(300)
def test_a_secret_run_admits_holders_of_the_secret_only(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    secret, wrong = b"s" * 20 + b"-the-run", b"w" * 20 + b"-a-guess"
    (tmp_path / "good").write_bytes(secret + b"\n")
    (tmp_path / "bad").write_bytes(wrong)
    (tmp_path / "run.toml").write_text(TINY_RUN + 'access = "secret"\n')
    boot = start_bootstrap(processes, tmp_path)
    good = ("--secret-file", str(tmp_path / "good"))
    creator, member = processes.start_many(
        [
            join_cmd(
                tmp_path, "p0", boot, "--create-run", str(tmp_path / "run.toml"), *good, steps=300
            ),
            join_cmd(tmp_path, "p1", boot, *good, steps=300),
        ]
    )
    created = wait_for(creator, "run_created")
    nosecret = processes.start(join_cmd(tmp_path, "p2", boot))
    guesser = processes.start(
        join_cmd(tmp_path, "p3", boot, "--secret-file", str(tmp_path / "bad"))
    )
    assert "is secret: give its secret (--secret-file)" in _refused(nosecret)
    assert "is not run 't''s" in _refused(guesser)
    assert not (tmp_path / "p3" / "state.pt").exists()

    # The transport refuses calls without the tag, or with a tag of another secret, on both
    # planes; the right secret's tag passes the gate (and the call fails on its own merits).
    stranger = Identity.generate()
    assert _call(creator.address, stranger) == ["PERMISSION_DENIED"] * 2
    assert _call(creator.address, stranger, wrong) == ["PERMISSION_DENIED"] * 2
    assert "PERMISSION_DENIED" not in _call(creator.address, stranger, secret)

    runs = [events_until_exit(p) for p in (creator, member)]
    assert creator.process.returncode == member.process.returncode == 0
    assert created["creator"]
    averaged = [
        {e["round"]: e["state_hash"] for e in _outer(ev) if e["group_size"] == 2} for ev in runs
    ]
    common = set(averaged[0]) & set(averaged[1])
    assert common, runs
    assert all(averaged[0][r] == averaged[1][r] for r in common), "\n".join(
        f"{name}: {_steps(ev)}\n{''.join(p.stderr_tail)[-6000:]}"
        for name, p, ev in zip(("creator", "member"), (creator, member), runs, strict=True)
    )


def _run_list(
    action: str, peer: str, boot: str, state_dir: str
) -> subprocess.CompletedProcess[str]:
    """`swarmd run allow|deny PEER` on run "t", signed by the key in `state_dir`."""
    return run_command(
        swarmd_cmd("run", action, peer, "--run", "t", "--peers", boot, "--state-dir", state_dir),
        timeout=60,
    )


@pytest.mark.timeout(300)
def test_an_allowlisted_run_waits_for_the_creator_and_bans_run_wide(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    (tmp_path / "run.toml").write_text(TINY_RUN + 'access = "allowlist"\n')
    boot = start_bootstrap(processes, tmp_path)
    creator = processes.start(
        join_cmd(tmp_path, "p0", boot, "--create-run", str(tmp_path / "run.toml"), steps=400)
    )
    created = wait_for(creator, "run_created")
    run_id = f"t@{created['creator']}"  # what --create-run prints for joiners
    joiner = processes.start(join_cmd(tmp_path, "p1", boot, "--run", run_id, steps=60))
    outsider = processes.start(
        join_cmd(tmp_path, "p2", boot, "--run", run_id, "--join-timeout", "8")
    )
    waiting = wait_for(joiner, "access_wait")
    assert "not on run 't''s allowlist" in _refused(outsider)
    outsider_key = Identity.load(tmp_path / "p2")
    assert _call(creator.address, outsider_key) == ["PERMISSION_DENIED"] * 2

    allowed = _run_list("allow", str(waiting["peer_id"]), boot, str(tmp_path / "p0"))
    assert allowed.returncode == 0, allowed.stderr
    # Only the creator's key changes the list: a stranger's `allow` is refused before storing.
    squat = _run_list("allow", str(outsider_key.peer_id), boot, str(tmp_path / "p2"))
    assert squat.returncode == 2 and "did not create run 't'" in squat.stderr, squat.stderr
    # Nor does a list the stranger signs and stores itself, naming itself, however new.
    forged = AccessList(frozenset({outsider_key.peer_id}), version=2**62).to_bytes()
    publish_own(boot, tmp_path / "p2", access_key("t"), forged)

    joined = events_until_exit(joiner, timeout=180)
    assert creator.process.poll() is None, "".join(creator.stderr_tail)
    time.sleep(ACCESS_REFRESH_S + 1)  # a refresh of the creator's peer has read the forgery
    assert joiner.process.returncode == 0, "".join(joiner.stderr_tail)
    steps = [(e["round"], e["status"], e["group_size"]) for e in _outer(joined)]
    assert any(e["group_size"] == 2 and e["status"] == "averaged" for e in _outer(joined)), (
        steps,
        "".join(joiner.stderr_tail)[-4000:],
        "".join(creator.stderr_tail)[-4000:],
    )
    assert _call(creator.address, outsider_key) == ["PERMISSION_DENIED"] * 2

    # A run-wide ban: every peer of the run refuses the banned key within a refresh.
    member_key = Identity.load(tmp_path / "p1")
    assert "PERMISSION_DENIED" not in _call(creator.address, member_key)
    denied = _run_list("deny", str(member_key.peer_id), boot, str(tmp_path / "p0"))
    assert denied.returncode == 0, denied.stderr
    deadline = time.monotonic() + 30
    while _call(creator.address, member_key) != ["PERMISSION_DENIED"] * 2:
        assert time.monotonic() < deadline, "the ban did not reach the creator's peer"
        time.sleep(1.0)
    assert PeerId.from_string(str(waiting["peer_id"])) == member_key.peer_id
