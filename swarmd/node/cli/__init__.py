"""The `swarmd` command line: the parser, one module per command that does more than a call.

Importing it loads neither torch nor grpc: `swarmd dht`, `swarmd ping` and `swarmd --help`
start fast on machines that only route or watch (each command imports what it needs).
"""

from swarmd.node.cli.app import entry, main

__all__ = ["entry", "main"]
