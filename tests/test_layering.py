"""The import rules of docs/architecture.md, checked on the source (lazy imports included):
a module that breaks one fails here, naming the file and line. And no import loops: the graph of
modules importing modules (at the top, inside functions, and under `if TYPE_CHECKING:`, the
last checked on their own) has no cycle but those listed in `KNOWN_LOOPS`."""

from __future__ import annotations

import ast
import collections
from collections.abc import Iterable
from pathlib import Path

import pytest

import pdserve

SRC = Path(pdserve.__file__).parent

# (the package or module the rule is about, the imports it must not make, why)
RULES = [
    (
        "engine",
        ("pdserve.workers", "pdserve.router", "pdserve.transfer"),
        "the engine is a library",
    ),
    ("transfer", ("pdserve.workers", "pdserve.router"), "transports know no worker"),
    ("costmodel", ("pdserve.router", "pdserve.bench", "pdserve.serve"), "serve/plan/sim use it"),
    (
        "router",
        ("pdserve.launcher", "pdserve.serve", "pdserve.cluster", "pdserve.ray"),
        "composition roots spawn",
    ),
    ("metrics", ("pdserve.router", "pdserve.workers", "pdserve.engine"), "metrics is a leaf"),
    ("workloads", ("pdserve.bench", "pdserve.sim"), "request streams serve bench and sim"),
    (
        "kvpool",
        ("pdserve.router", "pdserve.workers", "pdserve.bench"),
        "the pool is a library its users call",
    ),
]
# Exceptions by design: the timeline vocabulary imports nothing from the router at run time.
ALLOWED = {"pdserve.router.timeline"}
# Only bench itself and the CLI may import bench (the simulator replays the request streams of
# workloads/, which bench's load generator sends too).
BENCH_USERS = ("bench", "cli.py")

# Import loops allowed for now, each with why; the test below fails on any other loop, and on
# an entry here that is no longer a loop (so the list only shrinks).
KNOWN_LOOPS: dict[frozenset[str], str] = {}


def _module_name(path: Path, src: Path = SRC) -> str:
    rel = path.relative_to(src.parent).with_suffix("")
    return ".".join(rel.parts).removesuffix(".__init__")


def _imports(path: Path, src: Path = SRC) -> list[tuple[int, str]]:
    """Every absolute module name `path` imports, with its line (relative imports resolved)."""
    return [(line, name) for line, name, _ in _typed_imports(path, src)]


def _typed_imports(path: Path, src: Path = SRC) -> list[tuple[int, str, bool]]:
    """As `_imports`, each with whether it sits under `if TYPE_CHECKING:` (type-only)."""
    module = _module_name(path, src)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []
    for node, typing_only in _walk(ast.parse(path.read_text(), str(path)), False):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, typing_only) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out += [(node.lineno, f"{base}.{alias.name}", typing_only) for alias in node.names]
    return out


def _walk(node: ast.AST, typing_only: bool) -> Iterable[tuple[ast.AST, bool]]:
    """Every node below `node`, with whether an `if TYPE_CHECKING:` body encloses it."""
    for child in ast.iter_child_nodes(node):
        yield child, typing_only
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for part in child.body:
                yield part, True
                yield from _walk(part, True)
            for part in child.orelse:
                yield part, typing_only
                yield from _walk(part, typing_only)
        else:
            yield from _walk(child, typing_only)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


Edges = dict[str, dict[str, list[str]]]  # module -> module it imports -> where ("file:line")


def _graph(src: Path = SRC, typing_too: bool = True) -> Edges:
    """Module -> pdserve module it imports (a `from m import name` resolved to the longest
    module prefix: `name` is a module or a name in one); type-only edges marked as such."""
    paths = {_module_name(p, src): p for p in sorted(src.rglob("*.py"))}
    edges: Edges = collections.defaultdict(lambda: collections.defaultdict(list))
    for module, path in paths.items():
        for line, name, typing_only in _typed_imports(path, src):
            if typing_only and not typing_too:
                continue
            while name and name not in paths:
                name = name.rpartition(".")[0]
            if name and name != module:
                where = f"{path.relative_to(src.parent)}:{line}"
                where += " (TYPE_CHECKING)" if typing_only else ""
                if where not in edges[module][name]:  # `from m import a, b`: one line
                    edges[module][name].append(where)
    return edges


def _loops(edges: Edges) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, {})):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _describe(component: list[str], edges: Edges) -> str:
    """One loop for people: the component's modules and every import that ties them."""
    ties = [
        f"    {a} -> {b}: {', '.join(edges[a][b])}"
        for a in component
        for b in sorted(edges.get(a, {}))
        if b in component
    ]
    return " <-> ".join(component) + "\n" + "\n".join(ties)


def _sources(top: str) -> list[Path]:
    target = SRC / top
    return sorted(target.rglob("*.py")) if target.is_dir() else [target.with_suffix(".py")]


def _violations(paths: list[Path], banned: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(SRC.parent)}:{line} imports {name}"
        for path in paths
        for line, name in _imports(path)
        if any(name == b or name.startswith(b + ".") for b in banned)
        and not any(name == a or name.startswith(a + ".") for a in ALLOWED)
    ]


def test_the_timeline_vocabulary_imports_nothing_from_pdserve() -> None:
    """What lets metrics and bench import it (timelines.py keeps and scores timelines)."""
    names = [name for _, name in _imports(SRC / "router" / "timeline.py")]
    assert names and not [n for n in names if n.startswith("pdserve")]


@pytest.mark.parametrize(("top", "banned", "why"), RULES, ids=[r[0] for r in RULES])
def test_layer_imports_nothing_above_it(top: str, banned: tuple[str, ...], why: str) -> None:
    assert _violations(_sources(top), banned) == [], why


def test_only_bench_and_the_cli_import_bench() -> None:
    others = [
        p for p in sorted(SRC.rglob("*.py")) if p.relative_to(SRC).parts[0] not in BENCH_USERS
    ]
    assert _violations(others, ("pdserve.bench",)) == []


def test_the_checker_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The rule would be empty if `_imports` missed imports inside functions."""
    src = tmp_path / "pdserve" / "router" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text("def f():\n    from pdserve.bench import sched\n    from ..serve import run\n")
    names = [name for _, name in _imports(src, tmp_path / "pdserve")]
    assert names == ["pdserve.bench.sched", "pdserve.serve.run"]


@pytest.mark.parametrize("typing_too", [False, True], ids=["run_time", "with_type_checking"])
def test_no_import_loops(typing_too: bool) -> None:
    """Run-time imports (top level and inside functions) first, then with the imports under
    TYPE_CHECKING too: a type-only loop is coupling all the same (a module annotating with
    another's types that imports it back)."""
    edges = _graph(typing_too=typing_too)
    loops = [c for c in _loops(edges) if frozenset(c) not in KNOWN_LOOPS]
    assert loops == [], "import loops:\n" + "\n".join(_describe(c, edges) for c in loops)


def test_every_known_loop_is_still_a_loop() -> None:
    """An entry whose loop is gone must leave KNOWN_LOOPS (the list only shrinks)."""
    loops = {frozenset(c) for c in _loops(_graph())}
    assert [sorted(k) for k in KNOWN_LOOPS if k not in loops] == []


def test_the_loop_check_sees_lazy_and_type_only_loops(tmp_path: Path) -> None:
    root = tmp_path / "pdserve"
    (root / "a").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/x.py": "from pdserve.a import y\n",
        "a/y.py": "def f():\n    from . import x\n",  # lazy, relative: x <-> y
        "a/p.py": "from typing import TYPE_CHECKING\nfrom pdserve.a.q import Q\n",
        "a/q.py": "import typing\nif typing.TYPE_CHECKING:\n    from pdserve.a.p import P\n",
        "a/r.py": "from pdserve.a.p import P\n",  # imports into a loop: not part of it
    }
    for name, text in files.items():
        (root / name).write_text(text)
    run_time = _loops(_graph(root, typing_too=False))
    assert run_time == [["pdserve.a.x", "pdserve.a.y"]]
    edges = _graph(root)
    both = _loops(edges)
    assert sorted(both) == [["pdserve.a.p", "pdserve.a.q"], ["pdserve.a.x", "pdserve.a.y"]]
    assert _describe(["pdserve.a.p", "pdserve.a.q"], edges).splitlines() == [
        "pdserve.a.p <-> pdserve.a.q",
        "    pdserve.a.p -> pdserve.a.q: pdserve/a/p.py:2",
        "    pdserve.a.q -> pdserve.a.p: pdserve/a/q.py:3 (TYPE_CHECKING)",
    ]


MAX_LINES = 500
# Modules over MAX_LINES for now, each with why; the list only shrinks (the test below fails on
# an entry that is back under the limit or gone).
LONG_MODULES: dict[str, str] = {}


def _line_counts() -> dict[str, int]:
    return {
        str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in sorted(SRC.rglob("*.py"))
    }


def test_no_module_over_the_line_limit() -> None:
    long = {m: n for m, n in _line_counts().items() if n > MAX_LINES and m not in LONG_MODULES}
    assert long == {}, f"split these modules (at most {MAX_LINES} lines each)"


def test_every_long_module_is_still_long() -> None:
    counts = _line_counts()
    assert [m for m in LONG_MODULES if counts.get(m, 0) <= MAX_LINES] == []
