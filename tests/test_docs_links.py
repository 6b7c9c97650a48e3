"""The front page and the docs point at things that exist.

For ``README.md``, every ``docs/*.md`` and ``benchmarks/README.md``:

* every relative Markdown link or image target (``[text](path)``, ``![alt](path)``; web and mail
  links skipped) names a file or folder, relative to the Markdown file's own folder, and a ``#anchor``
  into a Markdown page names one of its headings (GitHub's heading ids);
* every backticked token that looks like a repository path (starts with ``dit_mcore/``,
  ``energon_data/``, ``kernels/``, ``recipes/``, ``tests/``, ``benchmarks/``, ``docs/`` or ``.ci/``)
  names a file or folder relative to the repository root, after a ``::test_id`` suffix and trailing
  punctuation are cut off; tokens with a space (commands) or a placeholder (``*``, ``{``, ``<``,
  ``…``, ``XXXX``) are skipped. Where the test id is a plain name, the test file defines it;
* ``README.md`` stays a front page: at most 12 KiB.

Plain text parsing only (no project import), so it runs in well under a second.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_LIMIT = 12 * 1024
PATH_PREFIXES = ("dit_mcore/", "energon_data/", "kernels/", "recipes/", "tests/", "benchmarks/", "docs/", ".ci/")
PLACEHOLDERS = ("*", "{", "<", "…", "XXXX", " ")

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
TEST_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def markdown_files() -> list[Path]:
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]
    return [f for f in files if f.exists()]


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def link_targets(text: str) -> list[str]:
    """Link and image targets outside fenced code blocks and code spans."""
    prose = FENCE.sub("", text)
    prose = CODE_SPAN.sub("", prose)
    return [m.group(1) for m in LINK.finditer(prose)]


def code_tokens(text: str) -> list[str]:
    """The text of every code span outside fenced code blocks (fenced blocks hold commands)."""
    prose = FENCE.sub("", text)
    return [m.group(2).strip() for m in CODE_SPAN.finditer(prose)]


def heading_ids(md: Path) -> set[str]:
    """The ids GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens,
    ``-1``, ``-2`` … on repeats."""
    ids, seen = set(), {}
    for line in FENCE.sub("", md.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids


def broken_links(md: Path) -> list[str]:
    broken = []
    for target in link_targets(md.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = md.parent / path if path else md
        if not dest.exists():
            broken.append(f"{rel(md)}: link ({target}) -> no {rel(md.parent) + '/' if md.parent != REPO else ''}{path}")
        elif anchor and dest.suffix == ".md" and anchor not in heading_ids(dest):
            broken.append(f"{rel(md)}: link ({target}) -> {rel(dest.resolve())} has no heading #{anchor}")
    return broken


def repo_path_of(token: str) -> tuple[str, str | None] | None:
    """(path, test id or None) for a token that names a repository path, else None."""
    if not token.startswith(PATH_PREFIXES):
        return None
    path, _, test_id = token.partition("::")
    path = path.rstrip(".,;:)")
    if any(p in path for p in PLACEHOLDERS):
        return None
    return path, (test_id or None)


def broken_paths(md: Path) -> list[str]:
    broken = []
    for token in code_tokens(md.read_text(encoding="utf-8")):
        found = repo_path_of(token)
        if found is None:
            continue
        path, test_id = found
        target = REPO / path
        if not target.exists():
            broken.append(f"{rel(md)}: `{token}` -> no {path}")
            continue
        if test_id and TEST_NAME.match(test_id) and target.is_file():
            if not re.search(rf"^\s*(async\s+)?def {re.escape(test_id)}\(", target.read_text(encoding="utf-8"), re.M):
                broken.append(f"{rel(md)}: `{token}` -> {path} defines no {test_id}")
    return broken


def test_the_pages_exist():
    names = {rel(f) for f in markdown_files()}
    assert {"README.md", "benchmarks/README.md"} <= names, f"missing pages: {names}"


def test_relative_links_resolve():
    broken = [b for md in markdown_files() for b in broken_links(md)]
    assert not broken, f"{len(broken)} broken link(s):\n" + "\n".join(broken)


def test_backticked_repository_paths_exist():
    broken = [b for md in markdown_files() for b in broken_paths(md)]
    assert not broken, f"{len(broken)} backticked path(s) that do not exist:\n" + "\n".join(broken)


def test_the_readme_is_a_front_page():
    size = (REPO / "README.md").stat().st_size
    assert size <= README_LIMIT, (
        f"README.md is {size:,} bytes, over the front page's {README_LIMIT:,}: move depth into docs/ "
        "or benchmarks/README.md")


@pytest.mark.parametrize(
    "token, expected",
    [
        ("tests/test_training.py::test_a_step_decided_on_the_device_equals_one_decided_on_the_host",
         ("tests/test_training.py", "test_a_step_decided_on_the_device_equals_one_decided_on_the_host")),
        ("tests/test_parallel_layouts.py::…[2-tp2_sp_*]", ("tests/test_parallel_layouts.py", "…[2-tp2_sp_*]")),
        ("benchmarks/slurm/", ("benchmarks/slurm/", None)),
        ("dit_mcore/training/", ("dit_mcore/training/", None)),
        ("runs/digits/samples/step_XXXXXX.png", None),
        ("benchmarks/results/<file>.json", None),
        ("python benchmarks/packing.py", None),
        ("dit_mcore.evaluate.clip_check", None),
    ],
)
def test_what_counts_as_a_repository_path(token, expected):
    assert repo_path_of(token) == expected


def test_heading_ids_follow_github(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Compilation (`model.compile`)\n## Not yet\n```\n# not a heading\n```\n## Not yet\n"
                    "### ST-DiT (`model.family=stdit`)\n", encoding="utf-8")
    assert heading_ids(page) == {"compilation-modelcompile", "not-yet", "not-yet-1", "st-dit-modelfamilystdit"}


def test_links_are_found_outside_code_only():
    text = "see [a](docs/a.md#x) and ![img](b.png \"t\")\n```\n[c](nope.md)\n```\n`[d](nope2.md)`"
    assert link_targets(text) == ["docs/a.md#x", "b.png"]
