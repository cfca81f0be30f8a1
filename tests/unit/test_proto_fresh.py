"""The committed swarmd_pb2.py must match swarmd.proto (run scripts/gen_proto.py to fix)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

from swarmd.protocol import swarmd_pb2

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_proto
    finally:
        sys.path.pop(0)
    gen_proto.generate(tmp_path)
    # Compare descriptors, not text: protoc versions differ in comments and layout only.
    source = (tmp_path / "swarmd_pb2.py").read_text()
    marker = "AddSerializedFile("
    start = source.index(marker) + len(marker)
    fresh_bytes = eval(source[start : source.index(")\n", start)])  # a bytes literal
    fresh = descriptor_pb2.FileDescriptorProto.FromString(fresh_bytes)
    committed = descriptor_pb2.FileDescriptorProto()
    swarmd_pb2.DESCRIPTOR.CopyToProto(committed)
    assert fresh == committed, "swarmd_pb2.py is stale: run `python scripts/gen_proto.py`"
    assert importlib.util.find_spec("swarmd.protocol.swarmd_pb2") is not None
