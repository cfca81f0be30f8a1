"""`swarmd status`: what the DHT knows of a run — its config, live peers, their states.

It joins the DHT as a client-only node (port 0: nobody adds it to their routing table), reads
the run's keys (config, heartbeats, state adverts, stage directory, progress records), prints,
and leaves; it never trains and never serves.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import trio

from swarmd.node.algorithms.swarm import directory
from swarmd.node.algorithms.swarm.directory import StageRecord, by_stage
from swarmd.node.algorithms.swarm.rebalance import stage_rates
from swarmd.node.dht import BootstrapError, Value
from swarmd.node.dht.oneshot import client_dht
from swarmd.node.peer.progress_record import ProgressRecord, ProgressRecordError
from swarmd.node.peer.runconfig import RunConfig, RunConfigError, peers_key
from swarmd.node.peer.runrecord import claims
from swarmd.node.runkeys import heartbeat_address, is_client, progress_key
from swarmd.node.runtime.errors import innermost
from swarmd.node.statesync.donor import StateAdvert, advert_key
from swarmd.protocol.identity import Identity, PeerId

#: The most stages a run may have (SwarmConfig.stages): records beyond are not a run's.
MAX_STAGES = 64


async def collect(run: str, peers: Sequence[str]) -> dict[str, Any]:
    async with client_dht(Identity.generate(), peers) as dht:
        found = await claims(dht, run)
        live = await dht.peers(peers_key(run), exhaustive=True)
        adverts = await dht.get_map(advert_key(run), exhaustive=True)
        servers = await directory.read(dht, run, MAX_STAGES)
        progress = await dht.get_map(progress_key(run), exhaustive=True)
    report: dict[str, Any] = {"run": run, "config": None, "peers": [], "round": None}
    if len(found) > 1:
        keys = ", ".join(str(c.creator) for c in found)
        report["config"] = {"error": f"{len(found)} keys publish a config for this run: {keys}"}
    elif found:
        try:
            config = RunConfig.from_json(found[0].raw)
            report["config"] = {
                "hash": config.hash,
                "creator": str(found[0].creator),
                **json.loads(config.to_json()),
            }
        except RunConfigError as exc:
            report["config"] = {"error": str(exc)}
    states: dict[str, StateAdvert] = {}
    for subkey, value in adverts.items():
        try:
            states[subkey] = StateAdvert.from_bytes(value.value)
        except ValueError:
            continue
    now = time.time()
    for peer_id, value in sorted(live.items()):
        advert = states.get(str(peer_id))
        beat = value.value.decode("utf-8", "replace")
        report["peers"].append(
            {
                "peer_id": str(peer_id),
                "address": heartbeat_address(beat),
                "heartbeat_expires_in_s": round(value.expires - now, 1),
                "round": advert.round if advert else None,
                "state_hash": advert.state_hash.hex()[:16] if advert else None,
                # From the peer's signed state advert: client = others cannot dial it.
                "mode": "client" if (advert and advert.client) or is_client(beat) else "server",
            }
        )
    rounds = [a.round for a in states.values()]
    report["round"] = max(rounds) if rounds else None
    report["stages"] = _stages(servers)
    report["notices"] = _notices(progress)
    return report


#: The notices `status` prints (what peers published of their own: progress_record.Notice).
_SHOWN_NOTICES = {"stage_recovered": "recovery", "peer_banned": "ban"}


def _notices(progress: dict[str, Value]) -> list[dict[str, Any]]:
    """Stage recoveries and bans the live peers' progress records carry, oldest first."""
    found = []
    for peer_id, value in progress.items():
        try:
            record = ProgressRecord.from_bytes(value.value)
        except ProgressRecordError:
            continue
        for n in record.notices:
            if n.kind in _SHOWN_NOTICES:
                kind = _SHOWN_NOTICES[n.kind]
                found.append({"peer_id": peer_id, "time": n.time, "kind": kind, "text": n.text})
    return sorted(found, key=lambda n: n["time"])


def _stages(servers: dict[PeerId, StageRecord]) -> list[dict[str, Any]]:
    """A SWARM run's stages: each one's servers and their summed throughput."""
    if not servers:
        return []
    count = max(r.stage for r in servers.values()) + 1
    rates = stage_rates(servers, count)
    return [
        {
            "stage": stage,
            "rate": round(rates[stage], 3),
            "servers": [
                {
                    "peer_id": str(p),
                    "address": r.address,
                    "rate": round(r.rate, 3),
                    "queue": r.queue,
                    "state": r.state,
                    "round": r.round,
                }
                for p, r in sorted(group.items())
            ],
        }
        for stage, group in enumerate(by_stage(servers, count))
    ]


def status(run: str, peers: Sequence[str], as_json: bool) -> int:
    try:
        report = trio.run(collect, run, peers)
    except BaseExceptionGroup as group:
        leaf = innermost(group)
        if isinstance(leaf, BootstrapError):
            print(f"swarmd: error: {leaf}", file=sys.stderr)
            return 3
        raise
    if as_json:
        print(json.dumps(report))
        return 0 if report["config"] else 1
    if report["config"] is None:
        print(f"run {run!r}: no configuration in the DHT (is the name right? has it started?)")
        return 1
    cfg = report["config"]
    print(f"run {run!r}: config {cfg.get('hash', '?')}, created by {cfg.get('creator', '?')[:10]}")
    print(f"current outer round: {report['round'] if report['round'] is not None else '-'}")
    print(f"live peers: {len(report['peers'])}")
    for p in report["peers"]:
        state = (
            f"round {p['round']} state {p['state_hash']}"
            if p["round"] is not None
            else "no state yet"
        )
        mode = "  (client mode: unreachable)" if p["mode"] == "client" else ""
        print(f"  {p['peer_id'][:10]}  {p['address']:<21}  {state}{mode}")
    for stage in report["stages"]:
        servers = stage["servers"]
        print(
            f"stage {stage['stage']}: {len(servers)} servers, "
            f"{stage['rate']:.1f} micro-batches/s together"
        )
        for srv in servers:
            print(
                f"  {srv['peer_id'][:10]}  {srv['address']:<21}  {srv['state']}, round "
                f"{srv['round']}, {srv['rate']:.1f} micro-batches/s, queue {srv['queue']}"
            )
    for n in report["notices"]:
        when = time.strftime("%H:%M:%S", time.localtime(n["time"]))
        print(f"{n['kind']} {when} by {n['peer_id'][:10]}: {n['text']}")
    return 0
