#!/usr/bin/env bash
# Runs the Keras-facing tests (the adapter hope_keras.graph.adapter, the layer
# registry, walker, slim, engine, and the training wrappers) on the oldest and the newest Keras release that
# pyproject.toml allows, each installed with --no-deps into its own folder under
# .cache/keras-range/ and put in front of the virtual environment's own Keras (so the
# environment's TensorFlow and the other Keras dependencies are shared).
#
# Usage: scripts/test_keras_range.sh   (or `make test-keras-range`)
# Environment: PY (default .venv/bin/python), KERAS_RANGE_CACHE (default
# .cache/keras-range), KERAS_VERSIONS (default: "<oldest> <newest>", resolved from
# pyproject.toml and the package index). Needs the package index once per version.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
CACHE=${KERAS_RANGE_CACHE:-.cache/keras-range}
TESTS=(
    tests/test_keras_graph.py tests/test_graph.py tests/test_layer_patterns.py
    tests/test_slim_trajectory.py tests/test_engine.py tests/test_data.py
    tests/test_profile.py::test_flops_equal_a_brute_force_count_of_multiply_accumulates
    tests/test_profile.py::test_nested_sequential_and_shared_layers
    src/hope_keras/graph/adapter.py src/hope_keras/graph/layers.py
    # A pass that computes from copied weights (keras.StatelessScope) while they change.
    tests/test_correction.py::test_the_originals_pass_reads_the_weights_as_they_were_at_the_start
    # keras.ops reductions traced from a subclassed model; data of a model of two
    # inputs (a list or dict of arrays, datasets) read through keras.tree.
    "tests/test_tracing.py::test_a_spatial_reduction_between_a_group_and_its_reader_is_seen_through"
    "tests/test_correction.py::test_data_for_a_model_of_two_inputs_in_every_form_moves_the_stale_batchnorms"
    src/hope_keras/stats/inputs.py
    # What sets the floor (docs/architecture.md): training wrappers on Keras internals.
    tests/test_recover.py::test_labels_and_teacherless_training
    tests/test_recover.py::test_a_one_unit_output_is_refused_by_kl_and_distilled_by_its_mean_squared_difference
    tests/test_deft_training.py::test_optimizer_config_roundtrip_and_model_save
    src/hope_keras/deft/optimizer.py
)

# The requirement as pyproject.toml states it, e.g. keras>=3.6.0,<4.
spec=$(sed -n 's/^ *"\(keras[<>=!~][^"]*\)",\{0,1\} *$/\1/p' pyproject.toml)
oldest=$(sed -n 's/.*>=\([0-9][0-9.]*\).*/\1/p' <<<"$spec")
if [[ -z "$spec" || -z "$oldest" ]]; then
    echo "test-keras-range: no 'keras>=X.Y.Z,...' requirement found in pyproject.toml" >&2
    exit 2
fi

mkdir -p "$CACHE/wheels"
fetch() {  # fetch REQUIREMENT: downloads the matching wheel, prints its version
    local out
    out=$("$PY" -m pip download --no-deps --only-binary=:all: --progress-bar off \
          --dest "$CACHE/wheels" "$1" 2>&1) || { echo "$out" >&2; return 1; }
    grep -o 'keras-[0-9][0-9a-z.]*-py3-none-any\.whl' <<<"$out" | tail -n 1 |
        sed 's/^keras-\(.*\)-py3-none-any\.whl$/\1/'
}

if [[ -n "${KERAS_VERSIONS:-}" ]]; then
    read -r -a versions <<<"$KERAS_VERSIONS"
else
    newest=$(fetch "$spec")
    versions=("$oldest" "$newest")
    [[ "$newest" == "$oldest" ]] && versions=("$oldest")
fi

status=0
for v in "${versions[@]}"; do
    dir="$CACHE/keras-$v"
    if [[ ! -f "$dir/.installed" ]]; then
        whl="$CACHE/wheels/keras-$v-py3-none-any.whl"
        [[ -f "$whl" ]] || [[ "$(fetch "keras==$v")" == "$v" ]]
        rm -rf "$dir"
        "$PY" -m pip install --quiet --no-deps --target "$dir" "$whl"
        touch "$dir/.installed"
    fi
    echo "=== Keras $v ($dir)"
    start=$SECONDS
    # The folder must shadow the environment's Keras: check before testing.
    got=$(PYTHONPATH="$dir:src" "$PY" -c "import keras; print(keras.__version__)") ||
        { echo "=== Keras $v does not import next to this environment (see above)" >&2
          status=1; continue; }
    if [[ "$got" != "$v" ]]; then
        echo "=== Keras $got was imported instead of $v from $dir" >&2
        exit 2
    fi
    if PYTHONPATH="$dir:src" "$PY" -m pytest -q --tb=short -p no:cacheprovider "${TESTS[@]}"; then
        echo "=== Keras $v: passed in $((SECONDS - start)) s"
    else
        echo "=== Keras $v: FAILED (after $((SECONDS - start)) s)"
        status=1
    fi
done
exit $status
