"""The layout rules of docs/architecture.md, checked on the source (no imports executed).

Dependencies point one way (nothing below `swarmd/node` imports it), only the transport imports
grpc, and modules and functions stay small enough to read in one sitting; an exception is
listed here with its reason, so growing past a limit is a decision, not a drift.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SWARMD = Path(__file__).resolve().parents[2] / "swarmd"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
#: path relative to swarmd/ (or "path:function") -> why it may be longer.
EXCEPTIONS: dict[str, str] = {}


def _sources() -> Iterator[Path]:
    for path in sorted(SWARMD.rglob("*.py")):
        if not path.name.endswith("_pb2.py"):  # generated
            yield path


def _imports(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _rel(path: Path) -> str:
    return path.relative_to(SWARMD).as_posix()


@pytest.mark.parametrize("layer", ["optim", "compression", "protocol", "workloads"])
def test_lower_layers_never_import_the_daemon(layer: str) -> None:
    offenders = [
        f"{_rel(path)} imports {name}"
        for path in (SWARMD / layer).rglob("*.py")
        for name in _imports(ast.parse(path.read_text()))
        if name == "swarmd.node" or name.startswith("swarmd.node.")
    ]
    assert offenders == []


def test_only_the_transport_imports_grpc() -> None:
    importers = {
        _rel(path)
        for path in _sources()
        if any(n == "grpc" or n.startswith("grpc.") for n in _imports(ast.parse(path.read_text())))
    }
    assert importers and all(p.startswith(("protocol/rpc", "protocol/_rpc")) for p in importers), (
        importers
    )


def test_modules_and_functions_stay_small() -> None:
    too_long = []
    for path in _sources():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES and _rel(path) not in EXCEPTIONS:
            too_long.append(f"{_rel(path)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                name = f"{_rel(path)}:{node.name}"
                if length > MAX_FUNCTION_LINES and name not in EXCEPTIONS:
                    too_long.append(f"{name}: {length} lines")
    assert too_long == []


def test_the_lifecycle_never_branches_on_the_algorithm() -> None:
    """The peer lifecycle looks a strategy up by name; algorithm names appear nowhere in it."""
    source = (SWARMD / "node" / "training" / "lifecycle.py").read_text()
    code = ast.unparse(ast.parse(source))  # comments dropped
    for name in ("diloco", "DiLoCo", "streaming", "Streaming"):
        assert name not in code
