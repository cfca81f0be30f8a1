"""One JSON event per stdout line, written whole.

`print(line, flush=True)` makes two writes when stdout is unbuffered (the container image
sets PYTHONUNBUFFERED): the text, then the newline. A peer killed between the two leaves a
line without its end, and the next process writing to the same log (a restarted container)
continues that line, so its first event is lost to every reader. One `write` of the line
and its newline cannot be cut there.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def print_event(doc: dict[str, Any]) -> None:
    """`doc` as one JSON line on stdout, in one write, flushed."""
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()
