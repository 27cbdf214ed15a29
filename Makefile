# One command each: `make demo` runs the main job, `make test` runs the tests.
# `make test` is the fast tier: every public function and every claimed layer pattern,
# in parallel (pytest-xdist, TEST_WORKERS processes, one test file per process).
# `make test-all` adds the long tiers: `make test-slow` (tests marked slow), `make
# fuzz` (500 random networks, tests/fuzz_plan.py), `make test-apps` (every
# keras.applications family, tests/test_applications.py), `make test-benchmarks`
# (every script under benchmarks/ in --quick mode, tests/test_benchmarks_quick.py)
# and `make test-keras-range`.
# All create the virtual environment on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Test processes: 2 fits the 2-core machine the timings were taken on; `auto` uses
# every core. --dist loadfile keeps a file's tests (and its module fixtures) together.
TEST_WORKERS ?= 2
XDIST  := -n $(TEST_WORKERS) --dist loadfile

export TF_CPP_MIN_LOG_LEVEL ?= 2
export KERAS_BACKEND ?= tensorflow

.PHONY: test test-slow test-all test-apps test-benchmarks test-keras-range fuzz demo bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(XDIST)

test-slow: $(STAMP)
	$(PY) -m pytest $(XDIST) -m slow

# Every tier, the fast one first (what .ci/run runs).
test-all: test test-slow fuzz test-apps test-benchmarks test-keras-range

test-apps: $(STAMP)
	$(PY) -m pytest tests/test_applications.py -m applications -o addopts=-q -n $(TEST_WORKERS)

test-benchmarks: $(STAMP)
	$(PY) -m pytest tests/test_benchmarks_quick.py -m benchmarks -o addopts=-q

# The Keras-facing tests on the oldest and newest Keras that pyproject.toml allows,
# each installed next to the environment's TensorFlow (cached in .cache/keras-range).
test-keras-range: $(STAMP)
	PY=$(PY) scripts/test_keras_range.sh

# The 500 networks on TEST_WORKERS processes, each check's findings written to
# .cache/fuzz; then the coverage table of all 500 (printed) and its assertions.
FUZZ_N ?= 500
FUZZ_ENV := HOPE_FUZZ_N=$(FUZZ_N) HOPE_FUZZ_RESULTS=.cache/fuzz
fuzz: $(STAMP)
	rm -rf .cache/fuzz
	$(FUZZ_ENV) $(PY) -m pytest tests/test_fuzz.py -o addopts=-q -n $(TEST_WORKERS) \
		--dist load -k "not test_fuzz_coverage"
	$(FUZZ_ENV) $(PY) -m pytest tests/test_fuzz.py -o addopts=-q -s -k test_fuzz_coverage

demo: $(STAMP)
	$(PY) examples/demo.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .cache/keras-range
