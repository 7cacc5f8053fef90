# Common entry points; see README.md for the environment knobs.
PYTHON ?= python3

.PHONY: install test test-all bench clean generate

install:
	$(PYTHON) -m pip install --no-build-isolation -e .

test:
	$(PYTHON) -m pytest -q tests

test-all:
	$(PYTHON) -m pytest -q tests --exhaustive

bench:
	$(PYTHON) bench/mma_peak.py && $(PYTHON) bench/bench_fwd.py

generate:
	$(PYTHON) csrc/generate_kernels.py

clean:
	rm -rf build dist *.egg-info flash_attn_cuda/_C*.so
	find . -name __pycache__ -prune -exec rm -rf {} +
