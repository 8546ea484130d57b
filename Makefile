# One entry point for a fresh machine: `make demo` and `make test` create .venv themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup demo lint typecheck test test-slow test-bench bench notebooks docs-api clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Without a GPU, take the CPU build of torch (a local file on these machines), never a CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e '.[dev]'
	touch $@

demo: setup
	$(VENV)/bin/embcache demo

# Style and likely bugs (ruff: pycodestyle, pyflakes, import order, pyupgrade, bugbear); part of `make test`.
lint: setup
	$(VENV)/bin/ruff check lightning_embcache benchmarks tests tools examples

# Static types of the package (clean; part of `make test`).
typecheck: setup
	$(VENV)/bin/mypy

# One pytest-xdist worker per core (TEST_WORKERS=0: one process); worksteal evens out the long tests.
TEST_WORKERS ?= auto
test: setup lint typecheck
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal

test-slow: setup
	$(PY) -m pytest -q -p no:cacheprovider -m slow --timeout=3600

# The benchmarks' smoke tests (each runs a benchmark end to end at a small size).
test-bench: setup
	$(PY) -m pytest -q -p no:cacheprovider -m bench

bench: setup
	$(VENV)/bin/embcache bench store

# Re-execute the example notebook and store it with its outputs (the tests run it at a small size).
notebooks: setup
	cd examples && ../$(VENV)/bin/jupyter-execute --inplace autodecoder.ipynb

# Regenerate docs/api.md from the docstrings (a test checks it is up to date).
docs-api: setup
	$(PY) tools/gen_api_docs.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
