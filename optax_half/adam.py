"""Named Adam optimizers for low-precision params (``adam_fp32_master``, ``adamw_bf16``),
built from the wrappers around one fp32 core, ``scale_by_adamw``.
Spec: ``docs/algorithms.md#adamw-core``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

import optax_half_native as native_lib
from optax_half_native import checks
from optax_half import _native, rounding, wrappers
from optax_half._coefficients import (Coefficients, _f32, _is_zero, adamw_leaf,  # noqa: F401
                                      coefficients)
from optax_half._util import (check_no_float64, check_trees, decay_mask, leaf_indices,
                              maybe_skip_nonfinite, seed_from_key, transformation, unzip,
                              zeros_like_param)
from optax_half.compensation import COMPENSATIONS

__all__ = ["adam_fp32_master", "adamw_bf16", "scale_by_adamw", "ScaleByAdamWState"]



class ScaleByAdamWState(NamedTuple):
  """State of ``scale_by_adamw``.

  Attributes:
    count: int32 number of updates taken.
    mu, nu: first and second moments (``mu_dtype``, ``nu_dtype`` or the param dtype;
      fp32 for fp16 params).
    seed: uint32 seed of the stochastic moment writes.

  Example:
    >>> import jax.numpy as jnp, optax_half as oh
    >>> params = {"w": jnp.zeros(3, jnp.bfloat16)}
    >>> state = oh.scale_by_adamw(1e-3, nu_dtype=jnp.float32).init(params)
    >>> print(state.count.dtype, state.mu["w"].dtype, state.nu["w"].dtype, state.seed.dtype)
    int32 bfloat16 float32 uint32
  """
  count: jax.Array
  mu: Any
  nu: Any
  seed: jax.Array


def moment_dtype(param_dtype) -> jnp.dtype:
  """The moments' default dtype for a param of ``param_dtype`` (fp16: fp32)."""
  return jnp.dtype(native_lib.moment_dtype_of(jnp.dtype(param_dtype).name))


def _check_hyperparams(learning_rate, b1, b2, eps, weight_decay, eps_root=0.0):
  # Arrays (optax.inject_hyperparams) by dtype only: reading a value could be a host sync.
  if isinstance(eps_root, (int, float)) and eps_root < 0:
    raise ValueError(f"eps_root must be >= 0; got {eps_root}.")
  for name, v in (("learning_rate", learning_rate), ("b1", b1), ("b2", b2),
                  ("eps", eps), ("eps_root", eps_root), ("weight_decay", weight_decay)):
    dtype = getattr(v, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4:
      raise ValueError(
          f"hyperparameter {name} arrived as {jnp.dtype(dtype)}: 16-bit hyperparameters "
          "lose their meaning (b2=0.999 rounds to 1.0 in bf16). With "
          "optax.inject_hyperparams pass hyperparam_dtype=jnp.float32.")
  checks.check_adamw_args(learning_rate, b1, b2, eps, weight_decay)


def scale_by_adamw(
    learning_rate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: Optional[float] = None,
    mu_dtype=None,
    nu_dtype=None,
    state_rounding: str = "nearest",
    key=None,
    *,
    eps_root: float = 0.0,
    mask=None,
    nesterov: bool = False,
) -> optax.GradientTransformation:
  r"""The AdamW update, in fp32, as one transformation.

  With ``t`` the 1-based step, gradient ``g``, params ``x``, everything in fp32:

  .. math::
     m_t &= b_1 m_{t-1} + (1 - b_1) g \\
     v_t &= b_2 v_{t-1} + (1 - b_2) g^2 \\
     \hat m &= m_t \cdot \mathrm{f32}(1 / (1 - b_1^t)),\quad
     \hat v = v_t \cdot \mathrm{f32}(1 / (1 - b_2^t)) \\
     u &= -\eta_{t-1} \left(\hat m / (\sqrt{\hat v} + \epsilon) + \lambda x\right)

  in optax's ``adamw`` order; ``m_t``, ``v_t`` are stored rounded to ``mu_dtype``/``nu_dtype``,
  the update uses them unrounded. No FMA, no ``pow``: the bits of ``torch_bridge``
  (docs/algorithms.md#adamw-core).

  Args:
    learning_rate: a float or an optax schedule (``count -> lr``).
    b1, b2, eps: Adam coefficients.
    weight_decay: decoupled weight decay, multiplied by the lr; ``update`` then needs
      ``params`` (an injected value, 0 included, is traced). ``None``: neither, also
      under ``optax.inject_hyperparams``.
    mu_dtype, nu_dtype: moment dtypes; ``None`` means the param dtype, fp32 for fp16
      params (fp16's range underflows ``(1 - b2) g^2``).
    state_rounding: "nearest" or "stochastic", for 16-bit moment writes.
    key: ``None`` (seed 0), a Python int or a JAX PRNG key: the stochastic writes' seed.
    eps_root, mask, nesterov: as in ``optax.adamw``: ``sqrt(v_hat + eps_root)``; weight
      decay only where ``mask`` (a tree of bools or a callable ``updates -> bools``) is
      True; Nesterov momentum (Dozat 2016) with optax's formula.

  Returns:
    An ``optax.GradientTransformation`` with ``ScaleByAdamWState``; updates in the param
    dtype: for a 16-bit param the step to ``round_nearest(p + u)`` (``p + u`` lands there,
    docs/algorithms.md#landing-exactly); without ``params``, ``u`` rounded to the gradient's
    dtype.

  Example:
    Adam's first step is ``-lr * sign(g)``; for bf16 params, the step to its rounding:

    >>> import jax.numpy as jnp, optax_half as oh
    >>> tx = oh.scale_by_adamw(learning_rate=0.1)
    >>> params = {"w": jnp.array([1.0, -2.0], jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.array([0.5, -4.0], jnp.bfloat16)}
    >>> updates, state = tx.update(grads, state, params)
    >>> print(updates["w"].dtype, updates["w"].tolist())
    bfloat16 [-0.1015625, 0.1015625]

  References:
    Kingma & Ba, `Adam: A Method for Stochastic Optimization
    <https://arxiv.org/abs/1412.6980>`_, ICLR 2015

    Loshchilov & Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, ICLR 2019

    Gupta et al., `Deep Learning with Limited Numerical Precision
    <https://arxiv.org/abs/1502.02551>`_, ICML 2015 (stochastic rounding: the moment writes)
  """
  if weight_decay is None:
    weight_decay = 0.0
  _check_hyperparams(learning_rate, b1, b2, eps, weight_decay, eps_root)
  if not isinstance(nesterov, bool):
    raise TypeError(f"nesterov must be True or False; got {nesterov!r}.")
  seed_from_key(key)  # a bad key fails here, not at init
  checks.check_state_rounding(state_rounding)

  def state_dtype(override, p):
    return jnp.dtype(override) if override is not None else moment_dtype(p.dtype)

  def init(params):
    check_no_float64("scale_by_adamw (the fp32 AdamW core of adamw_bf16 and "
                     "adam_fp32_master)", params)
    params = jax.tree.map(jnp.asarray, params)  # canonical dtypes (x64 off: f64 -> f32)
    mu = jax.tree.map(lambda p: zeros_like_param(p, state_dtype(mu_dtype, p)), params)
    nu = jax.tree.map(lambda p: zeros_like_param(p, state_dtype(nu_dtype, p)), params)
    return ScaleByAdamWState(jnp.zeros([], jnp.int32), mu, nu,
                             seed_from_key(key))

  def update(updates, state, params=None, **extra_args):
    del extra_args
    if params is None and not _is_zero(weight_decay):
      raise ValueError(
          "scale_by_adamw with weight_decay needs params: call tx.update(grads, state, params) "
          "(weight_decay=None, the default, needs none).")
    if params is not None:
      check_trees("scale_by_adamw", updates, params)
    c = coefficients(learning_rate, b1, b2, eps, weight_decay, state.count)
    count = optax.safe_increment(state.count)
    leaf_index = leaf_indices(updates)
    # Without weight decay the params are not read: any tree of the same shape will do.
    params_ = params if params is not None else updates
    decays = decay_mask(mask, updates)
    if decays is None:
      decays = jax.tree.map(lambda _: True, updates)
    if nesterov:  # optax's mu_hat reads m at the next step's bias correction
      inv_bc1_next = coefficients(learning_rate, b1, b2, eps, weight_decay, count).inv_bc1

    def one(g, m, v, x, i, decay):
      u, m32, v32 = adamw_leaf(c, g, m, v, x, decay and not _is_zero(weight_decay), eps_root,
                               inv_bc1_next if nesterov else None)
      # The caller adds it to the params, in their dtype (optax's convention: fp32 inside
      # the wrappers, which hand the core fp32 params). A 16-bit param lands on
      # round_nearest(x + u), as torch's scale_by_adamw and round_to_nearest
      # (docs/algorithms.md#landing-exactly); without params, round(u) in the gradient's dtype.
      x = jnp.asarray(x)
      if not jnp.issubdtype(x.dtype, jnp.floating):  # non-float leaves: fp32, as before
        pass
      elif params is not None and jnp.finfo(x.dtype).bits < 32:
        u = rounding.land(x, (rounding.widen(x) + u).astype(x.dtype))[0]
      else:
        u = u.astype(x.dtype)
      m_new, v_new = rounding.round_moments(m32, v32, m.dtype, v.dtype, state_rounding,
                                            state.seed, state.count, i)
      return u, m_new, v_new

    out = jax.tree.map(one, updates, state.mu, state.nu, params_, leaf_index, decays)
    u, mu, nu = unzip(updates, out, 3)
    return u, ScaleByAdamWState(count, mu, nu, state.seed)

  return transformation(init, update, "scale_by_adamw")


def _kernel_has(eps_root, nesterov) -> bool:
  """Whether the kernel steps these options: it has no eps_root and no Nesterov term, so
  those run in XLA (the same code that gives the kernel's bits where both step)."""
  return _is_zero(eps_root) and not nesterov


def adam_fp32_master(
    learning_rate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    weight_decay: float = 0.0,
    mask=None,
    *,
    nesterov: bool = False,
    skip_nonfinite: bool = False,
    flat_state: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Adam(W) on an fp32 master copy of 16-bit params, fp32 moments.

  ``master_weights(scale_by_adamw(..., mu_dtype=f32, nu_dtype=f32))``: exact fp32 Adam on
  a master that follows outside writes (docs/algorithms.md#named-optimizers).

  Args:
    learning_rate: a float or an optax schedule (``count -> lr``).
    b1, b2, eps, eps_root: Adam coefficients (``eps_root``: inside the square root).
    weight_decay: decoupled weight decay (AdamW), multiplied by the lr; 0 (Adam) by
      default, as ``torch_bridge``'s.
    mask: where weight decay applies, as in ``optax.adamw``: a tree of bools (or a prefix
      of the params tree) or a callable ``params -> bools``; ``None``: everywhere.
    nesterov: Nesterov momentum, as in ``optax.adamw`` (not in the kernel: XLA steps it).
    skip_nonfinite: skip (and count) every step whose gradients hold a NaN or Inf
      (docs/algorithms.md#non-finite-gradients).
    flat_state: the master and moments of all leaves as one 1-D array per dtype: the same
      values in fewer arrays, for many small leaves (docs/algorithms.md#flat-state).

  Returns:
    An ``optax.GradientTransformationExtraArgs``: a ``MasterWeightsState`` around a
    ``ScaleByAdamWState``. ``update`` needs ``params``.

  Example:
    Steps of ``-1e-3``, lost on a bf16 1.0, add up in the master until it moves:

    >>> import jax.numpy as jnp, optax, optax_half as oh
    >>> tx = oh.adam_fp32_master(1e-3)
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> print(state.master["w"].dtype, state.inner_state.mu["w"].dtype)
    float32 float32
    >>> grads = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> for _ in range(3):
    ...   updates, state = tx.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> round(float(state.master["w"][0]), 4), float(params["w"][0])
    (0.997, 0.99609375)

  References:
    Micikevicius et al., `Mixed Precision Training
    <https://arxiv.org/abs/1710.03740>`_, ICLR 2018 (fp32 master weights)

    Kingma & Ba, `Adam: A Method for Stochastic Optimization
    <https://arxiv.org/abs/1412.6980>`_, ICLR 2015

    Loshchilov & Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, ICLR 2019

    NVIDIA NeMo, ``MainParamsOptimizerWrapper``, `github.com/NVIDIA/NeMo
    <https://github.com/NVIDIA/NeMo>`_ (fp32 main params behind a 16-bit model)
  """
  core = scale_by_adamw(learning_rate, b1, b2, eps, weight_decay,
                        mu_dtype=jnp.float32, nu_dtype=jnp.float32,
                        state_rounding="nearest", eps_root=eps_root, mask=mask,
                        nesterov=nesterov)
  compensation = COMPENSATIONS["master"]
  tx = wrappers.wrap(compensation, core, check_state=False)  # fused checks it
  tx = _native.fused(compensation, (learning_rate, b1, b2, eps, weight_decay), "nearest",
                     tx.init, tx.update, flat_state, "adam_fp32_master",
                     mask=mask, kernel=_kernel_has(eps_root, nesterov),
                     tx_apply=tx.update_and_apply)
  return maybe_skip_nonfinite(tx, skip_nonfinite, _native.all_finite)


def adamw_bf16(
    learning_rate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype=None,
    weight_decay: float = 1e-4,
    mask=None,
    *,
    nesterov: bool = False,
    compensation: str = "kahan",
    nu_dtype=None,
    state_rounding: str = "stochastic",
    key=None,
    skip_nonfinite: bool = False,
    flat_state: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """AdamW for params that stay in bf16 (or fp16), without stale weights.

  Moments default to the param dtype (fp32 for fp16 params), 16-bit ones written
  stochastically so that bf16 ``nu`` does not go stale (docs/algorithms.md#adamw-core).

  ``optax.adamw``'s parameters, defaults and order (``weight_decay=1e-4``;
  ``torch_bridge.adamw_bf16`` keeps ``torch.optim.AdamW``'s 1e-2), then our keywords.

  Args:
    learning_rate: a float or an optax schedule.
    b1, b2, eps, eps_root: Adam coefficients (``eps_root``: inside the square root).
    weight_decay: decoupled weight decay, multiplied by the lr.
    mask: where weight decay applies, as in ``optax.adamw``: a tree of bools (or a prefix
      of the params tree) or a callable ``params -> bools``; ``None``: everywhere.
    nesterov: Nesterov momentum, as in ``optax.adamw`` (not in the kernel: XLA steps it).
    compensation: "kahan" (``kahan_summation``), "split" (``master_weights(split=True)``),
      "stochastic" (``stochastic_rounding``) or "none" (round to nearest: updates stall).
    mu_dtype, nu_dtype: moment dtypes; ``None`` means the param dtype, fp32 for fp16
      params (fp16's range underflows ``(1 - b2) g^2``).
    state_rounding: "stochastic" or "nearest", for 16-bit moment writes.
    key: ``None`` (seed 0), a Python int or a JAX PRNG key: the seed of every random bit.
    skip_nonfinite: as in ``adam_fp32_master``.
    flat_state: the buffer and the moments flat, as in ``adam_fp32_master``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``: ``compensation``'s wrapper state (e.g.
    ``KahanSummationState``) around a ``ScaleByAdamWState``. ``update`` needs ``params``.

  Example:
    Steps of ``-1e-3``, lost by plain AdamW on a bf16 1.0, kept by Kahan summation:

    >>> import jax.numpy as jnp, optax, optax_half as oh
    >>> def train(tx, steps=3):
    ...   params = {"w": jnp.ones(2, jnp.bfloat16)}
    ...   state = tx.init(params)
    ...   for _ in range(steps):
    ...     updates, state = tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params)
    ...     params = optax.apply_updates(params, updates)
    ...   return params["w"].dtype.name, float(params["w"][0])
    >>> train(optax.adamw(1e-3))
    ('bfloat16', 1.0)
    >>> train(oh.adamw_bf16(1e-3))
    ('bfloat16', 0.99609375)
    >>> train(oh.adamw_bf16(1e-3, compensation="none"))
    ('bfloat16', 1.0)

  References:
    Loshchilov & Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, ICLR 2019

    Kingma & Ba, `Adam: A Method for Stochastic Optimization
    <https://arxiv.org/abs/1412.6980>`_, ICLR 2015

    Kahan, `Further remarks on reducing truncation errors
    <https://doi.org/10.1145/363707.363723>`_, Communications of the ACM, 1965

    Zamirai et al., `Revisiting BFloat16 Training
    <https://arxiv.org/abs/2010.06192>`_, 2020 (Kahan summation, stochastic rounding of bf16)

    Gupta et al., `Deep Learning with Limited Numerical Precision
    <https://arxiv.org/abs/1502.02551>`_, ICML 2015 (stochastic rounding)

    arogozhnikov, `adamw_bfloat16 <https://github.com/arogozhnikov/adamw_bfloat16>`_
    (AdamW with bf16 params and moments, and its schedule)
  """
  compensation = COMPENSATIONS[native_lib.check_compensation(compensation).name]
  core = scale_by_adamw(learning_rate, b1, b2, eps, weight_decay, mu_dtype=mu_dtype,
                        nu_dtype=nu_dtype, state_rounding=state_rounding, key=key,
                        eps_root=eps_root, mask=mask, nesterov=nesterov)
  wrapped = wrappers.wrap(compensation, core, key=0 if key is None else key,
                         check_state=False)  # its init recasts the moments; fused checks

  def init(params):
    # The core was initialised on the fp32 view: default moments take the param's dtype,
    # as zeros made in it (not fp32 zeros cast down: docs/algorithms.md#memory).
    state = wrapped.init(params)
    core_state = state.inner_state
    def param_dtype(moments, override):
      if override is not None:
        return moments
      return jax.tree.map(
          lambda p, m: m if isinstance(m, optax.MaskedNode)
          else zeros_like_param(p, moment_dtype(jnp.asarray(p).dtype)), params, moments)
    core_state = core_state._replace(mu=param_dtype(core_state.mu, mu_dtype),
                                     nu=param_dtype(core_state.nu, nu_dtype))
    return state._replace(inner_state=core_state)

  tx = _native.fused(compensation, (learning_rate, b1, b2, eps, weight_decay), state_rounding,
                     init, wrapped.update, flat_state, "adamw_bf16",
                     mask=mask, kernel=_kernel_has(eps_root, nesterov),
                     tx_apply=wrapped.update_and_apply)
  return maybe_skip_nonfinite(tx, skip_nonfinite, _native.all_finite)
