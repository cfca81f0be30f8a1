"""Regenerates swarmd/protocol/swarmd_pb2.py(i) from swarmd.proto (needs grpcio-tools).

Only message classes are generated: the service wiring lives in swarmd/protocol/rpc.py, the one
module that imports grpc, so no *_pb2_grpc.py is produced.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent.parent / "swarmd" / "protocol"


def generate(out_dir: Path) -> None:
    """Writes swarmd_pb2.py and swarmd_pb2.pyi for swarmd.proto into out_dir."""
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        str(PROTO_DIR / "swarmd.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR)
