"""The committed *_pb2.py must match their .proto files (run scripts/gen_proto.py to fix)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[2]
PROTOS = sorted(p.stem for p in (ROOT / "swarmd" / "protocol").glob("*.proto"))


def test_every_proto_is_covered() -> None:
    assert "swarmd" in PROTOS and "dht" in PROTOS


@pytest.mark.parametrize("name", PROTOS)
def test_generated_code_is_fresh(tmp_path: Path, name: str) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_proto
    finally:
        sys.path.pop(0)
    gen_proto.generate(tmp_path)
    # Compare descriptors, not text: protoc versions differ in comments and layout only.
    source = (tmp_path / f"{name}_pb2.py").read_text()
    marker = "AddSerializedFile("
    start = source.index(marker) + len(marker)
    fresh_bytes = eval(source[start : source.index(")\n", start)])  # a bytes literal
    fresh = descriptor_pb2.FileDescriptorProto.FromString(fresh_bytes)
    module = importlib.import_module(f"swarmd.protocol.{name}_pb2")
    committed = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(committed)
    assert fresh == committed, f"{name}_pb2.py is stale: run `python scripts/gen_proto.py`"
    assert (ROOT / "swarmd" / "protocol" / f"{name}_pb2.pyi").exists()
