"""`swarmd dashboard`'s process: a client-only DHT node polling the run, and the HTTP server.

Hypercorn serves the Starlette app (app.py) with its trio worker, in the same trio run as the
DHT node, so the poll loop and the requests share one event loop and the Board needs no lock.
The DHT node listens on port 0 and serves nothing of its own, like `swarmd status`.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from swarmd.node.dashboard.app import make_app
from swarmd.node.dashboard.board import Board
from swarmd.node.dashboard.reading import read_run
from swarmd.node.dht import BootstrapError, DHTNode
from swarmd.node.runtime.errors import innermost
from swarmd.node.runtime.jsonlines import print_event
from swarmd.protocol import rpc
from swarmd.protocol.address import Address
from swarmd.protocol.identity import Identity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DashboardOptions:
    run: str
    peers: tuple[str, ...]
    listen: Address = field(default_factory=lambda: Address("127.0.0.1", 8080))
    #: Seconds between reads of the run (each is four exhaustive DHT lookups).
    poll_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.run or len(self.run) > 64 or "/" in self.run:
            raise ValueError("run name must be 1-64 characters without '/'")
        if not self.peers:
            raise ValueError("the dashboard needs --peers to join the DHT")
        if not 0.1 <= self.poll_s <= 3600:
            raise ValueError(f"poll interval must be in [0.1, 3600] s, got {self.poll_s}")


async def poll(dht: DHTNode, board: Board, poll_s: float) -> None:
    """Reads the run every ``poll_s`` into ``board`` until cancelled. A failed read is shown
    on the page, logged and retried, never fatal: the page is worth more up with the last
    reading and the error than down."""
    while True:
        try:
            with trio.fail_after(max(10.0, 3 * poll_s)):
                board.update(await read_run(dht, board.run))
        except Exception as exc:
            log.warning("reading run %r failed: %r", board.run, exc, exc_info=True)
            board.failed_poll(f"{type(exc).__name__}: {exc}")
        await trio.sleep(poll_s)


async def run_dashboard(
    options: DashboardOptions, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serves the dashboard until cancelled; ``task_status`` gets the page's URL."""
    identity = Identity.generate()
    client = rpc.RpcClient(identity)
    dht = DHTNode(identity, client)
    board = Board(options.run)
    config = Config()
    config.bind = [f"{options.listen.host}:{options.listen.port}"]
    config.accesslog = None
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(dht.run, 0, list(options.peers))
            binds = await nursery.start(serve, make_app(board), config)
            url = binds[0] + "/"
            nursery.start_soon(poll, dht, board, options.poll_s)
            task_status.started(url)
    finally:
        client.close()


async def _main(options: DashboardOptions) -> None:
    async with trio.open_nursery() as nursery:
        url = await nursery.start(run_dashboard, options)
        # A JSON line on stdout for scripts and tests (as `swarmd dht` announces itself), the
        # URL for a person on stderr.
        address = url.removeprefix("http://").rstrip("/")
        print_event({"event": "dashboard", "url": url, "address": address})
        print(f"[swarmd] dashboard of run {options.run!r}: {url}", file=sys.stderr, flush=True)


def dashboard(options: DashboardOptions) -> int:
    """`swarmd dashboard`'s exit code: 0 on Ctrl-C, 3 if no bootstrap peer answered."""
    try:
        trio.run(_main, options)
    except KeyboardInterrupt:
        return 0
    except BaseExceptionGroup as group:
        leaf = innermost(group)
        if isinstance(leaf, BootstrapError):
            print(f"swarmd: error: {leaf}", file=sys.stderr)
            return 3
        if isinstance(leaf, OSError):
            print(f"swarmd: error: cannot serve the dashboard: {leaf}", file=sys.stderr)
            return 1
        raise
    return 0
