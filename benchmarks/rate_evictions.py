"""How the distortion rate should treat evictions under a density budget.

Variants: the spec's `J/P_init` (params); distortion per neuron for prunes/merges and
`J_evict / neurons removed` for evictions (neurons); per neuron for prunes/merges but
`J_evict` undivided for evictions (neurons, evict undivided); per neuron without
evictions (neurons, no evict). Models: the bundled demo CNN (2000 test images) and the
ResNet-50 Fashion-MNIST fixture of `scripts/make_benchmark_fixtures.py` (first 1000
test images; skipped when `.cache/resnet50_fmnist.keras` is absent).

Run: .venv/bin/python benchmarks/rate_evictions.py
"""

import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import hope_keras  # noqa: E402
from hope_keras.engine import Encoder  # noqa: E402

DENSITIES = (0.9, 0.8, 0.7)


class UndividedEvictions(Encoder):
    def eviction_cost(self, name):
        dr, J, P = super().eviction_cost(name)
        return (J, J, P) if self.rate == "neurons" else (dr, J, P)


def run(loader, x, y, rate, actions=("prune", "merge", "evict"), cls=Encoder):
    row = []
    for density in DENSITIES:
        model = loader()
        enc = cls(model, actions=actions, rate=rate)
        enc.run(density=density, verbose=False)
        acc = np.mean(np.argmax(model.predict(x, batch_size=250, verbose=0), 1) == y)
        row.append(f"{acc:.3f} ({enc.active / enc.num_neurons:.2f})")
    return row


def main():
    from quality import load

    models = {"demo": None}
    if (pathlib.Path(__file__).parent.parent / ".cache" / "resnet50_fmnist.keras").exists():
        models["resnet50"] = None
    print("| model | variant | " + " | ".join(str(d) for d in DENSITIES) + " |")
    print("| --- | --- |" + " --- |" * len(DENSITIES))
    for name in models:
        _, x, y, _ = load(name)
        if name == "resnet50":
            x, y = x[:1000], y[:1000]
            path = pathlib.Path(__file__).parent.parent / ".cache" / "resnet50_fmnist.keras"
            loader = lambda: keras.models.load_model(path, compile=False)  # noqa: E731
        else:
            loader = hope_keras.data.load_demo_model
        variants = {
            "params (spec)": dict(rate="params"),
            "neurons": dict(rate="neurons"),
            "neurons, evict undivided": dict(rate="neurons", cls=UndividedEvictions),
            "neurons, no evict": dict(rate="neurons", actions=("prune", "merge")),
        }
        for label, kw in variants.items():
            print(f"| {name} | {label} | " + " | ".join(run(loader, x, y, **kw)) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
