"""The Triton kernels of ``torch_bridge._triton`` (loaded by it, once per mode).

``_triton`` loads this file as a module of its own for Triton's compiler and
for its interpreter (``TRITON_INTERPRET=1``), since ``triton.jit`` picks one
at decoration time. Every fp32 -> 16-bit rounding is integer bit arithmetic
(the interpreter truncates fp32 -> bf16 where a GPU rounds to nearest), every
fp32 op is an IEEE op rounded once (``sqrt_rn``, ``div_rn``, and launches with
``enable_fp_fusion=False``: no FMA), so the bits are ``adam.adamw_step``'s.
Spec: docs/algorithms.md#triton-multi-tensor-step.
"""

import triton
import triton.language as tl

import optax_half_native as native_lib

# Storage kinds of a tensor (constexpr codes of this file only).
F32 = tl.constexpr(0)
BF16 = tl.constexpr(1)
F16 = tl.constexpr(2)

# The kernel's modes: optax_half_native.MODES, the one table.
DIRECT = tl.constexpr(native_lib.MODES["direct"])
MASTER = tl.constexpr(native_lib.MODES["master"])
SPLIT = tl.constexpr(native_lib.MODES["split"])
KAHAN = tl.constexpr(native_lib.MODES["kahan"])
STOCHASTIC = tl.constexpr(native_lib.MODES["stochastic"])
NEAREST = tl.constexpr(native_lib.MODES["none"])

# The random-bit hash's multipliers (docs/algorithms.md#counter-based-random-bits).
M1 = tl.constexpr(native_lib.MIX32_M1)
M2 = tl.constexpr(native_lib.MIX32_M2)

# The streams' words xored into a step's key (rounding._stream_key).
STREAM_P = tl.constexpr((native_lib.STREAM_PARAMS * native_lib.GOLDEN) & 0xFFFFFFFF)
STREAM_M = tl.constexpr((native_lib.STREAM_MOMENTS * native_lib.GOLDEN) & 0xFFFFFFFF)

# Columns of a row of the tensor table (int64 each), see _triton.Plan.
ROW = tl.constexpr(9)


@triton.jit
def mix32(x):
  """rounding.mix32 on uint32 words (wrapping multiplies, logical shifts)."""
  x = x ^ (x >> 16)
  x = x * tl.full(x.shape, M1, tl.uint32)
  x = x ^ (x >> 15)
  x = x * tl.full(x.shape, M2, tl.uint32)
  return x ^ (x >> 15)


@triton.jit
def bf16_bits(x):
  """fp32 -> bf16 bits (low half of a uint32), nearest even; NaN -> 0x7FC0."""
  u = x.to(tl.uint32, bitcast=True)
  r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
  return tl.where(x != x, 0x7FC0, r)


@triton.jit
def f16_bits(x):
  """fp32 -> fp16 bits (low half of a uint32), nearest even: subnormals,
  overflow to inf, NaN quiet with the payload's top bits (torch's CPU)."""
  u = x.to(tl.uint32, bitcast=True)
  sign = (u >> 16) & 0x8000
  a = u & 0x7FFFFFFF
  # normal: rebias the exponent (127 -> 15), round at bit 13; past 65504: inf
  n = a - (112 << 23)
  n = (n + 0xFFF + ((n >> 13) & 1)) >> 13
  n = tl.minimum(n, 0x7C00)
  # subnormal (|x| < 2^-14): the significand in units of 2^-24, shifted by
  # 126 - exponent (14..25; 25 and more give 0) with ties to even
  e = (a >> 23).to(tl.int32)
  shift = tl.minimum(tl.maximum(126 - e, 14), 25).to(tl.uint32)
  m = (a & 0x7FFFFF) | 0x800000
  q = m >> shift
  rest = m & ((tl.full(m.shape, 1, tl.uint32) << shift) - 1)
  half = tl.full(m.shape, 1, tl.uint32) << (shift - 1)
  q = q + ((rest > half) | ((rest == half) & ((q & 1) == 1))).to(tl.uint32)
  r = tl.where(a < 0x38800000, q, n)
  r = tl.where(a > 0x7F800000, 0x7E00 | ((a >> 13) & 0x3FF), r)
  return sign | r


@triton.jit
def widen_bits(b, KIND: tl.constexpr):
  """16-bit storage bits (low half of a uint32) -> their exact fp32 value."""
  if KIND == BF16:
    return (b << 16).to(tl.float32, bitcast=True)
  else:
    return b.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def nearest_bits(x, KIND: tl.constexpr):
  if KIND == BF16:
    return bf16_bits(x)
  else:
    return f16_bits(x)


@triton.jit
def stochastic_bits(x, bits, KIND: tl.constexpr):
  """rounding.stochastic_round of fp32 x to 16-bit KIND with the word ``bits``."""
  if KIND == BF16:
    # 16 random bits added below the bf16 mantissa, then truncated
    r = (x.to(tl.uint32, bitcast=True) + (bits >> 16)) >> 16
    return tl.where(x != x, 0x7FC0, r)
  else:
    # the fp16 neighbours below and above |x| by integer steps of the
    # magnitude of its nearest; up where the 24-bit uniform is below the fraction
    nearest = f16_bits(x)
    ax = tl.abs(x)
    over = tl.abs(widen_bits(nearest, F16)) > ax
    magnitude = (nearest & 0x7FFF) - over.to(tl.uint32)
    sign = nearest & 0x8000
    down = sign | magnitude
    up = sign | ((magnitude + 1) & 0xFFFF)
    down32 = tl.abs(widen_bits(down, F16))
    gap = tl.abs(widen_bits(up, F16)) - down32
    frac = tl.div_rn(ax - down32, gap)
    uniform = ((bits >> 8) & 0xFFFFFF).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
    y = tl.where(uniform < frac, up, down)
    finite = (x.to(tl.uint32, bitcast=True) & 0x7F800000) != 0x7F800000
    return tl.where(finite, y, nearest)


@triton.jit
def one_minus_pow(b, n):
  """rounding.one_minus_pow(b, n): 1 - b**n in fp32 by binary exponentiation
  on d(k) = 1 - b**k, each op rounded once (no FMA: the launch turns it off)."""
  d_pow = 1.0 - b
  d = tl.full((), 0.0, tl.float32)
  for _ in range(32):
    d = tl.where((n & 1) != 0, (d + d_pow) - d * d_pow, d)
    d_pow = d_pow * (2.0 - d_pow)
    n = n >> 1
  return d


@triton.jit
def typed(addr, start, KIND: tl.constexpr, ALIGNED: tl.constexpr):
  """Element ``start`` of the tensor at integer address ``addr``: an fp32
  pointer, or a uint16 one to 16-bit storage; ALIGNED: 16-byte aligned."""
  if KIND == F32:
    ptr = addr.to(tl.pointer_type(tl.float32)) + start
  else:
    ptr = addr.to(tl.pointer_type(tl.uint16)) + start
  if ALIGNED:
    ptr = tl.multiple_of(ptr, 16)
  return ptr


@triton.jit
def load_f32(ptrs, mask, KIND: tl.constexpr, MASKED: tl.constexpr):
  """Elements at ``ptrs`` (``typed`` + offsets), widened to fp32."""
  if MASKED:
    v = tl.load(ptrs, mask=mask, other=0)
  else:
    v = tl.load(ptrs)
  if KIND == F32:
    return v
  else:
    return widen_bits(v.to(tl.uint32), KIND)


@triton.jit
def store_bits(ptrs, mask, bits, MASKED: tl.constexpr):
  if MASKED:
    tl.store(ptrs, bits.to(tl.uint16), mask=mask)
  else:
    tl.store(ptrs, bits.to(tl.uint16))


@triton.jit
def store_rounded(ptrs, mask, x, KIND: tl.constexpr, MASKED: tl.constexpr):
  """fp32 ``x`` rounded to nearest into a KIND tensor."""
  if KIND == F32:
    if MASKED:
      tl.store(ptrs, x, mask=mask)
    else:
      tl.store(ptrs, x)
  else:
    store_bits(ptrs, mask, nearest_bits(x, KIND), MASKED)

@triton.jit
def store_moment(ptrs, mask, x, word, KIND: tl.constexpr, SR: tl.constexpr,
                 MASKED: tl.constexpr):
  """A moment written by round_moments: stochastically with ``word`` (SR, 16-bit), else nearest."""
  if SR and KIND != F32:
    store_bits(ptrs, mask, stochastic_bits(x, word, KIND), MASKED)
  else:
    store_rounded(ptrs, mask, x, KIND, MASKED)

@triton.jit
def land_bits(pw, t32, P: tl.constexpr):
  """rounding.land: u = update_of(t - p) (bf16: its high half), and the bits of round(p + u)."""
  d = t32 - pw
  if P == BF16:  # a NaN stays one, and lands as nearest_bits' NaN
    u = (d.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
  else:
    u = widen_bits(nearest_bits(d, P), P)
  return nearest_bits(pw + u, P)


@triton.jit
def split_high(x):
  """split_f32's bf16 half (bits), NaN -> 0x7FC0."""
  hi = ((x.to(tl.uint32, bitcast=True) + 0x8000) >> 16) & 0xFFFF
  return tl.where(x != x, 0x7FC0, hi)


@triton.jit
def split_low(x):
  """split_f32's int16 half (bits, low 16 of a uint32), NaN -> 0."""
  u = x.to(tl.uint32, bitcast=True)
  lo = (u - (((u + 0x8000) >> 16) << 16)) & 0xFFFF
  return tl.where(x != x, 0, lo)


@triton.jit
def round_kernel(x_ptr, out_ptr, n, KIND: tl.constexpr, STOCHASTIC_WORDS: tl.constexpr,
                 words_ptr, BLOCK: tl.constexpr):
  """Rounds fp32 x to KIND's bits (the tests of the rounding itself)."""
  offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
  mask = offs < n
  x = tl.load(x_ptr + offs, mask=mask, other=0.0)
  if STOCHASTIC_WORDS:
    w = tl.load(words_ptr + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)
    bits = stochastic_bits(x, w, KIND)
  else:
    bits = nearest_bits(x, KIND)
  tl.store(out_ptr + offs, bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)



@triton.jit
def step_block(p_ptr, g_ptr, mu_ptr, nu_ptr, buf_ptr, offs, mask, counter, lr, b1, b2,
               one_minus_b1, one_minus_b2, inv_bc1, inv_bc2, eps, weight_decay, inv_scale,
               word_p, word_m, P: tl.constexpr, G: tl.constexpr, M: tl.constexpr,
               V: tl.constexpr, BUF: tl.constexpr, MODE: tl.constexpr,
               SR_MOMENTS: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_INV_SCALE: tl.constexpr,
               MASKED: tl.constexpr):
  """adam.adamw_step on one block of elements (``offs`` from the typed pointers).
  The moments are written before the param is read: fewer values live at once
  (registers), the same ops."""
  g = load_f32(g_ptr + offs, mask, G, MASKED)
  if HAS_INV_SCALE:
    g = g * inv_scale
  if MAXIMIZE:
    g = -g
  m32 = b1 * load_f32(mu_ptr + offs, mask, M, MASKED) + one_minus_b1 * g
  v32 = b2 * load_f32(nu_ptr + offs, mask, V, MASKED) + one_minus_b2 * (g * g)
  m_hat = m32 * inv_bc1
  v_hat = v32 * inv_bc2
  u = tl.div_rn(m_hat, tl.sqrt_rn(v_hat) + eps)
  # rounding.round_moments: one word w, swap_halves(w) for nu
  w = counter
  if SR_MOMENTS:
    w = mix32(counter ^ word_m)
  store_moment(mu_ptr + offs, mask, m32, w, M, SR_MOMENTS, MASKED)
  store_moment(nu_ptr + offs, mask, v32, (w << 16) | (w >> 16), V, SR_MOMENTS, MASKED)

  pw = load_f32(p_ptr + offs, mask, P, MASKED)
  if MODE == MASTER:  # the master follows a param written from outside
    master = load_f32(buf_ptr + offs, mask, F32, MASKED)
    x = tl.where(widen_bits(nearest_bits(master, P), P) == pw, master, pw)
  elif MODE == SPLIT:  # hi: the param's bits; lo: the buffer's int16 bits, sign-extended
    if MASKED:
      lo = tl.load(buf_ptr + offs, mask=mask, other=0)
      hi = tl.load(p_ptr + offs, mask=mask, other=0)
    else:
      lo = tl.load(buf_ptr + offs)
      hi = tl.load(p_ptr + offs)
    lo32 = lo.to(tl.int16, bitcast=True).to(tl.int32).to(tl.uint32, bitcast=True)
    x = ((hi.to(tl.uint32) << 16) + lo32).to(tl.float32, bitcast=True)
  elif MODE == KAHAN:
    x = pw + load_f32(buf_ptr + offs, mask, BUF, MASKED)
  else:
    x = pw
  u = tl.where(weight_decay != 0.0, u + weight_decay * x, u)  # none at 0 (an Inf x stays one)
  u = -lr * u

  if MODE == DIRECT:
    if MASKED:
      tl.store(p_ptr + offs, pw + u, mask=mask)
    else:
      tl.store(p_ptr + offs, pw + u)
  else:
    x_new = x + u
    if MODE == MASTER:  # the param is the master's rounding, the master x_new
      landed = nearest_bits(x_new, P)
      store_rounded(buf_ptr + offs, mask, x_new, F32, MASKED)
    elif MODE == SPLIT:  # the param is the high half, the buffer the low half
      landed = split_high(x_new)
      store_bits(buf_ptr + offs, mask, split_low(x_new), MASKED)
    elif MODE == KAHAN:
      landed = land_bits(pw, widen_bits(nearest_bits(x_new, P), P), P)
      store_rounded(buf_ptr + offs, mask, x_new - widen_bits(landed, P), BUF, MASKED)
    elif MODE == STOCHASTIC:
      word = mix32(counter ^ word_p)
      landed = land_bits(pw, widen_bits(stochastic_bits(x_new, word, P), P), P)
    else:
      landed = land_bits(pw, widen_bits(nearest_bits(x_new, P), P), P)
    store_bits(p_ptr + offs, mask, landed, MASKED)


@triton.jit(do_not_specialize=["seed_key"])  # one compile for every seed
def adamw_kernel(table_ptr, programs_ptr, lr, lr_ptr, b1, b2, eps, weight_decay, seed_key,
                 inv_scale_ptr, found_inf_ptr, P: tl.constexpr, G: tl.constexpr,
                 M: tl.constexpr, V: tl.constexpr, BUF: tl.constexpr, MODE: tl.constexpr,
                 SR_MOMENTS: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_INV_SCALE: tl.constexpr,
                 HAS_FOUND_INF: tl.constexpr, LR_TENSOR: tl.constexpr, ALIGNED: tl.constexpr,
                 BLOCK: tl.constexpr, ITERS: tl.constexpr, INVERT_SCALE: tl.constexpr = False):
  """One AdamW step of ITERS blocks of one tensor of the table: adam.adamw_step
  op for op. ``programs_ptr``: (table row, first element) per program, int32;
  a row holds the tensor's addresses, its numel, its random-bit counter of
  element 0, its leaf and the address of its int64 step count (before this
  step: the bias corrections and random-bit keys are made here from it).
  ``seed_key``: mix32(seed) (int32 bits). ALIGNED: every address of every row
  is 16-byte aligned, so full blocks move 16 bytes per access. INVERT_SCALE:
  ``inv_scale_ptr`` holds the loss scale itself (GradScaler's ``grad_scale``),
  whose correctly rounded reciprocal is GradScaler's ``inv_scale``."""
  pid = tl.program_id(0)
  r = tl.load(programs_ptr + 2 * pid)
  start = tl.multiple_of(tl.load(programs_ptr + 2 * pid + 1), BLOCK)
  row = table_ptr + r.to(tl.int64) * ROW
  numel = tl.load(row + 5).to(tl.int32)
  counter0 = tl.load(row + 6).to(tl.uint32) + start.to(tl.uint32)  # mod 2^32
  leaf = tl.load(row + 7).to(tl.uint32)
  step = tl.load(tl.load(row + 8).to(tl.pointer_type(tl.int64))).to(tl.uint32)
  if HAS_FOUND_INF:  # GradScaler's skip: no element
    numel = tl.where(tl.load(found_inf_ptr) == 0, numel, 0)
  p_ptr = typed(tl.load(row), start, P, ALIGNED)
  g_ptr = typed(tl.load(row + 1), start, G, ALIGNED)
  mu_ptr = typed(tl.load(row + 2), start, M, ALIGNED)
  nu_ptr = typed(tl.load(row + 3), start, V, ALIGNED)
  buf_ptr = typed(tl.load(row + 4), start, BUF, ALIGNED)

  # adam's scalars for this step (t = step + 1), as LowPrecisionAdamW._scalars
  if LR_TENSOR:
    lr = tl.load(lr_ptr)
  one = tl.full((), 1.0, tl.float32)
  one_minus_b1 = one - b1
  one_minus_b2 = one - b2
  inv_bc1 = tl.div_rn(one, one_minus_pow(b1, step + 1))
  inv_bc2 = tl.div_rn(one, one_minus_pow(b2, step + 1))
  inv_scale = one
  if HAS_INV_SCALE:
    inv_scale = tl.load(inv_scale_ptr)
    if INVERT_SCALE:  # = fp32(1 / fp64(scale)): rounding twice from fp64 is innocuous here
      inv_scale = tl.div_rn(one, inv_scale)
  # the leaves' random-bit keys (rounding.leaf_key) of both streams
  k = mix32(seed_key.to(tl.uint32, bitcast=True) ^ step)
  word_p = mix32(mix32(k ^ STREAM_P) ^ leaf)
  word_m = mix32(mix32(k ^ STREAM_M) ^ leaf)

  offs = tl.arange(0, BLOCK)
  for i in range(ITERS):
    first = i * BLOCK
    counter = counter0 + first.to(tl.uint32) + offs.to(tl.uint32)
    if start + first + BLOCK <= numel:
      step_block(p_ptr + first, g_ptr + first, mu_ptr + first, nu_ptr + first, buf_ptr + first,
                 offs, None, counter, lr, b1, b2, one_minus_b1, one_minus_b2, inv_bc1, inv_bc2,
                 eps, weight_decay, inv_scale, word_p, word_m, P, G, M, V, BUF, MODE,
                 SR_MOMENTS, MAXIMIZE, HAS_INV_SCALE, False)
    elif start + first < numel:
      step_block(p_ptr + first, g_ptr + first, mu_ptr + first, nu_ptr + first, buf_ptr + first,
                 offs, offs < numel - start - first, counter, lr, b1, b2, one_minus_b1,
                 one_minus_b2, inv_bc1, inv_bc2, eps, weight_decay, inv_scale, word_p, word_m,
                 P, G, M, V, BUF, MODE, SR_MOMENTS, MAXIMIZE, HAS_INV_SCALE, True)


@triton.jit
def advance_kernel(table_ptr, n_rows, found_inf_ptr, HAS_FOUND_INF: tl.constexpr,
                   BLOCK: tl.constexpr):
  """Each row's int64 step count + 1 (+ 0 where found_inf is nonzero), after the step."""
  rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
  mask = rows < n_rows
  steps = tl.load(table_ptr + rows.to(tl.int64) * ROW + 8, mask=mask, other=0).to(
      tl.pointer_type(tl.int64))
  add = tl.full((BLOCK,), 1, tl.int64)
  if HAS_FOUND_INF:
    add = add * (tl.load(found_inf_ptr) == 0).to(tl.int64)
  tl.store(steps, tl.load(steps, mask=mask) + add, mask=mask)
