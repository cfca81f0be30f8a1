"""Keys and who may use them: `swarmd identity` (this peer's key) and `swarmd run` (the run
creator's access commands: allow, deny, secret)."""

from __future__ import annotations

import argparse
from typing import TypeAlias

from swarmd.node.cli import commands
from swarmd.node.cli.options import add_state_dir, address_list, peer_id, usage

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_run(sub: Subparsers) -> None:
    p = sub.add_parser(
        "run",
        help="a run creator's access commands: allow, deny, secret",
        description="Changes who may take part in a run. allow/deny rewrite the run's access "
        "list, which only the run's creator can sign: run them with the creator's --state-dir "
        '(its key). `allow KEY` admits a peer to an access = "allowlist" run; `deny KEY` '
        "bans a peer from the run in every access mode (every peer refuses its calls and its "
        'records). `secret` prints a new random secret for an access = "secret" run.',
    )
    rsub = p.add_subparsers(dest="action", metavar="ACTION")
    for action, text in (
        ("allow", "admit this peer id (printed by `swarmd identity show`) to the run"),
        ("deny", "ban this peer id from the run (a signed, run-wide ban)"),
    ):
        a = rsub.add_parser(action, help=text)
        a.add_argument("key", type=peer_id, metavar="PEER_ID")
        a.add_argument("--run", required=True, help="the run's name")
        a.add_argument(
            "--peers", type=address_list, required=True, help="bootstrap peers, HOST:PORT[,...]"
        )
        add_state_dir(a)
        a.set_defaults(func=commands.cmd_run_access)
    s = rsub.add_parser("secret", help="print a new random run secret (64 hex characters)")
    s.set_defaults(func=commands.cmd_run_secret)
    p.set_defaults(func=lambda args: usage(p))


def add_identity(sub: Subparsers) -> None:
    p = sub.add_parser("identity", help="create or show this peer's Ed25519 identity")
    isub = p.add_subparsers(dest="identity_command", metavar="ACTION")
    c = isub.add_parser("create", help="create a new identity key (mode 0600)")
    add_state_dir(c)
    c.add_argument("--force", action="store_true", help="replace an existing key")
    c.set_defaults(func=commands.cmd_identity_create)
    s = isub.add_parser("show", help="print the peer id of the stored identity")
    add_state_dir(s)
    s.set_defaults(func=commands.cmd_identity_show)
    p.set_defaults(func=lambda args: usage(p))
