"""Every script under benchmarks/ runs in ``--quick`` mode (tiny sizes, one point).

A benchmark no test runs breaks silently when the library changes under it; this tier
runs each one as a user would (``python benchmarks/<name>.py --quick``, a fresh
process, from the repository root) and checks that it finishes, prints something, and
leaves benchmarks/results/ and docs/ as they were (quick runs write under
``$HOPE_BENCH_QUICK_DIR``). Not part of the default run: ``make test-benchmarks``
(``pytest -m benchmarks tests/test_benchmarks_quick.py``), a few minutes on 2 cores.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
# benchmarks/*.py and benchmarks/peers/*.py (the peer comparisons); files starting
# with "_" are helpers (peers/_torch_pruning_side.py runs in the peer's own interpreter).
SCRIPTS = sorted(str(p.relative_to(BENCHMARKS)) for pattern in ("*.py", "peers/*.py")
                 for p in BENCHMARKS.glob(pattern) if not p.name.startswith("_"))
# What a quick run must leave alone: the recorded results and the docs.
WATCHED = [BENCHMARKS / "results", REPO / "docs"]
TIMEOUT_S = 240

pytestmark = pytest.mark.benchmarks


def _snapshot():
    out = {}
    for root in WATCHED:
        for path in root.rglob("*"):
            if path.is_file():
                st = path.stat()
                out[str(path.relative_to(REPO))] = (st.st_size, st.st_mtime_ns)
    return out


def test_every_script_is_listed():
    assert len(SCRIPTS) >= 20, SCRIPTS
    assert "deft_transfer.py" in SCRIPTS
    assert "peers/resnet50.py" in SCRIPTS


def test_fashion_mnist_is_installed():
    # Most benchmarks read it; the tier never installs it (apt-get install -y
    # dataset-fashion-mnist does).
    d = Path("/usr/share/datasets/fashion-mnist")
    assert (d / "t10k-images-idx3-ubyte.gz").exists(), (
        f"Fashion-MNIST missing from {d}: apt-get install -y dataset-fashion-mnist")


@pytest.mark.parametrize("script", SCRIPTS)
def test_quick_run(script, tmp_path):
    env = dict(os.environ)
    env.update(HOPE_BENCH_QUICK_DIR=str(tmp_path), TF_CPP_MIN_LOG_LEVEL="3",
               KERAS_BACKEND=env.get("KERAS_BACKEND", "tensorflow"),
               HOPE_KERAS_CACHE="off", MPLBACKEND="Agg",
               HOPE_NO_INSTALL="1")  # a missing data set fails; nothing is installed
    src = str(REPO / "src")
    env["PYTHONPATH"] = src + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else src
    before = _snapshot()
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), "--quick"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    tail = (proc.stdout[-3000:] + "\n--- stderr ---\n" + proc.stderr[-3000:])
    assert proc.returncode == 0, f"{script} --quick exited {proc.returncode}:\n{tail}"
    assert proc.stdout.strip(), f"{script} --quick printed nothing:\n{tail}"
    after = _snapshot()
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"{script} --quick wrote into the repository: {changed}"
