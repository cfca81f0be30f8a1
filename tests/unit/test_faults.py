"""Fault plans (parsing, reload) and the transport hook, with real in-process gRPC calls."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import trio
import trio.testing

from swarmd.node.peer.service import PEER_SERVICE, PING, Scratch, peer_service
from swarmd.protocol import faults, rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.faults import FaultInjector, FaultPlan, FaultPlanError
from swarmd.protocol.framing import TensorMeta
from swarmd.protocol.identity import Identity


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plan_parses_every_field() -> None:
    plan = FaultPlan.from_json(
        json.dumps(
            {
                "latency_ms": 50,
                "jitter_ms": 10,
                "loss": 0.25,
                "bandwidth_bytes_s": 1e6,
                "isolated": True,
                "blocked": ["127.0.0.1:7001", "127.0.0.2:7002"],
                "clock_skew_s": -12.5,
                "step_delay_s": 0.05,
                "round_overrun_s": 2.5,
            }
        )
    )
    assert plan.latency_ms == 50 and plan.jitter_ms == 10 and plan.loss == 0.25
    assert plan.bandwidth_bytes_s == 1e6 and plan.isolated and plan.clock_skew_s == -12.5
    assert plan.step_delay_s == 0.05 and plan.round_overrun_s == 2.5
    assert plan.blocked == frozenset({"127.0.0.1:7001", "127.0.0.2:7002"})
    assert FaultPlan.from_dict(plan.to_dict()) == plan
    assert FaultPlan.from_json("{}").healthy and not plan.healthy


@pytest.mark.parametrize(
    "data, words",
    [
        ([], "JSON object"),
        ({"latency": 5}, "unknown"),
        ({"loss": 1.5}, "probability"),
        ({"loss": "x"}, "number"),
        ({"latency_ms": -1}, ">= 0"),
        ({"latency_ms": 5, "jitter_ms": 6}, "jitter"),
        ({"bandwidth_bytes_s": 0}, "positive"),
        ({"isolated": 1}, "true or false"),
        ({"blocked": "127.0.0.1:1"}, "list"),
        ({"blocked": [1]}, "host:port"),
        ({"clock_skew_s": float("inf")}, "finite"),
        ({"step_delay_s": -0.1}, "step_delay_s must be >= 0"),
        ({"step_delay_s": "slow"}, "step_delay_s must be a number"),
        ({"round_overrun_s": -1}, "round_overrun_s must be >= 0"),
    ],
)
def test_bad_plans_are_refused_with_the_field_named(data: object, words: str) -> None:
    with pytest.raises(FaultPlanError, match=words):
        FaultPlan.from_json(json.dumps(data))


def test_injector_rereads_the_file_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "faults.json"
    clock = FakeClock()
    inj = FaultInjector(path, clock=clock)
    assert inj.plan().healthy  # no file: no faults
    FaultPlan(isolated=True).write(path)
    assert inj.plan().healthy  # not re-checked within the reload interval
    clock.now += faults.RELOAD_INTERVAL_S
    assert inj.plan().isolated
    path.write_text("{not json")  # a broken file keeps the last good plan
    clock.now += faults.RELOAD_INTERVAL_S
    assert inj.plan().isolated
    FaultPlan(latency_ms=5).write(path)
    clock.now += faults.RELOAD_INTERVAL_S
    assert inj.plan() == FaultPlan(latency_ms=5)
    path.unlink()
    clock.now += faults.RELOAD_INTERVAL_S
    assert inj.plan().healthy


def test_outgoing_refuses_isolated_blocked_and_lost_calls(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    clock = FakeClock()
    inj = FaultInjector(path, rng=random.Random(0), clock=clock)

    def set_plan(plan: FaultPlan) -> None:
        plan.write(path)
        clock.now += 1

    async def main() -> None:
        set_plan(FaultPlan(blocked=frozenset({"127.0.0.1:9"})))
        assert "partitioned" in (await inj.outgoing("127.0.0.1:9") or "")
        assert await inj.outgoing("127.0.0.1:10") is None
        assert inj.incoming() is None  # a blocked set cuts outgoing only
        set_plan(FaultPlan(blocked=frozenset({"127.0.0.7"})))  # a whole host
        assert "partitioned" in (await inj.outgoing("127.0.0.7:4321") or "")
        assert await inj.outgoing("127.0.0.70:4321") is None
        set_plan(FaultPlan(isolated=True))
        assert "isolated" in (await inj.outgoing("127.0.0.1:10") or "")
        assert "isolated" in (inj.incoming() or "")
        set_plan(FaultPlan(loss=0.3))
        lost = sum([await inj.outgoing("127.0.0.1:10") is not None for _ in range(2000)])
        assert 500 < lost < 700  # ~30 %

    trio.run(main)


def test_latency_and_bandwidth_delay_calls(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    FaultPlan(latency_ms=200, jitter_ms=50, bandwidth_bytes_s=1000).write(path)
    inj = FaultInjector(path, rng=random.Random(1))
    mock = trio.testing.MockClock(autojump_threshold=0)

    async def main() -> list[float]:
        waits = []
        for _ in range(20):
            t0 = trio.current_time()
            await inj.outgoing("127.0.0.1:1")
            waits.append(trio.current_time() - t0)
        return waits

    waits = trio.run(main, clock=mock)
    assert all(0.15 <= w <= 0.25 for w in waits), waits
    assert max(waits) - min(waits) > 0.02  # jitter is applied

    # Pacing: the uplink is shared, so bytes booked back to back queue behind each other.
    clock = FakeClock()
    paced = FaultInjector(path, clock=clock)
    assert paced._reserve(500, 1000) == pytest.approx(0.5)
    assert paced._reserve(500, 1000) == pytest.approx(1.0)
    clock.now += 5  # idle time is not banked as credit beyond "now"
    assert paced._reserve(1000, 1000) == pytest.approx(1.0)


def test_clock_skew_moves_the_wall_clock(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    FaultPlan(clock_skew_s=42.0).write(path)
    inj = FaultInjector(path)
    assert inj.wall_clock() - time.time() == pytest.approx(42.0, abs=0.5)


def test_from_env_is_none_without_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    assert faults.from_env() is None
    monkeypatch.setenv(faults.ENV_VAR, str(tmp_path / "x.json"))
    first = faults.from_env()
    assert first is not None and faults.from_env() is first  # one uplink per process


# -- through the real transport (in-process gRPC server and client) --------------------------


async def _ping(client: rpc.RpcClient, address: str) -> pb.PingResponse:
    return await client.unary(
        address, PING, pb.PingRequest(payload=b"x"), pb.PingResponse, timeout=5
    )


def test_transport_refuses_and_recovers_with_the_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server_plan = tmp_path / "server.json"
    client_plan = tmp_path / "client.json"
    identity = Identity.generate()

    async def main() -> None:
        monkeypatch.setenv(faults.ENV_VAR, str(server_plan))
        async with rpc.serve([peer_service(identity, Scratch(1 << 20))]) as server:
            monkeypatch.setenv(faults.ENV_VAR, str(client_plan))
            client = rpc.RpcClient(Identity.generate())
            address = str(server.address)
            try:
                assert (await _ping(client, address)).payload == b"x"
                # The server isolated: refused even though the client is healthy.
                FaultPlan(isolated=True).write(server_plan)
                await trio.sleep(faults.RELOAD_INTERVAL_S + 0.05)
                with pytest.raises(rpc.RpcError) as err:
                    await _ping(client, address)
                assert err.value.code is rpc.StatusCode.UNAVAILABLE
                FaultPlan().write(server_plan)
                await trio.sleep(faults.RELOAD_INTERVAL_S + 0.05)
                await _ping(client, address)
                # The client partitioned from the server.
                FaultPlan(blocked=frozenset({address})).write(client_plan)
                await trio.sleep(faults.RELOAD_INTERVAL_S + 0.05)
                with pytest.raises(rpc.RpcError, match="partitioned"):
                    await _ping(client, address)
                # A client clock 60 s ahead is refused by the server's 30 s skew bound...
                FaultPlan(clock_skew_s=60).write(client_plan)
                await trio.sleep(faults.RELOAD_INTERVAL_S + 0.05)
                with pytest.raises(rpc.RpcError, match="away from our clock") as err:
                    await _ping(client, address)
                assert err.value.code is rpc.StatusCode.UNAUTHENTICATED
                # ...and 10 s is within it.
                FaultPlan(clock_skew_s=10).write(client_plan)
                await trio.sleep(faults.RELOAD_INTERVAL_S + 0.05)
                await _ping(client, address)
                # 64 KiB/s: a 256 KiB tensor (4 frames of 64 KiB) takes ~3 s beyond the first.
                FaultPlan(bandwidth_bytes_s=64 * 1024).write(client_plan)
                await trio.sleep(faults.RELOAD_INTERVAL_S + 0.05)
                small = rpc.TransportConfig(chunk_bytes=64 * 1024)
                paced = rpc.RpcClient(Identity.generate(), small)
                blob = bytes(256 * 1024)
                t0 = time.monotonic()
                await paced.put_tensor(
                    address,
                    f"/{PEER_SERVICE}/PutTensor",
                    TensorMeta("uint8", (len(blob),), name="t"),
                    memoryview(blob),
                    pb.TensorAck,
                    timeout=30,
                )
                took = time.monotonic() - t0
                paced.close()
                assert 2.5 < took < 15, took
            finally:
                client.close()

    trio.run(main)
