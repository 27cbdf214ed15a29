"""`make demo`: HOPE on the bundled Fashion-MNIST CNN, data-free, no fine-tuning.

Analyses the model, compresses it once to the lowest density with the greedy
encoder and the library's defaults, replays the trajectory to each density, slims
the result (checking it matches the in-place model) and prints test accuracy,
parameters, FLOPs and wall time. Variants (the paper's cost, baselines) are in
benchmarks/quality.py. ``--update-docs`` rewrites the table docs/benchmarks.md prints
(a test checks the two agree).
"""

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import hope_keras  # noqa: E402
from hope_keras.data import load_demo_data, load_demo_model  # noqa: E402

DENSITIES = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
START, END = "<!-- make-demo-table -->", "<!-- /make-demo-table -->"


def accuracy(model, x, y):
    return float(np.mean(np.argmax(model.predict(x, batch_size=500, verbose=0), 1) == y))


def demo_rows(densities=DENSITIES, slim=True):
    """The demo's table: one greedy run with the defaults to the lowest density,
    replayed to each density and slimmed. Returns ``(rows, run_info)``; each row is
    ``(density, accuracy, params, params ratio, FLOPs ratio)``. With ``slim=False``
    the in-place model is scored (the same function) and the parameters are the
    engine's exact live count."""
    data = load_demo_data()
    x, y = data.x_test, data.y_test
    original = load_demo_model()
    base_params = original.count_params()
    rows = [(1.0, accuracy(original, x, y), base_params, 1.0, 1.0)]
    t0 = time.perf_counter()
    result = hope_keras.compress(load_demo_model(), density=min(densities), verbose=False)
    seconds = time.perf_counter() - t0
    trajectory = result.trajectory
    weights = original.get_weights()
    for density in densities:
        k = trajectory.step_for(density=density)
        original.set_weights(weights)
        model = trajectory.replay(original, step=k)
        step = trajectory.steps[k - 1]
        if slim:
            small = hope_keras.slim(model)
            assert np.allclose(small.predict(x[:64], verbose=0),
                               model.predict(x[:64], verbose=0), atol=1e-4)
            params = small.count_params()
        else:
            small, params = model, round(step.params_after * base_params)
        rows.append((density, accuracy(small, x, y), params, params / base_params,
                     step.flops_after))
    kinds = {k: sum(s.kind == k for s in trajectory.steps) for k in ("prune", "merge", "evict")}
    return rows, dict(steps=len(trajectory), kinds=kinds, seconds=seconds)


def render_table(rows) -> str:
    """The markdown table docs/benchmarks.md prints for `make demo`."""
    lines = ["| density | accuracy | params | params ratio | FLOPs ratio |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for d, acc, params, pr, fr in rows:
        lines.append(f"| {d:.2f} | {acc:.4f} | {params} | {pr:.3f} | {fr:.3f} |")
    return "\n".join(lines)


def main():
    data = load_demo_data()
    hope_keras.analyze(load_demo_model()).summary()
    print()
    rows, info = demo_rows()
    print(f"Greedy run to density {min(DENSITIES)}: {info['steps']} steps {info['kinds']}, "
          f"{info['seconds']:.1f} s (analysis included)")
    print(f"\n{'density':>8} {'accuracy':>9} {'params':>8} {'params':>7} {'FLOPs':>7}")
    print(f"{'':>8} {'':>9} {'':>8} {'ratio':>7} {'ratio':>7}")
    for d, acc, params, pr, fr in rows:
        print(f"{d:>8.2f} {acc:>9.4f} {params:>8d} {pr:>7.3f} {fr:>7.3f}")
    print(f"\nTest accuracy on the bundled {len(data.y_test)}-image Fashion-MNIST test "
          "subset; no data was used to compress, no fine-tuning.")
    if "--update-docs" in sys.argv:
        update_docs(rows)


def update_docs(rows, path=DOCS):
    """Rewrites the demo table in docs/benchmarks.md (between its markers)."""
    text = path.read_text()
    start, end = text.index(START) + len(START), text.index(END)
    path.write_text(text[:start] + "\n" + render_table(rows) + "\n" + text[end:])
    print(f"Updated {path}")


if __name__ == "__main__":
    main()
