"""Peer processes forked from one interpreter that has already imported torch and swarmd.

Why: a fresh interpreter spends about 2.7 CPU-seconds importing torch before a peer says a
word, and the suite starts hundreds of peers on a 2-core machine, several at a time, while
others are mid-round. The children here are still real processes: each has its own pid,
address space, sockets, stdio pipes and exit status, and receives the signals a test sends
(SIGKILL, SIGSTOP, SIGTERM) itself. Only the imports are shared, as multiprocessing's
forkserver shares them. ``SWARMD_TEST_ZYGOTE=0`` starts every process fresh instead.

The server (``python -m tests.harness.zygote SOCKET``) is single-threaded and never runs
torch or trio itself, so a fork copies no lock held by another thread. A request is one
frame on a Unix socket: JSON (argv, env, cwd) with the child's three stdio descriptors
passed alongside (SCM_RIGHTS). The server forks, answers the pid, and when it reaps the
child, the raw wait status; the connection is the client's handle on its child.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

#: Modules every peer program imports: loaded once in the server, shared by every child.
PRELOAD = (
    "torch",
    "numpy",
    "trio",
    "grpc",
    "cryptography.hazmat.primitives.ciphers.aead",
    "zstandard",
    "swarmd.node.cli.app",
    "swarmd.node.cli.commands",
    "swarmd.node.algorithms.registry",
    "swarmd.node.peer.lifecycle",
    "swarmd.node.peer.service",
    "swarmd.node.dht.main",
    "swarmd.workloads.gpt",
)
ENV_SWITCH = "SWARMD_TEST_ZYGOTE"
_HEADER = struct.Struct("!I")
_MAX_REQUEST = 1 << 20


# --- server -----------------------------------------------------------------------------


def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, _MAX_REQUEST, 3)
    while len(data) < _HEADER.size or len(data) < _HEADER.size + _HEADER.unpack_from(data)[0]:
        more = conn.recv(_MAX_REQUEST)
        if not more:
            raise ConnectionError("request cut short")
        data += more
    (size,) = _HEADER.unpack_from(data)
    request: dict[str, Any] = json.loads(data[_HEADER.size : _HEADER.size + size])
    return request, fds


def _serve(path: str) -> dict[str, Any] | None:
    """Answers requests until the parent goes away; returns only in a forked child, with the
    request it is to run (the caller runs it at the top of the stack, as a fresh `python`
    would, so SystemExit and atexit behave as they do there)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    parent = os.getppid()
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    print(json.dumps({"ready": os.getpid()}), flush=True)
    while os.getppid() == parent:
        for key, _ in sel.select(timeout=1.0):
            if key.fileobj is wake_r:
                with contextlib.suppress(BlockingIOError):
                    wake_r.recv(4096)
            elif key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _recv_request(conn)
                except (OSError, ValueError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    for sock in (listener, wake_r, wake_w, *children.values()):
                        sock.close()
                    conn.close()
                    sel.close()
                    _become(request, fds)
                    return request
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            reaped = children.pop(pid) if pid in children else None
            if reaped is not None:
                with contextlib.suppress(OSError):
                    reaped.sendall(json.dumps({"status": status}).encode() + b"\n")
                reaped.close()
    return None


def _become(request: Mapping[str, Any], fds: Sequence[int]) -> None:
    """Turns the forked server into the program a fresh interpreter would have been."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if request.get("new_session"):
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # The process's own standard streams, as a fresh interpreter makes them (never closed).
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False), encoding="utf-8")  # noqa: SIM115
    sys.stdout = io.TextIOWrapper(
        open(1, "wb", 0 if unbuffered else -1, closefd=False),  # noqa: SIM115
        encoding="utf-8",
        write_through=unbuffered,
    )
    sys.stderr = io.TextIOWrapper(
        open(2, "wb", 0, closefd=False),  # noqa: SIM115
        encoding="utf-8",
        errors="backslashreplace",
        line_buffering=True,
        write_through=True,
    )
    # What a fresh interpreter's originals are (faulthandler and friends write to them).
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr  # type: ignore[misc]
    # Fresh interpreters draw their seeds from the OS; forked ones would share the server's.
    import random

    import numpy
    import torch

    random.seed()
    numpy.random.seed()
    torch.seed()


def _run(request: Mapping[str, Any]) -> None:
    kind, target, args = request["kind"], request["target"], request["args"]
    if kind == "module":
        sys.argv = [target, *args]
        sys.path[0] = request["cwd"]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path[0] = str(Path(target).resolve().parent)
        runpy.run_path(target, run_name="__main__")


def server_main(path: str) -> None:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as swarmd's own main does
    for name in PRELOAD:
        __import__(name)
    request = _serve(path)
    if request is not None:
        _run(request)


# --- client -----------------------------------------------------------------------------


def _parse(args: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """(kind, target, args) for `python -m MOD ...` and `python SCRIPT ...`; None for any
    other command line, which then starts fresh."""
    if len(args) < 2 or args[0] != sys.executable:
        return None
    if args[1] == "-m" and len(args) >= 3:
        return "module", args[2], list(args[3:])
    if not args[1].startswith("-"):
        return "path", args[1], list(args[2:])
    return None


class ZygoteChild:
    """The parts of subprocess.Popen the tests and stop_all use, for a forked child."""

    def __init__(
        self,
        args: list[str],
        pid: int,
        conn: socket.socket,
        replies: IO[str],
        stdin: IO[str] | None,
        stdout: IO[str] | None,
        stderr: IO[str] | None,
    ) -> None:
        self.args = args
        self.pid = pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self._conn, self._replies = conn, replies
        self._done = threading.Event()
        threading.Thread(target=self._await_status, daemon=True).start()

    def _await_status(self) -> None:
        with self._conn, self._replies:
            for line in self._replies:
                message = json.loads(line)
                if "status" in message:
                    self.returncode = os.waitstatus_to_exitcode(message["status"])
                    break
        if self.returncode is None:  # the server died first: the child went with it
            self.returncode = -signal.SIGKILL
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The client: starts the server on first use and stops it when the tests end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: subprocess.Popen[str] | None = None
        # Made on import, so removed at exit even where no test started a process (a worker
        # that drew only unit tests, a benchmark): before, each left an empty directory.
        self._dir = tempfile.mkdtemp(prefix="swarmd-zygote-")
        self._path = os.path.join(self._dir, "sock")
        atexit.register(self.close)

    def _ensure(self) -> None:
        with self._lock:
            if self._server is not None and self._server.poll() is None:
                return
            root = str(Path(__file__).resolve().parents[2])
            self._server = subprocess.Popen(
                [sys.executable, "-m", "tests.harness.zygote", self._path],
                cwd=root,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert self._server.stdout is not None
            line = self._server.stdout.readline()
            if not line:
                raise RuntimeError("the zygote server did not start")

    def spawn(
        self,
        args: list[str],
        *,
        env: Mapping[str, str],
        stdin: bool,
        cwd: str | None = None,
    ) -> ZygoteChild | subprocess.Popen[str]:
        """Forks ``args`` when it is `python -m ...` or `python SCRIPT`; else starts it fresh."""
        parsed = _parse(args)
        if parsed is None or os.environ.get(ENV_SWITCH, "1") == "0":
            return subprocess.Popen(
                args,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=dict(env),
                cwd=cwd,
            )
        self._ensure()
        kind, target, rest = parsed
        in_r, in_w = os.pipe() if stdin else (os.open(os.devnull, os.O_RDONLY), -1)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        request = {
            "kind": kind,
            "target": target,
            "args": rest,
            "env": dict(env),
            "cwd": cwd or os.getcwd(),
        }
        body = json.dumps(request).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self._path)
            socket.send_fds(conn, [_HEADER.pack(len(body)) + body], [in_r, out_w, err_w])
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        replies = conn.makefile("r")
        pid = int(json.loads(replies.readline())["pid"])
        return ZygoteChild(
            list(args),
            pid,
            conn,
            replies,
            io.TextIOWrapper(open(in_w, "wb"), write_through=True) if stdin else None,
            io.TextIOWrapper(open(out_r, "rb")),
            io.TextIOWrapper(open(err_r, "rb")),
        )

    def close(self) -> None:
        with self._lock:
            if self._server is not None and self._server.poll() is None:
                self._server.kill()
                self._server.wait()
            self._server = None
        with contextlib.suppress(OSError):
            os.unlink(self._path)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)


ZYGOTE = Zygote()


if __name__ == "__main__":
    server_main(sys.argv[1])
