"""What the user of `swarmd join` chooses; the run's own settings are in runconfig.py.

The two are kept apart on purpose: a run config is signed by the run's creator and identical on
every peer, while these options are one volunteer's (where to listen, which device, when to
stop) and never cross the network.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from swarmd.node.algorithms.swarm.config import ROLES
from swarmd.node.peer.local.config import LocalConfig, choose_precision
from swarmd.node.peer.progress_record import check_text
from swarmd.node.peer.runconfig import RunConfig
from swarmd.protocol import rpc
from swarmd.protocol.address import Address
from swarmd.protocol.identity import PeerId
from swarmd.workloads import AllowedWorkloads, resolve_device

#: Shards a peer may name with --data-shard (a run cuts its data into `data_shards` <= this).
NUM_SHARDS = 64


class JoinError(Exception):
    """Joining failed in a way the user must fix; the message says how."""


@dataclass(frozen=True)
class JoinOptions:
    run: str
    state_dir: Path
    listen: Address = field(default_factory=lambda: Address("127.0.0.1", 0))
    peers: tuple[str, ...] = ()
    metrics: Address | None = None
    create_run: RunConfig | None = None
    #: Stop after this many inner steps or seconds (None: run until signalled).
    max_steps: int | None = None
    duration_s: float | None = None
    log_format: str = "text"
    progress_interval_s: float = 5.0
    join_timeout_s: float = 60.0
    #: Advertised bandwidth (bytes/s) for part sizing; the all-reduce measures the real one.
    bandwidth: float = 1e8
    #: Refuse to join a run whose config names another algorithm (None: any).
    algo: str | None = None
    #: The training shard to read (None: the one the peer id hashes to). For experiments
    #: that must compare methods on the same data; peers sharing a shard draw the same
    #: batches, so a swarm should leave this unset.
    data_shard: int | None = None
    #: The bulk data plane's port (0: the OS picks; None: tensors go over gRPC only).
    bulk_port: int | None = 0
    #: Whether others can dial this peer: auto (a dial-back check on join), yes, or no (client
    #: mode: it dials out only; --reachable).
    reachable: str = "auto"
    #: Requests per second this peer answers per peer id and per source address.
    rate_limits: rpc.RateLimits = field(default_factory=rpc.RateLimits)
    #: Where the model trains (swarmd/workloads/device.py): a peer's own choice.
    device: str = "auto"
    #: The only run config accepted is the one this key signed (None: the only one there is).
    creator: PeerId | None = None
    #: Models and data this peer's user allowed beyond the built-ins (--model, --data).
    allowed: AllowedWorkloads = field(default_factory=AllowedWorkloads)
    #: A name this peer shows on the run's dashboard (--public-name; "" for none).
    public_name: str = ""
    #: Ranks on this machine that train as this one peer (--local-workers; 1: this process).
    local_workers: int = 1
    #: auto (bf16 autocast on a GPU that has it, else fp32), fp32 or bf16 (--precision).
    precision: str = "auto"
    #: torch.compile the training forward (--compile).
    compile: bool = False
    #: SWARM runs: trainer, server, both, or auto (both) (--role); the stage to serve first
    #: (--stage; None: the one with the least throughput).
    role: str = "auto"
    stage: int | None = None
    #: SWARM servers: each compute holds the device `slowdown` times the fastest it took here,
    #: to emulate a slower GPU (--slowdown; benchmarks/swarm.py).
    slowdown: float = 1.0
    #: SWARM servers: append the id of every micro-batch whose backward this peer applied to
    #: <state-dir>/stage-applied.log (--swarm-audit; tests check exactly-once with it).
    swarm_audit: bool = False
    #: The run's secret (--secret-file), for runs with `access = "secret"`; never sent.
    secret: bytes | None = field(default=None, repr=False)
    #: The creator's starting weights (--init-weights; safetensors as `swarmd export` writes
    #: them). Joiners get them by state sync: a run config never names a local file.
    init_weights: Path | None = None

    def __post_init__(self) -> None:
        if self.log_format not in ("text", "json"):
            raise ValueError("log_format must be text or json")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("max_steps must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("duration_s must be > 0")
        if self.data_shard is not None and not 0 <= self.data_shard < NUM_SHARDS:
            raise ValueError(f"data_shard must be in [0, {NUM_SHARDS}), got {self.data_shard}")
        if self.bulk_port is not None and not 0 <= self.bulk_port <= 65535:
            raise ValueError(f"bulk_port must be in [0, 65535], got {self.bulk_port}")
        if self.reachable not in ("auto", "yes", "no"):
            raise ValueError(f"reachable must be auto, yes or no, got {self.reachable!r}")
        resolve_device(self.device)  # a missing GPU is a usage error, said before joining
        check_text("public_name", self.public_name)  # published: printable, at most 64 chars
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.stage is not None and not 0 <= self.stage < 64:
            raise ValueError(f"stage must be in [0, 64), got {self.stage}")
        if not 1.0 <= self.slowdown <= 1000.0:
            raise ValueError(f"slowdown must be in [1, 1000], got {self.slowdown}")
        self.local_config()  # more ranks than GPUs, an unknown precision: said before joining
        if self.init_weights is not None:
            if self.create_run is None:
                raise ValueError("--init-weights starts a new run: it needs --create-run")
            if self.create_run.algo == "swarm":
                raise ValueError("--init-weights: SWARM runs (a state per stage) not yet")

    def local_config(self) -> LocalConfig:
        """How this peer trains on its machine (ranks, precision, compilation)."""
        device = resolve_device(self.device)
        return LocalConfig(
            workers=self.local_workers,
            device=str(device),
            precision=choose_precision(self.precision, device),
            compile=self.compile,
        )
