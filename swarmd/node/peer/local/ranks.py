"""Rank 0's side of a peer's local ranks: start them, drive them, notice when one dies.

The design follows the split prime-diloco's ElasticDeviceMesh and torchft make between a local
group (fast, inside one machine, torch.distributed) and the global one (the swarm), with one
difference: here only rank 0 is a member of the swarm. The model is replicated on every rank
(DDP), so rank 0 holds the full parameters and can compute, send and apply the whole
pseudo-gradient itself; the other ranks never open a socket to another machine. What that
costs is memory (a full replica per GPU, as DDP always does) and the broadcast of the
parameters after each outer step, which over NVLink or shared memory takes milliseconds.

Failure model: any rank that dies or stops answering takes the peer down. Rank 0 learns it
either from the rank's process (polled before every step) or from a collective failing (gloo
raises when a socket closes; a hung rank runs into the process group's timeout). Nothing is
half-applied: the peer's state on disk is its last outer step's, written by rank 0 alone, and
the ranks never write anything. `swarmd join` then starts the peer again, which resumes from
that state with fresh ranks.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import FileStore, Store

from swarmd.node.peer.local.config import LocalConfig
from swarmd.node.peer.local.module import training_module
from swarmd.node.peer.local.protocol import (
    Op,
    WorkerSpec,
    batch_index,
    broadcast_params,
    gather_digests,
    send_command,
)
from swarmd.optim.forward import InnerForward

log = logging.getLogger("swarmd.local")

T = TypeVar("T")

#: Seconds a stopping rank gets to exit before it is killed.
STOP_GRACE_S = 10.0


class LocalRankError(Exception):
    """A local rank died or stopped answering; the message says which and how."""


def _collective_error(exc: BaseException) -> bool:
    """Whether `exc` came from torch.distributed (gloo reports a lost peer as a plain
    RuntimeError naming itself)."""
    text = str(exc)
    return isinstance(exc, dist.DistError) or any(k in text for k in ("gloo", "NCCL", "c10d"))


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass(frozen=True)
class _Rendezvous:
    store: Store
    path: str


def _rendezvous(work_dir: Path, world: int, timeout: datetime.timedelta) -> _Rendezvous:
    """The ranks' rendezvous: a torch FileStore in the peer's own directory, readable by its
    user alone. A TCPStore (torchrun's) listens on every interface whatever host it is given
    (measured: `*:PORT` for "127.0.0.1") and takes any client's reads and writes: another
    host could have set the ranks' keys. The ranks are on one machine, so a file does; a
    killed peer's leftover store is removed first (a stale one would hold old keys)."""
    work_dir.chmod(0o700)
    for stale in work_dir.glob("rendezvous-*"):
        stale.unlink(missing_ok=True)
    path = str(work_dir / f"rendezvous-{secrets.token_hex(8)}")
    store = FileStore(path, world)
    store.set_timeout(timeout)
    return _Rendezvous(store, path)


class LocalRanks(InnerForward):
    """Rank 0's `InnerForward`: each step it tells the other ranks to take the same step (on
    their own batches) and runs its own through DDP; parameters it changed outside a step
    (an outer step, a catch-up, a DeMo step) are broadcast first. Torch bumps a tensor's
    version counter on every in-place write, so rank 0 notices such changes without each
    strategy having to report them."""

    def __init__(
        self,
        config: LocalConfig,
        params: Sequence[nn.Parameter],
        procs: list[subprocess.Popen[bytes]],
        store: Store,
    ) -> None:
        super().__init__(nn.Identity())
        self.config = config
        self.world = config.workers
        self.params = list(params)
        self.procs = procs
        self._store = store  # the rendezvous: must outlive the process group's start
        self._device = config.rank_device(0)
        self._step = 0
        self._versions: list[int] | None = None
        self._broken = False
        self._closed = False

    # -- start -------------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        config: LocalConfig,
        spec: WorkerSpec,
        model: nn.Module,
        params: Sequence[nn.Parameter],
        work_dir: Path,
    ) -> LocalRanks:
        """Starts ranks 1..N-1 (`python -m swarmd.node.peer.local.worker`, torchrun's environment
        variables), waits until each has built its model, then forms the process group and
        wraps the model in DDP (which copies rank 0's parameters to every rank)."""
        timeout = datetime.timedelta(seconds=config.timeout_s)
        work_dir.mkdir(parents=True, exist_ok=True)
        spec_path = work_dir / "spec.json"
        spec.write(spec_path)
        store = _rendezvous(work_dir, config.workers, timeout)
        env = dict(os.environ)
        # gloo binds the interface its host name resolves to unless told; the ranks of one
        # machine talk over loopback only.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.update(
            SWARMD_LOCAL_STORE=store.path,
            WORLD_SIZE=str(config.workers),
            LOCAL_WORLD_SIZE=str(config.workers),
        )
        procs: list[subprocess.Popen[bytes]] = []
        ranks = cls(config, params, procs, store.store)
        try:
            for rank in range(1, config.workers):
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "swarmd.node.peer.local.worker", str(spec_path)],
                        env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                        stdout=sys.stderr,  # stdout carries rank 0's JSON lines
                    )
                )
            ranks._await_ready(store.store, config.timeout_s)
            if config.backend == "nccl":
                torch.cuda.set_device(ranks._device)
            dist.init_process_group(
                config.backend, store=store.store, rank=0, world_size=config.workers,
                timeout=timeout,
            )  # fmt: skip
            ranks.module = ranks._guard(
                lambda: training_module(
                    model, ranks._device, config.precision,
                    compile_model=config.compile, ddp=True,
                )
            )  # fmt: skip
        except BaseException:
            ranks.close()
            raise
        return ranks

    def _await_ready(self, store: Store, timeout_s: float) -> None:
        keys = [f"ready/{r}" for r in range(1, self.world)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            self._check_alive()
            if time.monotonic() > deadline:
                raise LocalRankError(
                    f"the local ranks did not start within {timeout_s:.0f}s "
                    "(building the model on each rank takes longer? their errors are above)"
                )
            time.sleep(0.05)

    # -- the step ----------------------------------------------------------------------------

    def data_index(self, step: int) -> int:
        """Rank 0's batch index at the peer's inner step `step` (the others take the next
        N-1); remembered for the next `begin`."""
        self._step = step
        return batch_index(step, 0, self.world)

    def begin(self, lr: float, *, optimizer_step: bool) -> None:
        self._check_alive()
        if self._versions != self._current_versions():
            self._guard(lambda: send_command(self._device, Op.SYNC))
            self._guard(lambda: broadcast_params(self.params))
        op = Op.INNER if optimizer_step else Op.GRADS
        self._guard(lambda: send_command(self._device, op, self._step, lr))

    def run(self, step: Callable[[], T]) -> T:
        # DDP's backward all-reduces with the other ranks: a dead one fails it (gloo: the
        # socket closes; seen when a rank was killed mid-step).
        return self._guard(step)

    def end(self) -> None:
        self._versions = self._current_versions()

    def digests(self) -> list[bytes]:
        """Each rank's digest of its parameters (rank 0's first): equal after every inner
        step when the replicas are identical (tests and diagnostics call it)."""
        self._check_alive()
        self._guard(lambda: send_command(self._device, Op.DIGEST))
        return self._guard(lambda: gather_digests(self.params, self._device))

    @property
    def pids(self) -> list[int]:
        """The process ids of ranks 1..N-1."""
        return [p.pid for p in self.procs]

    def _current_versions(self) -> list[int]:
        return [p._version for p in self.params]

    # -- failures and stop -------------------------------------------------------------------

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                self._broken = True
                raise LocalRankError(f"local rank {rank} {describe_exit(code)}")

    def _guard(self, fn: Callable[[], T]) -> T:
        """Runs `fn` (collectives, or a step with them inside); a failure becomes
        LocalRankError naming the dead rank if one is (a closed socket is how gloo reports a
        dead peer), or the collective's error; any other error (the model's own) stays what
        it is."""
        try:
            return fn()
        except Exception as exc:
            time.sleep(0.2)  # a dying rank's exit code lands a moment after its sockets close
            self._check_alive()
            if not _collective_error(exc):
                raise
            self._broken = True
            raise LocalRankError(f"a collective between local ranks failed: {exc}") from exc

    def close(self) -> None:
        """Stops every rank: a STOP command when the group still works, else (or if they do
        not exit in time) SIGTERM, then SIGKILL. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._broken and dist.is_initialized():
            try:
                send_command(self._device, Op.STOP)
            except Exception as exc:  # already broken: the signals below stop them
                log.debug("STOP to the local ranks failed: %s", exc)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs:
            if self._broken:
                proc.terminate()
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
