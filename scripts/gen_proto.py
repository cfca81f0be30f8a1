"""Regenerates swarmd/protocol/*_pb2.py(i) from every .proto there (needs grpcio-tools).

Only message classes are generated: the service wiring lives in swarmd/protocol/rpc.py, the one
module that imports grpc, so no *_pb2_grpc.py is produced.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent.parent / "swarmd" / "protocol"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path) -> None:
    """Writes NAME_pb2.py and NAME_pb2.pyi for every NAME.proto into out_dir."""
    for proto in proto_files():
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            str(proto),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto.name}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR)
