"""The Byzantine peer's process: `swarmd` itself, with chaos/byzantine.py's lie installed
first (`SWARMD_LIE`). `swarmd chaos --byzantine` starts it as `python -m swarmd.node.cli.liar`;
it lives with the CLI so that chaos never imports the command line that runs it."""

from __future__ import annotations

import os

from swarmd.node.chaos import byzantine
from swarmd.node.cli.app import entry


def main() -> None:
    byzantine.install(os.environ.get(byzantine.ENV_VAR, ""))
    entry()


if __name__ == "__main__":
    main()
