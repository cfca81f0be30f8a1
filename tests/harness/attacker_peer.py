"""A hostile peer process: throwaway keys that advertise a forged state of the run and serve it.

    python -m tests.harness.attacker_peer --boot ADDR --run-file run.toml --run t \\
        --attack scrambled|nan|huge [--keys 2] [--round 1000000]

scrambled: the run's own layout, parameters replaced by large noise (finite: it loads).
nan:       the run's own layout, one tensor all NaN.
huge:      a manifest declaring a 200 GiB state (its chunks are never served).

Each key runs its own donor server and, once an honest peer advertises round --after-round,
advertises its state in the run's DHT under its own peer id. The process prints {"ready": true}
at start and {"attacking": true} once every advert is stored, then serves until killed.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import torch
import trio

from swarmd.node.dht import open_dht
from swarmd.node.peer.model import build_model
from swarmd.node.peer.runconfig import RunConfig
from swarmd.node.statesync.donor import (
    DONOR_SERVICE,
    StateAdvert,
    StateDonor,
    advert_key,
)
from swarmd.node.statesync.snapshot import (
    MAX_CHUNK_BYTES,
    Manifest,
    StateSnapshot,
    TensorEntry,
)
from swarmd.optim.diloco import DiLoCo
from swarmd.protocol import rpc
from swarmd.protocol import statesync_pb2 as pb
from swarmd.protocol.identity import Identity

HUGE_BYTES = 200 << 30


def forged_state(config: RunConfig, attack: str, round_no: int) -> StateSnapshot:
    opt = DiLoCo(build_model(config, "cpu"), config.diloco_config())
    state = opt.state_dict()
    for name, tensor in state.items():
        if tensor.is_floating_point():
            if attack == "scrambled":
                state[name] = torch.randn_like(tensor) * 30.0
            elif attack == "nan":
                state[name] = torch.full_like(tensor, float("nan"))
                break
    state["round"] = torch.tensor(round_no, dtype=torch.int64)
    return StateSnapshot.build(state, round=round_no, meta={"config": config.hash})


def huge_manifest(config: RunConfig, round_no: int) -> Manifest:
    chunks = HUGE_BYTES // MAX_CHUNK_BYTES
    return Manifest(
        round=round_no,
        total_bytes=HUGE_BYTES,
        chunk_bytes=MAX_CHUNK_BYTES,
        chunk_hashes=tuple(bytes([i % 256]) * 32 for i in range(chunks)),
        tensors=(TensorEntry("global.weights", "float32", (HUGE_BYTES // 4,), 0, HUGE_BYTES),),
        meta=(("config", config.hash),),
    )


def huge_service(manifest: Manifest) -> rpc.Service:
    async def get_manifest(
        req: pb.GetManifestRequest, ctx: rpc.CallContext
    ) -> pb.GetManifestResponse:
        return pb.GetManifestResponse(manifest=manifest.to_proto(), state_hash=manifest.state_hash)

    return rpc.Service(
        DONOR_SERVICE, [rpc.unary("GetManifest", pb.GetManifestRequest, get_manifest)]
    )


async def main(args: argparse.Namespace) -> None:
    config = RunConfig.from_toml(args.run_file, name=args.run)
    forged = [_forge(config, args) for _ in range(args.keys)]
    print(json.dumps({"ready": True}), flush=True)
    async with AsyncExitStack() as stack:
        nodes = []
        for service, _, _ in forged:
            identity = Identity.generate()
            node, server = await stack.enter_async_context(
                open_dht(identity, bootstrap=[args.boot], extra_services=[service])
            )
            nodes.append((identity, node, str(server.address)))
        # Strike mid-run, once the honest peers are training: the point is to move them.
        key = advert_key(config.name)
        while not any(
            StateAdvert.from_bytes(v.value).round >= args.after_round
            for v in (await nodes[0][1].get_map(key)).values()
            if v.value
        ):
            await trio.sleep(0.1)
        for (identity, node, address), (_, state_hash, total) in zip(nodes, forged, strict=True):
            advert = StateAdvert(args.round, state_hash, address, total)
            await node.store(key, advert.to_bytes(), node.now() + 600.0, str(identity.peer_id))
            print(f"advertised as {identity.peer_id}", file=sys.stderr, flush=True)
        print(json.dumps({"attacking": True}), flush=True)
        await trio.sleep_forever()


def _forge(config: RunConfig, args: argparse.Namespace) -> tuple[rpc.Service, bytes, int]:
    """The donor service of one attacking key, its state's hash and declared size."""
    if args.attack == "huge":
        manifest = huge_manifest(config, args.round)
        return huge_service(manifest), manifest.state_hash, HUGE_BYTES
    donor = StateDonor()
    snap = forged_state(config, args.attack, args.round)
    donor.publish(snap)
    return donor.service(), snap.state_hash, snap.total_bytes


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--boot", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--run-file", type=Path, required=True)
    parser.add_argument("--attack", choices=["scrambled", "nan", "huge"], required=True)
    parser.add_argument("--keys", type=int, default=1)
    parser.add_argument("--round", type=int, default=1_000_000)
    parser.add_argument("--after-round", type=int, default=2, help="strike once a peer is here")
    trio.run(main, parser.parse_args())
