"""The layout rules of docs/architecture.md, checked on the source (no imports executed).

Dependencies point one way (nothing below `swarmd/node` imports it; inside it, the shared
machinery imports neither the lifecycle nor an algorithm, the lifecycle no algorithm, and
nothing the CLI), no module takes part in an import circle, only the transport imports grpc,
a run's DHT keys are built in one module, no test module imports another, and modules and
functions stay small enough to read in one sitting; an exception is listed here with its
reason, so growing past a limit is a decision, not a drift.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SWARMD = ROOT / "swarmd"
NODE = SWARMD / "node"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
#: path relative to swarmd/ (or "path:function") -> why it may be longer.
EXCEPTIONS: dict[str, str] = {}


def _sources() -> Iterator[Path]:
    for path in sorted(SWARMD.rglob("*.py")):
        if not path.name.endswith("_pb2.py"):  # generated
            yield path


def _imports(tree: ast.AST, modules: Collection[str] = ()) -> Iterator[str]:
    """Every module an import names, wherever it stands (function-local and TYPE_CHECKING
    imports included); `from a import b` names `a.b` when that is one of ``modules``, else
    `a`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                yield sub if sub in modules else node.module


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """swarmd's modules and the swarmd modules each imports."""
    modules = {_module(path): path for path in SWARMD.rglob("*.py")}
    return {
        name: {
            n for n in _imports(ast.parse(path.read_text()), modules) if n in modules and n != name
        }
        for name, path in modules.items()
    }


def _package_imports(package: str) -> Iterator[tuple[str, str]]:
    """(importer, imported) for every swarmd import made by a module of ``package``."""
    for name, imported in _graph().items():
        if name == package or name.startswith(package + "."):
            yield from ((name, other) for other in imported)


def _within(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


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
    """The peer lifecycle is handed the algorithm table (algorithms/registry.py, by the CLI);
    algorithm names appear nowhere in it."""
    source = (NODE / "peer" / "lifecycle.py").read_text()
    code = ast.unparse(ast.parse(source))  # comments dropped
    names = re.findall(r"\b(?:diloco|streaming|demo|swarm)\b", code, flags=re.IGNORECASE)
    assert names == []


def test_no_import_circles() -> None:
    """Tarjan's strongly connected components of the module graph: each must be one module.
    A circle means two modules that cannot be read, tested or moved apart."""
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == []


#: The shared machinery both the lifecycle and the algorithms stand on.
SHARED = [
    f"swarmd.node.{p}"
    for p in ("dht", "averaging", "statesync", "runtime", "access", "bans", "metrics", "runkeys")
]
ABOVE_SHARED = [f"swarmd.node.{p}" for p in ("peer", "algorithms", "cli", "chaos", "dashboard")]


@pytest.mark.parametrize("package", SHARED)
def test_the_shared_machinery_imports_nothing_above_it(package: str) -> None:
    offenders = [
        f"{a} imports {b}" for a, b in _package_imports(package) if _within(b, *ABOVE_SHARED)
    ]
    assert offenders == []


#: What the lifecycle may read of an algorithm: the run config validates every algorithm's
#: settings when it is read, before the run's algorithm (and so its strategy) is known.
LIFECYCLE_MAY_READ = {"swarmd.node.algorithms.swarm.config"}


def test_the_lifecycle_imports_no_algorithm() -> None:
    offenders = [
        f"{a} imports {b}"
        for a, b in _package_imports("swarmd.node.peer")
        if _within(b, "swarmd.node.algorithms", "swarmd.node.cli", "swarmd.node.chaos")
        and b not in LIFECYCLE_MAY_READ
    ]
    assert offenders == []


def test_algorithms_import_no_other_algorithm() -> None:
    """Each algorithm is one package; they share only algorithms/loop.py, and the registry
    (algorithms/registry.py) names them all."""
    root = NODE / "algorithms"
    packages = sorted(p.name for p in root.iterdir() if (p / "__init__.py").exists())
    assert {"diloco", "streaming", "demo", "swarm"} <= set(packages)
    shared = ("swarmd.node.algorithms", "swarmd.node.algorithms.loop")
    offenders = [
        f"{a} imports {b}"
        for package in packages
        for a, b in _package_imports(f"swarmd.node.algorithms.{package}")
        if _within(b, "swarmd.node.algorithms")
        and not _within(b, f"swarmd.node.algorithms.{package}")
        and b not in shared
    ]
    assert offenders == []


def test_only_the_cli_imports_the_cli() -> None:
    offenders = [
        f"{a} imports {b}"
        for a, imported in _graph().items()
        for b in imported
        if _within(b, "swarmd.node.cli") and not _within(a, "swarmd.node.cli")
    ]
    assert offenders == []


def test_the_demo_command_and_demo_never_share_a_module_name() -> None:
    """`swarmd demo` (cli/showcase*.py) is not DeMo (algorithms/demo/, optim/demo.py)."""
    assert not list((NODE / "cli").glob("demo*.py"))


def _key_strings(tree: ast.AST) -> Iterator[int]:
    """Lines of string literals and f-strings that begin a run's DHT key ("swarmd/...")."""
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and node.values:
            first = node.values[0]
            if isinstance(first, ast.Constant) and str(first.value).startswith("swarmd/"):
                yield node.lineno


def test_every_run_key_is_built_in_runkeys() -> None:
    offenders = [
        f"{_rel(path)}:{line}"
        for path in _sources()
        if path != NODE / "runkeys.py"
        for line in _key_strings(ast.parse(path.read_text()))
    ]
    assert offenders == []


def test_no_test_module_imports_another() -> None:
    """Shared fixtures, helpers and the peer programs tests start live in tests/harness/; a
    test module imports nothing else of tests/, so each can be read and moved alone."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        offenders += [
            f"{path.relative_to(ROOT)} imports {name}"
            for name in _imports(ast.parse(path.read_text()))
            if _within(name, "tests") and not _within(name, "tests.harness") and name != "tests"
        ]
    assert offenders == []
