# One virtual environment for everything; created on first use and reused after.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test test-slow soak demo bench install clean gpu-static test-gpu-static tpu-static \
        test-tpu-static

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
# of the kernel, the 8-device sharding run, torch's FSDP2/DDP run); CI runs them after
# `make test`.
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

# GPU kernels compiled without a GPU (benchmarks/gpu_static.py): XLA:GPU needs the
# CUDA plugin at the jaxlib version, kept out of .venv in .venv-gpu (JAX there
# compiles for a deviceless H100; no CUDA libraries, no GPU). OUT: where to write.
GPU_VENV  := .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed
OUT       ?= gpu_static_out

$(GPU_STAMP): pyproject.toml $(STAMP)
	test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	v=$$($(PY) -c "import jax; print(jax.__version__)"); \
	pins=$$($(PY) -c "import optax, flax, chex, ml_dtypes, numpy; print(' '.join(f'{m.__name__}=={m.__version__}' for m in (optax, flax, chex, ml_dtypes, numpy)))"); \
	$(GPU_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
	  "jax==$$v" "jaxlib==$$v" "jax-cuda12-plugin==$$v" "jax-cuda12-pjrt==$$v" $$pins "pytest>=8"
	touch $(GPU_STAMP)

# Every JAX benchmark row compiled for an H100: HLO, PTX and OUT/jax.json;
# then the torch Triton kernels (.venv has torch and triton).
gpu-static: $(GPU_STAMP)
	PYTHONPATH=$(CURDIR) $(GPU_VENV)/bin/python -m benchmarks.gpu_static $(OUT) --jax
	$(PY) -m benchmarks.gpu_static $(OUT)

# tests/test_gpu_static.py in .venv-gpu (skipped in .venv); CI runs it.
test-gpu-static: $(GPU_STAMP)
	JAX_PLATFORMS=cpu PYTHONPATH=$(CURDIR) $(GPU_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_gpu_static.py

# TPU steps compiled without a TPU (benchmarks/tpu_static.py): XLA:TPU is libtpu,
# pinned by jax[tpu] at the jax version, kept out of .venv in .venv-tpu (JAX there
# compiles for deviceless v5e, v6e and v4 chips; no TPU).
TPU_VENV  := .venv-tpu
TPU_STAMP := $(TPU_VENV)/.installed

$(TPU_STAMP): pyproject.toml $(STAMP)
	test -x $(TPU_VENV)/bin/python || $(PYTHON) -m venv $(TPU_VENV)
	v=$$($(PY) -c "import jax; print(jax.__version__)"); \
	pins=$$($(PY) -c "import optax, flax, chex, ml_dtypes, numpy; print(' '.join(f'{m.__name__}=={m.__version__}' for m in (optax, flax, chex, ml_dtypes, numpy)))"); \
	$(TPU_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
	  "jax[tpu]==$$v" "jaxlib==$$v" $$pins "pytest>=8"
	touch $(TPU_STAMP)

# Every JAX benchmark row compiled for v5e, v6e and v4 (TPU_ARGS="--chips v5e"):
# HLO per chip and row and OUT/tpu.json (OUT: default tpu_static_out).
TPU_OUT = $(if $(filter command line environment,$(origin OUT)),$(OUT),tpu_static_out)
tpu-static: $(TPU_STAMP)
	PYTHONPATH=$(CURDIR) $(TPU_VENV)/bin/python -m benchmarks.tpu_static $(TPU_OUT) $(TPU_ARGS)

# tests/test_tpu_static.py in .venv-tpu (skipped in .venv); CI runs it.
test-tpu-static: $(TPU_STAMP)
	JAX_PLATFORMS=cpu PYTHONPATH=$(CURDIR) $(TPU_VENV)/bin/python -m pytest -q -p no:cacheprovider \
	  --durations=5 tests/test_tpu_static.py

clean:
	rm -rf $(VENV) $(GPU_VENV) $(TPU_VENV) .pytest_cache demo_out bench_out gpu_static_out \
	  tpu_static_out
