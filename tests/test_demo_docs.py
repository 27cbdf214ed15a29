"""Docs cannot go stale: the `make demo` table in docs/benchmarks.md is recomputed."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _demo():
    spec = importlib.util.spec_from_file_location("demo", ROOT / "examples" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parse(table: str):
    rows = []
    for line in table.strip().splitlines()[2:]:
        d, acc, params, pr, fr = (c.strip() for c in line.strip("|").split("|"))
        rows.append((float(d), float(acc), int(params), float(pr), float(fr)))
    return rows


def test_benchmarks_md_prints_what_make_demo_computes():
    demo = _demo()
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    start, end = text.index(demo.START) + len(demo.START), text.index(demo.END)
    printed = _parse(text[start:end])
    rows, _ = demo.demo_rows(slim=False)  # the in-place model: the same function
    stale = ("docs/benchmarks.md's demo table is stale: run "
             ".venv/bin/python examples/demo.py --update-docs")
    assert len(printed) == len(rows), stale
    for (d0, a0, p0, pr0, fr0), (d1, a1, p1, pr1, fr1) in zip(printed, rows):
        # Sizes are exact (the same trajectory); an accuracy may move by a few of the
        # 2000 test images on another CPU (TensorFlow's kernels round differently and
        # images at a decision boundary flip): up to 12 images at density 0.4 (6 at
        # 0.3, 3 at 0.5) between two machines (one an AMD EPYC), the same code and
        # sizes. 20 images
        # (1 %) is the tolerance: a code change that moves the accuracy more, or any
        # size, fails here.
        assert (d0, p0, pr0, fr0) == (d1, p1, round(pr1, 3), round(fr1, 3)), stale
        assert abs(a0 - a1) <= 0.01, stale
