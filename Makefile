# One virtual environment for everything; created on first use and reused after.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test test-slow soak demo bench install clean

# Reinstall only when the package metadata changes: a second `make test` is seconds.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# Two pytest-xdist workers: most of the suite is single-threaded XLA compiles
# and small torch steps, so two workers use both cores of a 2-core machine.
# TEST_WORKERS=0 runs it in one process; the slowest tests are listed at the end.
# worksteal: a worker that runs out of tests takes some of the other's.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15 $(PYTEST_ARGS)

# The long runs (marker `slow`: training runs, 1000-step parity, the AVX2 build
# of the kernel, the 8-device sharding run); CI runs them after `make test`.
test-slow: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15 -m slow $(PYTEST_ARGS)

# Long-run soak (tests/test_soak.py, marker `soak`, not in `make test`): 100k steps
# of every optimizer in JAX and torch; SOAK_STEPS=10000 make soak for a shorter one.
soak: $(STAMP)
	$(PY) -m pytest -q -s -m soak tests/test_soak.py $(PYTEST_ARGS)

# The main job: stale bf16 weights and their cures, JAX and torch (examples/demo.py).
# Flags go in DEMO_ARGS, e.g. make demo DEMO_ARGS="--quick" or "--framework jax".
demo: $(STAMP)
	$(PY) examples/demo.py $(DEMO_ARGS)

# Optimizer step benchmarks, JAX then torch (ratios to the reference run in the
# same process); BENCH_ARGS="--tree many" or "--quick"; results in bench_out/.
bench: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check "torch-optimi>=0.3"
	mkdir -p bench_out
	$(PY) -m benchmarks.step $(BENCH_ARGS) --json bench_out/jax.json
	$(PY) -m benchmarks.torch_step $(BENCH_ARGS) --json bench_out/torch.json

clean:
	rm -rf $(VENV) .pytest_cache demo_out bench_out
