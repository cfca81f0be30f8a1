"""`swarmd export`'s options: a run's model out of the swarm (swarmd/node/cli/export.py)."""

from __future__ import annotations

from pathlib import Path

from swarmd.node.cli import commands
from swarmd.node.cli.options import address_list, positive_float, positive_int
from swarmd.node.cli.parser_keys import Subparsers


def add_export(sub: Subparsers) -> None:
    p = sub.add_parser(
        "export",
        help="write a run's model to DIR/model.safetensors (+ config.json for transformers)",
        description="Takes the state most live peers of a run hold (at least --quorum of them "
        "agreeing on its hash; default: a majority of the peers advertising a state), or a "
        "peer's own saved state (--state-dir), and writes its model's weights as safetensors. "
        "The built-in GPT is written in Hugging Face's GPT-2 layout with a config.json, so "
        "transformers.AutoModelForCausalLM.from_pretrained(DIR) loads it; a user's model is "
        "written under its own parameter names. Files are written to a temporary name and "
        "renamed. Exit code 1 if the run is unknown or no quorum agrees, 2 on a state that "
        "does not fit its config or an unwritable DIR, 3 if no bootstrap answers.",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--run", help="the run's name (with --peers)")
    where.add_argument(
        "--state-dir", type=Path, help="a peer's --state-dir: export its own saved state offline"
    )
    p.add_argument("--peers", type=address_list, help="bootstrap peers, HOST:PORT[,...]")
    p.add_argument("--out", type=Path, required=True, help="directory to write into")
    p.add_argument(
        "--dtype", choices=("fp32", "bf16"), default="fp32", help="weights' dtype (default fp32)"
    )
    p.add_argument(
        "--quorum",
        type=positive_int,
        default=None,
        help="live peers that must hold the exported state (default: a majority)",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=600.0,
        help="seconds the download may take (default: 600)",
    )
    p.set_defaults(func=commands.cmd_export)
