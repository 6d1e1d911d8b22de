"""The torch.optim contract, held by every torch_bridge optimizer and wrapper.

What PyTorch's own OptimizerInfo tests (``test/test_optim.py``) ask of an
optimizer, and the recipes torch users run, over the optimizer table of
``test_torch_optim`` in fp32 and bf16: ``deepcopy``/``pickle``, state-dict
hooks, older state dicts, torch's spellings (``lr``, ``betas``) and LR
schedulers (``OneCycleLR`` with momentum cycling), per-group options,
``add_param_group`` on the wrappers, ``requires_grad=False`` params, and
weights loaded into the model after the optimizer was built.
"""

import copy
import io
import pickle

import pytest

torch = pytest.importorskip("torch")

import torch_bridge as tb  # noqa: E402
from test_torch_optim import OPTIMIZERS, _grads, _params, _run, _same, _snapshot  # noqa: E402
from suite_helpers import default_or_slow, host_work  # noqa: E402
from torch_bridge.compensation import kahan_remainder_fits  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
CASES = [(name, dtype) for name in OPTIMIZERS for dtype in DTYPES]
IDS = [f"{name}-{str(dtype).removeprefix('torch.')}" for name, dtype in CASES]
# The factories that take torch's spellings, with their optax_half spelling.
ADAM_LIKE = {
    "adamw_bf16": tb.adamw_bf16,
    "adam_fp32_master": tb.adam_fp32_master,
    "scale_by_adamw": tb.scale_by_adamw,
    "scaled_adam": tb.scaled_adam,
}
WRAPPERS = {
    "master_weights": tb.master_weights,
    "master_weights split": lambda o: tb.master_weights(o, split=True),
    "master_weights foreach": lambda o: tb.master_weights(o, foreach=True),
    "master_weights split foreach": lambda o: tb.master_weights(o, split=True, foreach=True),
    "kahan_summation foreach": lambda o: tb.kahan_summation(o, foreach=True),
    "round_to_nearest foreach": lambda o: tb.round_to_nearest(o, foreach=True),
    "stochastic_rounding foreach": lambda o: tb.stochastic_rounding(o, key=5, foreach=True),
    "kahan_summation": tb.kahan_summation,
    "stochastic_rounding": lambda o: tb.stochastic_rounding(o, key=5),
    "round_to_nearest": tb.round_to_nearest,
}


def _setup(name, dtype, steps=3):
  params = _params(dtype)
  opt = OPTIMIZERS[name](params)
  grads = _grads(steps + 3, dtype)
  _run(opt, params, grads[:steps])
  return params, opt, grads[steps:]


def _params_of(opt):
  return [p for g in opt.param_groups for p in g["params"]]


# ---------------------------------------------------------------------------
# Copies.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_step_like_the_original(name, dtype, how):
  """A deep copy or an unpickled optimizer (with its own params) steps to the
  same bits as the original, and keeps every public attribute."""
  params, opt, grads = _setup(name, dtype)
  clone = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
  assert {k for k in vars(opt) if not k.startswith("_")} == {
      k for k in vars(clone) if not k.startswith("_")}
  clone_params = _params_of(clone)
  assert all(a is not b and torch.equal(a, b) for a, b in zip(params, clone_params))
  _run(opt, params, grads)
  _run(clone, clone_params, grads)
  assert _same(_snapshot(opt, params), _snapshot(clone, clone_params))


# ---------------------------------------------------------------------------
# state_dict: hooks, older formats, weights_only loading, determinism.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_state_dict_hooks_run(name, dtype):
  params, opt, _ = _setup(name, dtype, steps=1)
  calls = []
  opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))

  def post(o, sd):
    calls.append("post")
    assert "kind" in sd  # post hooks see the whole dict
    sd = dict(sd)
    sd["marked"] = True
    return sd
  opt.register_state_dict_post_hook(post)
  sd = opt.state_dict()
  assert calls == ["pre", "post"] and sd["marked"]

  def load_pre(o, sd):
    calls.append("load_pre")
    sd = copy.deepcopy(sd)
    for g in sd["param_groups"]:
      g["lr"] = 0.003
    return sd  # the dict returned is the one loaded
  opt.register_load_state_dict_pre_hook(load_pre)
  opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
  opt.load_state_dict(sd)
  assert calls[2:] == ["load_pre", "load_post"]
  assert all(g["lr"] == 0.003 for g in opt.param_groups)


@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_python_number_steps_load_and_resume_exactly(name, dtype):
  """A state dict whose ``step`` entries are Python numbers (older torch
  formats) loads, and the run goes on exactly as from the tensor one."""
  params, opt, grads = _setup(name, dtype)
  sd = copy.deepcopy(opt.state_dict())

  def as_numbers(d):
    for k, v in d.items():
      if isinstance(v, dict):
        as_numbers(v)
      elif k == "step" and torch.is_tensor(v):
        d[k] = v.item()
  as_numbers(sd)
  fresh = _params(dtype)
  for f, p in zip(fresh, params):
    f.data.copy_(p.detach())
  other = OPTIMIZERS[name](fresh)
  other.load_state_dict(sd)
  _run(opt, params, grads)
  _run(other, fresh, grads)
  assert _same(_snapshot(opt, params), _snapshot(other, fresh))


NAMED = {  # the table's optimizers, built from (name, param) pairs
    "master_weights(Adam)": lambda ps: tb.master_weights(torch.optim.Adam(ps, lr=1e-2)),
    "kahan_summation(Adam)": lambda ps: tb.kahan_summation(torch.optim.Adam(ps, lr=1e-2)),
    "adamw_bf16 kahan": lambda ps: tb.adamw_bf16(ps, lr=1e-2),
    "adam_fp32_master": lambda ps: tb.adam_fp32_master(ps, lr=1e-2),
    "scaled_adam": lambda ps: tb.scaled_adam(ps, clipping_scale=2.0),
}


@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_state_dict_loads_with_weights_only(name, dtype):
  """``torch.load(weights_only=True)`` reads a saved state dict back: it
  holds only plain types and tensors."""
  params, opt, _ = _setup(name, dtype, steps=2)
  buf = io.BytesIO()
  torch.save(opt.state_dict(), buf)
  buf.seek(0)
  loaded = torch.load(buf, weights_only=True)
  assert loaded["kind"] == opt.state_dict()["kind"]
  opt.load_state_dict(loaded)


@pytest.mark.parametrize("name", list(NAMED))
def test_named_params_carry_their_names(name):
  params = _params()
  opt = NAMED[name]([(f"w{i}", p) for i, p in enumerate(params)])
  _run(opt, params, _grads(2))
  names = [f"w{i}" for i in range(len(params))]
  assert opt.param_groups[0]["param_names"] == names
  assert opt.state_dict()["param_groups"][0]["param_names"] == names


@pytest.mark.parametrize("name", list(NAMED))
@pytest.mark.parametrize("named0, named1", [(True, True), (True, False), (False, True)])
def test_param_names_survive_a_load_between_named_and_plain(name, named0, named1):
  """test_optim's test_can_load_from_to_named_state_dict: names given to either
  optimizer are in the loaded one's state_dict (a wrapper's groups are saved once, at
  the top, as torch.optim's; its inner optimizer shares them)."""
  model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)).to(torch.bfloat16)
  names = ["0.weight", "0.bias", "1.weight", "1.bias"]

  def build():
    return NAMED[name](list(model.named_parameters()) if named0 else list(model.parameters()))
  opt = build()
  for p in model.parameters():
    p.grad = torch.ones_like(p)
  opt.step()
  named0, saved = named1, copy.deepcopy(opt.state_dict())
  opt2 = build()
  opt2.load_state_dict(saved)
  opt2.step()
  state = opt2.state_dict()
  assert state["param_groups"][0]["param_names"] == names
  if "inner" in state:
    assert "param_groups" not in state["inner"]
    assert opt2.inner.param_groups[0]["param_names"] == names


@pytest.mark.parametrize("factory", list(ADAM_LIKE.values()) + [tb.LowPrecisionAdamW],
                         ids=list(ADAM_LIKE) + ["LowPrecisionAdamW"])
def test_a_tensor_lr_of_more_than_one_element_is_torchs_error(factory):
  p = torch.nn.Parameter(torch.ones(2))
  with pytest.raises(ValueError, match="^Tensor lr must be 1-element$"):
    factory([p], lr=torch.tensor([1e-3, 1e-3]))
  with pytest.raises(ValueError, match="^Tensor lr must be 1-element$"):
    torch.optim.AdamW([p], lr=torch.tensor([1e-3, 1e-3]))
  opt = factory([p], lr=torch.tensor(1e-3))  # one element: taken
  with pytest.raises(ValueError, match="^Tensor lr must be 1-element$"):
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))],
                         "lr": torch.tensor([1.0, 2.0])})


@pytest.mark.parametrize("factory", list(ADAM_LIKE.values()) + [tb.LowPrecisionAdamW],
                         ids=list(ADAM_LIKE) + ["LowPrecisionAdamW"])
def test_fused_on_meta_params_raises_as_torch_does(factory):
  """test_optim's test_fused_error_on_params_on_meta: torch's error at the first
  step, and the step works once the params are materialised."""
  messages = []
  for make in (lambda ps: factory(ps, lr=1e-3, fused=True),
               lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)):
    with torch.device("meta"):
      model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)).to(torch.bfloat16)
    opt = make(model.parameters())
    with torch.device("meta"):
      for p in model.parameters():
        p.grad = torch.rand_like(p)
    with pytest.raises(RuntimeError, match="`fused=True` requires all the params") as err:
      opt.step()
    messages.append(str(err.value))
    assert not any(opt.state.values())
    opt.zero_grad(set_to_none=True)
    model.to_empty(device="cpu")
    for p in model.parameters():
      p.grad = torch.rand_like(p)
    opt.step()
  assert messages[0] == messages[1]


# ---------------------------------------------------------------------------
# Steps torch.optim takes (or does not).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_no_grads_and_zero_grads_are_no_ops(name, dtype):
  """No gradient: nothing changes. Zero gradients with no weight decay: the
  params do not move (test_optim's ``test_step_is_noop_*``)."""
  params = _params(dtype)
  opt = OPTIMIZERS[name](params)
  for g in opt.param_groups:
    g["weight_decay"] = 0.0
  before = [p.detach().clone() for p in params]
  assert opt.step(lambda: torch.tensor(1.0)).item() == 1.0
  for p in params:
    p.grad = torch.zeros_like(p)
  opt.step()
  assert all(torch.equal(a, b) for a, b in zip(before, params))
  opt.zero_grad(set_to_none=False)
  assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in params)
  opt.zero_grad()
  assert all(p.grad is None for p in params)


@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_a_frozen_param_with_a_grad_is_stepped(name, dtype):
  """``requires_grad=False`` with a ``.grad``: stepped as torch.optim does,
  to the same bits as a trainable param."""
  a, b = _params(dtype), _params(dtype)
  a[0].requires_grad_(False)
  opt_a, opt_b = OPTIMIZERS[name](a), OPTIMIZERS[name](b)
  grads = _grads(3, dtype)
  _run(opt_a, a, grads)
  _run(opt_b, b, grads)
  assert _same(_snapshot(opt_a, a), _snapshot(opt_b, b))


# ---------------------------------------------------------------------------
# torch's spellings, param groups and schedulers.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("factory", list(ADAM_LIKE))
def test_torch_spellings_are_the_same_optimizer(factory):
  make = ADAM_LIKE[factory]
  betas = (0.8, 0.95)
  a, b = _params(), _params()
  opt_a = make(a, learning_rate=1e-2, b1=betas[0], b2=betas[1])
  opt_b = make(b, lr=1e-2, betas=betas)
  assert opt_b.param_groups[0]["lr"] == 1e-2 and opt_b.param_groups[0]["betas"] == betas
  assert "betas" in opt_b.defaults and "b1" not in opt_b.param_groups[0]
  grads = _grads(4)
  _run(opt_a, a, grads)
  _run(opt_b, b, grads)
  assert _same(_snapshot(opt_a, a), _snapshot(opt_b, b))
  with pytest.raises(TypeError, match="learning_rate or torch's lr"):
    make(_params(), learning_rate=0.5, lr=1e-2)
  with pytest.raises(TypeError, match="b1/b2 or torch's betas"):
    make(_params(), lr=1e-2, b1=0.7, betas=(0.8, 0.9))
  with pytest.raises(ValueError, match="betas must be a pair"):
    make(_params(), lr=1e-2, betas=0.9)


@pytest.mark.parametrize("make", [tb.LowPrecisionAdamW, tb.adamw_bf16, tb.adam_fp32_master,
                                  tb.scale_by_adamw])
def test_the_learning_rate_defaults_to_torchs(make):
  assert make(_params()).param_groups[0]["lr"] == torch.optim.AdamW(_params()).defaults["lr"]


@pytest.mark.parametrize("factory", list(ADAM_LIKE))
def test_per_group_options_are_honoured(factory):
  """A group's own ``betas`` (or ``b1``), ``lr`` and ``eps`` are used: its params
  step as under an optimizer built with those values."""
  make = ADAM_LIKE[factory]
  ps, alone = _params(), _params()
  opt = make([{"params": ps[:1]}, {"params": ps[1:], "betas": (0.5, 0.9), "lr": 3e-2}], lr=1e-2)
  # The same params in the same places (random bits follow a param's position).
  ref = make([{"params": alone[:1]}, {"params": alone[1:]}], lr=3e-2, betas=(0.5, 0.9))
  grads = _grads(4)
  _run(opt, ps, grads)
  _run(ref, alone, grads)
  assert all(torch.equal(a, b) for a, b in zip(ps[1:], alone[1:]))
  assert not torch.equal(ps[0], alone[0])
  opt_b1 = make([{"params": alone[:1], "b1": 0.5}], lr=1e-2)
  assert opt_b1.param_groups[0]["betas"][0] == 0.5  # optax_half's spelling in a group


@pytest.mark.parametrize("factory", list(ADAM_LIKE))
def test_unknown_group_keys_are_refused(factory):
  opt = ADAM_LIKE[factory](_params()[:1], lr=1e-2)
  with pytest.raises(ValueError, match=r"unknown \['momentum'\]"):
    opt.add_param_group({"params": _params()[1:], "momentum": 0.9})
  assert len(opt.param_groups) == 1  # nothing half-added
  with pytest.raises(ValueError, match="unknown"):
    ADAM_LIKE[factory]([{"params": _params(), "weight_decy": 0.1}], lr=1e-2)


def test_a_schedule_belongs_to_its_group():
  """A callable learning rate drives the groups that take it; a group with
  its own ``lr`` keeps it."""
  schedule = tb.preheat_decay_schedule(1e-2, preheat_steps=10)
  ps = _params()
  opt = tb.adamw_bf16([{"params": ps[:1]}, {"params": ps[1:2], "lr": 0.5},
                       {"params": ps[2:], "lr": lambda count: 0.25}], schedule)
  _run(opt, ps, _grads(3))
  assert opt.param_groups[0]["lr"] == schedule(2)
  assert opt.param_groups[1]["lr"] == 0.5
  assert opt.param_groups[2]["lr"] == 0.25
  assert "lr_schedule" not in opt.state_dict()["param_groups"][0]  # functions are not saved


def _one_cycle_run(make):
  """``test_cycle_lr_with_adam`` of torch's scheduler tests, on any optimizer."""
  p = torch.nn.Parameter(torch.ones(3))
  q = torch.nn.Parameter(torch.ones(3))
  opt = make([{"params": [p]}, {"params": [q], "lr": 0.5}])
  sched = torch.optim.lr_scheduler.OneCycleLR(
      opt, max_lr=25, final_div_factor=2, base_momentum=1, max_momentum=22, total_steps=10,
      anneal_strategy="linear")
  lrs, b1s = [], []
  for _ in range(10):  # no gradients: torch's test cycles beta1 through 1 and 22
    lrs.append(opt.param_groups[0]["lr"])
    b1s.append(opt.param_groups[0]["betas"][0])
    opt.step()
    sched.step()
  return lrs, b1s


@pytest.mark.parametrize("make", [
    lambda g: tb.adamw_bf16(g, lr=0.05),
    lambda g: tb.scaled_adam(g, lr=0.05),
    lambda g: tb.master_weights(torch.optim.Adam(g, lr=0.05)),
], ids=["adamw_bf16", "scaled_adam", "master_weights(Adam)"])
def test_one_cycle_lr_cycles_lr_and_momentum(make):
  lrs, b1s = _one_cycle_run(make)
  ref_lrs, ref_b1s = _one_cycle_run(lambda g: torch.optim.Adam(g, lr=0.05))
  assert lrs == pytest.approx([1, 13, 25, 21.5, 18, 14.5, 11, 7.5, 4, 0.5], abs=1e-5)
  assert b1s == pytest.approx([22, 11.5, 1, 4, 7, 10, 13, 16, 19, 22], abs=1e-5)
  assert (lrs, b1s) == (ref_lrs, ref_b1s)


@pytest.mark.parametrize("factory", list(ADAM_LIKE))
def test_betas_written_into_a_group_reach_the_step(factory):
  """What a momentum scheduler writes (``group["betas"]``) is what the next step uses."""
  make = ADAM_LIKE[factory]
  ps, ref = _params(), _params()
  opt = make(ps, lr=1e-2)
  opt.param_groups[0]["betas"] = (0.5, 0.9)
  _run(opt, ps, _grads(2))
  _run(make(ref, lr=1e-2, betas=(0.5, 0.9)), ref, _grads(2))
  assert all(torch.equal(a, b) for a, b in zip(ps, ref))


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_scheduler_on_the_inner_optimizer_drives_the_wrapper(wrapper):
  """One set of param groups: a StepLR attached to the wrapped optimizer
  before wrapping gives the same run as one attached to the wrapper."""
  runs = []
  for attach_to_inner in (True, False):
    ps = _params()
    inner = torch.optim.Adam(ps, lr=1e-2)
    sched_inner = torch.optim.lr_scheduler.StepLR(inner, 1, gamma=0.5) if attach_to_inner else None
    opt = WRAPPERS[wrapper](inner)
    sched = sched_inner or torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for g in _grads(4):
      _run(opt, ps, [g])
      sched.step()
    assert opt.param_groups[0]["lr"] == inner.param_groups[0]["lr"] == 1e-2 / 16
    runs.append(_snapshot(opt, ps))
  assert _same(*runs)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_add_param_group_on_a_wrapper(wrapper):
  """Progressive unfreezing: a group added after 3 steps steps like a fresh
  wrapper of it (Adam treats params independently), the first group goes on
  undisturbed, and a checkpoint of the whole resumes exactly."""
  ps, first, second = _params(), _params(), _params()
  grads = _grads(6)
  opt = WRAPPERS[wrapper](torch.optim.Adam(ps[:1], lr=1e-2))
  _run(opt, ps[:1], [g[:1] for g in grads[:3]])
  opt.add_param_group({"params": ps[1:], "lr": 2e-2})
  assert len(opt.inner.param_groups) == 2 and opt.param_groups is opt.inner.param_groups
  _run(opt, ps, grads[3:])
  ref1 = WRAPPERS[wrapper](torch.optim.Adam(first[:1], lr=1e-2))
  _run(ref1, first[:1], [g[:1] for g in grads])
  ref2 = WRAPPERS[wrapper](torch.optim.Adam(second[1:], lr=2e-2))
  _run(ref2, second[1:], [g[1:] for g in grads[3:]])
  if not wrapper.startswith("stochastic_rounding"):  # its random bits follow the position
    assert torch.equal(ps[0], first[0])
    assert all(torch.equal(a, b) for a, b in zip(ps[1:], second[1:]))
  # Save, rebuild with the same groups, load: the same bits.
  sd = copy.deepcopy(opt.state_dict())
  again = [p.detach().clone().requires_grad_() for p in ps]
  rebuilt = WRAPPERS[wrapper](torch.optim.Adam(again[:1], lr=1e-2))
  rebuilt.add_param_group({"params": again[1:], "lr": 2e-2})
  rebuilt.load_state_dict(sd)
  more = _grads(2, seed=9)
  _run(opt, ps, more)
  _run(rebuilt, again, more)
  assert _same(_snapshot(opt, ps), _snapshot(rebuilt, again))


def test_a_group_added_to_the_inner_optimizer_is_taken_up():
  ps = _params()
  inner = torch.optim.Adam(ps[:1], lr=1e-2)
  opt = tb.kahan_summation(inner)
  inner.add_param_group({"params": ps[1:]})
  before = [p.detach().clone() for p in ps]
  _run(opt, ps, _grads(2))
  assert all(not torch.equal(a, b) for a, b in zip(before, ps))
  assert all("compensation" in opt.state[p] for p in ps)


# ---------------------------------------------------------------------------
# Weights loaded into the model after the optimizer was built.
# ---------------------------------------------------------------------------

FOLLOWING = ["adam_fp32_master", "master_weights(Adam)", "master_weights(Adam, foreach)",
             "adamw_bf16 kahan", "kahan_summation(Adam)", "kahan_summation(Adam, foreach)",
             "master_weights(Adam, split)", "master_weights(Adam, split, foreach)",
             "adamw_bf16 split"]
MASTERS = ["adam_fp32_master", "master_weights(Adam)", "master_weights(Adam, foreach)"]


def _write(ps, weights, how):
  """Writes ``weights`` into the params as users load checkpoints."""
  with torch.no_grad():
    if how == "copy_":
      for p, w in zip(ps, weights):
        p.copy_(w)
    elif how == "load_state_dict":
      torch.nn.ParameterList(ps).load_state_dict(
          {str(i): w.detach() for i, w in enumerate(weights)})
    else:  # a new storage
      for p, w in zip(ps, weights):
        p.data = w.detach().clone()


def _frozen(opt):
  """No movement from here on: lr 0 and no decay (the update is exactly 0)."""
  for o in (opt, getattr(opt, "inner", None)):
    for g in (o.param_groups if o is not None else ()):
      g["lr"], g["weight_decay"] = 0.0, 0.0


@pytest.mark.parametrize("name", MASTERS)
@pytest.mark.parametrize("how", ["copy_", "load_state_dict", "data"])
def test_weights_loaded_into_the_model_are_not_reverted(name, how):
  """Build, train, load other weights into the model: the next step keeps
  them (the master is re-seeded from the params), where a stale master would
  write the old weights back."""
  ps = _params(torch.bfloat16)
  opt = OPTIMIZERS[name](ps)
  _run(opt, ps, _grads(3))
  loaded = _params(torch.bfloat16, seed=7)
  _write(ps, loaded, how)
  _frozen(opt)
  _run(opt, ps, _grads(1, seed=4))
  assert all(torch.equal(p, w) for p, w in zip(ps, loaded))
  # Re-seeded where the old master did not round to the loaded weight, kept where it did.
  assert all(torch.equal(opt.state[p]["master"].to(torch.bfloat16), w) for p, w in zip(ps, loaded))


@pytest.mark.parametrize("name", ["adamw_bf16 kahan", "kahan_summation(Adam)"])
@pytest.mark.parametrize("how", ["copy_", "data"])
def test_a_kahan_buffer_that_no_longer_fits_is_dropped(name, how):
  """Large weights leave large remainders; loading small weights over them
  must not add the old remainders to the new weights (a zero update keeps
  the loaded weights, to the ULP where a remainder still fits)."""
  big = [(p.detach().float() * 300).to(torch.bfloat16).requires_grad_() for p in _params()]
  opt = OPTIMIZERS[name](big)
  _run(opt, big, _grads(5))
  assert max(opt.state[p]["compensation"].float().abs().max().item() for p in big) > 1e-2
  small = [(w.float() * 1e-5).to(torch.bfloat16) for w in _params(seed=7)]
  _write(big, small, how)
  _frozen(opt)
  _run(opt, big, _grads(1, seed=4))
  for p, w in zip(big, small):
    assert (p.float() - w.float()).abs().max() <= w.float().abs().max() * 2**-7
    assert kahan_remainder_fits(p.detach(), opt.state[p]["compensation"]).all()


@pytest.mark.parametrize("name", FOLLOWING)
def test_loaded_weights_before_the_first_step_equal_a_new_optimizer(name):
  """Weights loaded into the params (``p.copy_``) after building and before
  the first step give, step for step, the bits of an optimizer built on them."""
  ps = _params(torch.bfloat16)
  opt = OPTIMIZERS[name](ps)
  loaded = _params(torch.bfloat16, seed=7)
  _write(ps, loaded, "copy_")
  fresh = [w.detach().clone().requires_grad_() for w in loaded]
  ref = OPTIMIZERS[name](fresh)
  grads = _grads(5, seed=4)
  _run(opt, ps, grads)
  _run(ref, fresh, grads)
  assert _same(_snapshot(opt, ps), _snapshot(ref, fresh))


@pytest.mark.parametrize("name", FOLLOWING)
@pytest.mark.parametrize("model_first", [True, False], ids=["model-first", "optimizer-first"])
def test_resume_is_exact_in_either_load_order(name, model_first):
  """Resuming loads the model and the optimizer; in either order the run
  equals the uninterrupted one bit for bit (a buffer that still belongs to
  its param is kept)."""
  ps = _params(torch.bfloat16)
  opt = OPTIMIZERS[name](ps)
  grads = _grads(8)
  _run(opt, ps, grads[:4])
  ckpt = copy.deepcopy({"model": [p.detach() for p in ps], "opt": opt.state_dict()})
  _run(opt, ps, grads[4:])
  again = _params(torch.bfloat16, seed=11)
  other = OPTIMIZERS[name](again)
  _run(other, again, _grads(2, seed=12))  # some other history, overwritten by the load
  if model_first:
    _write(again, ckpt["model"], "copy_")
    other.load_state_dict(ckpt["opt"])
  else:
    other.load_state_dict(ckpt["opt"])
    _write(again, ckpt["model"], "copy_")
  _run(other, again, grads[4:])
  assert _same(_snapshot(opt, ps), _snapshot(other, again))


def test_master_follows_writes_no_version_counter_sees_kernel_and_eager_alike():
  """``p.data`` writes bump no version counter; the step's own compare (the
  master must round to the param) takes them up, in the native kernel
  (fused=None on CPU) and the eager step (fused=False) with the same bits."""
  out = {}
  for fused in (None, False):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(300, dtype=torch.float32).to(torch.bfloat16))
    opt = tb.adam_fp32_master([p], lr=1e-3, fused=fused)
    grads = [torch.randn(300).to(torch.bfloat16) * 0.1 for _ in range(4)]
    for t, g in enumerate(grads):
      if t == 2:
        version = p._version
        p.data[::3] = p.data[::3] * 3 + 1
        assert p._version == version
        loaded = p.detach().clone()
      p.grad = g
      opt.step()
    gap = (p.detach().float() - loaded.float()).abs()
    assert gap.max() < 0.05, gap.max()
    out[fused] = (p.detach().view(torch.int16).clone(), opt.state[p]["master"].clone())
  assert torch.equal(out[None][0], out[False][0])
  assert torch.equal(out[None][1].view(torch.int32), out[False][1].view(torch.int32))


# ---------------------------------------------------------------------------
# master_weights' batched step (foreach): the per-param step's values, with
# host work that does not grow with the number of params.
# ---------------------------------------------------------------------------


def _mixed_model(gen, n: int) -> list:
  """``n`` 16-bit params (bf16 and fp16), an fp32 one, and a frozen one."""
  ps = [torch.nn.Parameter((torch.randn(40 + 7 * k, generator=gen) * 0.02).to(
      torch.float16 if k % 3 == 2 else torch.bfloat16)) for k in range(n)]
  ps.insert(2, torch.nn.Parameter(torch.randn(9, generator=gen)))
  ps.append(torch.nn.Parameter(torch.randn(5, generator=gen).to(torch.bfloat16),
                               requires_grad=False))
  return ps


BATCHED = {
    "master_weights": tb.master_weights,
    "master_weights split": lambda o, foreach: tb.master_weights(o, split=True, foreach=foreach),
    "kahan_summation": tb.kahan_summation,
    "round_to_nearest": tb.round_to_nearest,
    "stochastic_rounding": lambda o, foreach: tb.stochastic_rounding(o, key=5, foreach=foreach),
}


_BATCHED_CASES = [(w, i, c) for w in BATCHED for i in (
    "AdamW", "AdamW fused", "scaled_adam", "scaled_adam skip_nonfinite", "SGD momentum")
    for c in (None, 100)]
# make test: each wrapper in many chunks under the fused step, and in one chunk under an
# inner step of all params at once; every case in make test-slow.
_BATCHED_DEFAULT = [(w, i, c) for w in BATCHED
                    for i, c in (("AdamW fused", 100), ("scaled_adam skip_nonfinite", None))]


@pytest.mark.parametrize("wrapper, inner, chunk",
                         default_or_slow(_BATCHED_CASES, _BATCHED_DEFAULT))
def test_batched_wrapper_step_equals_the_per_param_step(wrapper, inner, chunk, monkeypatch):
  """``foreach=True`` against ``foreach=False``, bit for bit in params,
  buffers and the inner state: bf16, fp16 and fp32 params and a frozen one,
  in one chunk and in many (``CHUNK_NUMEL`` 100: a wide param hides its
  gradient outside its chunk; flat reads and writes in blocks of 37),
  ``main_grad`` on some steps, gradients set to None between steps, weights
  written from outside twice (the next step follows them param by param), a
  state dict loaded midway, an infinite gradient, and inner optimizers that
  step all params together."""
  from torch_bridge import wrappers  # noqa: PLC0415
  if chunk:  # and the flat reads and writes in blocks of 37 elements
    monkeypatch.setattr(wrappers, "CHUNK_NUMEL", chunk)
    monkeypatch.setattr(wrappers, "_BLOCK", 37)
  make = {"AdamW": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1),
          "AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=3e-3, fused=True),
          "scaled_adam": lambda ps: tb.scaled_adam(ps, clipping_scale=2.0),
          "scaled_adam skip_nonfinite": lambda ps: tb.scaled_adam(ps, skip_nonfinite=True),
          "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)}[inner]
  runs = []
  for foreach in (True, False):
    gen = torch.Generator().manual_seed(0)
    ps = _mixed_model(gen, 7)
    opt = BATCHED[wrapper](make(ps), foreach=foreach)
    saved, batched = None, []
    for step in range(7):
      for k, p in enumerate(ps):
        if p.requires_grad:
          g = torch.randn(p.shape, generator=gen) * 0.05
          if step == 3 and k % 2:
            p.main_grad = g  # fp32, as accumulate_in_fp32 keeps it
          else:
            p.grad = g.to(p.dtype)
      if step == 5:
        ps[0].grad[1] = float("inf")  # skipped by skip_nonfinite, NaN masters elsewhere
      opt.step()
      if "_batched" in opt.__dict__:
        batched.append(step)
      for p in ps:
        p.main_grad = None
      if step == 1:
        opt.zero_grad()
      if step == 2:
        with torch.no_grad():
          ps[4].mul_(0.5)  # an outside write
        saved = copy.deepcopy(opt.state_dict())
      if step == 4:
        opt.load_state_dict(saved)
      if step == 5:
        with torch.no_grad():
          ps[1].add_(0.25)  # and one the batched step must see (nothing else changed)
    runs.append((ps, opt))
    # The steps after an outside write follow it param by param.
    assert batched == ([0, 1, 2, 4, 5] if foreach else []), batched
  assert _same(_snapshot(runs[0][1], runs[0][0]), _snapshot(runs[1][1], runs[1][0]))


def _host_step_of(wrapper: str, n: int) -> tuple:
  """Python calls in torch_bridge and torch ops of one batched step of
  ``BATCHED[wrapper](AdamW(fused=True))`` over ``n`` bf16 params (after a
  first step, which makes the plan), with fresh gradients as
  ``zero_grad(set_to_none=True)`` and a backward make."""
  gen = torch.Generator().manual_seed(0)
  ps = [torch.nn.Parameter(torch.randn(64 + k, generator=gen).to(torch.bfloat16))
        for k in range(n)]
  opt = BATCHED[wrapper](torch.optim.AdamW(ps, lr=1e-3, fused=True), foreach=True)
  for step in range(2):
    for p in ps:
      p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
    if step == 0:
      opt.step()
  work = host_work(opt.step)
  assert "_batched" in opt.__dict__
  return work


@pytest.mark.parametrize("wrapper, copies", [("master_weights", 2), ("kahan_summation", 7),
                                             ("master_weights split", 7),
                                             ("round_to_nearest", 4),
                                             ("stochastic_rounding", 4)])
def test_batched_wrapper_host_step_is_the_same_for_any_number_of_params(wrapper, copies):
  """A batched step makes the same Python calls in torch_bridge and the same
  torch ops at 8 and 40 params, and reads no scalar: ``_foreach_copy_``
  calls (gradients in; a master's rounding out, or the params and buffers
  gathered before the step and after it and scattered back), the
  compensation's flat read and write, and the wrapped ``AdamW(fused=True)``
  (one fused op and its step counts). The per-param step makes about 26
  Python calls a param (``master_weights``), 49 (``kahan_summation``)."""
  (calls8, ops8), (calls40, ops40) = (_host_step_of(wrapper, n) for n in (8, 40))
  assert calls8 == calls40 and sum(calls8.values()) < 80, (calls8, calls40)
  assert ops8 == ops40, (ops8, ops40)
  assert ops8["aten._foreach_copy_.default"] == copies, ops8
  assert ops8["aten._fused_adamw_.default"] == 1, ops8
  assert not [op for op in ops8 if "local_scalar" in op or "item" in op], ops8


class _RebindingSGD(torch.optim.Optimizer):
  """SGD as some older optimizers write it: ``p.data`` rebound, not updated in place."""

  def __init__(self, params, lr):
    super().__init__(params, dict(lr=lr))

  @torch.no_grad()
  def step(self, closure=None):
    for group in self.param_groups:
      for p in group["params"]:
        if p.grad is not None:
          p.data = p.data - group["lr"] * p.grad


@pytest.mark.parametrize("case", ["rebinding inner", "fp8 params", "transposed param",
                                  "transposed gradient", "buffer replaced", "int step"])
@pytest.mark.parametrize("wrapper", list(BATCHED))
def test_batched_wrapper_edge_cases_equal_the_per_param_step(wrapper, case):
  """Where the batched step does not apply, or must notice a change, it gives the
  per-param step's bits: an inner optimizer that rebinds ``p.data``; fp8 params
  (the flat gathers take 16-bit ones); a transposed param under an inner step
  with reductions (ScaledAdam: the stand-in keeps the param's strides); a
  transposed gradient into ``AdamW(fused=True)`` (widened into the stand-in's
  layout, as its fused kernel reads both flat); a buffer or step count replaced
  between steps; a Python int as a step count."""
  make_inner = {"rebinding inner": lambda ps: _RebindingSGD(ps, 0.5),
                "transposed param": lambda ps: tb.scaled_adam(ps, clipping_scale=2.0),
                }.get(case, lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True))
  dtype = torch.float8_e4m3fn if case == "fp8 params" else torch.bfloat16
  if case == "fp8 params" and wrapper == "stochastic_rounding":
    for foreach in (True, False):  # refused alike, with the rounding's own error
      p = torch.nn.Parameter(torch.ones(8).to(dtype))
      opt = BATCHED[wrapper](torch.optim.SGD([p], lr=0.1), foreach=foreach)
      p.main_grad = torch.ones(8)
      with pytest.raises(ValueError, match="rounds to bfloat16 or float16"):
        opt.step()
    return

  def snapshot(opt, ps):  # every param and state value as bytes (fp8 and int counts too)
    values = list(ps) + [v for o in (opt, opt.inner) for st in o.state.values()
                         for _, v in sorted(st.items())]
    return [torch.as_tensor(v).detach().contiguous().reshape(-1).view(torch.uint8)
            for v in values if torch.is_tensor(v) or isinstance(v, int)]
  runs = []
  for foreach in (True, False):
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.5).to(dtype))
          for s in ((12, 8), (30,), (5, 6))]
    if case == "int step":  # and a wide param, whose count is taken up too
      ps.append(torch.nn.Parameter(torch.randn(7, generator=gen)))
    if case == "transposed param":
      ps[0] = torch.nn.Parameter(ps[0].detach().t())
    opt = BATCHED[wrapper](make_inner(ps), foreach=foreach)
    for step in range(4):
      for p in ps:
        g = torch.randn(p.shape, generator=gen)
        if case == "fp8 params":
          p.main_grad = g  # fp8 params take fp32 gradients (accumulate_in_fp32)
        else:
          p.grad = (g.t().contiguous().t() if case == "transposed gradient" and p.dim() == 2
                    else g).to(p.dtype)
      opt.step()
      for p in ps:
        state = opt.state.get(p, {})
        if case == "buffer replaced" and step == 1:
          for name in ("compensation", "master"):
            if name in state:
              state[name] = state[name].clone()
        if case in ("buffer replaced", "int step") and "step" in state and step == 1:
          state["step"] = int(state["step"]) if case == "int step" else state["step"].clone()
    runs.append(snapshot(opt, ps))
  assert _same(*runs)


def test_a_gradient_of_another_shape_is_refused_by_both_steps():
  """A ``main_grad`` of another shape (broadcastable) is an error in both steps."""
  for foreach in (True, False):
    p = torch.nn.Parameter(torch.ones(4, 5, dtype=torch.bfloat16))
    opt = tb.kahan_summation(torch.optim.SGD([p], lr=0.1), foreach=foreach)
    p.main_grad = torch.ones(5)
    with pytest.raises(RuntimeError, match=r"param 0 is \[4, 5\] but its gradient \(main_grad\)"):
      opt.step()
    assert torch.equal(p, torch.ones(4, 5, dtype=torch.bfloat16))
