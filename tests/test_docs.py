"""Every ```python block in docs/*.md runs (blocks of one file share a namespace).

A block right after a line `<!-- no-run -->` is skipped (e.g. one that downloads weights).
"""

import pathlib
import re

import pytest

DOCS = sorted((pathlib.Path(__file__).parent.parent / "docs").glob("*.md"))
BLOCK = re.compile(r"(<!-- no-run -->\s*\n)?```python\n(.*?)```", re.S)


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
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
