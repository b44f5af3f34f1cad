"""The docs' links resolve: every relative link in README.md and docs/ points at a file that
exists, and every docs/benchmarks/ path named in src/ exists (benchmark outputs aside)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        path = target.split("#")[0]
        external = path.startswith(("http://", "https://", "mailto:"))
        if path and not external and not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


def test_benchmark_paths_named_in_src_exist() -> None:
    missing = set()
    for source in (ROOT / "src").rglob("*.py"):
        for path in re.findall(r"docs/benchmarks/[\w./-]*[\w/]", source.read_text()):
            if not (ROOT / path).exists():
                missing.add(f"{source.relative_to(ROOT)}: {path}")
    assert not missing, sorted(missing)


def test_the_benchmark_index_and_readme_stay_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) < 150
    assert (ROOT / "docs" / "benchmarks" / "README.md").is_file()
