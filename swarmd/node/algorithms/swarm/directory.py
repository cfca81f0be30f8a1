"""Who serves which stage: each stage server's signed record in the DHT, and reading them.

A server refreshes its record every few seconds with what it measured: micro-batches per
second its stage computes (`rate`, from its call times over its last ~5 s of compute, sleeps
of a slowed device included) and how many calls wait for its compute (`queue`). Trainers
route by it; servers rebalance by it. The record's sub-key is its signer's peer id, so nobody
can speak for another server; everything read is checked and a malformed record is skipped,
not trusted. A record lapses `SwarmTimings.record_ttl_s` after its last refresh: a dead server
leaves the directory then (trainers learn sooner, when its calls fail).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass

from swarmd.node.dht import DHTNode
from swarmd.node.runkeys import stages_key
from swarmd.protocol.identity import PeerId

MAX_RECORD_BYTES = 512
#: Server states: serving a stage, downloading one it is moving to (it counts for that stage
#: already, so two servers don't both move to fill the same gap), or gone (a record can't be
#: deleted: the newest expiry wins in the DHT, so a leaving server outlives its last record
#: with one that says it left).
STATES = ("serving", "joining", "leaving")


@dataclass(frozen=True)
class StageRecord:
    stage: int
    address: str
    #: Micro-batches per second this server computes for its stage (forward + backward).
    rate: float
    #: Calls waiting for this server's compute when it published.
    queue: int
    state: str = "serving"
    #: The stage's round this server has reached.
    round: int = 0
    #: The norm of the stage's last averaged gradient (CheckFree weighs neighbours by it).
    grad_norm: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or not isinstance(self.stage, int) or self.stage < 0:
            raise ValueError("stage must be a non-negative int")
        if not isinstance(self.address, str) or not 0 < len(self.address) <= 256:
            raise ValueError("address must be a short string")
        r = self.rate
        if isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(r):
            raise ValueError("rate must be a finite number")
        if not 0 <= r <= 1e6:
            raise ValueError("rate out of range")
        g = self.grad_norm
        if isinstance(g, bool) or not isinstance(g, int | float) or not 0 <= g < 1e30:
            raise ValueError("grad_norm must be a finite non-negative number")
        for name in ("queue", "round"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 40:
                raise ValueError(f"{name} must be a non-negative int")
        if self.state not in STATES:
            raise ValueError(f"state must be one of {STATES}")

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> StageRecord:
        if len(raw) > MAX_RECORD_BYTES:
            raise ValueError("stage record too large")
        values = json.loads(raw)
        if not isinstance(values, dict):
            raise ValueError("stage record is not an object")
        try:
            return cls(**values)
        except TypeError as exc:
            raise ValueError(str(exc)) from None


async def publish(dht: DHTNode, run: str, peer: PeerId, record: StageRecord, ttl_s: float) -> None:
    """Stores (or refreshes) this server's record, to lapse ``ttl_s`` from now."""
    await dht.store(stages_key(run), record.to_bytes(), dht.now() + ttl_s, subkey=str(peer))


def gone(record: StageRecord) -> StageRecord:
    """The record that says this server left (its last one would otherwise count until it
    lapses)."""
    return dataclasses.replace(record, rate=0.0, queue=0, state="leaving")


async def read(dht: DHTNode, run: str, stages: int) -> dict[PeerId, StageRecord]:
    """The live stage servers of the run; records of stages the run does not have, or that
    fail to parse, are left out."""
    out: dict[PeerId, StageRecord] = {}
    for peer, value in (await dht.peers(stages_key(run))).items():
        try:
            record = StageRecord.from_bytes(value.value)
        except ValueError:
            continue
        if record.stage < stages and record.state != "leaving":
            out[peer] = record
    return out


def by_stage(records: dict[PeerId, StageRecord], stages: int) -> list[dict[PeerId, StageRecord]]:
    """The records grouped by stage (a list of `stages` maps, empty for unserved stages)."""
    out: list[dict[PeerId, StageRecord]] = [{} for _ in range(stages)]
    for peer, record in records.items():
        out[record.stage][peer] = record
    return out
