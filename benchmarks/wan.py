"""The all-reduce over internet-like links: 4 network-namespace hosts (deploy/netns.py) with
`tc tbf` at 100 Mbit/s each way and 40 ms of round trip added to every call in user space
(SWARMD_FAULTS latency: netem is not in this kernel), against the link bound; then the same
with the last 2 hosts behind a NAT router, in client mode (issue 27).

bound_s: the bytes the busiest host must send in one round at the link rate, plus 4 round
trips (announce/matchmaking is timed apart; the round's calls: hello, put, proof, get).
Without NAT every host sends (P-1)/P of its vector in each phase: 2(P-1)/P x N values. With
K client-mode hosts the P-K reachable ones reduce everything: each sends its contributions to
the other reachable hosts and every reduced part to the P-1 others, N/(P-K) x (P-K-1 + P-1)
values; a client sends N values once. link_efficiency = bound / measured, int8, no NAT.

The latency fault delays each call before it is sent, which is a round trip per call; it does
not make TCP's window ramp up over a 40 ms path, so real links with a bandwidth-delay product
of 500 KB may do worse than measured here.

Needs root, iproute2 and iptables. Last line:
round_s_fp32=… round_s_int8=… bound_s_fp32=… bound_s_int8=… link_efficiency=…
round_s_int8_nat=… bound_s_int8_nat=… nat_cost=…
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deploy.netns import NetnsConfig, Network, Shaping  # noqa: E402
from swarmd.node.averaging.allreduce import AllReduceConfig, Averager, Member  # noqa: E402
from swarmd.node.averaging.matchmaking import MatchmakingConfig, form_group  # noqa: E402
from swarmd.node.dht import DHTNode  # noqa: E402
from swarmd.node.runkeys import round_key  # noqa: E402
from swarmd.protocol import rpc  # noqa: E402
from swarmd.protocol.identity import Identity  # noqa: E402

#: Bytes on the wire per value (int8: a code a value and an fp32 scale per 256-value block).
WIRE_BYTES = {"fp32": 4.0, "int8": 1.0 + 4 / 256}


async def worker(host: str, numel: int, codec: str, bootstrap: str, client_mode: bool) -> None:
    identity = Identity.generate()
    client = rpc.RpcClient(identity)
    averager = Averager(client, identity.peer_id, AllReduceConfig(codec=codec))  # type: ignore[arg-type]
    dht = DHTNode(identity, client)
    local = torch.randn(numel, generator=torch.Generator().manual_seed(secrets.randbits(31)))
    out = torch.empty_like(local)
    async with (
        rpc.serve([dht.service(), averager.service()], host, 0, identity=identity) as server,
        trio.open_nursery() as nursery,
    ):
        # A client-mode node says no port: nobody enters it in a routing table.
        port = 0 if client_mode else server.address.port
        await nursery.start(dht.run, port, [bootstrap] if bootstrap else [])
        me = Member(identity.peer_id, str(server.address), client=client_mode)
        print(json.dumps({"address": str(server.address)}), flush=True)
        while line := await trio.to_thread.run_sync(sys.stdin.readline):
            cmd = json.loads(line)
            size = cmd["peers"]
            mm = MatchmakingConfig(target_group_size=size, min_group_size=size, gather_s=60.0)
            group = await form_group(dht, round_key("wan", cmd["round"]), me, mm)
            assert group is not None and len(group.members) == size
            t0 = time.monotonic()
            result = await averager.allreduce(group, local, 1.0, out=out)
            print(json.dumps({"round_s": time.monotonic() - t0, "ok": result.ok}), flush=True)
        nursery.cancel_scope.cancel()
    client.close()


def bound_s(numel: int, codec: str, peers: int, nated: int, rate_bps: float, rtt: float) -> float:
    b = WIRE_BYTES[codec]
    if nated == 0:
        busiest = 2 * (peers - 1) / peers * numel * b
    else:
        servers = peers - nated
        busiest = numel / servers * (servers - 1 + peers - 1) * b
    return busiest * 8 / rate_bps + 4 * rtt


def measure(args: argparse.Namespace, codec: str, nated: int, faults: Path) -> list[float]:
    """Median-able round times of `args.rounds` rounds (after one warm-up) on a fresh net."""
    net = Network(
        NetnsConfig(secrets.token_hex(3), args.peers, shaping=Shaping(rate=args.rate), nated=nated)
    )
    numel = int(args.mparams * 1e6)
    env = {**os.environ, "SWARMD_FAULTS": str(faults), "PYTHONPATH": str(ROOT)}
    procs: list[subprocess.Popen[str]] = []
    with net:
        try:
            boot = ""
            for i in range(args.peers):
                cmd = [sys.executable, __file__, "--worker", net.ip(i), str(numel), codec, boot]
                cmd.append("client" if net.is_nated(i) else "server")
                procs.append(
                    subprocess.Popen(
                        [*net.exec_prefix(i), *cmd],
                        env=env,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
                address = json.loads(procs[-1].stdout.readline())["address"]  # type: ignore[union-attr]
                boot = boot or address
            times = []
            for r in range(args.rounds + 1):
                for p in procs:
                    p.stdin.write(json.dumps({"round": r, "peers": args.peers}) + "\n")  # type: ignore[union-attr]
                    p.stdin.flush()  # type: ignore[union-attr]
                outs = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
                slowest = max(o["round_s"] for o in outs)
                print(
                    f"{codec}, {nated} NATed: round {r} {slowest:.2f} s"
                    + (" (warm-up)" if r == 0 else "")
                    + ("" if all(o["ok"] for o in outs) else f" degraded: {outs}"),
                    flush=True,
                )
                if r:
                    times.append(slowest)
        finally:
            for p in procs:
                if p.stdin:
                    p.stdin.close()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--nated", type=int, default=2, help="hosts behind NAT in the NAT run")
    parser.add_argument("--mparams", type=float, default=25.0, help="millions of fp32 values")
    parser.add_argument("--rate", default="100mbit", help="tbf rate each way (mbit)")
    parser.add_argument("--rtt-ms", type=float, default=40.0)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (median reported)")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(1)
        host, numel, codec, boot, mode = args.worker
        trio.run(worker, host, int(numel), codec, boot, mode == "client")
        return
    if not args.rate.endswith("mbit"):
        parser.error("--rate must be in mbit, e.g. 100mbit")
    rate_bps = float(args.rate.removesuffix("mbit")) * 1e6
    rtt = args.rtt_ms / 1000
    numel = int(args.mparams * 1e6)
    with tempfile.TemporaryDirectory() as tmp:
        faults = Path(tmp) / "faults.json"
        faults.write_text(json.dumps({"latency_ms": args.rtt_ms}))
        fp32 = statistics.median(measure(args, "fp32", 0, faults))
        int8 = statistics.median(measure(args, "int8", 0, faults))
        nat = statistics.median(measure(args, "int8", args.nated, faults))
    b_fp32 = bound_s(numel, "fp32", args.peers, 0, rate_bps, rtt)
    b_int8 = bound_s(numel, "int8", args.peers, 0, rate_bps, rtt)
    b_nat = bound_s(numel, "int8", args.peers, args.nated, rate_bps, rtt)
    print(
        f"{args.peers} hosts, {args.mparams:g}M values, {args.rate} each way, "
        f"{args.rtt_ms:g} ms RTT per call; {args.nated} behind NAT in the last run"
    )
    print(
        f"round_s_fp32={fp32:.3f} round_s_int8={int8:.3f} bound_s_fp32={b_fp32:.3f} "
        f"bound_s_int8={b_int8:.3f} link_efficiency={b_int8 / int8:.3f} "
        f"round_s_int8_nat={nat:.3f} bound_s_int8_nat={b_nat:.3f} nat_cost={nat / int8:.3f}"
    )


if __name__ == "__main__":
    main()
