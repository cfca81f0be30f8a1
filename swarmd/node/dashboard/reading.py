"""One read of a run from the DHT: its config, heartbeats, progress records, state adverts
and (SWARM) stage servers' records.

Everything here was published by strangers, so each value is validated before it is kept:
the config is read as plain JSON (not through RunConfig, which imports torch) and only the
fields the page shows are taken, each type-checked; progress records go through
ProgressRecord.from_bytes; adverts are decoded and bounded here. A value that fails is
dropped (and counted), never shown half-parsed.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError

from swarmd.node.algorithms.swarm.directory import StageRecord
from swarmd.node.dht import DHTNode, Value
from swarmd.node.peer.progress_record import (
    ProgressRecord,
    ProgressRecordError,
    check_text,
)
from swarmd.node.runkeys import (
    CONFIG_TTL_S,
    advert_key,
    config_key,
    heartbeat_address,
    peers_key,
    progress_key,
    stages_key,
)
from swarmd.protocol import statesync_pb2
from swarmd.protocol.identity import PeerId

#: The config fields the page shows, with the type each must have.
_CONFIG_FIELDS: dict[str, type] = {
    "algo": str,
    "model": str,
    "data": str,
    "n_layer": int,
    "n_head": int,
    "n_embd": int,
    "block_size": int,
    "batch_size": int,
    "inner_steps": int,
    "codec": str,
    "target_group_size": int,
    "min_group_size": int,
    "swarm_stages": int,
    "version": str,
}
#: The longest text shown from a config field or a heartbeat's address.
_MAX_SHOWN = 256
#: The most stages a run has (SwarmConfig.stages); a record naming a later one is not shown.
MAX_STAGES = 64


@dataclass(frozen=True)
class RunInfo:
    """The run's config as the page shows it, or why there is none to show."""

    #: Field -> value for the fields in _CONFIG_FIELDS the config has with the right type.
    fields: dict[str, str | int]
    #: sha256 of the published bytes, 16 hex digits (RunConfig.hash for an honest creator).
    config_hash: str
    creator: str
    #: Seconds since the config was published, from its record's expiry (it is published
    #: with CONFIG_TTL_S to live); None when the record says otherwise.
    age_s: float | None


@dataclass(frozen=True)
class Advert:
    """The state a peer advertises: its outer round and the hash of its state."""

    round: int
    state_hash: str


@dataclass
class Reading:
    """What one poll of the DHT found about a run."""

    run: RunInfo | None = None
    #: Why no config is shown although one was found ("" when there is none or it is fine).
    run_error: str = ""
    #: Live peers (heartbeats) -> the address each names.
    heartbeats: dict[str, str] = field(default_factory=dict)
    progress: dict[str, ProgressRecord] = field(default_factory=dict)
    adverts: dict[str, Advert] = field(default_factory=dict)
    #: SWARM runs: stage servers' records (algorithms/swarm/directory.py), by peer.
    stages: dict[str, StageRecord] = field(default_factory=dict)
    #: Published values refused as malformed.
    refused: int = 0


def parse_config(entries: dict[PeerId, Value], now: float) -> tuple[RunInfo | None, str]:
    """The run's config when exactly one key publishes one, else (None, why)."""
    if not entries:
        return None, ""
    if len(entries) > 1:
        return None, f"{len(entries)} keys publish a config for this run"
    creator, value = next(iter(entries.items()))
    try:
        values: Any = json.loads(value.value, parse_constant=lambda name: None)
    except (ValueError, RecursionError):
        return None, "the published config is not JSON"
    if not isinstance(values, dict):
        return None, "the published config is not a JSON object"
    fields: dict[str, str | int] = {}
    for name, kind in _CONFIG_FIELDS.items():
        item = values.get(name)
        if kind is int and isinstance(item, int) and not isinstance(item, bool):
            fields[name] = item
        elif kind is str and isinstance(item, str):
            try:
                fields[name] = check_text(name, item, _MAX_SHOWN)
            except ProgressRecordError:
                continue
    age = CONFIG_TTL_S - (value.expires - now)
    return (
        RunInfo(
            fields=fields,
            config_hash=hashlib.sha256(value.value).hexdigest()[:16],
            creator=str(creator),
            age_s=round(age, 1) if math.isfinite(age) and 0 <= age <= CONFIG_TTL_S else None,
        ),
        "",
    )


def parse_advert(raw: bytes) -> Advert | None:
    try:
        msg = statesync_pb2.StateAdvert.FromString(raw)
    except DecodeError:
        return None
    if len(raw) > 1024 or not 0 <= msg.round < 1 << 63 or not 1 <= len(msg.state_hash) <= 64:
        return None
    return Advert(msg.round, msg.state_hash.hex()[:16])


def parse_address(raw: bytes) -> str | None:
    try:
        return check_text("address", raw.decode(), _MAX_SHOWN)
    except (UnicodeDecodeError, ProgressRecordError):
        return None


async def read_run(dht: DHTNode, run: str) -> Reading:
    """One exhaustive read of the run's five keys; validates every value it keeps."""
    reading = Reading()
    reading.run, reading.run_error = parse_config(
        await dht.peers(config_key(run), exhaustive=True), dht.now()
    )
    for peer, value in (await dht.peers(peers_key(run), exhaustive=True)).items():
        address = parse_address(value.value)
        address = heartbeat_address(address) if address is not None else None
        reading.heartbeats[str(peer)] = address if address is not None else "?"
        reading.refused += address is None
    for peer, value in (await dht.peers(progress_key(run), exhaustive=True)).items():
        try:
            reading.progress[str(peer)] = ProgressRecord.from_bytes(value.value)
        except ProgressRecordError:
            reading.refused += 1
    for peer, value in (await dht.peers(advert_key(run), exhaustive=True)).items():
        advert = parse_advert(value.value)
        if advert is None:
            reading.refused += 1
        else:
            reading.adverts[str(peer)] = advert
    for peer, value in (await dht.peers(stages_key(run), exhaustive=True)).items():
        try:
            record = StageRecord.from_bytes(value.value)
            check_text("address", record.address, _MAX_SHOWN)
        except (ValueError, ProgressRecordError):
            reading.refused += 1
            continue
        if record.stage < MAX_STAGES and record.state != "leaving":
            reading.stages[str(peer)] = record
    return reading
