# Common entry points; see README.md for the environment knobs.
PYTHON ?= python3

.PHONY: install test test-all bench clean generate wheel smoke-wheel

# -v: pip shows the build's output, among it the compile progress ("flash_attn_cuda._C: compiled K/N files").
install:
	$(PYTHON) -m pip install --no-build-isolation -v -e .

# Build the wheel into dist/ and repair it into wheelhouse/ (tools/build_wheel.sh; the setup.py knobs apply).
wheel:
	PYTHON=$(PYTHON) bash tools/build_wheel.sh

# Install wheelhouse's wheel into a fresh venv outside the tree and run the tests against it.
smoke-wheel:
	PYTHON=$(PYTHON) bash tools/smoke_test_wheel.sh $(wildcard wheelhouse/flash_attn_cuda-*.whl)

test:
	$(PYTHON) -m pytest -q tests -n 8

test-all:
	$(PYTHON) -m pytest -q tests --exhaustive

bench:
	$(PYTHON) bench/mma_peak.py && $(PYTHON) bench/bench_fwd.py

generate:
	$(PYTHON) csrc/generate.py

clean:
	rm -rf build dist wheelhouse *.egg-info flash_attn_cuda/_C*.so flash_attn_cuda/_autograd_torch*.so flash_attn_cuda/_build_info.py
	find . -name __pycache__ -prune -exec rm -rf {} +
