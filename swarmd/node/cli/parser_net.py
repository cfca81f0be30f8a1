"""`swarmd join`'s network options: whom it dials first, where it listens, and whether others
can dial it at all (the reachability check, issue 27)."""

from __future__ import annotations

import argparse

from swarmd.node.cli.options import add_listen, add_rate_limits, address_list


def add_join_network(p: argparse.ArgumentParser) -> None:
    """How `join` reaches its peers and they reach it."""
    p.add_argument(
        "--peers",
        type=address_list,
        default=(),
        help="bootstrap peers, HOST:PORT[,HOST:PORT...] (omit only for the first peer)",
    )
    add_listen(p)
    add_rate_limits(p)
    p.add_argument(
        "--bulk-port",
        type=int,
        default=0,
        help="port of the bulk data plane: tensors (all-reduce parts, state downloads) travel "
        "there as plain TCP beside the gRPC port, at about half gRPC's CPU cost; 0 lets the OS "
        "choose (default). Peers learn it over gRPC and fall back to gRPC if it is unreachable",
    )
    p.add_argument(
        "--no-bulk",
        action="store_true",
        help="send tensors over the gRPC port only (a host that can open just one port)",
    )
    p.add_argument(
        "--reachable",
        choices=("auto", "yes", "no"),
        default="auto",
        help="can other peers dial this one? auto (default): ask the bootstrap peers to dial "
        "it back on its ports when it joins; no answer through (behind a home router or a "
        "firewall) puts it in client mode: it still trains and contributes, dialling out "
        "only, but reduces no part of the all-reduce and serves no state. yes / no: skip the "
        "check",
    )
