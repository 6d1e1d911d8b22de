"""Property-based tests (hypothesis) of every optimizer, in JAX and in torch.

Random trees (JAX) and param lists (torch) of 1 to 5 leaves whose shapes
include 0-size, 0-d, 1-element and odd sizes, with float32, bfloat16 and
float16 leaves mixed in one tree; random gradients (normal times random
powers of two, finite); random hyperparameters in their valid ranges; 1 to 4
steps. Properties, per example:

* no crash;
* every param keeps its dtype and shape, and so does every state leaf from
  ``init`` (JAX) or the first step (torch, whose optimizers may create state
  lazily) to the last step;
* the jitted update equals the op-by-op one (``jax.disable_jit()``): bitwise
  for the AdamW family and for the wrappers around ``scale_by_adamw`` (the
  repo's claim, docs/algorithms.md#determinism-and-jit); within a few
  roundings for ScaledAdam and for wrappers around ``optax.adam`` (code that
  XLA contracts into FMAs);
* JAX and torch agree within ``torch_bridge.parity.TOLERANCES`` (and, where
  the repo claims it, bit for bit), in params and in every buffer both have;
  ScaledAdam and wrappers around ``optax.adam`` / ``torch.optim.Adam`` within
  a few roundings (different programs; see their tests);
* torch params that are non-contiguous views (a transposed matrix, a strided
  slice) keep their strides and storage, the memory between their elements
  is never written, and they end bitwise equal to the contiguous run (for
  ScaledAdam, whose reductions torch sums in memory order, within the
  ScaledAdam bound).

Found: ScaledAdam on fp16 params blew up on small gradients (fp16 second
moments underflowed); fixed, ``test_scaled_adam_fp16_small_gradient_is_a_small_step``.

Examples per test: ``_examples(n)``; ``HYPOTHESIS_PROFILE=long`` runs 8x as
many, not derandomized (``pytest --hypothesis-show-statistics`` counts them).
The default profile is derandomized, so CI sees the same examples every run.
"""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

torch = pytest.importorskip("torch")

import optax_half as oh  # noqa: E402
import torch_bridge as tb  # noqa: E402
from torch_bridge import parity  # noqa: E402

# -- hypothesis profiles ------------------------------------------------------

# Every example compiles a jitted step (~1-2 s on a 2-core CPU): no "explain"
# phase (it reruns failing examples for minutes), no example database.
_COMMON = dict(deadline=None, database=None, print_blob=True,
               phases=[Phase.explicit, Phase.generate, Phase.shrink],
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("properties-ci", derandomize=True, **_COMMON)
settings.register_profile("long", derandomize=False, **_COMMON)
_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "properties-ci")
if _PROFILE not in ("properties-ci", "long"):
  _PROFILE = "properties-ci"
_SCALE = 8 if _PROFILE == "long" else 1


def _examples(n: int):
  """Settings of one test: ``n`` examples (8n with HYPOTHESIS_PROFILE=long).

  Per-test settings (not ``settings.load_profile``), so that loading this
  module changes nothing for the other hypothesis tests of the suite.
  """
  return settings(settings.get_profile(_PROFILE), max_examples=n * _SCALE)


# -- strategies ---------------------------------------------------------------

SHAPES = [(), (0,), (1,), (0, 3), (3, 0), (7,), (3, 5), (1, 1, 9), (2, 3, 5), (5, 1), (13,),
          (1, 1)]
DTYPES = ["float32", "bfloat16", "float16"]


def _log_uniform(lo, hi):
  return st.floats(math.log10(lo), math.log10(hi)).map(lambda e: float(10.0 ** e))


LR = _log_uniform(1e-5, 1e-1)
B1 = st.floats(0.0, 0.99)
B2 = st.floats(0.5, 0.9999)
EPS = _log_uniform(1e-10, 1e-3)
WEIGHT_DECAY = st.floats(0.0, 0.1)
KEY = st.integers(0, 2**32 - 1)


class Case:
  """One random problem: params (numpy, in their dtypes) and a gradient per step."""

  def __init__(self, specs, seed, steps, param_exp, grad_exps):
    rng = np.random.default_rng(seed)
    self.specs = specs
    self.params = []
    for (shape, dtype), e in zip(specs, param_exp):
      x = rng.standard_normal(shape).astype(np.float32) * np.float32(2.0 ** e)
      self.params.append(np.asarray(x).astype(jnp.dtype(dtype)))
    self.grads = []
    for t in range(steps):
      g = []
      for (shape, dtype), e in zip(specs, grad_exps[t]):
        x = rng.standard_normal(shape).astype(np.float32) * np.float32(2.0 ** e)
        g.append(np.asarray(x).astype(jnp.dtype(dtype)))
      self.grads.append(g)
    for tree in [self.params] + self.grads:
      for x in tree:
        assert np.all(np.isfinite(x.astype(np.float32)))

  @property
  def steps(self):
    return len(self.grads)

  def __repr__(self):
    return f"Case({[(s, d) for s, d in self.specs]}, steps={self.steps})"


@st.composite
def cases(draw, max_steps=4, dtypes=DTYPES):
  n = draw(st.integers(1, 5))
  specs = draw(st.lists(st.tuples(st.sampled_from(SHAPES), st.sampled_from(dtypes)),
                        min_size=n, max_size=n))
  steps = draw(st.integers(1, max_steps))
  param_exp = draw(st.lists(st.integers(-6, 3), min_size=n, max_size=n))
  # Gradients: N(0, 1) times 2^e; fp16 stays finite (at most ~5 * 2^4).
  grad_exps = draw(st.lists(st.lists(st.integers(-12, 4), min_size=n, max_size=n),
                            min_size=steps, max_size=steps))
  seed = draw(st.integers(0, 2**32 - 1))
  return Case(specs, seed, steps, param_exp, grad_exps)


# -- numpy <-> torch, bit for bit ---------------------------------------------

_INT_VIEW = {2: (np.int16, torch.int16), 4: (np.int32, torch.int32)}


def _to_torch(a: np.ndarray) -> "torch.Tensor":
  a = np.array(a, copy=True, order="C")  # (np.ascontiguousarray makes 0-d arrays 1-d)
  if a.dtype == jnp.bfloat16:
    return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
  return torch.from_numpy(a.copy())


def _to_numpy(t) -> np.ndarray:
  if not isinstance(t, torch.Tensor):
    return np.asarray(t)
  t = t.detach().contiguous()
  if t.dtype == torch.bfloat16:
    return t.view(torch.int16).numpy().copy().view(jnp.bfloat16)
  return t.numpy().copy()


def _noncontiguous(t: "torch.Tensor"):
  """The same values in a non-contiguous view, and the tensor that owns the memory.

  Two or more dims: a transposed copy, transposed back. Otherwise a strided
  slice ``base[..., 0]`` of a ``(*shape, 2)`` tensor whose other half holds a
  sentinel (it must never be written).
  """
  if t.dim() >= 2:
    order = list(range(t.dim()))[::-1]
    base = t.permute(order).contiguous()
    return base.permute(order), base
  base = torch.full((*t.shape, 2), 1234.0, dtype=t.dtype)
  base[..., 0] = t
  return base[..., 0], base


def _sentinels_untouched(base, view):
  if view.dim() >= 2:
    return True  # a transposed view covers all of its base
  return bool(torch.all(base[..., 1] == 1234.0))


# -- comparisons --------------------------------------------------------------

def _bitwise(a, b) -> bool:
  a, b = np.asarray(a), np.asarray(b)
  if a.dtype != b.dtype or a.shape != b.shape:
    return False
  if a.dtype.kind in "iub" or a.size == 0:
    return np.array_equal(a, b)
  u = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
  return np.array_equal(a.view(u), b.view(u))


def _struct(tree):
  """Every leaf's (shape, dtype), and the tree structure."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, [(tuple(np.shape(x)), jnp.result_type(x).name) for x in leaves]


def _ulps(a, b) -> float:
  """Max distance in ULPs of the dtype (``parity._stats``): 0 for empty arrays."""
  return parity._stats(np.asarray(a), np.asarray(b))[2]


def _check_within_tolerance(buffer, kind, pairs):
  """``pairs``: [(leaf, jax array, torch array)] of one buffer and dtype.

  Checks ``parity.TOLERANCES[kind]`` the way ``compare`` does: relative error
  and ULPs per leaf, the bitwise-equal fraction over all leaves together.
  """
  tol = parity.TOLERANCES[kind]
  n_equal = n_total = 0
  for leaf, a, b in pairs:
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (buffer, leaf, a.dtype, b.dtype,
                                                       a.shape, b.shape)
    _, rel, ulp, eq, _ = parity._stats(a, b)
    n_equal += eq
    n_total += a.size
    if tol.max_rel is not None:
      assert rel <= tol.max_rel, f"{buffer}[{leaf}] ({kind}): rel {rel:.3g} > {tol.max_rel}"
    if tol.max_ulp is not None:
      assert ulp <= tol.max_ulp, f"{buffer}[{leaf}] ({kind}): {ulp} ULP > {tol.max_ulp}"
  if tol.min_equal is not None and n_total:
    assert n_equal / n_total >= tol.min_equal, (
        f"{buffer} ({kind}): {n_equal}/{n_total} bitwise equal < {tol.min_equal}")


def _kind(buffer, dtype, compensation):
  if np.dtype(dtype).kind in "iu":
    return "exact"  # counters, the int16 low half of a split master
  return parity._kind(buffer, np.dtype(dtype), compensation)


def _compare_buffers(jax_state, jax_params, torch_opt, scaler, torch_params, compensation,
                     bitwise: bool):
  """JAX vs torch: params and every buffer ``torch_bridge.parity`` knows
  (mu, nu, master, compensation, count, the loss scaler's counters)."""
  treedef = jax.tree.structure(jax_params)
  n = treedef.num_leaves
  jb = parity._jax_buffers(jax_state, treedef, list(range(n)))
  tbuf = parity._torch_buffers(torch_opt, scaler, torch_params)
  jb["params"] = jax.tree.leaves(jax_params)
  tbuf["params"] = torch_params
  compared = set()
  for buffer in jb:
    if buffer not in tbuf:
      continue
    rows = {}
    for k, (a, b) in enumerate(zip(jb[buffer], tbuf[buffer])):
      if a is None or b is None:
        continue
      a, b = np.asarray(a), _to_numpy(b)
      if buffer == "count":
        a, b = a.astype(np.int64), b.astype(np.int64)
      rows.setdefault(a.dtype.name, []).append((k, a, b))
      compared.add(buffer)
    for dtype, pairs in rows.items():
      _check_within_tolerance(buffer, _kind(buffer, np.dtype(jnp.dtype(dtype)), compensation),
                              pairs)
      if bitwise:
        for k, a, b in pairs:
          assert _bitwise(a, b), (f"{buffer}[{k}] {dtype}: not bitwise equal, "
                                  f"{_ulps(a, b)} ULP, jax {a!r} torch {b!r}")
  return compared


# -- runs ---------------------------------------------------------------------

def _jax_tree(arrays):
  return {f"p{i}": jnp.asarray(a) for i, a in enumerate(arrays)}


def _jax_run(tx, case: Case, jit: bool, grad_scale: float = 1.0):
  """``steps`` in-place steps, as torch's (``tx.update`` + ``optax.apply_updates``'s bits,
  but a master's params land on its rounding: tests/test_landing.py); returns (params,
  state, state after init)."""
  params = _jax_tree(case.params)

  def step(p, s, g):
    return oh.update_and_apply(tx, g, s, p)

  state = tx.init(params)
  init_state = state
  if jit:
    step = jax.jit(step)
    for g in case.grads:
      params, state = step(params, state, _jax_tree(_scaled(g, grad_scale)))
  else:
    with jax.disable_jit():
      for g in case.grads:
        params, state = step(params, state, _jax_tree(_scaled(g, grad_scale)))
  return params, state, init_state


def _scaled(grads, scale):
  if scale == 1.0:
    return grads
  with np.errstate(over="ignore"):  # fp16 overflows to inf: a step the scaler skips
    return [np.asarray(g.astype(np.float32) * np.float32(scale)).astype(g.dtype)
            for g in grads]


def _torch_state_struct(opt):
  """(owner, param position, name) -> (shape, dtype) of every tensor in the state."""
  out = {}

  def collect(owner, o):
    position = {}
    for group in o.param_groups:
      for p in group["params"]:
        position[p] = len(position)
    for p, s in o.state.items():
      for name, v in s.items():
        if isinstance(v, torch.Tensor):
          out[(owner, position.get(p, -1), name)] = (tuple(v.shape), v.dtype)
    for i, gs in enumerate(getattr(o, "group_state", [])):
      for name, v in gs.items():
        if isinstance(v, torch.Tensor):
          out[(owner, f"group{i}", name)] = (tuple(v.shape), v.dtype)

  collect("outer", opt)
  if hasattr(opt, "inner"):
    collect("inner", opt.inner)
  return out


def _torch_run(make_opt, case: Case, noncontiguous: bool, scaler=None, grad_scale=1.0):
  """Runs torch; returns (params, optimizer, state structs after construction,
  after the first step and after the last)."""
  params, bases = [], []
  for a in case.params:
    t = _to_torch(a)
    base = None
    if noncontiguous:
      t, base = _noncontiguous(t)
    params.append(torch.nn.Parameter(t))
    bases.append(base)
  strides = [p.stride() for p in params]
  pointers = [p.data_ptr() for p in params]
  opt = make_opt(params)
  structs = [_torch_state_struct(opt)]
  for t, g in enumerate(case.grads):
    for p, gi in zip(params, _scaled(g, grad_scale)):
      gt = _to_torch(gi)
      p.grad = _noncontiguous(gt)[0] if noncontiguous else gt
    if scaler is not None:
      scaler.step(opt)
      scaler.update()
    else:
      opt.step()
    if t == 0:
      structs.append(_torch_state_struct(opt))
  structs.append(_torch_state_struct(opt))
  for i, (p, a) in enumerate(zip(params, case.params)):
    assert isinstance(p, torch.nn.Parameter)
    assert tuple(p.shape) == a.shape and p.dtype == _to_torch(a).dtype, (i, p.shape, p.dtype)
    assert p.stride() == strides[i] and p.data_ptr() == pointers[i], (i, p.stride(),
                                                                      strides[i])
    if bases[i] is not None:
      assert _sentinels_untouched(bases[i], p), f"param {i}: memory between elements written"
  return params, opt, structs


def _check_jax_structs(case, params, state, init_state):
  for i, (a, p) in enumerate(zip(case.params, jax.tree.leaves(params))):
    assert p.shape == a.shape and p.dtype == a.dtype, (i, p.shape, p.dtype, a.shape, a.dtype)
  t0, leaves0 = _struct(init_state)
  t1, leaves1 = _struct(state)
  assert t0 == t1, (t0, t1)
  assert leaves0 == leaves1, [(a, b) for a, b in zip(leaves0, leaves1) if a != b]


def _check_torch_structs(structs, eager_state: bool):
  constructed, first, last = structs
  assert first == last, {k: (first.get(k), last.get(k)) for k in set(first) | set(last)
                         if first.get(k) != last.get(k)}
  if eager_state:
    assert constructed == last, {k: (constructed.get(k), last.get(k))
                                 for k in set(constructed) | set(last)
                                 if constructed.get(k) != last.get(k)}


def _check_noncontiguous_equals_contiguous(run_a, run_b):
  (pa, oa, _), (pb, ob, _) = run_a, run_b
  for i, (a, b) in enumerate(zip(pa, pb)):
    assert _bitwise(_to_numpy(a), _to_numpy(b)), (i, _to_numpy(a), _to_numpy(b))
  sa, sb = _torch_state_struct(oa), _torch_state_struct(ob)
  assert sa == sb
  for owner_a, owner_b in [(oa, ob)] + ([(oa.inner, ob.inner)] if hasattr(oa, "inner") else []):
    for group_a, group_b in zip(owner_a.param_groups, owner_b.param_groups):
      for p, q in zip(group_a["params"], group_b["params"]):
        for name, v in owner_a.state[p].items():
          if isinstance(v, torch.Tensor):
            assert _bitwise(_to_numpy(v), _to_numpy(owner_b.state[q][name])), (name,)


def _torch_runs(make_torch, case: Case, eager_state: bool, make_scaler=lambda: None,
                grad_scale=1.0):
  """The torch run on contiguous and on non-contiguous params: checks both
  runs' structures and that they are bitwise equal; returns the contiguous
  run ``(params, optimizer, scaler)``."""
  runs = []
  for noncontiguous in (False, True):
    scaler = make_scaler()
    tparams, opt, structs = _torch_run(make_torch, case, noncontiguous, scaler, grad_scale)
    _check_torch_structs(structs, eager_state=eager_state)
    runs.append((tparams, opt, scaler))
  _check_noncontiguous_equals_contiguous(runs[0], runs[1])
  return runs[0]


# -- the AdamW family: adamw_bf16, adam_fp32_master, scale_by_adamw ----------

@st.composite
def adamw_configs(draw):
  name = draw(st.sampled_from(["adamw_bf16", "adam_fp32_master", "scale_by_adamw"]))
  hp = dict(learning_rate=draw(LR), b1=draw(B1), b2=draw(B2), eps=draw(EPS),
            weight_decay=draw(WEIGHT_DECAY))
  if name == "adamw_bf16":
    hp["compensation"] = draw(st.sampled_from(["kahan", "split", "stochastic", "none"]))
    hp["state_rounding"] = draw(st.sampled_from(["stochastic", "nearest"]))
    for k in ("mu_dtype", "nu_dtype"):
      hp[k] = draw(st.sampled_from([None, "float32"]))
    hp["key"] = draw(KEY)
  elif name == "scale_by_adamw":
    hp["state_rounding"] = draw(st.sampled_from(["stochastic", "nearest"]))
    hp["mu_dtype"] = draw(st.sampled_from([None, "float32", "bfloat16"]))
    hp["key"] = draw(KEY)
  loss_scale = None
  if name != "scale_by_adamw" and draw(st.booleans()):
    loss_scale = dict(init_scale=2.0 ** draw(st.integers(0, 16)),
                      growth_interval=draw(st.integers(1, 3)))
  return name, hp, loss_scale


def _adamw_factories(name, hp, loss_scale):
  jhp = {k: (jnp.dtype(v) if k.endswith("_dtype") and v is not None else v)
         for k, v in hp.items()}
  thp = {k: (getattr(torch, v) if k.endswith("_dtype") and v is not None else v)
         for k, v in hp.items()}

  def make_jax():
    tx = getattr(oh, name)(**jhp)
    return oh.dynamic_loss_scale(tx, **loss_scale) if loss_scale else tx

  def make_torch(params):
    return getattr(tb, name)(params, **thp)

  def make_scaler():
    return tb.dynamic_loss_scale(**loss_scale) if loss_scale else None
  return make_jax, make_torch, make_scaler


@_examples(6)
@given(case=cases(), config=adamw_configs())
def test_adamw_family(case, config):
  _adamw_family(case, config)


@pytest.mark.slow
@_examples(30)
@given(case=cases(), config=adamw_configs())
def test_adamw_family_more_examples(case, config):
  """``test_adamw_family`` on other examples (derandomized per test)."""
  _adamw_family(case, config)


def _adamw_family(case, config):
  """adamw_bf16 (every compensation, moment rounding and dtype),
  adam_fp32_master, scale_by_adamw, with and without dynamic_loss_scale:
  shapes and dtypes kept, jit == op by op bitwise, JAX == torch bitwise
  (within the parity tolerances, and equal bits as the repo claims), torch
  non-contiguous == contiguous bitwise."""
  name, hp, loss_scale = config
  make_jax, make_torch, make_scaler = _adamw_factories(name, hp, loss_scale)
  # Pre-scaled gradients (as a loss scaled by init_scale would give): in fp16
  # they may overflow, and then both frameworks must skip the same steps.
  grad_scale = loss_scale["init_scale"] if loss_scale else 1.0
  jp, js, js0 = _jax_run(make_jax(), case, jit=True, grad_scale=grad_scale)
  _check_jax_structs(case, jp, js, js0)
  np_, ns, _ = _jax_run(make_jax(), case, jit=False, grad_scale=grad_scale)
  for a, b in zip(jax.tree.leaves((jp, js)), jax.tree.leaves((np_, ns))):
    assert _bitwise(a, b), f"jit != op by op: {_ulps(a, b)} ULP ({a.dtype}{a.shape})"

  # State made at the first step, as in torch.optim (eager_state=False).
  tparams, opt, scaler = _torch_runs(make_torch, case, False, make_scaler, grad_scale)
  compensation = hp.get("compensation", "kahan") if name == "adamw_bf16" else None
  compared = _compare_buffers(js, jp, opt, scaler, tparams, compensation, bitwise=True)
  assert {"params", "mu", "nu", "count"} <= compared, compared
  if loss_scale:
    assert {"loss_scale", "growth_tracker", "skipped_steps"} <= compared, compared


# -- wrappers around optax.adam / torch.optim.Adam, and around scale_by_adamw --

_WRAPPERS = ["master_weights", "master_weights_split", "kahan_summation",
             "stochastic_rounding", "round_to_nearest"]


def _wrap(framework, wrapper, inner, key):
  mod = oh if framework == "jax" else tb
  if wrapper == "master_weights_split":
    return mod.master_weights(inner, split=True)
  if wrapper == "stochastic_rounding":
    return mod.stochastic_rounding(inner, key=key)
  return getattr(mod, wrapper)(inner)


@st.composite
def wrapper_configs(draw):
  wrapper = draw(st.sampled_from(_WRAPPERS))
  hp = dict(learning_rate=draw(LR), b1=draw(B1), b2=draw(B2), eps=draw(EPS))
  return wrapper, hp, draw(KEY)


@_examples(4)
@given(case=cases(), config=wrapper_configs())
def test_wrappers_around_the_adamw_core(case, config):
  """The wrappers around the repo's own core (``scale_by_adamw`` in both
  frameworks): the generic wrapper code paths, which the repo claims are
  bitwise under jit and across frameworks like the named optimizers."""
  _wrappers_around_the_adamw_core(case, config)


@pytest.mark.slow
@_examples(16)
@given(case=cases(), config=wrapper_configs())
def test_wrappers_around_the_adamw_core_more_examples(case, config):
  """``test_wrappers_around_the_adamw_core`` on other examples (derandomized per test)."""
  _wrappers_around_the_adamw_core(case, config)


def _wrappers_around_the_adamw_core(case, config):
  wrapper, hp, key = config
  hp = dict(hp, weight_decay=0.01)

  def make_jax():
    return _wrap("jax", wrapper, oh.scale_by_adamw(**hp), key)

  def make_torch(params):
    return _wrap("torch", wrapper, tb.scale_by_adamw(params, **hp), key)

  jp, js, js0 = _jax_run(make_jax(), case, jit=True)
  _check_jax_structs(case, jp, js, js0)
  np_, ns, _ = _jax_run(make_jax(), case, jit=False)
  for a, b in zip(jax.tree.leaves((jp, js)), jax.tree.leaves((np_, ns))):
    assert _bitwise(a, b), f"jit != op by op: {_ulps(a, b)} ULP ({a.dtype}{a.shape})"
  tparams, opt, _ = _torch_runs(make_torch, case, eager_state=False)
  compensation = {"kahan_summation": "kahan", "stochastic_rounding": "stochastic"}.get(wrapper)
  compared = _compare_buffers(js, jp, opt, None, tparams, compensation, bitwise=True)
  assert "params" in compared
  # The core's moments, which the torch wrapper keeps in its inner optimizer.
  jmu = jax.tree.leaves(parity._jax_buffers(js, jax.tree.structure(jp),
                                            list(range(len(case.params))))["mu"])
  with opt.stand_ins() as inner:  # the inner optimizer's state is keyed by the stand-ins
    inner_state = [inner.state[w] for w in inner.param_groups[0]["params"]]
  for k, (a, s) in enumerate(zip(jmu, inner_state)):
    assert _bitwise(np.asarray(a), _to_numpy(s["mu"])), (k, a, s["mu"])


def _ulp_of(x: np.ndarray, dtype) -> np.ndarray:
  """The spacing of ``dtype`` at |x| (at least the smallest subnormal)."""
  finfo = jnp.finfo(dtype)
  x = np.abs(np.asarray(x, np.float64))
  exp = np.floor(np.log2(np.maximum(x, float(finfo.smallest_normal))))
  return np.maximum(2.0 ** (exp - finfo.nmant), float(finfo.smallest_subnormal))


def _same_nonfinite(a64, b64, what):
  """Both sides have inf/NaN at the same elements (same infs); returns the finite mask."""
  fa, fb = np.isfinite(a64), np.isfinite(b64)
  assert np.array_equal(fa, fb), (what, "non-finite elements differ", a64, b64)
  assert np.array_equal(a64[~fa], b64[~fb], equal_nan=True), (what, a64[~fa], b64[~fb])
  return fa


def _close_to_rounding(a, b, dtype, lr, steps, rel_update, what):
  """|a - b| <= 2 ULPs of the dtype at the value + ``rel_update * lr * steps``:
  the bound for two programs that compute the same steps with different
  roundings (each step's update differs by ~``rel_update`` of lr, and a 16-bit
  result may round the other way). Non-finite elements must be identical."""
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  finite = _same_nonfinite(a64, b64, what)
  a64, b64 = a64[finite], b64[finite]
  if a64.size == 0:
    return
  bound = 2 * _ulp_of(np.maximum(np.abs(a64), np.abs(b64)), dtype) + rel_update * lr * steps
  err = np.abs(a64 - b64)
  worst = int(np.argmax(err - bound))
  assert np.all(err <= bound), (
      f"{what}: |a - b| = {err[worst]:.3g} > {bound[worst]:.3g}; {_ulps(a, b)} ULP")


@_examples(6)
@given(case=cases(), config=wrapper_configs())
def test_wrappers_around_adam(case, config):
  """master_weights (also split), kahan_summation, stochastic_rounding and
  round_to_nearest around ``optax.adam`` (JAX) / ``torch.optim.Adam``.

  Those inner optimizers are not the repo's code and not the same program:
  optax's bias correction is ``1 - b ** t`` in fp32 (``b2 = 0.9999`` loses
  ~3e-4 of it), torch's in float64, and XLA contracts optax's moment updates
  into FMAs under jit. So jit vs op by op and JAX vs torch are bounded by a
  few roundings of the update (``_close_to_rounding``), not bitwise; the
  parity tolerances apply to the named optimizers. Bitwise here: the 16-bit
  params of ``master_weights`` equal their rounded master in every run, and
  torch non-contiguous == contiguous.
  """
  _wrappers_around_adam(case, config)


@pytest.mark.slow
@_examples(24)
@given(case=cases(), config=wrapper_configs())
def test_wrappers_around_adam_more_examples(case, config):
  """``test_wrappers_around_adam`` on other examples (derandomized per test)."""
  _wrappers_around_adam(case, config)


def _wrappers_around_adam(case, config):
  wrapper, hp, key = config
  lr = hp["learning_rate"]

  def make_jax():
    return _wrap("jax", wrapper, optax.adam(lr, b1=hp["b1"], b2=hp["b2"], eps=hp["eps"]), key)

  def make_torch(params):
    adam = torch.optim.Adam(params, lr=lr, betas=(hp["b1"], hp["b2"]), eps=hp["eps"])
    return _wrap("torch", wrapper, adam, key)

  jp, js, js0 = _jax_run(make_jax(), case, jit=True)
  _check_jax_structs(case, jp, js, js0)
  np_, ns, _ = _jax_run(make_jax(), case, jit=False)
  for k, (a, b) in enumerate(zip(jax.tree.leaves(jp), jax.tree.leaves(np_))):
    _close_to_rounding(a, b, a.dtype, lr, case.steps, 1e-5, f"jit vs op by op, param {k}")
  tparams, opt, _ = _torch_runs(make_torch, case, eager_state=False)
  for k, (a, b) in enumerate(zip(jax.tree.leaves(jp), tparams)):
    _close_to_rounding(a, _to_numpy(b), a.dtype, lr, case.steps, 1e-3, f"JAX vs torch, param {k}")
  if wrapper.startswith("master_weights"):
    # One entry per leaf, None where a leaf has no master (jax.tree.leaves would drop those
    # and pair a param with the next leaf's master).
    masters = parity._jax_buffers(js, jax.tree.structure(jp),
                                  list(range(len(case.params))))["master"]
    for k, (p, m) in enumerate(zip(jax.tree.leaves(jp), masters)):
      if m is not None and m.dtype == jnp.float32 and p.dtype != jnp.float32:
        assert _bitwise(p, m.astype(p.dtype)), k  # the param is its rounded master
    for k, p in enumerate(tparams):
      m = opt.state[p].get("master")
      if m is not None and m.dtype == torch.float32:
        assert _bitwise(_to_numpy(p), _to_numpy(m.to(p.dtype))), k


# -- ScaledAdam ---------------------------------------------------------------

@st.composite
def scaled_adam_configs(draw):
  hp = dict(learning_rate=draw(LR), b1=draw(B1), b2=draw(B2), eps=draw(EPS),
            clipping_scale=draw(st.one_of(st.none(), st.floats(0.5, 4.0))),
            size_update_period=draw(st.integers(1, 3)),
            clipping_update_period=draw(st.integers(1, 3)))
  wrapper = draw(st.sampled_from([None, "kahan_summation", "master_weights"]))
  return hp, wrapper


def _normwise(a, b, what="") -> float:
  """max |a - b| / max |b| over the finite elements of a tensor (0 for empty or
  all-zero ones); non-finite elements must be identical."""
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  finite = _same_nonfinite(a64, b64, what)
  a64, b64 = a64[finite], b64[finite]
  if a64.size == 0:
    return 0.0
  scale = max(np.max(np.abs(a64)), np.max(np.abs(b64)))
  return float(np.max(np.abs(a64 - b64)) / scale) if scale > 0 else 0.0


@_examples(4)
@given(case=cases(max_steps=4), config=scaled_adam_configs())
def test_scaled_adam(case, config):
  _scaled_adam(case, config)


@pytest.mark.slow
@_examples(14)
@given(case=cases(max_steps=4), config=scaled_adam_configs())
def test_scaled_adam_more_examples(case, config):
  """``test_scaled_adam`` on other examples (derandomized per test)."""
  _scaled_adam(case, config)


def _scaled_adam(case, config):
  """ScaledAdam alone, and inside kahan_summation / master_weights: shapes and
  dtypes kept; jit vs op by op and JAX vs torch within a few roundings.

  Not bitwise (docs/algorithms.md#jax-vs-torch: reductions are summed in
  different orders, and there is no ``no_fma``): the bound per tensor is the
  repo's own ``test_jax_and_torch_agree_for_500_steps_with_clipping`` bound,
  max|a - b| / max|b| <= 1e-5, or within 2 ULPs + 1e-5 lr per step of the
  param dtype for 16-bit params (a result near a rounding boundary may round
  the other way). torch on non-contiguous params is held to the same bound,
  not to bitwise equality with the contiguous run: torch sums a reduction
  (``mean(p * p)`` for ``param_rms``, ``sum(p * g)``) in memory order, so a
  transposed fp32 matrix gets an RMS one ULP away about half the time, and
  every element of its step follows (plain torch, not this library)."""
  hp, wrapper = config
  lr = hp["learning_rate"]

  def make_jax():
    tx = oh.scaled_adam(**hp)
    return getattr(oh, wrapper)(tx) if wrapper else tx

  def make_torch(params):
    opt = tb.scaled_adam(params, **hp)
    return getattr(tb, wrapper)(opt) if wrapper else opt

  jp, js, js0 = _jax_run(make_jax(), case, jit=True)
  _check_jax_structs(case, jp, js, js0)
  np_, ns, _ = _jax_run(make_jax(), case, jit=False)
  runs = []
  for noncontiguous in (False, True):
    tparams, opt, structs = _torch_run(make_torch, case, noncontiguous)
    _check_torch_structs(structs, eager_state=False)
    runs.append(tparams)
  for k, (a, b, c, d) in enumerate(zip(jax.tree.leaves(jp), jax.tree.leaves(np_), *runs)):
    c, d = _to_numpy(c), _to_numpy(d)
    for other, what in ((b, "jit vs op by op"), (c, "JAX vs torch"),
                        (d, "JAX vs torch non-contiguous")):
      if a.dtype == jnp.float32:
        assert _normwise(a, other, what) <= 1e-5, (what, k, _normwise(a, other))
      else:
        _close_to_rounding(a, other, a.dtype, lr, case.steps, 1e-5, f"{what}, param {k}")


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_scaled_adam_fp16_small_gradient_is_a_small_step(framework):
  """Found by test_scaled_adam (fp16 leaves with gradients of 2^-12 gave inf
  params, identically in JAX and torch): the second moment was stored in fp16,
  where (1 - b2) g^2 underflows to 0 for |g| < ~1.7e-3, so the step was
  g / eps (a 1e-4 gradient moved 1.0 to -29). Fixed: fp16 params keep fp32
  second moments. An fp16 param ends within two fp16 ULPs of the fp32 run."""
  results = {}
  for name in ("float32", "float16"):
    if framework == "jax":
      p = {"w": jnp.ones((4,), name)}
      tx = oh.scaled_adam()  # the seed's defaults: lr 3e-2, b1 0.9, b2 0.98, eps 1e-8
      u, _ = tx.update({"w": jnp.full((4,), 1e-4, name)}, tx.init(p), p)
      results[name] = np.asarray(optax.apply_updates(p, u)["w"], np.float32)
    else:
      w = torch.ones(4, dtype=getattr(torch, name), requires_grad=True)
      opt = tb.scaled_adam([w])
      w.grad = torch.full((4,), 1e-4, dtype=w.dtype)
      opt.step()
      results[name] = w.detach().float().numpy()
  np.testing.assert_allclose(results["float32"], 0.997, atol=1e-6)
  np.testing.assert_allclose(results["float16"], results["float32"], atol=2 * 2.0 ** -11)
