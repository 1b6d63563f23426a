"""benchmarks/results/ holds the current measurements and nothing else.

Every file there is cited by a doc (README.md, docs/*.md, launch/*.md or a README under benchmarks/), by
its own path or by a folder's above it; every `benchmarks/results/...` path that a doc, the package, a
benchmark script or a config names exists; and there are at most MAX_FILES of them. A path followed by
`<`, `{` or `*` is a pattern (`benchmarks/results/train_speed-<gpu>-<date>.json`), not a citation.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MAX_FILES = 60
CITATION = re.compile(r"benchmarks/results/[\w.\-/]*")
PATTERN_MARKS = "<{*"


def result_files() -> list[str]:
    return sorted(
        str(path.relative_to(ROOT))
        for path in RESULTS.rglob("*")
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(RESULTS).parts)
    )


def docs() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "launch").glob("*.md")),
        *sorted((ROOT / "benchmarks").rglob("README*.md")),
    ]


def citers() -> list[Path]:
    """The docs, and the code and configs that may name a result file."""
    code = [*(ROOT / "atma_titan").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    return [*docs(), *sorted(code), *sorted((ROOT / "train_configs").rglob("*.toml"))]


def citations(path: Path) -> list[tuple[int, str]]:
    """(line number, cited path) of every benchmarks/results/... path in the file, patterns left out."""
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for match in CITATION.finditer(line):
            if line[match.end() : match.end() + 1] in tuple(PATTERN_MARKS):
                continue
            cited = match.group().rstrip(".,/")
            if cited != "benchmarks/results":
                found.append((number, cited))
    return found


def test_the_citation_reader_takes_paths_and_folders_and_skips_patterns(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "[a](../benchmarks/results/x-h200-2026-12-04.json), see benchmarks/results/repro/.\n"
        "Results go to benchmarks/results/x-<gpu>-<date>.json or `benchmarks/results/` itself.\n"
    )
    assert citations(page) == [(1, "benchmarks/results/x-h200-2026-12-04.json"), (1, "benchmarks/results/repro")]


def test_results_hold_at_most_max_files():
    files = result_files()
    assert len(files) <= MAX_FILES, f"benchmarks/results/ holds {len(files)} files, at most {MAX_FILES}"


def test_every_result_file_is_cited_by_a_doc():
    cited = {path for page in docs() for _, path in citations(page)}
    uncited = [
        name
        for name in result_files()
        if not any(name == c or name.startswith(c + "/") for c in cited)
    ]
    assert not uncited, f"cited by no doc (cite them in docs/performance.md or docs/results.md, or git rm): {uncited}"


def test_every_cited_result_exists():
    missing = [
        f"{page.relative_to(ROOT)}:{number}: {path}"
        for page in citers()
        for number, path in citations(page)
        if not (ROOT / path).exists()
    ]
    assert not missing, "cited but not in benchmarks/results/:\n" + "\n".join(missing)
