"""Helpers shared by the benchmark scripts (not part of the library).

Every script takes ``--quick``: tiny sizes and one point, through the same code as the
full run, in seconds; what it writes goes to `quick_dir()` (never benchmarks/results/
or docs/). tests/test_benchmarks_quick.py runs each one that way (``make
test-benchmarks``).
"""

import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Benchmarks make compress's synthetic inputs every time (their timings include
# them); HOPE_KERAS_CACHE=<dir> in the environment reuses them across runs.
os.environ.setdefault("HOPE_KERAS_CACHE", "off")

import keras  # noqa: E402
import numpy as np  # noqa: E402


#: ``HOPE_BENCH_MERGES=trusted`` in the environment: the data-free correction trusts the
#: surrogate behind merges too (`bn_stats.untrusted_tensors(..., trust_merges=True)`,
#: the quality benchmark's `hope_trust_merges`) for a whole script; docs/quality.md,
#: "The surrogate behind merges", runs the real checkpoints so.
MERGES_ENV = "HOPE_BENCH_MERGES"


def apply_merges_setting(environ=os.environ) -> bool:
    """Applies `MERGES_ENV` (unset or ``untrusted``: the library's rule); returns
    whether the merges are trusted. Refuses any other value."""
    value = environ.get(MERGES_ENV, "untrusted") or "untrusted"
    if value not in ("trusted", "untrusted"):
        raise SystemExit(f"{MERGES_ENV} must be 'trusted' or 'untrusted'. "
                         f"Received: {value!r}")
    if value == "untrusted":
        return False
    import functools

    from hope_keras.stats import bn_stats

    if not isinstance(bn_stats.untrusted_tensors, functools.partial):
        bn_stats.untrusted_tensors = functools.partial(bn_stats.untrusted_tensors,
                                                       trust_merges=True)
        print(f"{MERGES_ENV}=trusted: the data-free correction trusts the surrogate "
              "behind merges", flush=True)
    return True


apply_merges_setting()

QUICK_HELP = ("tiny sizes and one point through the full run's code, in seconds (a "
              "check that the script runs, not a measurement); writes only under "
              "$HOPE_BENCH_QUICK_DIR or a new temporary folder")
QUICK_DIR_ENV = "HOPE_BENCH_QUICK_DIR"
# The input side of ResNet-50 in --quick runs (224 in the full runs).
QUICK_RESNET_SIZE = 32
_quick_dir = None


def add_quick(parser):
    """Adds ``--quick`` (see `QUICK_HELP`) to an argparse parser."""
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP)
    return parser


def quick_requested(argv=None) -> bool:
    """Whether ``--quick`` is among the arguments (for scripts without argparse)."""
    return "--quick" in (sys.argv[1:] if argv is None else argv)


def quick_dir() -> Path:
    """The folder a ``--quick`` run writes its results and plots to:
    ``$HOPE_BENCH_QUICK_DIR`` when set (the test tier sets it), else a new temporary
    folder (one per process)."""
    global _quick_dir
    if _quick_dir is None:
        given = os.environ.get(QUICK_DIR_ENV)
        _quick_dir = Path(given) if given else Path(
            tempfile.mkdtemp(prefix="hope_bench_quick_"))
        _quick_dir.mkdir(parents=True, exist_ok=True)
        print(f"--quick: results go to {_quick_dir}", flush=True)
    return _quick_dir


def quick_path(path) -> Path:
    """`path`'s file name inside `quick_dir()`."""
    return quick_dir() / Path(path).name


def write_results(path, out, quick=False, **json_options) -> Path:
    """Writes `out` as indented JSON (`json.dumps` options beside) to `path`, or to
    `quick_path(path)` for a ``--quick`` run; returns where it went."""
    path = quick_path(path) if quick else Path(path)
    path.write_text(json.dumps(out, indent=1, **json_options) + "\n")
    return path


def forward_time(model, x, repeats=5) -> float:
    """T: the median seconds of ``model(x, training=False)`` after one warm-up (the
    unit the benchmarks' timings are given in, measured in the same process)."""
    model(x, training=False)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        model(x, training=False)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def peak_rss_gb() -> float:
    """Peak resident memory of this process so far, in GB (Linux ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def calibrated_resnet50(seed=0, images=4, builder=None, size=224):
    """ResNet50(weights=None) at 224×224 with non-trivial BN (calibration pass on random
    images, random γ/β), the same preparation as the end-to-end test. ``builder``: another
    `keras.applications` constructor (e.g. ResNet152) prepared the same way; ``size``:
    another input side (``--quick`` runs use `QUICK_RESNET_SIZE`)."""
    import hope_keras

    kw = {} if size == 224 else {"input_shape": (size, size, 3)}
    model = (builder or keras.applications.ResNet50)(weights=None, **kw)
    rng = np.random.default_rng(seed)
    hope_keras.reestimate_batchnorm_statistics(
        model, rng.uniform(0, 255, (images, size, size, 3)).astype("float32"),
        batch_size=images)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            n = layer.gamma.shape[0]
            layer.gamma.assign(rng.uniform(0.3, 1.5, n).astype("float32"))
            layer.beta.assign(rng.normal(0, 0.5, n).astype("float32"))
    return model


_UNSET = object()


def encoder(model, *, analysis=None, correct_statistics="auto", cost="hope", actions=None,
            merge_scale=None, kernel=None, mean_compensation=None, refresh=_UNSET,
            merge_candidates=_UNSET, merge_search=_UNSET, round_to=1, verbose=False):
    """A `hope_keras.Encoder` from the options `compress` took before they moved, as
    the benchmarks' recorded commands name them: ``merge_scale``, ``kernel``,
    ``mean_compensation`` onto the cost; ``refresh``, ``merge_candidates``,
    ``merge_search`` into ``search=``; ``correct_statistics`` is ``correction=``;
    ``round_to`` into ``search=`` too."""
    import copy

    import hope_keras
    from hope_keras.scoring import costs

    cost = costs.get(cost)
    if (merge_scale, kernel, mean_compensation) != (None, None, None):
        cost = copy.copy(cost)  # the caller's cost object keeps its settings
        cost._set_options(merge_scale or cost.merge_scale, kernel or cost.kernel,
                          cost.mean_compensation if mean_compensation is None
                          else mean_compensation)
    search = {k: v for k, v in (("refresh", refresh), ("merge_candidates", merge_candidates),
                                ("merge_search", merge_search)) if v is not _UNSET}
    if round_to != 1:
        search["round_to"] = round_to
    kw = {} if actions is None else {"actions": actions}
    return hope_keras.Encoder(model, cost=cost, analysis=analysis, search=search or None,
                              correction=correct_statistics, verbose=verbose, **kw)


def compress(model, *, density=None, params=None, flops=None, steps=None, verbose=False,
             **options):
    """`hope_keras.compress` with an analysis made beforehand and the options of
    `encoder`: ``Encoder(...).compress(...)``, a `CompressionResult`."""
    return encoder(model, verbose=verbose, **options).compress(
        density=density, params=params, flops=flops, steps=steps)
