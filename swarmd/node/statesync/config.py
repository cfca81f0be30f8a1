"""How a joiner downloads a state: streams per donor, timeouts, back-off, failure limits and
the largest state it accepts. Its own module because both the download (download.py) and its
donor scheduling (donorpool.py) read it, and neither should import the other for it."""

from __future__ import annotations

from dataclasses import dataclass

from swarmd.node.statesync.snapshot import MAX_STATE_BYTES


@dataclass(frozen=True)
class SyncConfig:
    #: Chunk streams at once from one donor: two keep its pipe full across request latency.
    per_donor: int = 2
    #: Bound on each manifest request; a donor slower than this is not worth waiting for.
    manifest_timeout_s: float = 5.0
    #: Bound on a chunk before any throughput has been measured (then it is derived from it).
    first_chunk_timeout_s: float = 20.0
    #: A chunk may take ``timeout_slack`` times as long as the measured throughput predicts.
    timeout_slack: float = 4.0
    #: Floor of the derived chunk timeout: scheduling jitter on a loaded machine, not bandwidth.
    min_chunk_timeout_s: float = 1.0
    backoff_base_s: float = 0.05
    backoff_max_s: float = 2.0
    #: Consecutive failed fetches after which a donor is dropped for this download.
    max_donor_failures: int = 3
    #: Failed fetches of one chunk (over all donors) after which the download gives up.
    max_chunk_failures: int = 8
    #: Largest state a joiner accepts: checked on the manifest, before allocating the buffer.
    max_state_bytes: int = MAX_STATE_BYTES
    progress_interval_s: float = 2.0

    def __post_init__(self) -> None:
        if self.per_donor < 1 or self.max_donor_failures < 1 or self.max_chunk_failures < 1:
            raise ValueError("SyncConfig counts must be >= 1")
        for name in (
            "manifest_timeout_s",
            "first_chunk_timeout_s",
            "min_chunk_timeout_s",
            "backoff_base_s",
            "progress_interval_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"SyncConfig.{name} must be positive")
        if self.timeout_slack < 1:
            raise ValueError("SyncConfig.timeout_slack must be >= 1")
        if self.backoff_max_s < self.backoff_base_s:
            raise ValueError("SyncConfig.backoff_max_s must be >= backoff_base_s")
        if self.max_state_bytes < 0:
            raise ValueError("SyncConfig.max_state_bytes must be >= 0")
