"""The native CPU kernel of the AdamW core, shared by torch_bridge (and JAX).

``adamw.h`` is the AdamW core of ``docs/algorithms.md`` as one loop over the
elements, written op for op like ``torch_bridge.adam.adamw_step``: built
with ``-ffp-contract=off`` and without ``-ffast-math`` (no FMA, no
reassociation), every operation rounds to fp32 as theirs do, so its bits equal
the eager torch and jitted JAX steps (tested). ``adamw_cpu.cc`` steps a list of
tensors of one configuration in one call, its elements split over threads.

The library is compiled on first use with the machine's C++ compiler (``$CXX``
or ``g++``, ``-O3 -march=native``) into a cache folder
(``$OPTAX_HALF_CACHE``, default ``~/.cache/optax_half``), named by a hash of
the sources, the flags, the compiler and the CPU, and reused after. The JAX
kernel (``adamw_ffi.cc``) is its handlers (``ffi_library``) and one library
per 16-bit param dtype and mode (``FFI_STEPS``), each built as the first step
that takes it is traced (``ffi_steps``).
``$OPTAX_HALF_NATIVE_FLAGS`` adds compiler flags (e.g. ``-mno-avx512f``: the
AVX2 lanes on a CPU that has AVX-512; ``lanes()`` says which). Without a
compiler (or if the build fails) ``library()`` returns None, with one warning,
and callers keep their pure-framework path. Nothing here imports JAX or torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np

__all__ = ["library", "ffi_library", "cpus", "has_f16", "kernel", "scaled_adam_kernels", "lanes",
           "leaf_keys", "ADAMW_SCALARS", "TENSOR_DTYPE", "SCALED_ADAM_DTYPE",
           "SCALED_ADAM_CONFIGS", "SCALED_ADAM_F16_CONFIGS", "SUM_BLOCK",
           "MODES", "COMPENSATIONS", "OPTIMIZER_COMPENSATIONS", "BUFFERS", "Compensation", "Rules",
           "compensation_of", "check_compensation", "build_errors", "MOMENT_DTYPES",
           "moment_dtype_of", "FFI_STEPS", "ffi_steps"]

_HERE = Path(__file__).resolve().parent
_HEADERS = ("adamw.h", "adamw_threads.h", "scaled_adam.h")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=c++17",
          "-shared", "-fPIC", "-pthread"]

# oh::Mode in adamw.h: a compensation's, or a wide param's ("direct": p += u in
# place; "update": the fp32 update itself, for JAX).
MODES = {"direct": 0, "master": 1, "split": 2, "kahan": 3, "stochastic": 4, "none": 5,
         "update": 6}
# The JAX library's steps of 16-bit params, (param dtype, mode): each a library
# of its own, built on first use (ffi_steps; fp16 where the handlers have it).
FFI_STEPS = (*(("bfloat16", m) for m in ("master", "split", "kahan", "stochastic", "none")),
             *(("float16", m) for m in ("master", "kahan", "stochastic", "none")))


class Compensation(NamedTuple):
  """One way a 16-bit param keeps what its rounding loses
  (docs/algorithms.md#wrappers): the facts both frameworks and the kernel share.

  ``optax_half.compensation`` and ``torch_bridge.compensation`` hold each
  entry's rules (init, read, write, follow) under the same name.

  Attributes:
    name: the ``compensation=`` value and the kernel's mode (a ``MODES`` key).
    wrapper: the wrapper that applies it to any optimizer.
    buffer: the per-param buffer's field in the JAX wrapper state and its key
      in the torch optimizer state; None: no buffer.
    buffer_dtype: "param" (the param's dtype), "int16", "float32" (the
      master dtype) or None.
    holds_value: the buffer is the working value itself (a full master copy),
      which a wrapped optimizer steps in place.
    follows: the buffer is re-seeded where the param was written from outside
      (docs/algorithms.md#pytorch-mirror).
    read_follows: its read does that for every element on every step.
    draws_bits: its write draws random bits (stream ``STREAM_PARAMS``).
    fp16: the compensation non-bf16 16-bit params take instead (a split
      master needs a bf16 high half).
  """
  name: str
  wrapper: str
  buffer: Optional[str]
  buffer_dtype: Optional[str]
  holds_value: bool
  follows: bool
  read_follows: bool
  draws_bits: bool
  fp16: str


COMPENSATIONS = {c.name: c for c in (
    Compensation("kahan", "kahan_summation", "compensation", "param", False, True, False, False,
                 "kahan"),
    Compensation("split", "master_weights", "master", "int16", False, False, False, False,
                 "master"),
    Compensation("stochastic", "stochastic_rounding", None, None, False, False, False, True,
                 "stochastic"),
    Compensation("none", "round_to_nearest", None, None, False, False, False, False, "none"),
    # adam_fp32_master and master_weights (not an adamw_bf16 choice)
    Compensation("master", "master_weights", "master", "float32", True, True, True, False,
                 "master"),
)}
# adamw_bf16's compensation= choices, its default first.
OPTIMIZER_COMPENSATIONS = ("kahan", "split", "stochastic", "none")
# The buffer fields, each once ("master" is split's and master's).
BUFFERS = tuple(dict.fromkeys(c.buffer for c in COMPENSATIONS.values() if c.buffer))


class Rules:
  """The base of a framework's rules for one compensation
  (``optax_half.compensation``, ``torch_bridge.compensation``): its table
  row ``spec``, whose fields read as attributes."""

  def __init__(self, spec: Compensation):
    self.spec = spec
    vars(self).update(spec._asdict())  # plain attributes: read on every step

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.spec.name!r})"


# The moments' default dtype per param dtype (``mu_dtype=None``, ``nu_dtype=None``): the
# param's, except fp16, whose range underflows ``(1 - b2) g^2`` (1e-4 squared, times 1e-3,
# is below fp16's smallest subnormal): fp16 params keep fp32 moments.
MOMENT_DTYPES = {"float16": "float32"}


def moment_dtype_of(param_dtype: str) -> str:
  """The default moment dtype (a name) of a param of dtype name ``param_dtype``."""
  return MOMENT_DTYPES.get(param_dtype, param_dtype)


def compensation_of(name: str, bfloat16: bool) -> Compensation:
  """The compensation a 16-bit param of compensation ``name`` takes: its own,
  or for a param that is not bf16 its ``fp16`` one."""
  c = COMPENSATIONS[name]
  return c if bfloat16 else COMPENSATIONS[c.fp16]


def check_compensation(compensation: str) -> Compensation:
  """``adamw_bf16``'s ``compensation=`` choice, or a ValueError naming the choices."""
  if compensation not in OPTIMIZER_COMPENSATIONS:
    raise ValueError(
        f"compensation must be one of {OPTIMIZER_COMPENSATIONS}; got {compensation!r}.")
  return COMPENSATIONS[compensation]

# The C struct `oh::Scalars` of adamw.h, field for field (fp32 each): the
# AdamW step's scalars, then how the gradients are read (grad_scale: the
# loss-scale unscaling; clip_div, clip_mul: optax's clip_by_global_norm; 1
# each where the step does neither).
ADAMW_SCALARS = ("lr", "b1", "b2", "one_minus_b1", "one_minus_b2", "inv_bc1", "inv_bc2", "eps",
                 "weight_decay", "grad_scale", "clip_div", "clip_mul")
# The C struct `oh::Tensor` of adamw_threads.h, field for field.
TENSOR_DTYPE = np.dtype([
    ("numel", np.int64), ("p", np.uint64), ("p_out", np.uint64), ("g", np.uint64),
    ("mu", np.uint64),
    ("nu", np.uint64), ("buffer", np.uint64), ("scalars", np.float32, (len(ADAMW_SCALARS),)),
    ("keys", np.uint32, (2,)), ("keep", np.uint32), ("index", np.uint64), ("marks", np.uint64)],
    align=True)

# The C struct `oh::ScaledAdamTensor` of scaled_adam.h, field for field; the
# scalars are oh::ScaledAdamScalars, in SCALED_ADAM_SCALARS's order.
SCALED_ADAM_SCALARS = ("grad_scale", "b1", "b2", "one_minus_b1", "one_minus_b2", "inv_bc2",
                       "eps", "alpha", "scale_step", "rms")
SCALED_ADAM_DTYPE = np.dtype([
    ("numel", np.int64), ("p", np.uint64), ("g", np.uint64), ("delta", np.uint64),
    ("v", np.uint64), ("sums", np.uint64),
    ("scalars", np.float32, (len(SCALED_ADAM_SCALARS),)), ("size", np.int32),
    ("want", np.int32), ("comp", np.uint64), ("p_out", np.uint64)], align=True)
# ScaledAdam's (param, gradient, exp_avg_sq) types in both libraries (type
# codes of `kernel`): fp32; fp32 params with 16-bit gradients (the wrappers'
# fp32 stand-ins); bf16 params with bf16 or fp32 gradients; and, where a
# library has fp16, fp16 params with fp16 or fp32 gradients (fp32 second moments).
SCALED_ADAM_CONFIGS = ("FFF", "FBF", "BBB", "BFB")
SCALED_ADAM_F16_CONFIGS = ("HHF", "HFF", "FHF")
# Elements of a tensor per float64 partial sum of scaled_adam.h (kSumBlock):
# a tensor's sums need 3 * ceil(numel / SUM_BLOCK) doubles of scratch.
SUM_BLOCK = 4096

# The random-bit hash of docs/algorithms.md#counter-based-random-bits, in every
# implementation (JAX, torch, C++): mix32's multipliers, the stream constant
# (stream * GOLDEN is xored into the step key) and the streams.
MIX32_M1, MIX32_M2, GOLDEN = 0x21F0AAAD, 0x735A2D97, 0x9E3779B9
STREAM_PARAMS, STREAM_MOMENTS = 0, 1  # the params; both moments (one word per element)
_M1, _M2 = np.uint32(MIX32_M1), np.uint32(MIX32_M2)
_STREAMS = [np.uint32((s * GOLDEN) & 0xFFFFFFFF) for s in (STREAM_PARAMS, STREAM_MOMENTS)]


def _mix32(x: np.ndarray) -> np.ndarray:
  x = x ^ (x >> np.uint32(16))
  x = x * _M1
  x = x ^ (x >> np.uint32(15))
  x = x * _M2
  return x ^ (x >> np.uint32(15))


def leaf_keys(seed: int, steps, leaves) -> np.ndarray:
  """``rounding.leaf_key(seed, step, stream, leaf)`` for streams 0 and 1 (the
  param and the moments) of many (step, leaf) pairs at once: a uint32 (n, 2) array."""
  steps = np.asarray(steps, np.uint64).astype(np.uint32)
  leaves = np.asarray(leaves, np.uint64).astype(np.uint32)
  k = _mix32(_mix32(np.full(steps.shape, seed, np.uint32)) ^ steps)
  return np.stack([_mix32(_mix32(k ^ s) ^ leaves) for s in _STREAMS], -1)

_lock = threading.Lock()
_libs: dict = {}  # name -> loaded library, or None if it could not be built
_locks: dict = {}  # name -> the lock its build holds
build_errors: dict = {}  # name -> why it could not be built


def _cpu_id() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith(("flags", "Features")):
          return line.strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _compiler() -> Optional[str]:
  return shutil.which(os.environ.get("CXX", "g++"))


def _cache_dir() -> Path:
  root = os.environ.get("OPTAX_HALF_CACHE") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "optax_half")
  return Path(root)


def _build(cxx: str, source: str, headers: tuple, include_dirs: tuple,
           extra: tuple = (), defines: tuple = ()) -> Path:
  """The library of ``source`` compiled with flags ``extra`` and ``defines``, built into
  the cache unless it is there."""
  version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
  flags = (_FLAGS + list(extra) + list(defines) + os.environ.get("OPTAX_HALF_NATIVE_FLAGS", "").split()
           + [f"-I{_HERE}"] + [f"-I{d}" for d in include_dirs])
  digest = hashlib.sha256()
  for name in (source, *headers):
    digest.update((_HERE / name).read_bytes())
  for d in include_dirs:  # e.g. XLA's FFI headers: a new jaxlib means a new build
    for header in sorted(Path(d).glob("xla/ffi/api/*.h")):
      digest.update(header.read_bytes())
  digest.update(" ".join(flags + [cxx, version, _cpu_id(), platform.machine()]).encode())
  target = _cache_dir() / f"{Path(source).stem}-{digest.hexdigest()[:16]}.so"
  if target.exists():
    return target
  # A build with extra flags (OpenMP) that failed once is not tried again;
  # the plain build always is (its failure may have been passing).
  failed = target.with_suffix(".failed")
  if extra and failed.exists():
    raise RuntimeError(f"{cxx} failed before: {failed.read_text()[-2000:]}")
  target.parent.mkdir(parents=True, exist_ok=True)
  # Build to a temporary name, then rename: concurrent builders never see half a file.
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
  os.close(fd)
  try:
    run = subprocess.run([cxx, *flags, "-w", "-o", tmp, str(_HERE / source)],
                         capture_output=True, text=True)
    if run.returncode != 0:
      if extra:
        failed.write_text(run.stderr[-2000:])
      raise RuntimeError(f"{cxx} failed:\n{run.stderr[-2000:]}")
    os.replace(tmp, target)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return target


def cpus() -> int:
  """The CPUs this process may run on (its affinity; the kernels' thread count)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    return os.cpu_count() or 1


def _build_and_load(cxx: str, source: str, include_dirs, extra, defines=()) -> ctypes.CDLL:
  lib = ctypes.CDLL(str(_build(cxx, source, _HEADERS, tuple(include_dirs), tuple(extra),
                               tuple(defines))))
  offsets = [lib.oh_tensor_field_offset(k) for k in range(len(TENSOR_DTYPE.names))]
  if (lib.oh_tensor_struct_size() != TENSOR_DTYPE.itemsize
      or offsets != [TENSOR_DTYPE.fields[name][1] for name in TENSOR_DTYPE.names]):
    raise RuntimeError("struct layout differs from TENSOR_DTYPE")
  if hasattr(lib, "oh_scaled_adam_struct_size"):
    offsets = [lib.oh_scaled_adam_field_offset(k) for k in range(len(SCALED_ADAM_DTYPE.names))]
    if (lib.oh_scaled_adam_struct_size() != SCALED_ADAM_DTYPE.itemsize
        or offsets != [SCALED_ADAM_DTYPE.fields[n][1] for n in SCALED_ADAM_DTYPE.names]):
      raise RuntimeError("struct layout differs from SCALED_ADAM_DTYPE")
  return lib


def _gcc(cxx: str) -> bool:
  """Whether ``cxx`` is GCC, whose -fopenmp links libgomp (clang's links libomp,
  a second OpenMP runtime next to torch's: no gain)."""
  version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
  return "clang" not in version.lower()


def _load(source: str, include_dirs: tuple = (), extra: tuple = (), defines: tuple = (),
          name: Optional[str] = None) -> Optional[ctypes.CDLL]:
  """Builds (once per source, flags, compiler and CPU) and loads one library, ``name``
  (default ``source``); None, with one warning, if that fails. ``extra``: flags tried
  first; if the library cannot be built or loaded with them (a compiler without OpenMP),
  it is built without (a failed build is remembered in the cache). ``defines``: ``-D``
  flags it is always built with. Libraries of other names build at the same time."""
  name = name or source
  if name in _libs:
    return _libs[name]
  with _lock:
    lock = _locks.setdefault(name, threading.Lock())
  with lock:
    if name in _libs:
      return _libs[name]
    lib = None
    try:
      if os.environ.get("OPTAX_HALF_NATIVE", "1") == "0":
        raise RuntimeError("disabled by OPTAX_HALF_NATIVE=0")
      cxx = _compiler()
      if cxx is None:
        raise RuntimeError("no C++ compiler ($CXX or g++) on PATH")
      if "-fopenmp" in extra and not _gcc(cxx):
        extra = ()
      try:
        lib = _build_and_load(cxx, source, include_dirs, extra, defines)
      except (RuntimeError, OSError):
        if not extra:
          raise
        lib = _build_and_load(cxx, source, include_dirs, (), defines)
    except Exception as e:  # noqa: BLE001 (any failure means: use the framework path)
      lib = None
      build_errors[name] = f"{type(e).__name__}: {e}"
      warnings.warn(f"optax_half_native: the CPU kernel {name} is unavailable "
                    f"({build_errors[name]}); the framework implementation runs instead.",
                    RuntimeWarning, stacklevel=3)
    _libs[name] = lib
  return lib


def library() -> Optional[ctypes.CDLL]:
  """The multi-tensor kernel library for ctypes callers, built on first use.

  Built with OpenMP where the compiler has it: loaded after torch, it then
  shares torch's OpenMP runtime (both name ``libgomp.so.1``, and the loader
  reuses the one already loaded), so a step runs on torch's thread team.
  With threads of its own it would compete with torch's workers, which spin
  for milliseconds after every parallel op: on 2 cores, a 16.8M-param Kahan
  step right after another torch op took 17 ms instead of 9.
  """
  return _load("adamw_cpu.cc", extra=("-fopenmp",))


def ffi_library(xla_include_dir: str) -> Optional[ctypes.CDLL]:
  """The XLA FFI handler library (symbols ``OhAdamw``, ``OhAdamwFlat``,
  ``OhAllFinite``, ``OhScaledAdamSums``, ``OhScaledAdamStep``), built against
  the XLA FFI headers in ``xla_include_dir`` (``jax.ffi.include_dir()``). It
  steps fp32 params and ScaledAdam; the AdamW steps of 16-bit params are
  libraries of their own, one per ``FFI_STEPS`` pair (``ffi_steps``)."""
  return _load("adamw_ffi.cc", (xla_include_dir,))


_steps_set: set = set()  # the FFI_STEPS pairs in the handlers' table


def _ffi_step(xla_include_dir: str, param: str, mode: str) -> bool:
  f16 = int(param == "float16")
  if f16 and not has_f16(ffi_library(xla_include_dir)):  # the handlers' build first
    return False
  lib = _load("adamw_ffi.cc", (xla_include_dir,),
              defines=(f"-DOH_STEP_MODE={MODES[mode]}", f"-DOH_STEP_F16={f16}"),
              name=f"adamw_ffi.cc[{param} {mode}]")
  handlers = ffi_library(xla_include_dir)  # built beside a bf16 step
  if lib is None or handlers is None:
    return False
  with _lock:
    if (param, mode) not in _steps_set:
      lib.oh_ffi_step.restype = ctypes.c_void_p
      handlers.oh_ffi_set_step.restype = ctypes.c_bool
      handlers.oh_ffi_set_step.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
      # Only a library that holds the step asked for (its own param type and mode).
      if ((lib.oh_ffi_step_f16(), lib.oh_ffi_step_mode()) != (f16, MODES[mode])
          or not handlers.oh_ffi_set_step(f16, MODES[mode], lib.oh_ffi_step())):
        raise RuntimeError(f"the FFI handlers refused the step of {param} params in mode {mode}")
      _steps_set.add((param, mode))
  return True


def ffi_steps(xla_include_dir: str, pairs=FFI_STEPS) -> bool:
  """Whether the handlers (``ffi_library``) step each ``(param dtype, mode)`` of
  ``pairs`` (``FFI_STEPS`` entries; fp16 ones where the handlers have fp16):
  each step is built on first use, the handlers and the steps not yet built
  at the same time (as many as the process has CPUs), and loaded into the
  handlers' table. A step that cannot be built warns once and is False."""
  pairs = list(dict.fromkeys(pairs))
  unknown = [p for p in pairs if p not in FFI_STEPS]
  if unknown:
    raise ValueError(f"no FFI step for {unknown}; the steps: {FFI_STEPS}")
  todo = [p for p in pairs if p not in _steps_set]
  if not todo:
    return True
  with ThreadPoolExecutor(max(1, min(cpus(), len(todo) + 1))) as pool:
    pool.submit(ffi_library, xla_include_dir)
    # bf16 first: an fp16 step waits for the handlers (has_f16) before it builds
    done = list(pool.map(lambda p: _ffi_step(xla_include_dir, *p),
                         sorted(todo, key=lambda p: p[0] == "float16")))
  return all(done)


def lanes(lib: Optional[ctypes.CDLL] = None) -> int:
  """Elements per iteration of ``lib``'s loop (default: the torch library,
  ``library()``; or ``ffi_library(...)``): 16 (AVX-512 with BF16), 8 (AVX2)
  or 1; 0 if it is unavailable."""
  lib = library() if lib is None else lib
  return 0 if lib is None else int(lib.oh_lanes())


def has_f16(lib: Optional[ctypes.CDLL]) -> bool:
  """Whether ``lib`` (``library()`` or ``ffi_library(...)``) steps fp16
  params (built where the CPU has F16C)."""
  return lib is not None and bool(lib.oh_has_f16())


def scaled_adam_kernels(param: str, grad: str, exp_avg_sq: str):
  """ScaledAdam's ``(sums, step)`` entry points for one configuration, or None.

  Types as ``kernel``'s, one of ``SCALED_ADAM_CONFIGS`` (and, where
  ``has_f16``, ``SCALED_ADAM_F16_CONFIGS``). Each function takes
  ``(tensors: SCALED_ADAM_DTYPE array pointer, n, nthreads)``; ``sums``
  writes each tensor's three sums into the first three doubles of its
  ``sums`` scratch, ``step`` steps the tensors in place (scaled_adam.h).
  """
  lib = library()
  if lib is None:
    return None
  name = f"{param}{grad}{exp_avg_sq}"
  fns = [getattr(lib, f"oh_scaled_adam_{kind}_{name}", None) for kind in ("sums", "step")]
  if None in fns:
    return None
  for fn in fns:
    if fn.argtypes is None:
      fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
      fn.restype = None
  return tuple(fns)


def kernel(param: str, grad: str, mu: str, nu: str, mode: str, stochastic_moments: bool):
  """The entry point for one configuration, or None if there is none.

  Types are "B" (bf16), "F" (fp32) or "H" (fp16: params, gradients and
  moments of fp16 params, in the modes "master", "kahan", "stochastic" and
  "none", where ``has_f16``); ``mode`` is a key of ``MODES``. The
  function takes ``(tensors: TENSOR_DTYPE array pointer, n, nthreads)``.
  """
  lib = library()
  if lib is None:
    return None
  sr = int(stochastic_moments and ("B" in mu + nu or "H" in mu + nu))  # a 16-bit moment
  name = f"oh_adamw_{param}{grad}{mu}{nu}_{MODES[mode]}_{sr}"
  fn = getattr(lib, name, None)
  if fn is not None and fn.argtypes is None:
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    fn.restype = None
  return fn
