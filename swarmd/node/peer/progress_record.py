"""A training peer's progress as it publishes it to the DHT, for `swarmd dashboard` to show.

One small JSON record per peer under the run's progress key (its sub-key is the peer's id, so
only that peer can write it; the DHT signs every record), refreshed with the progress line and
lapsing soon after the peer stops. Whoever reads it reads a stranger's claim: `from_bytes`
refuses anything that is not exactly the shape below (types, bounded lengths, printable text,
finite numbers) before a field is used, so a hostile peer can at worst publish wrong figures
about itself. Imports neither torch nor trio: the dashboard reads these without training.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any

#: A record's encoded size limit (a typical one is ~300 B; every text at its longest in
#: 4-byte characters, notices included, stays under it).
MAX_RECORD_BYTES = 8192
#: The longest --public-name, device or algorithm name accepted.
MAX_TEXT = 64
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_MAX_INT = (1 << 63) - 1
#: Tokens per second beyond this are not a claim worth drawing (a petaflop peer does ~1e8).
_MAX_RATE = 1e12
#: Notices a record carries at most, the longest notice text, and the most fragments a run has.
MAX_NOTICES = 6
MAX_NOTICE_TEXT = 160
MAX_FRAGMENTS = 1024


class ProgressRecordError(ValueError):
    """A published progress record is malformed; the reader ignores it."""


def check_text(name: str, value: object, limit: int = MAX_TEXT) -> str:
    """``value`` if it is a string of at most ``limit`` printable characters."""
    if not isinstance(value, str):
        raise ProgressRecordError(f"{name} must be a string")
    if len(value) > limit:
        raise ProgressRecordError(f"{name} is longer than {limit} characters")
    if _UNPRINTABLE.search(value):
        raise ProgressRecordError(f"{name} holds control characters")
    return value


def _check_int(name: str, value: object, limit: int = _MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise ProgressRecordError(f"{name} must be an integer in [0, {limit}]")
    return value


def _check_float(name: str, value: object, limit: float, *, optional: bool) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProgressRecordError(f"{name} must be a number")
    number = float(value)
    if not (math.isfinite(number) and 0.0 <= number <= limit):
        raise ProgressRecordError(f"{name} must be a finite number in [0, {limit:g}]")
    return number


@dataclass(frozen=True)
class Notice:
    """A notable event of the peer (a ban it made, a stage it rebuilt) for the dashboard's
    event list: what only that peer knows."""

    time: float
    kind: str
    text: str

    def __post_init__(self) -> None:
        _check_float("notice time", self.time, 1e11, optional=False)
        check_text("notice kind", self.kind, 32)
        check_text("notice text", self.text, MAX_NOTICE_TEXT)

    @classmethod
    def parse(cls, value: object) -> Notice:
        if not isinstance(value, dict) or set(value) != {"time", "kind", "text"}:
            raise ProgressRecordError("a notice must be an object of time, kind and text")
        return cls(value["time"], value["kind"], value["text"])


@dataclass(frozen=True)
class ProgressRecord:
    """What one peer says about its training; every field validated on construction."""

    step: int
    round: int
    #: The last inner step's training loss; None before the first step.
    loss: float | None
    #: Validation loss at the last outer round (or at the start); None before it.
    val_loss: float | None
    tokens_per_s: float
    #: Where the peer trains: "cpu", "cuda", "cuda:1", "mps".
    device: str
    #: The user's optional --public-name ("" when none).
    name: str
    sent_bytes: int
    received_bytes: int
    #: Size of the last outer round's group (1: alone) and how it ended ("averaged", "local",
    #: "alone", ...; "-" before the first).
    group_size: int
    last_outer: str
    algo: str
    #: The model's parameter count (0 before the model is built).
    params: int
    #: Streaming DiLoCo: the fragment whose round is on the wire (None: none). Optional in
    #: the encoding, as are the fields below (records of peers before they were added).
    in_flight: int | None = None
    #: The peer's latest notices, oldest first.
    notices: tuple[Notice, ...] = ()

    def __post_init__(self) -> None:
        for name in ("step", "round", "sent_bytes", "received_bytes", "params"):
            _check_int(name, getattr(self, name))
        _check_int("group_size", self.group_size, 1 << 16)
        for name in ("loss", "val_loss"):
            _check_float(name, getattr(self, name), 1e6, optional=True)
        _check_float("tokens_per_s", self.tokens_per_s, _MAX_RATE, optional=False)
        for name in ("device", "name", "last_outer", "algo"):
            check_text(name, getattr(self, name))
        if self.in_flight is not None:
            _check_int("in_flight", self.in_flight, MAX_FRAGMENTS)
        if len(self.notices) > MAX_NOTICES or not all(isinstance(n, Notice) for n in self.notices):
            raise ProgressRecordError(f"at most {MAX_NOTICES} notices")

    def to_bytes(self) -> bytes:
        raw = json.dumps(
            dataclasses.asdict(self), separators=(",", ":"), allow_nan=False, ensure_ascii=False
        ).encode()
        if len(raw) > MAX_RECORD_BYTES:  # unreachable with the limits above; said if not
            raise ProgressRecordError(f"progress record of {len(raw)} B is too large")
        return raw

    @classmethod
    def from_bytes(cls, raw: bytes) -> ProgressRecord:
        """Decodes a DHT value; raises ProgressRecordError (never anything else) if it is
        malformed. Unknown fields are ignored (a newer peer may say more)."""
        if len(raw) > MAX_RECORD_BYTES:
            raise ProgressRecordError(f"progress record of {len(raw)} B is too large")
        try:
            values: Any = json.loads(raw, parse_constant=_refuse_constant)
        except (ValueError, RecursionError) as exc:
            raise ProgressRecordError(f"progress record is not JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ProgressRecordError("progress record must be a JSON object")
        fields = dataclasses.fields(cls)
        required = [f.name for f in fields if f.default is dataclasses.MISSING]
        missing = [n for n in required if n not in values]
        if missing:
            raise ProgressRecordError(f"progress record lacks {', '.join(missing)}")
        given = {f.name: values[f.name] for f in fields if f.name in values}
        if "notices" in given:
            notices = given["notices"]
            if not isinstance(notices, list) or len(notices) > MAX_NOTICES:
                raise ProgressRecordError(f"notices must be a list of at most {MAX_NOTICES}")
            given["notices"] = tuple(Notice.parse(n) for n in notices)
        return cls(**given)


def _refuse_constant(name: str) -> float:
    """json.loads would otherwise turn NaN and Infinity into floats."""
    raise ProgressRecordError(f"progress record holds {name}")


def optional_loss(value: float) -> float | None:
    """A loss to publish: None for NaN (no step yet) or a value outside the record's range
    (a diverged run is shown as unknown rather than refused)."""
    return value if math.isfinite(value) and 0.0 <= value <= 1e6 else None
