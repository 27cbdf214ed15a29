"""Every ```python block in docs/*.md runs (blocks of one file share a namespace).

A block right after a line `<!-- no-run -->` is skipped (e.g. one that downloads weights).
The walk-throughs whose every step is tested on its own in make test are marked
slow (make test-slow runs them): docs/deploy.md (compress, recover for an epoch, slim,
export, TFLite), docs/deft.md (tests/test_deft_*.py) and docs/derivative_matching.md
(tests/test_derivative_matching.py).
"""

import pathlib
import re

import pytest

DOCS = sorted((pathlib.Path(__file__).parent.parent / "docs").glob("*.md"))
BLOCK = re.compile(r"(<!-- no-run -->\s*\n)?```python\n(.*?)```", re.S)
SLOW_DOCS = {"deploy.md", "deft.md", "derivative_matching.md"}


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow)
                                  if p.name in SLOW_DOCS else p for p in DOCS],
                         ids=[p.name for p in DOCS])
def test_doc_code_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__doc_test__"}
    for k, match in enumerate(BLOCK.finditer(path.read_text())):
        if match.group(1):
            continue
        code = compile(match.group(2), f"{path.name}[block {k}]", "exec")
        exec(code, namespace)  # noqa: S102 - running our own documentation


def test_api_reference_is_current():
    import importlib.util

    root = pathlib.Path(__file__).parent.parent
    spec = importlib.util.spec_from_file_location("make_api_docs",
                                                  root / "scripts" / "make_api_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (root / "docs" / "api.md").read_text() == module.render(), (
        "docs/api.md is stale: run .venv/bin/python scripts/make_api_docs.py")


# --- The user docs carry no development history, and their references resolve. ---

ROOT = pathlib.Path(__file__).parent.parent
USER_DOCS = [ROOT / "README.md"] + DOCS  # benchmarks/LOG.md (the results log) is kept apart
SOURCES = sorted((ROOT / "src" / "hope_keras").rglob("*.py"))

#: What a user would read as development history rather than documentation.
HISTORY = {
    "a work item": re.compile(r"(?<!-)\b(?:stop|decision|issue|item)s? #?\d+", re.I),
    "the unpublished specification": re.compile(
        r"\bspec(?:ification)?(?:'s)? (?:section|§|eq)|\bthe spec\b|_SPEC\.md|\bspec sections?\b",
        re.I),
    "a session": re.compile(r"\b(?:this|that|the previous|an earlier|a later) session\b", re.I),
    "a branch name": re.compile(r"\b(?:on|from|of) (?:the )?branch `|\bthe `?main`? branch\b"
                                r"|\bgit (?:merge|log|checkout)\b"),
    "a dated aside": re.compile(
        r"\b20\d\d-\d\d-\d\d\b|\b(?:as of|since|until|before|after) (?:commit|today|yesterday)\b"
        r"|\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* 20\d\d\b", re.I),
}
#: A commit hash: 7 to 40 hex digits with at least one letter and one digit, as a word.
#: Digits-only runs (parameter counts such as 25636712, 0.3333333333333333, SELU's
#: constants) are numbers, not hashes, and pass; so does `eviction_diagnostic.py`'s
#: `--stop 0.5` option, which is no work item (the lookbehind above).
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def _history(text):
    found = [f"{why}: {m.group(0)!r}" for why, pattern in HISTORY.items()
             for m in pattern.finditer(text)]
    return found + [f"a commit hash: {m.group(0)!r}" for m in COMMIT.finditer(text)]


@pytest.mark.parametrize("path", USER_DOCS, ids=[p.name for p in USER_DOCS])
def test_user_docs_carry_no_history(path):
    found = [f"{path.name}:{n}: {hit}" for n, line in enumerate(path.read_text().splitlines(), 1)
             for hit in _history(line)]
    assert not found, "development history in the user docs:\n" + "\n".join(found)


def test_source_carries_no_history():
    """Docstrings and comments (what docs/api.md and a reader of the code see)."""
    found = [f"{path.relative_to(ROOT)}:{n}: {hit}" for path in SOURCES
             for n, line in enumerate(path.read_text().splitlines(), 1)
             for hit in _history(line)]
    assert not found, "development history in src/:\n" + "\n".join(found)


def test_history_patterns_catch_history():
    """The patterns above are not vacuous: each catches what it is meant to."""
    for text in ["see stop 26", "Decision 7 of docs/quality.md", "issue 12",
                 "(spec section 5)", "the spec's P_init", "this session's machine",
                 "as of commit 2faf675", "2faf675", "on 2026-12-05"]:
        assert _history(text), text
    for text in ["0.3333333333333333", "25636712 parameters", "a stop gradient", "--stop 0.5",
                 "the decision boundary", "np.float32(0.7071067811865476)"]:
        assert not _history(text), text


def _slug(heading):
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path):
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", path.read_text(), re.M)}


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", USER_DOCS, ids=[p.name for p in USER_DOCS])
def test_relative_links_resolve(path):
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{path.name}: broken links {broken}"


THEORY = ROOT / "docs" / "theory.md"
CITE_SECTION = re.compile(r"(?:docs/)?theory\.md,?\s+§\s?(\d+(?:\.\d+)?)")
#: A cited heading: docs/quality.md, "Heading" (or "docs/quality.md "Heading"").
CITE_HEADING = re.compile(r"(?:docs/)?(\w+)\.md,?\s+\"([^\"]+)\"")


def _titles(path):
    """Headings and bold paragraph titles (**Capacity.**) of a Markdown file, lowercase."""
    text = path.read_text()
    heads = re.findall(r"^#+ (?:\d+(?:\.\d+)?\. )?(.*)$", text, re.M)
    bold = re.findall(r"\*\*([^*]+?)\**\*\*", text)
    return [re.sub(r"[`*]", "", t).lower() for t in heads + bold]


def test_cited_sections_exist():
    """Every "docs/theory.md §N" and every "docs/X.md, \"Heading\"" names a real section."""
    numbers = set(re.findall(r"^#+ (\d+(?:\.\d+)?)\. ", THEORY.read_text(), re.M))
    assert len(numbers) >= 10
    missing = []
    for path in USER_DOCS + SOURCES:
        text = re.sub(r"\n\s*#:? ?", "\n", path.read_text())  # citations across comment lines
        text = re.sub(r"\s+", " ", text)
        for m in CITE_SECTION.finditer(text):
            if m.group(1) not in numbers:
                missing.append(f"{path.name}: theory.md §{m.group(1)}")
        for m in CITE_HEADING.finditer(text):
            target = ROOT / "docs" / f"{m.group(1)}.md"
            if not target.exists():
                continue  # not a docs page (e.g. README.md "...")
            cited = re.sub(r"[`*]", "", m.group(2)).lower()
            if not any(cited in title for title in _titles(target)):
                missing.append(f"{path.name}: {m.group(1)}.md \"{m.group(2)}\"")
    assert not missing, "no such section:\n" + "\n".join(missing)


def test_benchmarks_page_is_a_results_page():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(text.splitlines()) <= 800
    assert "LOG.md" not in text or "not documentation" in text
