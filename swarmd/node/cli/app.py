"""The `swarmd` command line.

Every option can also come from a TOML file (``--config FILE``, keys named like the long
options, per sub-command table or at top level) or an environment variable ``SWARMD_<OPTION>``
(e.g. ``SWARMD_STATE_DIR``). Precedence: command line, then environment, then file, then the
built-in default.

Exit codes: 0 success, 1 runtime failure, 2 bad usage or input, 3 peer unreachable or unhealthy.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from swarmd.node.cli.options import EXIT_UNREACHABLE, EXIT_USAGE, CliError, usage
from swarmd.node.cli.overlay import apply_overlays
from swarmd.node.cli.parser import build_parser

#: PyTorch backs CPU tensors of 2 MB and more with transparent huge pages when this is set
#: (kernels where THP is "madvise", the common default, give none otherwise). An all-reduce
#: allocates its result and reduced parts afresh every round: a 400 MB tensor's first touch
#: cost 0.18 CPU-s in 4 KiB page faults, 0.025 s in huge pages (measured on the 2-core
#: machine). Read once, at torch's first allocation: set before torch is imported.
THP_ENV = "THP_MEM_ALLOC_ENABLE"


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault(THP_ENV, "1")
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        apply_overlays(parser, args_list)
        args = parser.parse_args(args_list)
        logging.basicConfig(
            level=getattr(logging, args.log_level.upper()),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )
        if not hasattr(args, "func"):
            return usage(parser)
        code: int = args.func(args)
        return code
    except CliError as exc:
        print(f"swarmd: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
    except BaseExceptionGroup as group:  # from a command's trio.run
        from swarmd.node.dht import BootstrapError
        from swarmd.node.runtime.errors import innermost
        from swarmd.protocol.errors import ListenError

        leaf = innermost(group)
        if isinstance(leaf, CliError):
            print(f"swarmd: error: {leaf}", file=sys.stderr)
            return leaf.code
        if isinstance(leaf, ListenError | BootstrapError):
            print(f"swarmd: error: {leaf}", file=sys.stderr)
            return EXIT_USAGE if isinstance(leaf, ListenError) else EXIT_UNREACHABLE
        raise


def entry() -> None:
    """The `swarmd` command: `main`, then an exit that skips interpreter finalisation.

    By the time `main` returns, every server, channel and file of ours is closed and the state
    is saved, but grpcio's and torch's C++ threads can still abort the process while Python
    tears itself down ("terminate called without an active exception", SIGABRT): one of four
    daemons of a convergence benchmark run exited with -6 after a clean stop. os._exit leaves
    nothing of value behind: output is flushed and logging shut down first.
    """
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
