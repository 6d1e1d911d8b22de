"""Mixed-precision policies (jmp's API) and ``optax_half.nnx.apply_policy``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)


def test_only_floating_array_leaves_are_cast():
  policy = oh.Policy(F32, BF16, F16)
  tree = {"f32": jnp.ones(2), "f16": jnp.ones(2, jnp.float16), "np": np.ones(2, np.float64),
          "int": jnp.arange(3), "bool": jnp.array([True]), "py": 1.5, "none": None,
          "u8": np.zeros(2, np.uint8)}
  for cast, dtype in ((policy.cast_to_param, F32), (policy.cast_to_compute, BF16),
                      (policy.cast_to_output, F16)):
    out = cast(tree)
    assert {k: out[k].dtype for k in ("f32", "f16", "np")} == {"f32": dtype, "f16": dtype,
                                                                 "np": dtype}
    assert out["int"].dtype == tree["int"].dtype and out["bool"].dtype == jnp.bool_
    assert out["u8"].dtype == np.uint8 and out["py"] == 1.5 and out["none"] is None
  # Under jit too (tracers are arrays).
  assert jax.jit(policy.cast_to_compute)(tree["f32"]).dtype == BF16
  assert oh.cast_to_full({"w": jnp.ones(2, jnp.bfloat16)})["w"].dtype == F32
  assert oh.cast_to_half({"w": jnp.ones(2)})["w"].dtype == oh.half_dtype() == F16  # CPU


@pytest.mark.parametrize("name, expected", [
    ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
    ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
    ("p=full,c=half", (F32, F16, F16)),  # half: fp16 off TPU
    ("c=f16", (F32, F16, F16)),           # params f32, output follows compute
    ("p=bf16", (BF16, BF16, BF16)),
    ("bfloat16", (BF16, BF16, BF16)),
    (" p = f16 , o = f32 ", (F16, F16, F32)),
])
def test_policy_strings(name, expected):
  policy = oh.get_policy(name)
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected
  assert oh.get_policy(str(policy)) == policy


@pytest.mark.parametrize("name, message", [
    ("p=f32,q=bf16", "Unknown key 'q'"),
    ("p=f33", "Unknown dtype 'f33'"),
    ("p=f32,bf16", "'bf16' is not key=dtype"),
    ("p=f32,params=bf16", "param_dtype is given twice"),
    ("", "non-empty string"),
    ("int8", "Unknown dtype 'int8'"),
])
def test_bad_policy_strings_name_the_problem(name, message):
  with pytest.raises(ValueError, match=message):
    oh.get_policy(name)


def test_policies_hold_floating_dtypes_only():
  with pytest.raises(TypeError, match="param_dtype must be a floating dtype"):
    oh.Policy(jnp.int32, F32, F32)
  policy = oh.Policy(jnp.float32, "bfloat16", np.float16)
  assert policy.with_output_dtype(jnp.float32).output_dtype == F32
  assert policy.with_param_dtype(jnp.bfloat16).param_dtype == BF16
  assert policy.with_compute_dtype(jnp.float32).compute_dtype == F32
  assert hash(policy) == hash(oh.Policy(F32, BF16, F16))  # usable as a static jit argument


# ---------------------------------------------------------------------------
# Flax NNX.
# ---------------------------------------------------------------------------

nnx = pytest.importorskip("flax.nnx")


class Model(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(16, 8, rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.hidden = nnx.Linear(8, 8, rngs=rngs)
    self.out = nnx.Linear(8, 1, rngs=rngs)
    self.seen = None

  def __call__(self, tokens):
    h = self.hidden(self.norm(self.embed(tokens)))
    self.seen = h.dtype  # the compute dtype of the hidden layer (static: a dtype)
    return self.out(jax.nn.gelu(h))[..., 0]


def _dtypes(model):
  return {"/".join(map(str, path)): leaf.dtype
          for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
          for path in [[getattr(k, "key", k) for k in path[:-1]]]}


def test_apply_policy_sets_the_layers_and_casts_the_params():
  model = oh.nnx.apply_policy(Model(nnx.Rngs(0)), "p=bf16,c=bf16,o=f32")
  dtypes = _dtypes(model)
  assert {k: str(v) for k, v in dtypes.items()} == {
      "embed/embedding": "bfloat16", "hidden/bias": "bfloat16", "hidden/kernel": "bfloat16",
      "norm/bias": "float32", "norm/scale": "float32",      # norms keep fp32
      "out/bias": "bfloat16", "out/kernel": "bfloat16"}
  y = model(jnp.arange(4))
  assert model.seen == BF16 and y.dtype == BF16
  assert oh.get_policy("p=bf16,c=bf16,o=f32").cast_to_output(y).dtype == F32
  model = oh.nnx.apply_policy(Model(nnx.Rngs(0)), oh.get_policy("f16"), keep_fp32=())
  assert set(_dtypes(model).values()) == {F16}
  with pytest.raises(TypeError, match="Policy or a policy string"):
    oh.nnx.apply_policy(model, jnp.bfloat16)


def _train(policy, tx, scaled=False, steps=30):
  model = oh.nnx.apply_policy(Model(nnx.Rngs(0)), policy)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  tokens = jnp.arange(16) % 16
  target = jnp.linspace(-1, 1, 16)

  def loss_fn(m, opt_state):
    loss = jnp.mean((policy.cast_to_output(m(tokens)) - target) ** 2)
    # With a loss scaler, differentiate scale * loss (fp16 backward stays in range).
    return (oh.scale_loss(loss, opt_state) if scaled else loss), loss

  @nnx.jit
  def step(model, optimizer):
    grads, loss = nnx.grad(loss_fn, has_aux=True)(model, optimizer.opt_state)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(steps)]
  model(tokens)  # eagerly, to record the hidden layer's compute dtype
  return model, optimizer, losses


def test_pure_bf16_with_adamw_bf16():
  """bf16 params and compute, fp32 outputs: adamw_bf16 trains the model."""
  policy = oh.get_policy("p=bf16,c=bf16,o=f32")
  model, _, losses = _train(policy, oh.adamw_bf16(3e-2))
  assert model.hidden.kernel[...].dtype == BF16 and model.seen == BF16
  assert losses[-1] < 0.5 * losses[0]


def test_classic_amp_fp32_params_fp16_compute_loss_scaled():
  """fp32 params (the master), fp16 compute, fp32 outputs, dynamic loss scaling."""
  policy = oh.get_policy("p=f32,c=f16,o=f32")
  model, optimizer, losses = _train(policy, oh.dynamic_loss_scale(optax.adam(3e-2)), scaled=True)
  assert model.hidden.kernel[...].dtype == F32 and model.seen == F16
  assert losses[-1] < 0.5 * losses[0]
  # The first step at the default scale (2^16) overflows fp16's backward once.
  assert int(oh.find_loss_scale_state(optimizer.opt_state).skipped_steps) <= 1
