"""Low-precision wrappers: any optax transformation, trained on 16-bit params.

Each runs ``inner`` on an fp32 (or ``master_dtype``) view of the params, keeps what
16 bits cannot hold in a per-leaf buffer, and returns updates in the param dtype, which
``optax.apply_updates`` (or ``p + u``) adds bit for bit as the wrapper's own step does. Spec: ``docs/algorithms.md#wrappers``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from optax import MaskedNode

from optax_half import _in_place, rounding
from optax_half._util import (check_state_fits, check_trees, compiled_init, is_float,
                              leaf_indices, like_param, seed_from_key, transformation, unzip)
from optax_half.compensation import (COMPENSATIONS, Compensation, KahanSummationState,
                                     MasterWeightsState, RoundToNearestState,
                                     StochasticRoundingState, kept_leaves)

__all__ = [
    "master_weights",
    "kahan_summation",
    "stochastic_rounding",
    "MasterWeightsState",
    "KahanSummationState",
    "StochasticRoundingState",
    "round_to_nearest",
    "RoundToNearestState",
]


_WRAPPER_STATES = tuple(dict.fromkeys(c.state_type for c in COMPENSATIONS.values()))

_FROZEN = "frozen"  # not a float: masked out, zero update
_DIRECT = "direct"  # wide enough: inner runs on it as is, no buffer
_LOW = "low"        # 16-bit: inner runs on x, a buffer keeps the rest


def _engine(compensation: Compensation, inner: optax.GradientTransformation,
            master_dtype, nested_ok: bool):
  """``(init, step)`` of a wrapper applying ``compensation`` (per leaf: ``for_dtype``)
  around ``inner`` in ``master_dtype`` (docs/algorithms.md#wrappers)."""
  name = compensation.wrapper
  inner = optax.with_extra_args_support(inner)

  def roles(params):
    def role(p):
      if not is_float(p):
        return _FROZEN
      return _DIRECT if jnp.dtype(p.dtype).itemsize >= master_dtype.itemsize else _LOW
    return jax.tree.map(role, params)

  def rules(p) -> Compensation:
    return compensation.for_dtype(p.dtype)

  def view(params, buffers, rl, marks="each"):
    """The values ``x`` the inner optimizer steps, and each full master's mark after an
    in-place step by leaf index (``marks="tree"``; else none). ``marks``: how a full
    master's marks of missed landings are checked: each leaf on its own (``"each"``:
    through tx.update most steps hold some, and XLA:GPU would copy small leaves' outputs
    around a conditional), the whole tree at once where a leaf holds any (``"tree"``, in
    place: compensation.kept_leaves; after an in-place step none does), or not at all
    (``"fresh"``: the buffers ``init`` just made, where a full master is its param, exactly,
    and holds no mark; ``init`` may run op by op, so it reads nothing more)."""
    treedef = jax.tree.structure(params)
    ps, bs, rs = (treedef.flatten_up_to(t) for t in (params, buffers, rl))
    marked = [k for k, (p, r) in enumerate(zip(ps, rs)) if r == _LOW and rules(p).marks]
    keep, cleared = ((dict(zip(marked, out)) for out in
                      kept_leaves([(ps[k], *bs[k]) for k in marked]))
                     if marks == "tree" else ({}, {}))

    def one(k, p, buf, r):
      if r == _FROZEN:
        return MaskedNode()
      if r == _DIRECT:
        return p
      if marks == "fresh" and k in marked:
        return buf[0]
      return rules(p).read(p, buf, keep[k]) if k in keep else rules(p).read(p, buf)
    index = treedef.flatten_up_to(leaf_indices(params))
    return (treedef.unflatten([one(k, *leaf) for k, leaf in enumerate(zip(ps, bs, rs))]),
            {index[k]: mark for k, mark in cleared.items()})

  def init(params):
    params = jax.tree.map(jnp.asarray, params)
    rl = roles(params)
    buffers = jax.tree.map(
        lambda p, r: rules(p).init_buffer(p, master_dtype) if r == _LOW else MaskedNode(),
        params, rl)
    # The view is sharded like the params, so the inner state made from it is too.
    x = jax.tree.map(lambda p, xi, r: xi if r == _FROZEN else like_param(p, xi),
                     params, view(params, buffers, rl, marks="fresh")[0], rl)
    inner_state = _like_view(inner, inner.init(x), x)
    if not nested_ok:
      _check_not_nested(name, inner_state)
    return buffers, inner_state

  def step(grads, buffers, inner_state, params, stream, fused=None, in_place=False,
           **extra_args):
    """``(updates, buffers, inner state)``, new params first with ``in_place``; ``stream``:
    ``(seed, count)`` or None. ``fused`` (the inner's ``kahan_update``) gets ``(p, g, buffer or
    None, x, index)`` per leaf; None, or ``(u, state, {index: finish(...)})`` for leaves taken."""
    check_trees(name, grads, params)
    params = jax.tree.map(jnp.asarray, params)
    if buffers is None:  # compensations without per-leaf buffers
      buffers = jax.tree.map(lambda _: MaskedNode(), params)
    rl = roles(params)

    def finish(p, buf, xi, ui, i):
      """A 16-bit leaf's ``x' = x + u`` (rounded as optax.apply_updates
      rounds it) stored back: ``(update, landed param, new buffer)``."""
      x_new = jnp.asarray(xi + ui).astype(xi.dtype)
      c = rules(p)
      bits = (rounding.random_bits(*stream, rounding.STREAM_PARAMS, i, x_new.shape)
              if c.draws_bits else None)
      return c.write(x_new, p, buf, bits, in_place)

    x, cleared = view(params, buffers, rl, marks="tree" if in_place else "each")
    g = jax.tree.map(
        lambda p, g_, r: MaskedNode() if r == _FROZEN
        else rounding.widen(g_).astype(master_dtype),
        params, grads, rl)
    index = leaf_indices(params)
    taken = None
    if fused is not None:
      treedef = jax.tree.structure(params)
      flat = [treedef.flatten_up_to(t) for t in (params, grads, buffers, x, rl, index)]
      leaves = [(p, g_, b if r == _LOW else None, xi, i)
                for p, g_, b, xi, r, i in zip(*flat) if r != _FROZEN]
      taken = fused(g, inner_state, x, leaves, finish, in_place, **extra_args)
    if taken is None:
      inner_updates, inner_state = inner.update(g, inner_state, x, **extra_args)
      done = {}
    else:
      inner_updates, inner_state, done = taken

    def one(p, buf, xi, ui, r, i):
      if r == _LOW:
        if i in done:
          u, p_land, buf = done[i]
        else:
          u, p_land, buf = finish(p, buf, xi, ui, i)
          if i in cleared:  # the write's 0, as one vector for the tree (kept_leaves)
            buf = buf._replace(missed=cleared[i])
        return (p_land if in_place else u), buf
      u = jnp.zeros_like(p) if r == _FROZEN else ui
      return (optax.apply_updates(p, u) if in_place else u), buf

    pairs = jax.tree.map(one, params, buffers, x, inner_updates, rl, index)
    updates, buffers = unzip(params, pairs, 2)
    return updates, buffers, inner_state

  return init, step


def wrap(compensation: Compensation, inner: optax.GradientTransformation, *, key=None,
         master_dtype=jnp.float32, fused=None,
         check_state: bool = True) -> optax.GradientTransformationExtraArgs:
  """``inner`` on 16-bit params kept by ``compensation`` (every wrapper here). ``key``: the
  seed where it draws bits; ``fused``: the inner's ``kahan_update`` (adds an in-place step);
  ``check_state``: refuse a state made for params of other dtypes (off where the caller's
  init changes the state, and checks it itself)."""
  _validate_inner(compensation.wrapper, inner)
  master_dtype = jnp.dtype(master_dtype)
  init_fn, step = _engine(compensation, inner, master_dtype,
                          nested_ok=master_dtype.itemsize < 4)

  def init(params):
    buffers, inner_state = init_fn(params)
    seed = seed_from_key(key) if compensation.draws_bits else None
    return compensation.init_state(buffers, inner_state, seed)

  def run(updates, state, params, in_place, extra_args):
    if check_state:
      check_state_fits(compensation.wrapper, init, state, params)
    out, buffers, inner_state = step(
        updates, compensation.leaf_buffers(state), state.inner_state, params,
        compensation.param_stream(state), fused=fused, in_place=in_place, **extra_args)
    return out, compensation.next_state(state, buffers, inner_state)

  def update(updates, state, params=None, **extra_args):
    return run(updates, state, params, False, extra_args)

  tx = transformation(compiled_init(init), update, compensation.wrapper)

  def update_and_apply(updates, state, params, **extra_args):
    # A master's params are written, not updated: they land on its rounding.
    return run(updates, state, params, True, extra_args)

  return _in_place.register(tx, update_and_apply)


def _like_view(inner, inner_state, x):
  """``inner_state`` with its params-shaped parts tied to ``x``'s sharding when traced
  (docs/algorithms.md#jax-sharding)."""
  if not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(x)):
    return inner_state
  try:
    return optax.tree_map_params(
        inner, lambda s, xi: s if isinstance(s, MaskedNode) else like_param(xi, s),
        inner_state, x, is_leaf=lambda v: isinstance(v, MaskedNode))
  except Exception:  # noqa: BLE001 (an init that cannot run on optax's placeholder)
    return inner_state  # a layout hint only: the numbers are the same either way


def _check_not_nested(name, inner_state) -> None:
  """Refuses an inner transformation that keeps low-precision params itself: one layer only
  (docs/algorithms.md#wrappers)."""
  nested = [type(x).__name__ for x in jax.tree.leaves(
      inner_state, is_leaf=lambda x: isinstance(x, _WRAPPER_STATES))
            if isinstance(x, _WRAPPER_STATES)]
  if nested:
    raise ValueError(
        f"{name}: the inner transformation already keeps low-precision params "
        f"(its state holds a {nested[0]}: adamw_bf16, adam_fp32_master and the "
        "wrappers do). Wrap a plain optimizer once, e.g. "
        f"{name}(optax.adam(1e-3)), or use the named optimizer alone.")


def _validate_inner(name, inner):
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
        f"{name} wraps an optax.GradientTransformation (e.g. optax.adam(1e-3)); "
        f"got {type(inner).__name__}.")


def master_weights(
    inner: optax.GradientTransformation,
    master_dtype=jnp.float32,
    split: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""Keeps a high-precision master copy of every low-precision param.

  For each floating-point leaf ``p`` narrower than ``master_dtype``:

  .. math::
     g_m = \mathrm{cast}(g, m),\quad
     (u, s') = \mathrm{inner}(g_m, s, m),\quad
     m' = m + u,\quad p' = \mathrm{round}(m')

  returning ``round(p' - p)`` in the param dtype, on which ``optax.apply_updates`` lands
  (docs/algorithms.md#landing-exactly). Leaves
  in ``master_dtype`` have no copy. The master follows params written from outside
  after ``init`` (docs/algorithms.md#wrappers).

  Args:
    inner: the transformation run on the master params (e.g. ``optax.adam(1e-3)``).
    master_dtype: dtype of the master copy (a float type).
    split: store the fp32 master of bf16 leaves exactly as param (high half) + int16
      low half, 2 bytes/param; fp16 leaves keep a full fp32 copy.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``MasterWeightsState``.
    ``update`` requires ``params``.

  Example:
    Steps of ``-1e-3``, lost on a bf16 1.0, add up in the master until it moves:

    >>> import jax.numpy as jnp, optax, optax_half as oh
    >>> tx = oh.master_weights(optax.sgd(1e-3))
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> for _ in range(3):
    ...   updates, state = tx.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> print(params["w"].dtype, float(params["w"][0]), round(float(state.master["w"][0]), 4))
    bfloat16 0.99609375 0.997

  References:
    Micikevicius et al., `Mixed Precision Training
    <https://arxiv.org/abs/1710.03740>`_, ICLR 2018 (an fp32 master copy of fp16 weights)

    NVIDIA NeMo, ``MainParamsOptimizerWrapper``, `github.com/NVIDIA/NeMo
    <https://github.com/NVIDIA/NeMo>`_ (fp32 main params for any optimizer)
  """
  master_dtype = jnp.dtype(master_dtype)
  if not jnp.issubdtype(master_dtype, jnp.floating):
    raise ValueError(f"master_dtype must be a float dtype; got {master_dtype}.")
  if split and master_dtype != jnp.float32:
    raise ValueError(
        "master_weights(split=True) stores an fp32 master as a bf16 high half plus "
        f"int16 low half; it needs master_dtype=float32, got {master_dtype}.")
  return wrap(COMPENSATIONS["split" if split else "master"], inner, master_dtype=master_dtype)


def kahan_summation(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  r"""Kahan-compensated 16-bit params: a compensation buffer in the param dtype.

  For each 16-bit leaf ``p`` with compensation ``c`` (same dtype), in fp32:

  .. math::
     x = p + c,\quad (u, s') = \mathrm{inner}(g, s, x),\quad x' = x + u,\quad
     p' = \mathrm{round}(x'),\quad c' = \mathrm{round}(x' - p')

  ``c`` keeps ~8 (bf16) or ~11 (fp16) more bits than ``p``; 32-bit leaves get no
  buffer (docs/algorithms.md#wrappers).

  Args:
    inner: the transformation to run on the compensated params.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``KahanSummationState``.
    ``update`` requires ``params``.

  Example:
    Steps of ``-1e-3``, lost on a bf16 1.0, add up in ``c`` until the param moves:

    >>> import jax.numpy as jnp, optax, optax_half as oh
    >>> tx = oh.kahan_summation(optax.sgd(1e-3))
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> float(params["w"][0]), round(float(state.compensation["w"][0]), 5)
    (1.0, -0.001)
    >>> for _ in range(2):
    ...   updates, state = tx.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> float(params["w"][0])
    0.99609375

  References:
    Kahan, `Further remarks on reducing truncation errors
    <https://doi.org/10.1145/363707.363723>`_, Communications of the ACM, 1965

    Zamirai et al., `Revisiting BFloat16 Training
    <https://arxiv.org/abs/2010.06192>`_, 2020 (Kahan summation for bf16 weight updates)
  """
  # An inner with `kahan_update` (scaled_adam) steps leaf and buffer in one pass, same bits.
  return wrap(COMPENSATIONS["kahan"], inner, fused=getattr(inner, "kahan_update", None))


def stochastic_rounding(inner: optax.GradientTransformation,
                        key) -> optax.GradientTransformationExtraArgs:
  r"""Stochastically rounded 16-bit params: unbiased, no extra buffer.

  For each 16-bit leaf, in fp32: ``p' = stochastic_round(p + u)``, so ``E[p'] = p + u``,
  with bits from ``(key, count, leaf)``: torch_bridge's for an integer key
  (docs/algorithms.md#counter-based-random-bits).

  Args:
    inner: the transformation to run on the fp32 view of the params.
    key: a Python int or a JAX PRNG key (required here; ``adamw_bf16`` defaults to 0).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``StochasticRoundingState``.
    ``update`` requires ``params``.

  Example:
    A step of a quarter bf16 ULP moves about a quarter of the elements one ULP:

    >>> import jax.numpy as jnp, optax, optax_half as oh
    >>> tx = oh.stochastic_rounding(optax.sgd(1e-3), key=0)
    >>> params = {"w": jnp.ones(1000, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones(1000, jnp.bfloat16)}, state, params)
    >>> w = optax.apply_updates(params, updates)["w"]
    >>> sorted(set(w.tolist())), round(float(w.astype(jnp.float32).mean()), 3)
    ([0.99609375, 1.0], 0.999)

  References:
    Gupta et al., `Deep Learning with Limited Numerical Precision
    <https://arxiv.org/abs/1502.02551>`_, ICML 2015

    Zamirai et al., `Revisiting BFloat16 Training
    <https://arxiv.org/abs/2010.06192>`_, 2020 (stochastic rounding of bf16 weight updates)
  """
  if key is None:
    raise ValueError(
        "stochastic_rounding needs a key: pass key=<int seed> (an int gives the same "
        "random bits in optax_half and torch_bridge; optax_half also takes a jax.random.key).")
  seed_from_key(key)  # a bad key fails here, not at init
  return wrap(COMPENSATIONS["stochastic"], inner, key=key)


def round_to_nearest(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """No compensation: ``p' = round_nearest(p + u)`` with the inner's fp32 ``u``.

  The baseline the other wrappers cure (``adamw_bf16(compensation="none")``): an update
  under half a ULP of ``p`` is lost.

  Args:
    inner: the transformation to run on the fp32 view of the params.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``RoundToNearestState``.
    ``update`` requires ``params``.

  Example:
    Steps of ``-1e-3``, under half a bf16 ULP at 1.0, are all lost:

    >>> import jax.numpy as jnp, optax, optax_half as oh
    >>> tx = oh.round_to_nearest(optax.sgd(1e-3))
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> for _ in range(3):
    ...   updates, state = tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> float(params["w"][0])
    1.0

  References:
    Zamirai et al., `Revisiting BFloat16 Training
    <https://arxiv.org/abs/2010.06192>`_, 2020 (why nearest rounding of bf16 updates stalls)
  """
  return wrap(COMPENSATIONS["none"], inner)
