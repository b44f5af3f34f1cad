"""The import rules of docs/architecture.md, checked on the source (lazy imports included):
a module that breaks one fails here, naming the file and line."""

from __future__ import annotations

import ast
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


def _module_name(path: Path, src: Path = SRC) -> str:
    rel = path.relative_to(src.parent).with_suffix("")
    return ".".join(rel.parts).removesuffix(".__init__")


def _imports(path: Path, src: Path = SRC) -> list[tuple[int, str]]:
    """Every absolute module name `path` imports, with its line (relative imports resolved)."""
    out = []
    module = _module_name(path, src)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


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


def test_the_timeline_vocabulary_imports_nothing_at_run_time() -> None:
    """What lets metrics and bench import it: pdserve imports only under TYPE_CHECKING."""
    tree = ast.parse((SRC / "router" / "timeline.py").read_text())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    assert all(not (getattr(n, "module", "") or "").startswith("pdserve") for n in top)


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
