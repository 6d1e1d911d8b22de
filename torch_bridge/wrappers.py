"""Low-precision wrappers around any ``torch.optim`` optimizer.

The torch twins of ``optax_half/wrappers.py``. A wrapper takes a constructed
optimizer over 16-bit params and returns a ``torch.optim.Optimizer`` whose
``param_groups`` are the wrapped optimizer's own group dicts, holding the
model params: ``zero_grad``, ``add_param_group`` and LR schedulers work on
either object, and a scheduler attached to the wrapped optimizer before
wrapping keeps working. Inside ``step``, the wrapped optimizer runs on fp32
tensors ``x`` that stand in for the 16-bit params, with fp32 gradients:

==============================  =========================  ====================
wrapper                         persistent buffer / param   ``x`` the inner sees
==============================  =========================  ====================
``master_weights``              fp32 master                 the master
``master_weights(split=True)``  int16 low half (bf16)       ``join(p, lo)``
``kahan_summation``             compensation, param dtype   ``p + c``
``stochastic_rounding``         none (a step counter)       ``p``
``round_to_nearest``            none                        ``p``
==============================  =========================  ====================

The wrapped optimizer's ``state`` is keyed by the stand-ins; its groups
list them in place of the model params only while the wrapper calls it
(``step``, ``state_dict``, ``load_state_dict``, see ``stand_ins``), so save
and load through the wrapper. Except for ``master_weights``, ``x`` exists
only during ``step``: its storage
is filled before the wrapped optimizer steps and released after, chunk by
chunk (at most ``CHUNK_NUMEL`` elements of fp32 ``x`` and gradient at a time),
so no fp32 copy of the model is kept between steps (the batched step,
``foreach``, keeps one chunk's buffers). Params of 32 bits or more
(or as wide as ``master_dtype``) are handed to the wrapped optimizer as they
are. Spec: ``docs/algorithms.md#wrappers``.

``foreach`` (every wrapper; None: where every stepping param is on CUDA)
steps all params at once
(``_Batched``): a few ``torch._foreach_copy_`` calls and flat ops a chunk,
host work that does not grow with the number of params, the same values.

The wrapped optimizer is stepped once per chunk, so it must treat params
independently (Adam, AdamW, SGD, RMSprop, ... do; LBFGS does not), or say
otherwise with a true ``steps_all_params_together`` attribute (ScaledAdam
does: its clipping norm spans all params), which makes one chunk of all
params, at the cost of fp32 ``x`` for the whole model during ``step``. An
inner optimizer built with ``skip_nonfinite=True`` is stepped in one chunk
too, so that one bad gradient skips the whole step.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import numpy as np
import torch

from torch_bridge import _dist, rounding
from torch_bridge._optim import (_LOADED, LowPrecisionOptimizer, check_param, grad_of,
                                 optimizer_kind, prepare_load, seed_from_key, step_count,
                                 step_grad, stepping_params)
from torch_bridge.compensation import COMPENSATIONS, Compensation

__all__ = ["master_weights", "kahan_summation", "stochastic_rounding", "round_to_nearest",
           "LowPrecisionWrapper", "CHUNK_NUMEL"]

CHUNK_NUMEL = 1 << 24  # fp32 elements materialised per chunk (64 MiB of x + 64 MiB of grads)
_BLOCK = 1 << 18  # elements a batched read or write takes at a time on the CPU (_Group)



class LowPrecisionWrapper(LowPrecisionOptimizer):
  """A ``torch.optim.Optimizer`` that runs ``inner`` on fp32 views of 16-bit params.

  Built by ``master_weights``, ``kahan_summation``, ``stochastic_rounding``
  and ``round_to_nearest``; ``inner`` is the wrapped optimizer, which shares
  its param groups with the wrapper. ``state_dict()`` holds this wrapper's
  buffers, the param groups and ``"inner"``: the wrapped optimizer's
  ``state_dict()`` without its groups (they are the wrapper's, saved once).

  Example:
    >>> import torch, torch_bridge as tb
    >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    >>> opt = tb.master_weights(torch.optim.SGD([p], lr=1e-3))
    >>> opt.param_groups is opt.inner.param_groups
    True

  References:
    Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_,
    ICLR 2018 (master weights); Kahan, `Further remarks on reducing truncation
    errors <https://doi.org/10.1145/363707.363723>`_, CACM 1965 (compensated sums).
  """

  def __init__(self, inner: torch.optim.Optimizer, compensation: Compensation,
               master_dtype: torch.dtype = torch.float32, seed: int = 0,
               foreach: Optional[bool] = None):
    if not isinstance(inner, torch.optim.Optimizer):
      raise TypeError(
          "the wrappers take a constructed torch.optim.Optimizer (e.g. "
          f"torch.optim.Adam(model.parameters())); got {type(inner).__name__}.")
    # Nested low precision is refused where the outer work dtype is 32-bit (the
    # inner would only see fp32 params); bf16 masters of fp8 params may be
    # kept by an inner wrapper.
    nested = _keeps_low_precision(inner) if master_dtype.itemsize >= 4 else ""
    if nested:
      raise ValueError(
          f"{compensation.wrapper}: the inner optimizer already keeps low-precision params "
          f"(it is {nested}: adamw_bf16, adam_fp32_master and the wrappers do). "
          f"Wrap a plain optimizer once, e.g. {compensation.wrapper}(torch.optim.Adam(...)), "
          "or use the named optimizer alone.")
    self.inner = inner
    self._compensation = compensation
    self._master_dtype = master_dtype
    self._seed = seed
    self._foreach = foreach  # _Batched: None on CUDA, True everywhere, False never
    self._work: dict = {}  # model param -> the tensor the inner optimizer steps
    self._adopted: dict = {}  # model param -> (dtype, shape) when it was taken up
    # The inner optimizer's groups (and defaults) are the wrapper's: add_param_group
    # below adopts each of them instead of copying it.
    super().__init__(inner.param_groups, inner.defaults)

  # -- construction ----------------------------------------------------------

  def add_param_group(self, param_group: dict) -> None:
    """Adds a group to the wrapped optimizer (which checks it) and keeps its params.

    Progressive unfreezing works as with any torch optimizer; a group added to
    the wrapped optimizer directly is taken up at the next step.
    """
    if not any(param_group is g for g in self.inner.param_groups):  # a new group
      self.inner.add_param_group(param_group)
      try:
        self._adopt_all()
      except Exception:  # a refused param: the group goes back out
        self.inner.param_groups.pop()
        raise
    self.param_groups = self.inner.param_groups
    self._adopt_all()

  def _adopt_all(self) -> None:
    """Makes the buffers and the stand-in of every param that has none yet,
    and again for one whose dtype or shape changed since (``_readopt``)."""
    position = 0
    for group in self.param_groups:
      for p in group["params"]:
        if p not in self._work:
          check_param(p, position)
          self._adopt(p)
        elif self._adopted.get(p, (p.dtype, p.shape)) != (p.dtype, p.shape):
          check_param(p, position)
          self._readopt(p, position)
        position += 1

  @torch.no_grad()
  def _readopt(self, p: torch.Tensor, position: int) -> None:
    """``p`` changed dtype or shape (``model.to(dtype)``) after it was taken
    up: taken up afresh if nothing was stepped or loaded for it since, as if
    the wrapper were built now; else an error (its buffers and the wrapped
    optimizer's state belong to the old dtype)."""
    work = self._work[p]
    dtype, shape = self._adopted[p]
    step = self.state.get(p, {}).get("step")
    held = (self.inner.state.get(work) or self.inner.state.get(p)
            or (step is not None and int(step) > 0))
    if held or isinstance(self.inner, LowPrecisionWrapper):
      raise ValueError(
          f"param {position} is {p.dtype}{list(p.shape)}, but {self._compensation.wrapper} "
          f"took it up as {dtype}{list(shape)} and holds state made for that (its buffers "
          "and the wrapped optimizer's): the param's dtype or shape changed after its "
          "state was made (e.g. model.to(dtype) after a step or a load_state_dict). Build "
          f"the optimizer and the wrapper after model.to(dtype), or load a state dict saved "
          f"for {p.dtype} params.")
    del self._work[p], self._adopted[p]
    self.state.pop(p, None)
    self._marks.pop(p, None)
    self.inner.state.pop(work, None)
    self._adopt(p)

  def _takes_fp32_grad(self, p: torch.Tensor) -> bool:
    """Params it widens get their gradient in fp32 (``step_grad``); the others
    go to the inner optimizer with ``p.grad`` as it is."""
    return self._is_low(p)

  def _is_low(self, p: torch.Tensor) -> bool:
    return p.dtype.itemsize < self._master_dtype.itemsize

  def _param_compensation(self, p: torch.Tensor) -> Compensation:
    return self._compensation.for_dtype(p.dtype)

  @torch.no_grad()
  def _adopt(self, p: torch.Tensor) -> None:
    """The buffers of ``p``, its stand-in, and the inner state moved to the stand-in."""
    if self._compensation.draws_bits:  # the random bits' step count
      self.state[p]["step"] = torch.tensor(0, dtype=torch.int64)
    self._adopted[p] = (p.dtype, p.shape)
    if not self._is_low(p):
      self._work[p] = p
      return
    compensation = self._param_compensation(p)
    buffer = compensation.init_buffer(p, self._master_dtype)
    if buffer is not None:
      self.state[p][compensation.buffer] = buffer
    # A buffer that holds the value (the master) is what the inner optimizer
    # steps; the others fill a stand-in.
    work = buffer if compensation.holds_value else self._empty(p)
    # State the inner optimizer already holds for p moves to the stand-in.
    moved = self.inner.state.pop(p, None)
    if moved:
      self.inner.state[work] = {
          k: v.to(work.dtype) if (torch.is_tensor(v) and v.is_floating_point()
                                  and v.shape == p.shape) else v
          for k, v in moved.items()}
    if isinstance(self.inner, LowPrecisionWrapper):  # bf16 masters of fp8 params
      inner_work = self.inner._work.pop(p)
      self.inner._work[work] = work if inner_work is p else inner_work
      self.inner._adopted.pop(p, None)  # checked here: a stand-in's shape varies
      self.inner._marks.pop(p, None)
    self._work[p] = work
    self._remember([p])

  @staticmethod
  def _empty(p: torch.Tensor) -> torch.Tensor:
    """A stand-in with no elements yet. For a sharded param it is a DTensor laid
    out like the param (so the inner optimizer's state made from it is sharded
    the same way) whose local tensor is filled during each step only."""
    return _dist.like(torch.empty(0, dtype=torch.float32, device=_dist.local(p).device), p)

  @staticmethod
  def _fill(work: torch.Tensor, x) -> None:
    """Points a stand-in at ``x`` (local values), or at nothing (``x=None``)."""
    if x is None:
      x = torch.empty(0, dtype=work.dtype, device=_dist.local(work).device)
    # A DTensor keeps its layout; its local tensor (the same object while
    # grad is off, as in step) takes the storage.
    _dist.local(work).data = x

  @contextlib.contextmanager
  def stand_ins(self):
    """The wrapped optimizer's groups list the stand-ins (which its state is
    keyed by) in place of the model params, for as long as this lasts: call
    ``inner`` inside it (``convert`` does). Groups the call replaces (torch's
    ``load_state_dict`` does) are mapped back too."""
    self._adopt_all()
    back = {}
    for group in self.inner.param_groups:
      works = [self._work.get(p, p) for p in group["params"]]
      back.update({id(w): p for w, p in zip(works, group["params"])})
      group["params"] = works
    try:
      yield self.inner
    finally:
      for group in self.inner.param_groups:
        group["params"] = [back.get(id(w), w) for w in group["params"]]
      self.param_groups = self.inner.param_groups

  # -- checkpoints -----------------------------------------------------------

  def _kind(self) -> str:
    # The mode's buffers are checked by their keys and dtypes; the kind names
    # the wrapped optimizer, whose own load_state_dict may check little.
    return f"LowPrecisionWrapper({optimizer_kind(self.inner)})"

  def _extra_state(self) -> dict:
    # The groups are the wrapper's (one list, shared): saved once, at the top, as
    # torch.optim saves them.
    with self.stand_ins() as inner:
      saved = inner.state_dict()
    saved.pop("param_groups")
    return {"inner": saved, "seed": self._seed}

  def _load(self, state_dict: dict) -> None:
    self.__dict__.pop("_batched", None)
    # Check ours, load the inner optimizer's (it checks its own first), then ours:
    # a mismatch anywhere leaves both untouched.
    load = prepare_load(self, {k: state_dict[k] for k in ("state", "param_groups")})
    inner_state = dict(state_dict["inner"])
    inner_state.setdefault("param_groups", state_dict["param_groups"])
    with self.stand_ins() as inner:
      inner.load_state_dict(inner_state)
    load()
    self._seed = int(state_dict.get("seed", self._seed))

  # -- the step --------------------------------------------------------------

  def _step_all(self) -> None:
    self._adopt_all()  # groups added to the inner optimizer directly
    # The last step's batched plan, while it fits; else a new one where one applies.
    batched = self.__dict__.pop("_batched", None)
    if batched is None or not batched.step(self):
      batched = _Batched.of(self)
      if batched is not None and not batched.step(self):
        raise AssertionError("a new batched plan does not fit its optimizer")
    if batched is not None:
      self._batched = batched
      return
    todo = stepping_params(self)  # (leaf position, param)
    # Wide params carry their own grads: hide them outside their chunk.
    hidden = {p: p.grad for _, p in todo if self._work[p] is p}
    for p in hidden:
      p.grad = None
    try:
      for chunk in _chunks(todo, self.inner):
        self._step_chunk(chunk, hidden)
    finally:
      for p, g in hidden.items():
        p.grad = g

  def _step_chunk(self, chunk, hidden) -> None:
    for leaf, p in chunk:
      work = self._work[p]
      if work is p:
        p.grad = hidden[p]
        continue
      compensation = self._param_compensation(p)
      buffer = self.state.get(p, {}).get(compensation.buffer)
      if compensation.follows:  # written from outside since the last step: re-seed
        self._follow(p, compensation, buffer)
      if not compensation.holds_value:  # a sharded param reads its shard
        self._fill(work, compensation.read(_dist.local(p), _dist.local(buffer)))
      # Widened into the stand-in's layout: a fused inner step (AdamW(fused=True)) reads
      # param and gradient memory alike, so a transposed gradient must not keep its strides.
      local, g = _dist.local(work), _dist.local(step_grad(self, p))
      if g.shape != local.shape:  # copy_ below would broadcast it
        which = "main_grad" if getattr(p, "main_grad", None) is not None else "grad"
        raise RuntimeError(f"param {leaf} is {list(local.shape)} but its gradient ({which}) "
                           f"is {list(g.shape)}: a gradient has its param's shape.")
      grad = torch.empty_like(local)
      grad.copy_(rounding.widen(g))
      work.grad = _dist.like(grad, p)
    with self.stand_ins() as inner:
      inner.step()
    for leaf, p in chunk:
      work = self._work[p]
      if work is p:
        p.grad = None
      else:
        work.grad = None
        compensation = self._param_compensation(p)
        state = self.state.get(p, {})
        bits = None
        if compensation.draws_bits:
          bits = rounding.random_bits(self._seed, int(state["step"]), rounding.STREAM_PARAMS,
                                      leaf, _dist.local(work).shape,
                                      device=_dist.local(work).device, index=_dist.index(p))
        # On local tensors: a sharded param writes its shard. A master was
        # stepped in place by the inner optimizer.
        buffer = None if compensation.holds_value else _dist.local(state.get(compensation.buffer))
        compensation.write(_dist.local(work.detach()), _dist.local(p), buffer, bits)
        if not compensation.holds_value:
          self._fill(work, None)
        self._remember([p])
      if "step" in self.state.get(p, ()):
        self.state[p]["step"] += 1


class _Batched:
  """A wrapper's step over all params at once: the per-param step's values
  (``_step_chunk``), with Python work per step that does not grow with the
  number of params (docs/algorithms.md#pytorch-mirror, "Batched wrappers").

  Per chunk, one ``torch._foreach_copy_`` widens the gradients into views of
  a scratch buffer of the master dtype, which are the stand-ins' gradients
  while the wrapped optimizer steps. A master (``holds_value``) is stepped in
  place and one more ``_foreach_copy_`` writes its rounding into the params.
  The other compensations (kahan, split, stochastic, none) gather each
  dtype's params and buffers into flat views, run the compensation's own
  ``read`` and ``write`` on those (elementwise, so each param's values are
  the per-param step's; stochastic rounding's bits from the step's keys of
  all params, ``rounding.leaf_keys``), the stand-ins viewing a second
  scratch buffer ``x``, and scatter the results back: two scratch buffers
  of a chunk (at most ``CHUNK_NUMEL`` elements or the largest param), kept
  between steps, as the per-param step makes them in each; the gathers
  reuse the gradients' buffer, which is free when they run.

  It applies where ``foreach`` says (None: every stepping param on CUDA) to
  a plain wrapped optimizer, dense local params, and no gradients handed
  over by a loss scaler. The plan is kept while the params, their
  gradients' presence and dtypes and the stand-ins are the same; a param
  written from outside (its mark moved) takes the per-param step, which
  follows the write, and the plan is made again after it.
  """

  def __init__(self, key: tuple, lows: list, chunks: list, scratch: tuple, counted: list):
    self.key = key
    self.counted = counted  # the params whose step count advances (stochastic_rounding)
    self.lows = lows  # the 16-bit params stepped, whose marks each step checks
    self.chunks = chunks  # (groups, wide params); a group: _Group
    self.scratch = scratch  # (gradients, x): the buffers the views hold
    self.empty = torch.empty(0, dtype=scratch[0].dtype, device=scratch[0].device)

  @staticmethod
  def _key(opt) -> tuple:
    params = opt._all_params()
    # grad_of's choice (main_grad, else grad), without a call per param.
    grads = [p.grad if m is None else m
             for p, m in zip(params, [getattr(p, "main_grad", None) for p in params])]
    state = opt.state
    return ([id(p) for p in params], [id(opt._work.get(p)) for p in params],
            [None if g is None else (g.dtype, g.layout, g.device, g.shape) for g in grads],
            # the buffers and step counts, as objects (one replaced: a new plan)
            [tuple(map(id, state[p].values())) if p in state else () for p in params],
            [len(g["params"]) for g in opt.param_groups], opt._foreach,
            bool(opt._unscaled_grads), _together(opt.inner)), params, grads

  @classmethod
  def of(cls, opt) -> Optional["_Batched"]:
    """The plan of ``opt``'s step, or None where the per-param step runs."""
    if (opt._foreach is False or isinstance(opt.inner, LowPrecisionWrapper)
        or opt._unscaled_grads):
      return None
    first = next((p for g in opt.param_groups for p in g["params"]), None)
    if opt._foreach is None and not (first is not None and first.is_cuda):
      return None  # the default off CUDA, decided before any work per param
    todo = stepping_params(opt)  # checks each gradient, as the per-param step does
    if len(set(map(id, opt._all_params()))) != len(opt._all_params()) or not todo:
      return None
    for _, p in todo:
      if _dist.is_dtensor(p) or p.is_complex() or (opt._foreach is None and not p.is_cuda):
        return None
      if not opt._is_low(p):
        continue
      if (grad_of(p).shape != p.shape  # the per-param step refuses it as .grad
          or not p.is_contiguous()  # the stand-ins and gradients keep a param's strides
          or (p.element_size() != 2 and not opt._param_compensation(p).holds_value)):
        return None  # (the flat gathers take 16-bit params)
      if opt._marks.get(p) not in (_LOADED, (p._version, p.data_ptr())):
        return None  # written from outside: the per-param step follows it
    counted = [p for _, p in todo if "step" in opt.state.get(p, ())]  # the random bits' counts
    for p in counted:  # tensors, which the step advances in place (before the key reads them)
      step_count(opt.state[p])
    key, params, grads = cls._key(opt)
    spans = [[p for _, p in chunk] for chunk in _chunks(todo, opt.inner)]
    leaf_of = {id(p): leaf for leaf, p in todo}
    lows = [p for _, p in todo if opt._is_low(p)]
    size = max(sum(p.numel() for p in s if opt._is_low(p)) for s in spans)
    device = lows[0].device if lows else todo[0][1].device
    holds = [opt._param_compensation(p).holds_value for p in lows]
    grads_buf = torch.empty(size, dtype=opt._master_dtype, device=device)
    x_buf = torch.empty(size if not all(holds) else 0, dtype=opt._master_dtype, device=device)
    chunks = []
    for span in spans:
      low = [p for p in span if opt._is_low(p)]
      kinds: dict = {}  # (dtype, compensation) -> params, in order
      for p in low:
        kinds.setdefault((p.dtype, opt._param_compensation(p)), []).append(p)
      groups, offset = [], 0
      for (dtype, compensation), members in kinds.items():
        groups.append(_Group(opt, compensation, members, [leaf_of[id(p)] for p in members],
                             grads_buf, x_buf, offset))
        offset += sum(p.numel() for p in members)
      chunks.append((groups, [p for p in span if not opt._is_low(p)]))
    return cls(key, lows, chunks, (grads_buf, x_buf), counted)

  def step(self, opt) -> bool:
    """One step of ``opt`` by this plan; False (nothing done) where it no
    longer fits: another key, or a stepped param written from outside since
    the last step (which ``_follow`` takes up, param by param)."""
    key, params, grads = self._key(opt)
    marks = opt._marks
    if key != self.key or not all(
        [marks.get(p) in (_LOADED, (p._version, p.data_ptr())) for p in self.lows]):
      return False
    grad_of_param = dict(zip(params, grads))
    wides = [p for chunk in self.chunks for p in chunk[1]]
    hidden = dict(zip(wides, [p.grad for p in wides]))  # a wide param steps in its chunk only
    for p in wides:
      p.grad = None
    try:
      for groups, wide in self.chunks:
        for group in groups:
          group.read()
        for group in groups:  # after every read: the gathers share the gradients' buffer
          group.take_grads(grad_of_param)
        for p in wide:
          p.grad = hidden[p]
        try:
          with opt.stand_ins() as inner:
            inner.step()
        finally:
          for group in groups:
            group.release(self.empty)
          for p in wide:
            p.grad = None
        for group in groups:
          group.write(opt)
          opt._marks.update(zip(group.params, [(p._version, p.data_ptr())
                                               for p in group.params]))
    finally:
      for p, g in hidden.items():
        p.grad = g
    if self.counted:
      torch._foreach_add_([opt.state[p]["step"] for p in self.counted], 1)
    return True


class _Group:
  """The params of one dtype and compensation in a chunk of ``_Batched``:
  their views into the scratch buffers (from ``offset``, in elements) and
  the compensation's read and write on them, flat."""

  def __init__(self, opt, compensation: Compensation, params: list, leaves: list,
               grads_buf: torch.Tensor, x_buf: torch.Tensor, offset: int):
    self.compensation = compensation
    self.params = params
    self.leaves = np.asarray(leaves, np.int64)
    self.works = [opt._work[p] for p in params]
    numel = sum(p.numel() for p in params)
    dtype = params[0].dtype

    def views(flat: torch.Tensor) -> list:
      out, start = [], 0
      for p in params:
        out.append(flat[start:start + p.numel()].view(p.shape))
        start += p.numel()
      return out
    self.grads = views(grads_buf[offset:offset + numel])
    self.bufs = self.p_flat = self.b_flat = None
    if compensation.holds_value:  # the stand-ins are the masters
      return
    self.x_flat = x_buf[offset:offset + numel]
    self.xs = views(self.x_flat)
    self.x_ptrs = [x.data_ptr() for x in self.xs]
    # The params and buffers gathered into the gradients' buffer, seen as 16-bit halves:
    # the params in its first half, the buffers in its second.
    halves = grads_buf.view(torch.int16)
    self.p_flat = halves[offset:offset + numel].view(dtype)
    self.p_views = views(self.p_flat)
    if compensation.buffer is not None:
      self.bufs = [opt.state[p][compensation.buffer] for p in params]
      start = grads_buf.numel() + offset
      self.b_flat = halves[start:start + numel].view(self.bufs[0].dtype)
      self.b_views = views(self.b_flat)
    # The flat read and write in blocks of _BLOCK elements on the CPU, each block's ops in
    # cache (as a small param's are in the per-param step), their temporaries never mapped
    # and faulted in afresh (glibc maps blocks over 32 MiB). Off the CPU (a caching
    # allocator, kernels that stream) the whole group is one block.
    device = self.p_flat.device
    block = _BLOCK if device.type == "cpu" else numel
    self.blocks = [(self.x_flat[a:a + block], self.p_flat[a:a + block],
                    None if self.b_flat is None else self.b_flat[a:a + block])
                   for a in range(0, numel, block)]
    self.draws = []
    if compensation.draws_bits:
      # Per block, to spread the step's per-param keys and each element's counter in its
      # param (random_bits' index) over the block: which params it holds, how many elements
      # of each, and where each starts in the group (the counters are made each step).
      sizes = np.array([p.numel() for p in params], np.int64)
      starts = np.concatenate([[0], np.cumsum(sizes)])
      for a in range(0, numel, block):
        b = min(a + block, numel)
        first, last = np.searchsorted(starts, a, "right") - 1, np.searchsorted(starts, b, "left")
        counts = np.minimum(starts[first + 1:last + 1], b) - np.maximum(starts[first:last], a)
        self.draws.append((torch.arange(first, last, device=device),
                           torch.from_numpy(counts).to(device),
                           torch.from_numpy(starts[first:last].astype(np.int32)).to(device), a))

  def _gather(self) -> None:
    torch._foreach_copy_(self.p_views, self.params)
    if self.bufs is not None:
      torch._foreach_copy_(self.b_views, self.bufs)

  def read(self) -> None:
    """The stand-ins take ``x = read(p, buffer)`` (not for a master: it is ``x``)."""
    if self.p_flat is None:
      return
    self._gather()
    for x, p, b in self.blocks:
      x.copy_(self.compensation.read(p, b))
    for w, x in zip(self.works, self.xs):
      w.data = x

  def take_grads(self, grad_of_param: dict) -> None:
    torch._foreach_copy_(self.grads, [grad_of_param[p] for p in self.params])
    for w, g in zip(self.works, self.grads):
      w.grad = g

  def release(self, empty: torch.Tensor) -> None:
    """The stand-ins let go of the gradients, and of ``x`` (a master keeps its value).
    A stand-in the wrapped optimizer rebound (``p.data = ...``) hands its value to ``x``."""
    for w in self.works:
      w.grad = None
    if self.p_flat is not None:
      if [w.data_ptr() for w in self.works] != self.x_ptrs:
        torch._foreach_copy_(self.xs, self.works)
      for w in self.works:
        w.data = empty

  def write(self, opt) -> None:
    """``write(x', p, buffer, bits)`` into the params and buffers."""
    if self.p_flat is None:
      torch._foreach_copy_(self.params, self.works)  # the master's rounding (_Master.write)
      return
    self._gather()
    keys = None
    if self.draws:  # random_bits' keys of this step, one host computation and one copy
      steps = torch.stack([opt.state[p]["step"] for p in self.params]).numpy()
      keys = torch.from_numpy(rounding.leaf_keys(opt._seed, steps, rounding.STREAM_PARAMS,
                                                 self.leaves))
      if self.p_flat.device.type != "cpu":
        keys = keys.pin_memory().to(self.p_flat.device, non_blocking=True)
    for k, (x, p, b) in enumerate(self.blocks):
      bits = None
      if keys is not None:
        which, counts, starts, a = self.draws[k]
        n = x.numel()
        spread = keys.index_select(0, which).repeat_interleave(counts, output_size=n)
        counters = (torch.arange(a, a + n, dtype=torch.int32, device=x.device)
                    - starts.repeat_interleave(counts, output_size=n))
        bits = rounding.bits_from_key(spread, x.shape, x.device, index=counters)
      self.compensation.write(x, p, b, bits)
    torch._foreach_copy_(self.params, self.p_views)
    if self.bufs is not None:
      torch._foreach_copy_(self.bufs, self.b_views)


def _together(inner) -> bool:
  """Whether ``inner`` is stepped on all params at once (one chunk): it couples
  its params (ScaledAdam's clipping norm), or skips a whole step on any
  non-finite gradient."""
  return bool(getattr(inner, "steps_all_params_together", False)
              or getattr(inner, "_skip_nonfinite", False))


def _chunks(todo: list, inner) -> list:
  """``todo``'s ``(position, param)`` items in the chunks the wrapped optimizer
  steps: consecutive, each ending once it reaches ``CHUNK_NUMEL`` elements
  (one chunk where ``_together``)."""
  limit = math.inf if _together(inner) else CHUNK_NUMEL
  chunks, chunk, numel = [], [], 0
  for item in todo:
    chunk.append(item)
    numel += item[1].numel()
    if numel >= limit:
      chunks.append(chunk)
      chunk, numel = [], 0
  return chunks + [chunk] if chunk else chunks


def _check_foreach(foreach) -> None:
  if foreach not in (None, True, False):
    raise TypeError(f"foreach must be None, True or False; got {foreach!r}.")


def _keeps_low_precision(inner) -> str:
  """What ``optax_half.wrappers._check_not_nested`` finds in a JAX inner state:
  a wrapper or a compensating named optimizer, named; or ''."""
  from torch_bridge import adam  # noqa: PLC0415 (adam imports nothing from here)
  if isinstance(inner, LowPrecisionWrapper):
    return f"a {inner._compensation.wrapper} wrapper"
  if isinstance(inner, adam.LowPrecisionAdamW) and inner._compensation.name == "master":
    return "adam_fp32_master"
  if isinstance(inner, adam.LowPrecisionAdamW) and (
      inner._compensation.name != "none" or inner._factory == "adamw_bf16"):
    # adamw_bf16(compensation="none") is round_to_nearest of the core in JAX;
    # only the bare core, scale_by_adamw, is meant to be wrapped.
    return f"adamw_bf16(compensation={inner._compensation.name!r})"
  return ""


def master_weights(optimizer: torch.optim.Optimizer, master_dtype=torch.float32,
                   split: bool = False, *, foreach: Optional[bool] = None
                   ) -> LowPrecisionWrapper:
  """Keeps a ``master_dtype`` master copy of every narrower param.

  The wrapped optimizer's param lists are switched to the masters (state it
  already holds moves with them); each step copies the 16-bit grads into fp32
  master grads, steps it, and writes ``master.to(param.dtype)`` back into the
  model params. With ``split=True`` (fp32 master, bf16 params) the master is
  stored as the bf16 param plus an int16 low half (``rounding.split_f32``),
  exact at 2 bytes/param; it is rebuilt during ``step`` only. Weights
  loaded into the model after wrapping are taken up at the next step
  (``docs/algorithms.md#pytorch-mirror``, "Params written from outside").
  ``foreach`` (``torch.optim``'s switch, as in ``kahan_summation`` and
  ``round_to_nearest``): True steps all params at once (``_Batched``: a few
  ``torch._foreach_copy_`` calls a step, host work that does not grow with
  the number of params), False param by param; None, the default, batches
  where every stepping param is on CUDA. Both give the same values; the
  batched step keeps its scratch buffers (a chunk of fp32 gradients, and of
  ``x`` with ``split``) between steps.

  Example:
    >>> import torch, torch_bridge as tb
    >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    >>> opt = tb.master_weights(torch.optim.SGD([p], lr=1e-4))
    >>> p.grad = torch.ones_like(p)
    >>> opt.step()  # the update is below half a ULP of p: only the master moves
    >>> p[0].item(), opt.state[p]["master"][0].item()
    (1.0, 0.9998999834060669)

  References:
    Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_,
    ICLR 2018; NVIDIA NeMo's ``MainParamsOptimizerWrapper``.
  """
  if not (isinstance(master_dtype, torch.dtype) and master_dtype.is_floating_point):
    raise ValueError(f"master_dtype must be a torch float dtype; got {master_dtype!r}.")
  _check_foreach(foreach)
  if split and master_dtype != torch.float32:
    raise ValueError(
        "master_weights(split=True) stores an fp32 master as a bf16 high half plus "
        f"int16 low half; it needs master_dtype=torch.float32, got {master_dtype}.")
  return LowPrecisionWrapper(optimizer, COMPENSATIONS["split" if split else "master"],
                             master_dtype, foreach=foreach)


def kahan_summation(optimizer: torch.optim.Optimizer, *, foreach: Optional[bool] = None
                    ) -> LowPrecisionWrapper:
  """Kahan-compensated 16-bit params: ``x = p + c``, ``p' = round(x')``,
  ``c' = round(x' - p')``, with one buffer ``c`` in the param dtype.
  ``foreach``: as in ``master_weights`` (None: batched on CUDA).

  Example:
    >>> import torch, torch_bridge as tb
    >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    >>> opt = tb.kahan_summation(torch.optim.SGD([p], lr=1e-3))
    >>> for _ in range(10):
    ...   p.grad = torch.ones_like(p)
    ...   opt.step()
    >>> p[0].item()  # 10 steps of 1e-3, each below half a ULP of 1.0
    0.98828125

  References:
    Kahan, `Further remarks on reducing truncation errors
    <https://doi.org/10.1145/363707.363723>`_, CACM 1965; Zamirai et al.,
    `Revisiting BFloat16 Training <https://arxiv.org/abs/2010.06192>`_, 2020.
  """
  _check_foreach(foreach)
  return LowPrecisionWrapper(optimizer, COMPENSATIONS["kahan"], foreach=foreach)


def stochastic_rounding(optimizer: torch.optim.Optimizer, key, *,
                        foreach: Optional[bool] = None) -> LowPrecisionWrapper:
  """Stochastically rounded 16-bit params, with the random bits of
  ``optax_half.stochastic_rounding`` for the same integer ``key`` (required):
  bits ``random_bits(seed, step, STREAM_PARAMS, position, shape)`` with
  ``step`` the param's step count and ``position`` its place in the param groups.
  ``foreach``: as in ``master_weights`` (None: batched on CUDA).

  Example:
    >>> import torch, torch_bridge as tb
    >>> p = torch.nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
    >>> opt = tb.stochastic_rounding(torch.optim.SGD([p], lr=1e-3), key=0)
    >>> p.grad = torch.ones_like(p)
    >>> opt.step()
    >>> sorted(set(p.tolist()))  # 0.999 rounds down to 0.99609375 about a quarter of the time
    [0.99609375, 1.0]

  References:
    Gupta et al., `Deep Learning with Limited Numerical Precision
    <https://arxiv.org/abs/1502.02551>`_, ICML 2015.
  """
  if key is None:
    raise ValueError(
        "stochastic_rounding needs a key: pass key=<int seed> (an int gives the same "
        "random bits in optax_half and torch_bridge; optax_half also takes a jax.random.key).")
  _check_foreach(foreach)
  return LowPrecisionWrapper(optimizer, COMPENSATIONS["stochastic"], seed=seed_from_key(key),
                             foreach=foreach)


def round_to_nearest(optimizer: torch.optim.Optimizer, *, foreach: Optional[bool] = None
                     ) -> LowPrecisionWrapper:
  """No compensation: the wrapped optimizer steps an fp32 view of each 16-bit
  param and the result is rounded to nearest (the naive baseline).
  ``foreach``: as in ``master_weights`` (None: batched on CUDA).

  Example:
    >>> import torch, torch_bridge as tb
    >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    >>> opt = tb.round_to_nearest(torch.optim.SGD([p], lr=1e-3))
    >>> p.grad = torch.ones_like(p)
    >>> opt.step()
    >>> p[0].item()  # 0.999 rounds back to 1.0: a stale weight
    1.0

  References:
    Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_,
    ICLR 2018, on updates lost to rounding when weights are kept in 16 bits.
  """
  _check_foreach(foreach)
  return LowPrecisionWrapper(optimizer, COMPENSATIONS["none"], foreach=foreach)
