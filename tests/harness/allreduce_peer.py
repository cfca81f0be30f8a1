"""A real peer process for all-reduce tests, honest or misbehaving on purpose.

argv[1] is JSON: {"index", "numel", "codec", "weight", "behavior", "linger_s", "out_dir"}, and
for codec "topk" optionally "topk_density", "topk_bits", "topk_chunk"; codec "lowrank" takes
"shapes" (the vector's tensors, named t0, t1, ...) and "rank": PowerSGD in two all-reduces,
its Q and error feedback kept from round to round.
Prints {"address", "peer_id", "pid"} once serving. Then, for every line on stdin
({"round": name, "members": [[peer_id, address(, client)], ...]}), runs one all-reduce and prints
{"ok", "dropped", "failed_parts", "recovered_parts", "seconds", "file"}; the result tensor is
saved to "file". Behaviours: "honest"; "slow" (waits 30 s before sending or serving anything:
the test kills or stops it mid-round); "nan" and "shape" (sends NaN values / a part of the wrong
length, reduces its own part honestly); "huge" (sends values a million times too large);
"flip" and "x-20" (contributes honestly, but serves the part it reduces negated / times -20).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import trio

import swarmd.node.averaging.round as round_module
from swarmd.compression.codec import Codec
from swarmd.compression.lowrank import PowerSGD, PowerSGDConfig
from swarmd.node.averaging.allreduce import AllReduceConfig, Averager, Group, Member, make_codec
from swarmd.node.averaging.lowrank import allreduce_lowrank
from swarmd.node.peer.service import Scratch, peer_service
from swarmd.protocol import rpc
from swarmd.protocol.identity import Identity, PeerId


def local_values(index: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + index))


def round_id(name: str) -> bytes:
    return hashlib.sha256(f"test/{name}".encode()).digest()


def lying_encoder(codec: Codec, behavior: str) -> Callable[[torch.Tensor], bytes]:
    """What a faulty or malicious peer sends; its own reductions stay honest."""

    def encode(tensor: torch.Tensor) -> bytes:
        if behavior == "nan":
            blob = codec.encode(torch.ones_like(tensor))
            return blob.replace(b"\x00\x00\x80\x3f", b"\x00\x00\xc0\x7f")  # 1.0f -> NaN
        if behavior == "shape":
            return codec.encode(torch.cat([tensor, torch.zeros(3)]))
        if behavior == "huge":
            return codec.encode(tensor * 1e6)
        raise ValueError(behavior)

    return encode


def lie_as_reducer(factor: float) -> None:
    """The reducer's aggregate, scaled after the fact: its proof is made honestly from the
    contributions it received, as a reducer that does not know about proofs would."""
    honest = round_module.__dict__["aggregate"]

    def aggregate(*args: Any, **kwargs: Any) -> torch.Tensor:
        return honest(*args, **kwargs).mul_(factor)

    round_module.__dict__["aggregate"] = aggregate


async def main(cfg: dict[str, Any]) -> None:
    identity = Identity.generate()
    client = rpc.RpcClient(identity)
    lowrank = cfg.get("codec") == "lowrank"
    psgd = PowerSGD(PowerSGDConfig(rank=cfg.get("rank", 4))) if lowrank else None
    shapes = [torch.Size(s) for s in cfg.get("shapes", [])]
    names = [f"t{i}" for i in range(len(shapes))]
    config = AllReduceConfig(
        codec="fp32" if lowrank else cfg.get("codec", "fp32"),
        linger_s=cfg.get("linger_s", 60.0),
        min_deadline_s=3.0,
        topk_density=cfg.get("topk_density", 1 / 32),
        topk_bits=cfg.get("topk_bits", 2),
        topk_chunk=cfg.get("topk_chunk", 4096),
    )
    behavior = cfg.get("behavior", "honest")
    liar = (
        lying_encoder(make_codec(config.codec), behavior)
        if behavior in ("nan", "shape", "huge")
        else None
    )
    averager = Averager(client, identity.peer_id, config, outgoing_encoder=liar)
    if behavior in ("forge", "equivocate"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script
        from tests.harness import forger

        forger.install() if behavior == "forge" else forger.install_equivocator()
    if behavior in ("flip", "x-20"):
        lie_as_reducer(-1.0 if behavior == "flip" else -20.0)
    if behavior == "slow":
        honest_put = client.put_tensor

        async def slow_put(*args: Any, **kwargs: Any) -> Any:
            await trio.sleep(30)
            return await honest_put(*args, **kwargs)

        client.put_tensor = slow_put  # type: ignore[method-assign]
        honest_get = averager._get_part

        async def slow_get(*args: Any, **kwargs: Any) -> Any:
            await trio.sleep(30)
            return await honest_get(*args, **kwargs)

        averager._get_part = slow_get  # type: ignore[method-assign]
    local = local_values(cfg["index"], cfg["numel"])
    # A training peer's PutTensor scratch (lifecycle.py) beside the all-reduce: both are
    # tensor methods a stranger can reach.
    services = [averager.service(), peer_service(identity, Scratch(1 << 20))]
    async with rpc.serve(services, "127.0.0.1", 0, identity=identity) as server:
        print(
            json.dumps(
                {
                    "address": str(server.address),
                    "peer_id": str(identity.peer_id),
                    "pid": os.getpid(),
                }
            ),
            flush=True,
        )
        while line := await trio.to_thread.run_sync(sys.stdin.readline):
            cmd = json.loads(line)
            # [peer_id, address] or [peer_id, address, client]: a client-mode member.
            members = tuple(
                Member(PeerId.from_string(m[0]), m[1], client=len(m) > 2 and bool(m[2]))
                for m in cmd["members"]
            )
            group = Group(round_id(cmd["round"]), members)
            weight = float(cfg.get("weight", 1.0))
            if psgd is not None:
                result = await allreduce_lowrank(
                    averager, group, local, weight, psgd, names, shapes
                )
            else:
                result = await averager.allreduce(group, local, weight)
            path = Path(cfg["out_dir"]) / f"{cfg['index']}-{cmd['round']}.pt"
            torch.save(result.tensor, path)
            print(
                json.dumps(
                    {
                        "ok": result.ok,
                        "dropped": sorted(str(p) for p in result.dropped),
                        "failed_parts": result.failed_parts,
                        "recovered_parts": result.recovered_parts,
                        "seconds": result.duration_s,
                        "file": str(path),
                    }
                ),
                flush=True,
            )
    client.close()


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
