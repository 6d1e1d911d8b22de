"""Mixed-precision policies (jmp's API): which dtype params, computation and outputs use.

With jmp's loss-scale objects (``optax_half.loss_scale``), jmp code ports by changing the
import: ``import optax_half as jmp``.

    policy = oh.get_policy("p=f32,c=bf16,o=f32")  # "params=float32,compute=bfloat16,output=float32"
    x = policy.cast_to_compute(x)                 # floating array leaves only

Spec: docs/algorithms.md#mixed-precision-policies-and-fp32-gradient-accumulation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Policy", "get_policy", "cast_to_full", "cast_to_half", "half_dtype"]

T = TypeVar("T")

# Each dtype's names, the short one first (what str(policy) prints).
_NAMES = {
    np.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
    np.dtype(jnp.float16): ("f16", "float16"),
    np.dtype(jnp.float32): ("f32", "float32", "full"),
    np.dtype(jnp.float64): ("f64", "float64"),
}
_BY_NAME = {name: dtype for dtype, names in _NAMES.items() for name in names}
_KEYS = {"p": "param_dtype", "params": "param_dtype", "c": "compute_dtype",
         "compute": "compute_dtype", "o": "output_dtype", "output": "output_dtype"}


def _cast_floating(tree: T, dtype) -> T:
  """``tree`` with every floating-point array leaf cast to ``dtype``."""
  def cast(x):
    if isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating):
      return x.astype(dtype)
    return x
  return jax.tree.map(cast, tree)


def _as_float_dtype(value, what: str) -> np.dtype:
  try:
    dtype = np.dtype(value)
  except TypeError:
    raise TypeError(f"{what} must be a floating dtype (e.g. jnp.bfloat16); got {value!r}.") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{what} must be a floating dtype; got {dtype}.")
  return dtype


@dataclasses.dataclass(frozen=True)
class Policy:
  """The dtypes of params, of the computation and of its outputs.

  Args:
    param_dtype: the dtype params are stored in (and the optimizer updates).
    compute_dtype: the dtype the forward (and so backward) pass runs in.
    output_dtype: the dtype a model's outputs are returned in (e.g. fp32
      logits for a stable loss).

  Example:
    >>> import jax.numpy as jnp, optax_half as oh
    >>> policy = oh.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
    >>> out = policy.cast_to_compute({"x": jnp.ones(2), "step": jnp.int32(3)})
    >>> str(out["x"].dtype), str(out["step"].dtype)   # floating leaves only
    ('bfloat16', 'int32')
    >>> str(policy), str(policy.with_output_dtype(jnp.bfloat16))
    ('p=f32,c=bf16,o=f32', 'p=f32,c=bf16,o=bf16')

  References:
    Micikevicius et al., `Mixed Precision Training
    <https://arxiv.org/abs/1710.03740>`_, ICLR 2018; google-deepmind/jmp.
  """
  param_dtype: Any
  compute_dtype: Any
  output_dtype: Any

  def __post_init__(self):
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
      object.__setattr__(self, field, _as_float_dtype(getattr(self, field), field))

  def cast_to_param(self, x: T) -> T:
    """Floating leaves of ``x`` in the param dtype."""
    return _cast_floating(x, self.param_dtype)

  def cast_to_compute(self, x: T) -> T:
    """Floating leaves of ``x`` in the compute dtype."""
    return _cast_floating(x, self.compute_dtype)

  def cast_to_output(self, x: T) -> T:
    """Floating leaves of ``x`` in the output dtype."""
    return _cast_floating(x, self.output_dtype)

  def with_param_dtype(self, dtype) -> "Policy":
    return dataclasses.replace(self, param_dtype=dtype)

  def with_compute_dtype(self, dtype) -> "Policy":
    return dataclasses.replace(self, compute_dtype=dtype)

  def with_output_dtype(self, dtype) -> "Policy":
    return dataclasses.replace(self, output_dtype=dtype)

  def __str__(self) -> str:
    name = lambda d: _NAMES.get(d, (str(d),))[0]  # noqa: E731
    return f"p={name(self.param_dtype)},c={name(self.compute_dtype)},o={name(self.output_dtype)}"


def half_dtype() -> np.dtype:
  """The 16-bit dtype of the default backend: bf16 on TPU, fp16 elsewhere (jmp's rule).

  Example:
    >>> import optax_half as oh
    >>> str(oh.half_dtype())  # on CPU
    'float16'
  """
  on_tpu = jax.local_devices()[0].platform == "tpu"
  return np.dtype(jnp.bfloat16 if on_tpu else jnp.float16)


def _parse_dtype(name: str, policy_name: str) -> np.dtype:
  name = name.strip()
  if name == "half":
    return half_dtype()
  if name not in _BY_NAME:
    # "Unknown dtype"/"Unknown key": jmp's words, which ported tests match.
    raise ValueError(
        f"get_policy({policy_name!r}): Unknown dtype {name!r}; use one of "
        f"{sorted(_BY_NAME)} or 'half'.")
  return _BY_NAME[name]


def get_policy(policy_name: str) -> Policy:
  """A ``Policy`` from a string, in jmp's grammar (``"p=f32,c=bf16,o=f32"``; a part
  left out follows the one before it, params default to f32; a bare dtype sets
  all three; docs/algorithms.md#mixed-precision-policies-and-fp32-gradient-accumulation).

  Example:
    >>> import optax_half as oh
    >>> str(oh.get_policy("params=float32,compute=bfloat16,output=float32"))
    'p=f32,c=bf16,o=f32'
    >>> str(oh.get_policy("c=f16")), str(oh.get_policy("bf16"))
    ('p=f32,c=f16,o=f16', 'p=bf16,c=bf16,o=bf16')
  """
  if not isinstance(policy_name, str) or not policy_name.strip():
    raise ValueError(f"get_policy takes a non-empty string; got {policy_name!r}.")
  if "=" not in policy_name:
    dtype = _parse_dtype(policy_name, policy_name)
    return Policy(dtype, dtype, dtype)
  found: dict = {}
  for part in policy_name.split(","):
    key, sep, value = part.partition("=")
    key = key.strip()
    if not sep:
      raise ValueError(f"get_policy({policy_name!r}): {part!r} is not key=dtype "
                       "(keys: params/p, compute/c, output/o).")
    if key not in _KEYS:
      raise ValueError(f"get_policy({policy_name!r}): Unknown key {key!r}; use "
                       "params (p), compute (c) or output (o).")
    field = _KEYS[key]
    if field in found:
      raise ValueError(f"get_policy({policy_name!r}): {field} is given twice.")
    found[field] = _parse_dtype(value, policy_name)
  param = found.get("param_dtype", np.dtype(jnp.float32))
  compute = found.get("compute_dtype", param)
  output = found.get("output_dtype", compute)
  return Policy(param, compute, output)


def cast_to_full(tree: T) -> T:
  """Floating leaves of ``tree`` in fp32.

  Example:
    >>> import jax.numpy as jnp, optax_half as oh
    >>> oh.cast_to_full({"w": jnp.ones(2, jnp.bfloat16)})["w"].dtype
    dtype('float32')
  """
  return _cast_floating(tree, jnp.float32)


def cast_to_half(tree: T) -> T:
  """Floating leaves of ``tree`` in ``half_dtype()``.

  Example:
    >>> import jax.numpy as jnp, optax_half as oh
    >>> oh.cast_to_half({"w": jnp.ones(2)})["w"].dtype  # on CPU
    dtype('float16')
  """
  return _cast_floating(tree, half_dtype())
