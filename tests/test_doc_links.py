"""The documentation's links resolve (files and the headings they point at) and the README's tables stay readable."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md",
        *sorted((ROOT / "benchmarks" / "results").glob("*/README.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MAX_CELL = 300  # characters in one table cell of the README


def anchors(doc: Path) -> set[str]:
    """The heading anchors GitHub makes for ``doc``: lower case, punctuation but ``-`` and ``_`` dropped, spaces as
    ``-``, a repeated heading suffixed ``-1``, ``-2`` (GitHub's markdown renderer)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_no_readme_table_cell_is_a_paragraph():
    long = [(i, len(cell)) for i, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1)
            if line.startswith("|") for cell in line.strip().strip("|").split(" | ") if len(cell) > MAX_CELL]
    assert not long, f"README.md (line, characters): {long}; split the cell into rows or link to the table"
