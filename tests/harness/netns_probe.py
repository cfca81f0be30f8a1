"""A tiny TCP probe run inside a network namespace by test_netns.py (no swarmd, no torch).

netns_probe.py serve HOST PORT      accept one connection, read to EOF, print
                                    {"bytes": N, "seconds": S} (first byte to EOF)
netns_probe.py send HOST PORT N     connect (2 s timeout), send N bytes, close; exit 3 if
                                    the connection cannot be made
"""

from __future__ import annotations

import json
import socket
import sys
import time


def serve(host: str, port: int) -> None:
    with socket.create_server((host, port)) as server:
        print(json.dumps({"listening": port}), flush=True)
        conn, _ = server.accept()
        with conn:
            total, first = 0, None
            while chunk := conn.recv(1 << 16):
                first = first if first is not None else time.monotonic()
                total += len(chunk)
            seconds = time.monotonic() - first if first is not None else 0.0
    print(json.dumps({"bytes": total, "seconds": seconds}), flush=True)


def send(host: str, port: int, nbytes: int) -> int:
    try:
        conn = socket.create_connection((host, port), timeout=2.0)
    except OSError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 3
    with conn:
        conn.settimeout(60.0)
        conn.sendall(b"\0" * nbytes)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"] and len(argv) == 3:
        serve(argv[1], int(argv[2]))
        return 0
    if argv[:1] == ["send"] and len(argv) == 4:
        return send(argv[1], int(argv[2]), int(argv[3]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
