# One command each: `make demo` runs the main job, `make test` runs the tests.
# Both create the virtual environment on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

export TF_CPP_MIN_LOG_LEVEL ?= 2
export KERAS_BACKEND ?= tensorflow

.PHONY: test test-keras-range demo bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

# The Keras-facing tests on the oldest and newest Keras that pyproject.toml allows,
# each installed next to the environment's TensorFlow (cached in .cache/keras-range).
test-keras-range: $(STAMP)
	PY=$(PY) scripts/test_keras_range.sh

demo: $(STAMP)
	$(PY) examples/demo.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .cache/keras-range
