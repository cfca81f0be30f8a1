"""`swarmd run allow|deny KEY`: the run creator rewrites the run's signed access list.

It joins the DHT as a client only (like `swarmd status`), checks that the key in --state-dir is
the one that signed the run's config (nobody else's list is ever read, so another key's would
change nothing), reads the newest list, changes one key and stores it under its own sub-key.
Peers of the run read the list every few seconds (node/access.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import trio

from swarmd.node.access import RunAccess, publish_list
from swarmd.node.cli.options import EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, CliError
from swarmd.node.dht import BootstrapError
from swarmd.node.dht.oneshot import client_dht
from swarmd.node.peer.runrecord import claims
from swarmd.node.runtime.errors import innermost
from swarmd.protocol.errors import IdentityError
from swarmd.protocol.identity import Identity, PeerId


async def _change(
    run: str, peers: Sequence[str], identity: Identity, action: str, key: PeerId
) -> str:
    async with client_dht(identity, peers) as dht:
        found = await claims(dht, run)
        mine = [c for c in found if c.creator == identity.peer_id]
        if not mine:
            signers = ", ".join(str(c.creator) for c in found) or "nobody (no such run)"
            raise CliError(
                f"the key in --state-dir ({identity.peer_id}) did not create run {run!r} "
                f"(its config is signed by {signers}): only the creator can change who "
                "may take part",
                EXIT_USAGE,
            )
        if key == identity.peer_id:
            raise CliError("the creator is always admitted and cannot ban itself", EXIT_USAGE)
        view = RunAccess(run, "open", identity.peer_id, identity.peer_id)
        await view.refresh(dht)
        now_ms = int(time.time() * 1000)
        listed = view.listed
        listed = listed.allowing(key, now_ms) if action == "allow" else listed.denying(key, now_ms)
        stored = await publish_list(dht, run, listed)
    if not stored:
        raise CliError("no DHT node stored the access list; try again", EXIT_UNREACHABLE)
    what = "allowed" if action == "allow" else "denied"
    return (
        f"{what} {key} in run {run!r} (list v{listed.version}: {len(listed.allow)} allowed, "
        f"{len(listed.deny)} denied; stored on {stored} nodes)"
    )


def change_access(run: str, peers: Sequence[str], state_dir: Path, action: str, key: PeerId) -> int:
    try:
        identity = Identity.load(state_dir)
    except (IdentityError, OSError) as exc:
        raise CliError(f"--state-dir {state_dir}: {exc}", EXIT_USAGE) from None
    try:
        print(trio.run(_change, run, peers, identity, action, key))
    except BaseExceptionGroup as group:
        leaf = innermost(group)
        if isinstance(leaf, CliError):
            raise leaf from None
        if isinstance(leaf, BootstrapError):
            raise CliError(str(leaf), EXIT_UNREACHABLE) from None
        raise
    return EXIT_OK
