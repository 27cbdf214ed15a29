# One command each: `make demo` runs the main job, `make test` runs the tests.
# `make fuzz` checks 500 random networks (tests/fuzz_networks.py); `make test-apps`
# runs every keras.applications family (tests/test_applications.py); `make test-benchmarks`
# runs every script under benchmarks/ in --quick mode (tests/test_benchmarks_quick.py).
# All create the virtual environment on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

export TF_CPP_MIN_LOG_LEVEL ?= 2
export KERAS_BACKEND ?= tensorflow

.PHONY: test test-apps test-benchmarks test-keras-range fuzz demo bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

test-apps: $(STAMP)
	$(PY) -m pytest tests/test_applications.py -m applications -o addopts=-q

test-benchmarks: $(STAMP)
	$(PY) -m pytest tests/test_benchmarks_quick.py -m benchmarks -o addopts=-q

# The Keras-facing tests on the oldest and newest Keras that pyproject.toml allows,
# each installed next to the environment's TensorFlow (cached in .cache/keras-range).
test-keras-range: $(STAMP)
	PY=$(PY) scripts/test_keras_range.sh

fuzz: $(STAMP)
	HOPE_FUZZ_N=500 $(PY) -m pytest tests/test_fuzz.py -q -rs -s

demo: $(STAMP)
	$(PY) examples/demo.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .cache/keras-range
