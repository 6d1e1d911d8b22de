#!/usr/bin/env bash
# The whole GPU check in one call (about 8 minutes at most): the GPU tests
# (tests/test_gpu.py: bits against the CPU, no host sync, the Triton step) and the
# JAX and torch step benchmarks at GPU sizes (benchmarks/common.py's "gpt2" and
# "1.3b" trees), JSON and tables written into the folder given.
#
#   bash benchmarks/gpu_check.sh OUT_DIR
#
# Uses the python3 on PATH, which must hold a CUDA JAX, a CUDA torch and Triton
# (the GPU machines' image has all three; nothing is installed). The repository is
# imported from the working tree. GPU_CHECK_TREES (default "gpt2 1.3b") and
# GPU_CHECK_REPS (default 5) shrink it; each part has its own time limit, and a part
# that fails or runs out of time does not stop the others.
set -u
out=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
trees=${GPU_CHECK_TREES:-gpt2 1.3b}
reps=${GPU_CHECK_REPS:-5}
py=${PYTHON:-python3}

# Seven files come back at most: log.txt (every part's output), status.txt and the JSONs
# (a device machine returns 8 files at most).
part() {  # part NAME SECONDS COMMAND...: runs it, its output appended to OUT/log.txt
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*" | tee -a "$out/log.txt"
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/part.txt" 2>&1
  local rc=$?
  cat "$out/part.txt" >>"$out/log.txt"
  tail -n 25 "$out/part.txt"
  rm -f "$out/part.txt"
  echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$out/status.txt"
}

part env 30 "$py" -c "
import jax, torch, sys
print(sys.version.split()[0], 'jax', jax.__version__, jax.devices())
print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')
try:
  import triton; print('triton', triton.__version__)
except ImportError:
  print('no triton')
"
# (the IEEE-flags rerun of the JAX cases is left out for time: pytest tests/test_gpu.py -k ieee)
part test_gpu 120 "$py" -m pytest -q -p no:cacheprovider tests/test_gpu.py -rs -k "not ieee"

# JAX: the reference, the naive bf16 step, every compensation, the wrappers and the
# Flax paths, through tx.update and in place. The 1.3B tree holds fewer rows (each
# row keeps its params, gradients and state on the device for the interleaved timing).
# JAX compiles each row for about 25 s on an H200 (jax 0.11.2), so few rows fit: the
# Kahan step in place, tree and flat state (the Pallas kernels: docs/algorithms.md#pallas-kernels;
# the reference is always timed too); at gpt2 each also K steps in one jit for device_ms and
# host_ms (--split: a second compile a row), and XLA's own in-place step
# (OPTAX_HALF_GPU_KERNEL=0) to compare the kernels with.
jax_rows="adamw_bf16 kahan (update_and_apply),adamw_bf16 kahan flat_state (update_and_apply)"
jax_rows_big="adamw_bf16 kahan (update_and_apply)"
torch_rows="torch AdamW foreach fp32,torch AdamW fused bf16 (naive),adamw_bf16 kahan,\
adamw_bf16 stochastic,adamw_bf16 split,adam_fp32_master,adamw_bf16 kahan (fused=True),\
scaled_adam clip 2.0,master_weights(AdamW fused) foreach=True,\
master_weights(AdamW fused) foreach=False"
torch_rows_big="torch AdamW fused bf16 (naive),adamw_bf16 kahan,adam_fp32_master"
# Limits: 30 + 120 + (100 + 50 + 60) + (70 + 50) s = 8 minutes at most.
for tree in $trees; do
  if [ "$tree" = "1.3b" ]; then
    jr=$jax_rows_big tr=$torch_rows_big jl=70 js="" tl=50
  else
    jr=$jax_rows tr=$torch_rows jl=100 js="--split 10" tl=60
  fi
  part "jax_$tree" "$jl" "$py" -m benchmarks.step --tree "$tree" --reps "$reps" --memory off \
    --only "$jr" --json "$out/jax_$tree.json" ${js:-}
  if [ "$tree" != "1.3b" ]; then
    part "jax_xla_$tree" 50 env OPTAX_HALF_GPU_KERNEL=0 "$py" -m benchmarks.step --tree "$tree" \
      --reps "$reps" --memory off --only "adamw_bf16 kahan (update_and_apply)" \
      --json "$out/jax_xla_$tree.json"
  fi
  part "torch_$tree" "$tl" "$py" -m benchmarks.torch_step --device cuda --tree "$tree" \
    --reps "$reps" --memory off --only "$tr" --json "$out/torch_$tree.json"
done
cat "$out/status.txt"
