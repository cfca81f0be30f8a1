"""A run's configuration: what every peer of the run must agree on, published in the DHT.

The run's creator signs it (every DHT record is signed) and stores it under
``swarmd/<run>/config``; a joining peer reads it and refuses to train if its own swarmd version
differs, because peers of different versions may compute different things from the same
bytes. The config hash goes into every state advert, so a state built under another config is
never loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import swarmd
from swarmd.node.algorithms.swarm.config import SwarmConfig
from swarmd.node.runkeys import CONFIG_TTL_S as CONFIG_TTL_S
from swarmd.node.runkeys import config_key as config_key
from swarmd.node.runkeys import peers_key as peers_key
from swarmd.optim.demo import DeMoConfig
from swarmd.optim.diloco import DiLoCoConfig
from swarmd.optim.schedule import SCHEDULES, LrSchedule
from swarmd.optim.streaming import LAYOUTS, StreamingConfig

#: What a model name (builtin, an installed workload's, or module:function) and a data name (a
#: path) may look like. Neither is ever imported or opened unless the joining user allowed it
#: (swarmd/workloads/allowed.py).
_MODEL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,256}")
_DATA_NAME = re.compile(r"[^\x00-\x1f\x7f]{1,1024}")
#: How a run's pseudo-gradients may travel (see `RunConfig.codec`).
CODECS = ("int8", "fp16", "fp32", "topk", "lowrank")
#: How reducers combine contributions (averaging/reduction.Aggregation).
AGGREGATIONS = ("mean", "trimmed_mean", "centered_clip")
#: Who may take part in a run (node/access.py), spelled out so this module imports no DHT.
ACCESS_MODES = ("open", "secret", "allowlist")
#: The training algorithms a run may use.
ALGORITHMS = ("diloco", "streaming-diloco", "demo", "swarm")


#: Integer options and their ranges (max_local_workers: see the field).
_INT_RANGES = (
    ("max_local_workers", 1, 1024),
    ("lowrank_rank", 1, 256),
    ("int8_block_size", 1, 1 << 16),
    ("int8_bits", 2, 8),
    ("state_quorum", 1, 64),
)


class RunConfigError(ValueError):
    """A run configuration is malformed, or belongs to another swarmd version."""


@dataclass(frozen=True)
class RunConfig:
    name: str
    #: `builtin` (the GPT below), an installed workload's entry-point name, or `module:function`
    #: returning the run's own nn.Module whose forward(idx, targets) gives (logits, loss).
    #: A joiner loads a non-built-in model only if its user allowed it (--model, or installed).
    model: str = "builtin"
    #: Model shape (the built-in GPT); see swarmd.workloads.GPTConfig.
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128
    #: `builtin` (the Python standard library's sources), a text file/directory, or `.bin`.
    data: str = "builtin"
    #: How many shards the training split is cut into; each peer reads one (its peer id's
    #: hash picks it). 64 keeps a large swarm's peers on different data; a run of a few
    #: peers should cut fewer, larger ones, or each peer soon trains epochs over a sliver
    #: (the built-in corpus has about 125 K training tokens per shard of 64).
    data_shards: int = 64
    batch_size: int = 8
    #: DiLoCo: inner AdamW steps between outer steps, and the optimisers' settings. 36 with
    #: the int8 defaults below (3-bit codes, blocks of 4096, zstd) is the best loss-per-byte
    #: point measured at >= 400x fewer bytes than data-parallel (the frontier in
    #: benchmarks/convergence.md: H=35 +13.1% over seeds 0-2 at 422x; H=36 so that streaming
    #: DiLoCo's default 2 fragments divide it). The former 8-bit codes at H=50: ~2.4x the bytes.
    inner_steps: int = 36
    #: DiLoCo: a round also ends once this many seconds have passed since its first inner
    #: step, 0 for none. For runs whose volunteers' GPUs differ: every peer trains the same
    #: seconds, weighted by the samples it got through, so the slow ones come to the round's
    #: group with the fast ones instead of after it has closed. inner_steps then caps a fast
    #: peer's steps and stays the run clock's length of a round (lr schedule, total_steps):
    #: set it above what the fastest peer runs in inner_seconds.
    inner_seconds: float = 0.0
    inner_lr: float = 1e-3
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    #: The inner learning rate over the run's inner steps: `constant`, or `cosine` (from
    #: inner_lr down to lr_final_ratio·inner_lr at lr_decay_steps, then held); both warm up
    #: linearly over lr_warmup_steps. Steps are the run's (round × H), not a peer's own, so
    #: a late joiner takes the schedule up where the group is.
    lr_schedule: str = "constant"
    lr_warmup_steps: int = 0
    lr_decay_steps: int = 0
    lr_final_ratio: float = 0.1
    #: The run's length in inner steps on the run's clock (round × H plus this peer's steps
    #: since, as for lr_schedule), 0 for none: a peer stops once the state it holds reaches
    #: it, so peers that joined late stop with the others, on the same state. --max-steps
    #: counts a peer's own steps instead; a late joiner that trained its 150 then went on
    #: alone after the others had stopped (3% apart in final loss, 6 peers in groups of 2).
    #: A multiple of inner_steps (peers end on an outer step); not for swarm (no run clock).
    total_steps: int = 0
    #: How pseudo-gradients travel: int8 (with error feedback), fp16, fp32, topk (sparse:
    #: per chunk of 4096 values the `topk_density` largest, in `topk_bits` bits, with error
    #: feedback carrying the rest; SparseLoCo's compressor), or lowrank (PowerSGD: each 2-D
    #: tensor as rank-`lowrank_rank` factors, averaged in two all-reduces, warm-started Q and
    #: error feedback; 1-D and small tensors whole, in fp32; DiLoCo only).
    codec: str = "int8"
    #: How a reducer combines its part's contributions (averaging/reduction.py): `mean`, or
    #: a Byzantine-robust rule for runs that expect liars: `trimmed_mean` (per coordinate,
    #: 20% off each end) or `centered_clip` (Karimireddy et al. 2021, clipped around the
    #: coordinate median). Robust rules apply from three contributions on; their results are
    #: checked by the proofs' entries only (a robust aggregate is not linear in them).
    aggregation: str = "mean"
    #: From three contributions on, one pointing against more than half of the others' (a
    #: negative inner product) is left out of the mean, while such are fewer than half: a
    #: DiLoCo reducer drops it from its part, a DeMo member from the step (not SWARM's stage
    #: averaging, whose gradients of different micro-batches are noisier). It keeps a liar
    #: inside the weight and norm bounds (3.9x its weight, its update reversed) from turning
    #: the honest members round; `false` keeps every in-bounds contribution.
    drop_opposed: bool = True
    #: A joiner takes a state only when at least this many distinct keys advertise it (the
    #: run creator's advert counts as enough alone), so that one liar cannot hand newcomers
    #: a poisoned state; 1 takes the newest advertised state (checked anyway: its layout,
    #: finite values and its loss on the joiner's batches, statesync/vet.py).
    state_quorum: int = 1
    #: int8: values per fp32 scale; `zstd`: a lossless zstd frame around each int8/fp16 part.
    #: 4096 with zstd sends 4.35x fewer bytes than fp32 where 256 alone sends 3.94x (a DiLoCo
    #: pseudo-gradient of the built-in GPT); error feedback carries the coarser rounding.
    int8_block_size: int = 4096
    #: int8: code range in bits, 2..8 (4: codes -7..7, still a byte each). With `zstd`, 4 bits
    #: send half the bytes of 8 (a DiLoCo run can then sync twice as often for the same
    #: bytes); error feedback carries the coarser rounding. Without zstd it saves nothing.
    int8_bits: int = 3
    zstd: bool = True
    #: topk: the share of each chunk a peer sends, in (0, 1]. 1/32 is the top of the 1-3%
    #: SparseLoCo trained well with at 2 bits; here DiLoCo's outer Nesterov step stays (they
    #: replaced it by decayed error feedback, which measured worse on the built-in model:
    #: +21.9% against the exact mean's +6.6% at H=15). On the frontier top-k trails int8 at
    #: equal bytes (benchmarks/convergence.md), so int8 is the default codec.
    topk_density: float = 1 / 32
    #: topk: bits of each sent value, 1, 2, 4 or 8 (the 2**bits levels are ±scale, ±3·scale,
    #: …: top-k values are far from zero, so no level is spent on it).
    topk_bits: int = 2
    #: lowrank: the rank r of each 2-D tensor's factors ((n + m) · r values instead of n · m).
    lowrank_rank: int = 4
    target_group_size: int = 16
    min_group_size: int = 2
    #: `grid` (DiLoCo, and streaming DiLoCo's fragment rounds): with more live peers than
    #: `target_group_size`, a round takes a roll call of every live peer and averages on a
    #: grid of ceil(log_T N) levels of groups planned from it, so every contribution reaches
    #: every peer in the round and the run keeps one state line (algorithms/loop.py
    #: `average_grid`, averaging/grid.py; codec lowrank stays flat). `flat`:
    #: groups cut from whoever announced, which fork into separate state lines when peers
    #: outnumber a group (6 peers in groups of 2: 4 states a round, 5.7x the wall time).
    grouping: str = "grid"
    #: Seed of the initial weights (identical on every peer) and of the data order.
    seed: int = 0
    #: `diloco`, or `streaming-diloco`: the model in `fragments` parts that sync one at a time
    #: (H/P steps apart), each round starting `overlap_steps` inner steps before it is needed
    #: while training goes on, the result mixed as (1 - mix_alpha)·outer + mix_alpha·local;
    #: `fragment_layout` strided (layer i in fragment i mod P), sequential, or balanced (single
    #: tensors dealt by size: the most even fragments, so the lowest peak); `eager`: apply
    #: this peer's own pseudo-gradient when the average is late, replaced when it comes. The
    #: streaming options are ignored by `diloco` (but still part of the config's hash).
    algo: str = "diloco"
    fragments: int = 2
    overlap_steps: int = 1
    mix_alpha: float = 0.5
    fragment_layout: str = "strided"
    eager: bool = False
    #: `demo` (DeMo, Peng et al. 2024): every inner step each peer sends the top `demo_topk`
    #: DCT coefficients per `demo_chunk`-sized block of its momentum (decay `demo_decay`) to
    #: its group and applies the sign of everyone's, at inner_lr, with decoupled
    #: `weight_decay`. Every `inner_steps` steps the group publishes its state (joiners take
    #: it) and re-forms, so newcomers get in and drifted peers re-sync. `demo_value_bits`:
    #: 16 sends values as bf16, 8 or 4 as integer codes with a scale per block; 4 (the
    #: default) lost nothing measurable against bf16 at 0.53x the bytes (seeds 0-2 through the
    #: daemon within 0.7% of data-parallel on the mean at 106x fewer bytes: convergence.md).
    demo_topk: int = 32
    demo_chunk: int = 64
    demo_decay: float = 0.999
    demo_value_bits: int = 4
    #: Each member's coefficients for a tensor are clipped to this multiple of the group's
    #: median norm before the mean whose sign every member steps by (optim/demo.py); 0 is
    #: the paper's plain mean, which one member sending x(-1000) its coefficients steers.
    demo_clip: float = 2.0
    weight_decay: float = 0.0
    #: The most local ranks (`swarmd join --local-workers`) one peer may train on: a peer's
    #: outer weight is its samples, N times one process's, and the all-reduce drops a member
    #: declaring more than `max_weight`, so this bounds how much one peer may count.
    max_local_workers: int = 8
    #: `swarm` (SWARM parallelism, Ryabinin et al. 2023): the model cut into `swarm_stages`
    #: pipeline stages, each served by several peers; trainers route every micro-batch of
    #: `batch_size` sequences through one server per stage; each stage's servers average
    #: gradients and step AdamW (at inner_lr, weight_decay) every `swarm_round_s` seconds;
    #: servers move to the bottleneck stage (see swarmd/node/algorithms/swarm/config.py for each).
    swarm_stages: int = 3
    swarm_round_s: float = 5.0
    swarm_rebalance_s: float = 30.0
    swarm_rebalance_gain: float = 1.25
    swarm_activations: str = "fp16"
    swarm_inflight: int = 4
    swarm_call_timeout_s: float = 30.0
    swarm_swap: float = 0.0
    swarm_audit: float = 0.125
    #: Who may take part (node/access.py): `open` (anyone), `secret` (peers that hold the
    #: run's secret: `swarmd join --secret-file`), or `allowlist` (keys the creator allowed
    #: with `swarmd run allow`). In every mode the creator can ban a key (`swarmd run deny`).
    access: str = "open"
    version: str = field(default=swarmd.__version__)

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 64 or "/" in self.name:
            raise RunConfigError("run name must be 1-64 characters without '/'")
        shards = self.data_shards
        if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= 64:
            raise RunConfigError(f"data_shards must be an integer in [1, 64], got {shards!r}")
        for name in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "inner_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RunConfigError(f"{name} must be a positive integer, got {value!r}")
        self._check_total_steps()
        if self.n_embd % self.n_head:
            raise RunConfigError("n_embd must be divisible by n_head")
        for name, low, high in _INT_RANGES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise RunConfigError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
        if not isinstance(self.model, str) or not _MODEL_NAME.fullmatch(self.model):
            raise RunConfigError(
                "model must be 'builtin', an installed workload's name or 'module:function', "
                f"got {self.model!r}"
            )
        if not isinstance(self.data, str) or not _DATA_NAME.fullmatch(self.data):
            raise RunConfigError(f"data must be 'builtin' or a path, got {self.data!r}")
        for name, choices in (
            ("codec", CODECS),
            ("aggregation", AGGREGATIONS),
            ("access", ACCESS_MODES),
            ("algo", ALGORITHMS),
        ):
            if getattr(self, name) not in choices:
                raise RunConfigError(
                    f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}"
                )
        if self.codec == "lowrank" and self.algo not in ("diloco", "streaming-diloco"):
            raise RunConfigError(
                f"codec lowrank factors DiLoCo's and streaming DiLoCo's pseudo-gradients, not "
                f"{self.algo}'s updates"
            )
        density = self.topk_density
        if isinstance(density, bool) or not isinstance(density, (int, float)):
            raise RunConfigError(f"topk_density must be a number in (0, 1], got {density!r}")
        if not 1 / 4096 <= density <= 1:
            raise RunConfigError(
                f"topk_density must be in [1/4096, 1] (at least one value of each chunk of "
                f"4096), got {density!r}"
            )
        if isinstance(self.topk_bits, bool) or self.topk_bits not in (1, 2, 4, 8):
            raise RunConfigError(f"topk_bits must be 1, 2, 4 or 8, got {self.topk_bits!r}")
        for flag in ("zstd", "drop_opposed"):
            if not isinstance(getattr(self, flag), bool):
                raise RunConfigError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        self._check_inner_seconds()
        if not 1 <= self.min_group_size <= self.target_group_size:
            raise RunConfigError("need 1 <= min_group_size <= target_group_size")
        if self.grouping not in ("grid", "flat"):
            raise RunConfigError(f"grouping must be grid or flat, got {self.grouping!r}")
        if not (0 < self.inner_lr < 1 and 0 < self.outer_lr <= 10 and 0 <= self.outer_momentum < 1):
            raise RunConfigError("learning rates or momentum out of range")
        try:
            self.lr_schedule_config()
        except ValueError as exc:
            raise RunConfigError(f"lr_schedule options: {exc}") from None
        if self.algo == "streaming-diloco":
            try:
                self.streaming_config()
            except ValueError as exc:
                raise RunConfigError(f"streaming-diloco: {exc}") from None
        try:
            self.demo_config()
        except ValueError as exc:
            raise RunConfigError(f"demo options: {exc}") from None
        self._check_swarm()

    def _check_inner_seconds(self) -> None:
        seconds = self.inner_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise RunConfigError(f"inner_seconds must be a number of seconds, got {seconds!r}")
        if not (0 <= seconds < math.inf):
            raise RunConfigError(f"inner_seconds must be >= 0 (0: none), got {seconds!r}")
        if seconds and self.algo != "diloco":
            raise RunConfigError(
                f"inner_seconds bounds plain DiLoCo's rounds; {self.algo} paces its own "
                "(streaming fragments by steps, DeMo every step, swarm by swarm_round_s)"
            )

    def _check_total_steps(self) -> None:
        total = self.total_steps
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise RunConfigError(f"total_steps must be a non-negative integer, got {total!r}")
        if total and self.algo == "swarm":
            raise RunConfigError(
                "total_steps needs a run clock (diloco, streaming-diloco, demo); a swarm peer "
                "stops at its own --max-steps or --duration"
            )
        if total % self.inner_steps:
            raise RunConfigError(
                f"total_steps ({total}) must be a multiple of inner_steps ({self.inner_steps}): "
                "peers end on an outer step"
            )

    def _check_swarm(self) -> None:
        """SWARM's options, and how the built-in GPT's blocks cut into its stages."""
        try:
            swarm = self.swarm_config()
        except ValueError as exc:
            raise RunConfigError(f"swarm options: {exc}") from None
        if self.algo != "swarm" or self.model != "builtin":
            return
        if swarm.stages > self.n_layer:
            raise RunConfigError(
                f"swarm_stages ({swarm.stages}) must be at most n_layer ({self.n_layer}): "
                "each stage holds at least one block"
            )
        if swarm.swap > 0:
            n, k = self.n_layer, swarm.stages
            blocks = [(i + 1) * n // k - i * n // k for i in range(k)]
            if k < 2 or blocks[0] != blocks[1] or blocks[-1] != blocks[-2]:
                raise RunConfigError(
                    f"swarm_swap (CheckFree+) needs at least 2 stages with the first and last "
                    f"holding as many blocks as their neighbours: {n} blocks in {k} stages "
                    f"are cut {blocks} (make n_layer a multiple of swarm_stages)"
                )

    def lr_schedule_config(self) -> LrSchedule:
        """The inner learning-rate schedule (raises ValueError with the reason if invalid)."""
        kind = next((k for k in SCHEDULES if k == self.lr_schedule), None)
        if kind is None:
            raise ValueError(
                f"lr_schedule must be one of {', '.join(SCHEDULES)}, got {self.lr_schedule!r}"
            )
        return LrSchedule(
            kind,
            warmup_steps=self.lr_warmup_steps,
            decay_steps=self.lr_decay_steps,
            final_ratio=self.lr_final_ratio,
        )

    def diloco_config(self) -> DiLoCoConfig:
        """The optimiser settings every peer of the run uses."""
        return DiLoCoConfig(
            inner_steps=self.inner_steps,
            inner_lr=self.inner_lr,
            lr_schedule=self.lr_schedule_config(),
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            # Streaming: a fragment round that failed leaves that fragment's global copy as it
            # was (a round that failed for everyone keeps them all identical); plain DiLoCo
            # applies the peer's own pseudo-gradient, as it always has.
            on_failure="defer" if self.algo == "streaming-diloco" else "local",
            inner_seconds=float(self.inner_seconds),
        )

    def streaming_config(self) -> StreamingConfig:
        """Streaming DiLoCo's settings (raises ValueError with the reason if inconsistent)."""
        layout = next((x for x in LAYOUTS if x == self.fragment_layout), None)
        if layout is None:
            raise ValueError(
                f"fragment_layout must be one of {', '.join(LAYOUTS)}, got {self.fragment_layout!r}"
            )
        return StreamingConfig(
            self.diloco_config(),
            fragments=self.fragments,
            overlap_steps=self.overlap_steps,
            mix_alpha=self.mix_alpha,
            layout=layout,
            eager=self.eager,
        )

    def demo_config(self) -> DeMoConfig:
        """DeMo's settings (raises ValueError with the reason if invalid)."""
        for name in ("demo_topk", "demo_chunk", "demo_value_bits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        return DeMoConfig(
            lr=self.inner_lr,
            compression_decay=self.demo_decay,
            compression_topk=self.demo_topk,
            compression_chunk=self.demo_chunk,
            weight_decay=self.weight_decay,
            value_bits=self.demo_value_bits,
            clip_to_median=self.demo_clip,
            drop_opposed=self.drop_opposed,
        )

    def swarm_config(self) -> SwarmConfig:
        """SWARM's settings (raises ValueError with the reason if invalid)."""
        return SwarmConfig(
            stages=self.swarm_stages,
            round_s=self.swarm_round_s,
            rebalance_s=self.swarm_rebalance_s,
            rebalance_gain=self.swarm_rebalance_gain,
            activations=self.swarm_activations,
            inflight=self.swarm_inflight,
            call_timeout_s=self.swarm_call_timeout_s,
            swap=self.swarm_swap,
            audit=self.swarm_audit,
        )

    # -- serialisation ---------------------------------------------------------------------

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_mapping(cls, values: dict[str, Any], *, name: str | None = None) -> RunConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise RunConfigError(f"unknown run option(s): {', '.join(unknown)}")
        merged = dict(values)
        if name is not None:
            merged["name"] = name
        if "name" not in merged:
            raise RunConfigError("a run needs a name")
        try:
            return cls(**merged)
        except TypeError as exc:
            raise RunConfigError(str(exc)) from None

    @classmethod
    def from_json(cls, raw: bytes) -> RunConfig:
        try:
            values = json.loads(raw)
        except ValueError as exc:
            raise RunConfigError(f"run config is not JSON: {exc}") from None
        if not isinstance(values, dict):
            raise RunConfigError("run config must be a JSON object")
        config = cls.from_mapping(values)
        if config.version != swarmd.__version__:
            raise RunConfigError(
                f"run {config.name!r} was created with swarmd {config.version}, this is "
                f"swarmd {swarmd.__version__}: install that version to join it"
            )
        return config

    @classmethod
    def from_toml(cls, path: Path, *, name: str | None = None) -> RunConfig:
        try:
            values = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise RunConfigError(f"run file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise RunConfigError(f"run file {path} is not valid TOML: {exc}") from None
        values.pop("version", None)
        return cls.from_mapping(values, name=name)

    @property
    def max_weight(self) -> float:
        """The most samples an honest peer can declare for one outer step: its H inner steps of
        one batch on each of its local ranks, four times over (a streaming fragment whose round
        was deferred carries its samples into the next, plus the overlap steps)."""
        return 4.0 * self.inner_steps * self.batch_size * self.max_local_workers

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.to_json()).hexdigest()[:16]
