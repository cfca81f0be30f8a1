"""What an all-reduce is told (its config) and what it reports (its result), plus the measured
throughput every deadline derives from."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swarmd.compression import Int8Config, TopKConfig, ZstdConfig
from swarmd.node.averaging.codecs import BYTES_PER_VALUE, TOPK_RESULT_BITS, CodecName
from swarmd.node.averaging.reduction import ReductionConfig
from swarmd.protocol.identity import PeerId


@dataclass(frozen=True)
class AllReduceConfig:
    codec: CodecName = "int8"
    #: int8: values sharing one fp32 scale (see Int8Config). Larger blocks spend fewer bytes
    #: on scales and, with ``zstd_level``, leave codes that entropy-code better (on a DiLoCo
    #: pseudo-gradient: 256 → 3.94x vs fp32, 4096 with zstd → 4.35x), at a coarser step that
    #: error feedback carries into the next round.
    int8_block_size: int = 256
    #: int8: code range in bits (see Int8Config.bits): below 8 only pays with ``zstd_level``.
    int8_bits: int = 8
    #: topk: share of each chunk of ``topk_chunk`` values a member sends, and the bits of
    #: each sent value (see TopKConfig and `codecs.result_codec` for the reduced part).
    topk_density: float = 1 / 32
    topk_bits: int = 2
    topk_chunk: int = 4096
    #: zstd level for a lossless frame around every lossy-coded part (int8 and fp16), or None.
    #: Costs about 3 ms per MB at level 3; fp32 parts are never framed (mantissas are noise).
    zstd_level: int | None = None
    #: Carry each peer's compression error into its next contribution (no effect for fp32).
    error_feedback: bool = True
    reduction: ReductionConfig = field(default_factory=ReductionConfig)
    #: Random probes a reducer's proof is checked on (proof.py); 0 trusts reducers. At the
    #: run's 3-bit int8 a sign-flipped part escaped 2 probes in 72% of 300 checks and 16 in
    #: 1% (proof.energy_factor says why); at 8 bits 2 probes already caught all 300. 16 cost
    #: 18 ms per check at the largest sample (2 probes: 7 ms).
    probes: int = 16
    #: Longest a member waits for its fellows' accepted proofs (verify.cross_check): also
    #: bounded by half the round's time so far.
    cross_check_s: float = 5.0
    #: The share of a part's blocks (~4096 values each) the probes read; parts of up to 16
    #: blocks are read whole (proof.sample says why not all, with the figures).
    probe_density: float = 1 / 32
    #: Deadlines: floor + slack x (bytes / measured throughput).
    min_deadline_s: float = 5.0
    max_deadline_s: float = 600.0
    deadline_slack: float = 4.0
    #: Throughput assumed before anything was measured (bytes/s); deliberately modest.
    initial_throughput: float = 50e6
    #: How long a finished round keeps serving its parts to slower members.
    linger_s: float = 60.0
    #: Messages for a round this peer has not registered yet wait this long for it.
    unknown_round_wait_s: float = 5.0
    max_pending_rounds: int = 64

    def __post_init__(self) -> None:
        if self.codec not in BYTES_PER_VALUE:
            raise ValueError(f"unknown codec {self.codec!r}; expected fp32, fp16, int8 or topk")
        Int8Config(self.int8_block_size, self.int8_bits)  # raises ValueError with the reason
        TopKConfig(self.topk_chunk, self.topk_density, self.topk_bits)  # the same, for top-k
        if self.zstd_level is not None:
            ZstdConfig(self.zstd_level)
        if not self.cross_check_s > 0:
            raise ValueError("cross_check_s must be > 0")
        if not 0 <= self.probes <= 16:
            raise ValueError("probes must be in [0, 16]")
        if not 0 < self.probe_density <= 1:
            raise ValueError("probe_density must be in (0, 1]")
        if not 0 < self.min_deadline_s <= self.max_deadline_s:
            raise ValueError("need 0 < min_deadline_s <= max_deadline_s")
        if self.deadline_slack < 1 or self.initial_throughput <= 0:
            raise ValueError("deadline_slack must be >= 1 and initial_throughput > 0")
        if self.linger_s < 0 or self.unknown_round_wait_s < 0 or self.max_pending_rounds < 1:
            raise ValueError("linger_s, unknown_round_wait_s must be >= 0, max_pending_rounds >= 1")

    @property
    def topk(self) -> TopKConfig:
        """The top-k codec's settings (raises ValueError with the reason if invalid)."""
        return TopKConfig(chunk=self.topk_chunk, density=self.topk_density, bits=self.topk_bits)

    def proof_block(self, codec: str) -> tuple[int, int]:
        """(block, bits) of the reduced part's rounding, which the proof's probes sample by
        and bound the error with (proof.quantization_bound): int8's blocks, top-k's chunks
        at the result's bits."""
        if codec == "topk":
            return self.topk_chunk, TOPK_RESULT_BITS
        return self.int8_block_size, self.int8_bits


@dataclass
class AllReduceResult:
    tensor: torch.Tensor
    #: Members left out of at least one part (never sent, sent garbage, stalled, died).
    dropped: set[PeerId]
    #: Parts that could not be averaged at all: they hold this peer's own values.
    failed_parts: list[int]
    #: Parts obtained from a relay or a fallback reducer rather than from their reducer.
    recovered_parts: list[int]
    duration_s: float
    #: Every member's contribution is in every part (this peer's own included, which
    #: `dropped` leaves out) and no part failed: the group's full mean. With proofs on, every
    #: member that got the same parts reaches the same answer, as each part's proof lists its
    #: contributions. A grid's upper group needs that: when only the parts a member reduced
    #: itself told it who was left out, a member that died mid-round (after sending to some
    #: reducers) left one group's members split on whether their mean was whole, and the
    #: grid forked (150 simulated peers, 5% replaced a round: 18 on 6 other results).
    whole: bool = True

    @property
    def ok(self) -> bool:
        return not self.failed_parts


class Throughput:
    """EWMA of bytes/s over completed transfers: the basis of every deadline."""

    def __init__(self, initial: float) -> None:
        self.value = initial
        self._measured = False

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes < (1 << 16) or seconds <= 0:
            return  # tiny transfers measure latency, not bandwidth
        rate = nbytes / seconds
        self.value = rate if not self._measured else 0.7 * self.value + 0.3 * rate
        self._measured = True
