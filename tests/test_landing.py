"""Landing exactly (docs/algorithms.md#landing-exactly): 16-bit params get updates in
their dtype; optax.apply_updates, p + u, update_and_apply and the torch step store the
same bits, also on steps that jump across binades, where the buffers absorb what landed.
A master's in-place step writes its rounding (both frameworks), and its update keeps the
master where the param missed it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh
from optax_half import rounding
from optax_half.compensation import COMPENSATIONS as JAX_RULES
from suite_helpers import default_or_slow

NAMES = ["kahan", "split", "stochastic", "none", "master"]


def _cases(dtype, n=4096, seed=0):
  """(p, x') pairs: small steps, sign changes, binade jumps up and down."""
  rng = np.random.default_rng(seed)
  lo = -12 if dtype == "float16" else -30
  p32 = rng.standard_normal(n) * np.exp2(rng.integers(lo, 10, n))
  kind = rng.integers(0, 4, n)
  factor = np.select([kind == 0, kind == 1, kind == 2],
                     [1 + rng.standard_normal(n) * 1e-3,       # usual steps
                      -rng.uniform(0.001, 3.0, n),             # sign changes
                      np.exp2(rng.uniform(-14, 14, n))],       # binade jumps
                     rng.uniform(0.5, 2.0, n) * (1 + 1e-4 * rng.standard_normal(n)))
  x_new = (p32 * factor).astype(np.float32)
  p = jnp.asarray(p32.astype(np.float32)).astype(dtype)
  x_new = np.clip(x_new, -6e4, 6e4).astype(np.float32) if dtype == "float16" else x_new
  return p, jnp.asarray(x_new), rng


def _bits(x):
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32, 1: np.uint8}[x.dtype.itemsize])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", NAMES)
def test_updates_land_the_same_bits_every_way_and_in_torch(name, dtype):
  rules = JAX_RULES[name].for_dtype(jnp.dtype(dtype))
  p, x_new, rng = _cases(dtype)
  buf = rules.init_buffer(p, jnp.float32)
  if rules.buffer:  # a buffer as a previous step leaves it
    buf = rules.write(rounding.widen(p), p, buf, None)[2]
  bits = jnp.asarray(rng.integers(0, 2**32, p.shape, dtype=np.uint32))
  write = jax.jit(lambda x, p, b, r: rules.write(x, p, b, r if rules.draws_bits else None))
  u, p_land, new_buf = write(x_new, p, buf, bits)
  assert u.dtype == p.dtype == p_land.dtype
  np.testing.assert_array_equal(_bits(optax.apply_updates(p, u)), _bits(p_land))
  np.testing.assert_array_equal(_bits(jax.jit(lambda a, b: a + b)(p, u)), _bits(p_land))
  np.testing.assert_array_equal(_bits(p + u), _bits(p_land))
  # The cases include steps that land elsewhere than the target.
  if name in ("stochastic",):
    target = rounding.stochastic_round(x_new, p.dtype, bits)
  elif rules.name == "split":
    target = rounding.split_f32(x_new)[0]
  else:
    target = x_new.astype(p.dtype)
  jumped = np.asarray(rounding.widen(p_land) != rounding.widen(target))
  assert 5 < jumped.sum() < 0.5 * jumped.size, jumped.sum()
  nonzero = ~jumped & (np.asarray(rounding.widen(target)) != 0)  # zeros land on +0.0
  np.testing.assert_array_equal(_bits(p_land)[nonzero], _bits(target)[nonzero])
  x32, land32 = np.asarray(x_new), np.asarray(rounding.widen(p_land))
  if rules.name == "kahan":
    # p_land + c' holds x' to c's own rounding; where the target landed, as before.
    c32 = np.asarray(rounding.widen(new_buf))
    eps = 2.0 ** (-8 if dtype == "bfloat16" else -11)
    err = np.abs(land32.astype(np.float64) + c32 - x32)
    tiny = 2.0 ** -25 if dtype == "float16" else 1e-37  # half of fp16's subnormal spacing
    assert (err <= eps * np.abs(x32 - land32) + tiny).all()
    old = np.asarray(rounding.widen((x_new - rounding.widen(target)).astype(p.dtype)))
    np.testing.assert_array_equal(c32[~jumped], old[~jumped])
  masters = rules.name in ("master", "split")
  if rules.name == "master":  # never rounded: read back exactly, the missed params marked
    np.testing.assert_array_equal(np.asarray(rules.read(p_land, new_buf)), x32)
    assert int(new_buf.missed) != 0
    # A param written from outside where one missed is taken up, as anywhere else.
    edited = p_land.at[0].set(jnp.asarray(3.0, p.dtype))
    np.testing.assert_array_equal(np.asarray(rules.read(edited, new_buf))[0], 3.0)
    np.testing.assert_array_equal(np.asarray(rules.read(edited, new_buf))[1:][~jumped[1:]],
                                  x32[1:][~jumped[1:]])
  if rules.name == "split":  # a bf16 high half holds no other master: where it missed,
    read = np.asarray(rules.read(p_land, new_buf))  # the param (docs: the update path)
    np.testing.assert_array_equal(read[~jumped], x32[~jumped])
    np.testing.assert_array_equal(read[jumped], land32[jumped])
  if masters:  # in place the param is the target and the master exact
    _, p_in, buf_in = jax.jit(lambda x, p, b: rules.write(x, p, b, None, True))(x_new, p, buf)
    np.testing.assert_array_equal(_bits(p_in), _bits(target))
    np.testing.assert_array_equal(np.asarray(rules.read(p_in, buf_in)), x32)
    p_land, new_buf = p_in, buf_in

  torch = pytest.importorskip("torch")
  from torch_bridge import dlpack  # noqa: PLC0415
  from torch_bridge.compensation import COMPENSATIONS as TORCH_RULES  # noqa: PLC0415
  tc = TORCH_RULES[name].for_dtype(getattr(torch, dtype))
  master = lambda b: b.master if rules.name == "master" else b  # noqa: E731
  t_p = dlpack.to_torch(p, allow_copy=True).clone()
  t_buf = None if not rules.buffer else dlpack.to_torch(master(buf), allow_copy=True).clone()
  t_bits = dlpack.to_torch(bits.view(jnp.int32), allow_copy=True)
  tc.write(dlpack.to_torch(x_new, allow_copy=True).clone(), t_p, t_buf,
           t_bits if tc.draws_bits else None)
  np.testing.assert_array_equal(_bits(dlpack.to_jax(t_p)), _bits(p_land))
  if rules.buffer:
    np.testing.assert_array_equal(_bits(dlpack.to_jax(t_buf)), _bits(master(new_buf)))
  t_u = (t_p.float() - dlpack.to_torch(p, allow_copy=True).float()).to(t_p.dtype)
  assert t_u.dtype == t_p.dtype


# make test: every compensation in both dtypes, flat_state in both dtypes; the rest slow.
_BIG_CASES = [(c, d, f) for f in (False, True) for c in NAMES for d in ("bfloat16", "float16")]
_BIG_DEFAULT = [("kahan", "bfloat16", False), ("split", "float16", False),
                ("stochastic", "bfloat16", False), ("none", "float16", False),
                ("master", "bfloat16", False), ("master", "float16", True),
                ("kahan", "float16", True), ("stochastic", "bfloat16", True)]


@pytest.mark.parametrize("compensation, dtype, flat", default_or_slow(_BIG_CASES, _BIG_DEFAULT))
def test_big_steps_update_and_update_and_apply_agree(compensation, dtype, flat):
  """Steps of lr 0.5 on small weights change signs and binades: tx.update's u (the kernel's
  on CPU, else XLA's) applied by apply_updates and by p + u equals update_and_apply's params
  and state, bit for bit; a full master's two runs keep the same master and moments bit for
  bit, and their params differ only where the update missed the master's rounding (in place
  they are its rounding), put right by the next step."""
  if compensation == "master":
    tx = oh.adam_fp32_master(0.5, weight_decay=0.0, flat_state=flat)
  else:
    tx = oh.adamw_bf16(0.5, compensation=compensation, weight_decay=0.0, flat_state=flat)
  full_master = compensation == "master" or (compensation == "split" and dtype == "float16")
  rng = np.random.default_rng(1)
  params = {"w": jnp.asarray(rng.standard_normal(4099) * np.exp2(rng.integers(-12, 2, 4099)),
                             dtype),
            "b": jnp.asarray(rng.standard_normal(37), dtype)}
  state = tx.init(params)
  params_in, state_in = params, state
  update, in_place = jax.jit(tx.update), jax.jit(lambda g, s, p: oh.update_and_apply(tx, g, s, p))
  jumps = missed = 0
  for step in range(4):
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), dtype), params)
    u, s1 = update(grads, state, params)
    assert u["w"].dtype == params["w"].dtype
    by_optax = optax.apply_updates(params, u)
    np.testing.assert_array_equal(_bits(jax.tree.map(lambda a, b: a + b, params, u)["w"]),
                                  _bits(by_optax["w"]))
    exact = (rounding.widen(by_optax["w"]) - rounding.widen(params["w"]))
    jumps += int(np.sum(np.asarray(rounding.widen(u["w"]) != exact)))
    if not full_master:  # one trajectory
      p2, s2 = in_place(grads, state, params)
      if compensation != "split":  # the same bits
        for a, b in zip(jax.tree.leaves((p2, s2)), jax.tree.leaves((by_optax, s1))):
          np.testing.assert_array_equal(_bits(a), _bits(b))
      elif not flat:  # the same masters where the update landed on the high half
        for p_u, p_i, lo_u, lo_i in zip(*(jax.tree.leaves(t) for t in (
            by_optax, p2, s1.master, s2.master))):
          same = np.asarray(rounding.widen(p_u) == rounding.widen(p_i))
          np.testing.assert_array_equal(np.asarray(rounding.join_f32(p_u, lo_u))[same],
                                        np.asarray(rounding.join_f32(p_i, lo_i))[same])
          missed += int((~same).sum())
      params, state = p2, s2
      continue
    p2, s2 = in_place(grads, state_in, params_in)
    if full_master:  # the update's own run, and the in-place run beside it
      master = lambda s: jax.tree.leaves(oh.relayout_state(  # noqa: E731
          s, oh.adam_fp32_master(0.5), params).master) if flat else jax.tree.leaves(s.master)
      for a, b in zip(master(s1), master(s2)):
        np.testing.assert_array_equal(_bits(a), _bits(b))
      for a, b in zip(jax.tree.leaves(s1.inner_state), jax.tree.leaves(s2.inner_state)):
        np.testing.assert_array_equal(_bits(a), _bits(b))
      for p_u, p_i, m in zip(jax.tree.leaves(by_optax), jax.tree.leaves(p2), master(s2)):
        np.testing.assert_array_equal(_bits(p_i), _bits(m.astype(p_i.dtype)))
        off = np.asarray(rounding.widen(p_u) != rounding.widen(p_i))
        missed += int(off.sum())
        assert off.sum() < 0.5 * off.size
      assert any(int(f) != 0 for f in jax.tree.leaves(s1.missed)) == (missed > 0)
      params, state, params_in, state_in = by_optax, s1, p2, s2
  assert jumps > 0  # some steps were not representable: the landing rule mattered
  if full_master or (compensation == "split" and not flat):
    assert missed > 0


def test_equinox_style_loop_keeps_bf16_and_kahan_beats_nearest():
  """params = tree_map(p + u): 200 small steps keep bf16 params, and the compensation
  works (Kahan ends nearer the fp32 run than round-to-nearest)."""
  x = jnp.linspace(-1.0, 1.0, 64)
  target = 1.0 + 0.5 * x

  def loss(params):
    w = params["w"].astype(jnp.float32)
    pred = w[0] + w[1] * x
    return jnp.mean((pred - target) ** 2)

  def run(tx, dtype):
    params = {"w": jnp.asarray([0.9, 0.4], dtype)}
    state = tx.init(params)

    @jax.jit
    def step(params, state):
      grads = jax.grad(loss)(params)
      updates, state = tx.update(grads, state, params)
      return jax.tree.map(lambda p, u: p + u, params, updates), state

    for _ in range(200):
      params, state = step(params, state)
    assert params["w"].dtype == dtype
    return float(loss(params))

  kahan = run(oh.adamw_bf16(2e-4, compensation="kahan", weight_decay=0.0), jnp.bfloat16)
  nearest = run(oh.adamw_bf16(2e-4, compensation="none", weight_decay=0.0), jnp.bfloat16)
  reference = run(optax.adamw(2e-4, weight_decay=0.0), jnp.float32)
  assert kahan != nearest
  assert abs(kahan - reference) < abs(nearest - reference)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_update_of_truncates_bf16_and_rounds_fp16_in_both_frameworks(dtype):
  """update_of(d): bf16 keeps the high 16 bits of d (numpy's bit shift), a NaN as the cast's;
  fp16 is the nearest cast; torch's the same bits (a NaN as its own cast's)."""
  torch = pytest.importorskip("torch")
  from torch_bridge import rounding as torch_rounding  # noqa: PLC0415
  rng = np.random.default_rng(3)
  d = (rng.standard_normal(4096) * np.exp2(rng.integers(-20, 10, 4096))).astype(np.float32)
  d[:6] = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0]
  got = rounding.update_of(jnp.asarray(d), dtype)
  assert got.dtype == jnp.dtype(dtype)
  if dtype == "bfloat16":
    want = (d.view(np.uint32) >> 16).astype(np.uint16)
    nan = np.isnan(d)
    want[nan] = _bits(jnp.asarray(d[nan]).astype(dtype))
    # Truncation: never larger in magnitude than d, and less than one bf16 ULP of d below it.
    lost = np.abs(d.astype(np.float64)) - np.abs(np.asarray(got, np.float64))
    nonzero = np.isfinite(d) & (d != 0)
    assert (lost[nonzero] >= 0).all()
    assert (lost[nonzero] < np.abs(d[nonzero]) * 2.0**-7).all()
    assert (lost[nonzero] > 0).any()  # truncation, not the nearest rounding
  else:
    want = _bits(jnp.asarray(d).astype(dtype))
  np.testing.assert_array_equal(_bits(got), want)
  between = jnp.float32(1.0 + 2.0**-7 + 2.0**-8 + 2.0**-10)  # nearest: 1.015625
  assert float(rounding.update_of(between, jnp.bfloat16)) == 1.0078125
  assert float(between.astype(jnp.bfloat16)) == 1.015625
  def torch_bits(x):
    return x.view(torch.int16).numpy().view(np.uint16)
  td = torch.from_numpy(d)
  got_t = torch_bits(torch_rounding.update_of(td, getattr(torch, dtype)))
  # A NaN as torch's own cast writes it (0xFFFF on CPU, where XLA keeps the sign: 0x7FC0).
  cast_t = torch_bits(td.to(getattr(torch, dtype)))
  nan = np.isnan(d)
  np.testing.assert_array_equal(got_t[nan], cast_t[nan])
  np.testing.assert_array_equal(got_t[~nan], want[~nan])
