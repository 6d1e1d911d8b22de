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

# Columns of a row of the tensor table (int64 each), see _triton._table.
ROW = tl.constexpr(8)
# Scalars, in adam.adamw_step's order.
N_SCALARS = tl.constexpr(9)


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
def load_f32(addr, offs, mask, KIND: tl.constexpr):
  """Elements ``offs`` of the tensor at integer address ``addr``, widened to fp32."""
  if KIND == F32:
    return tl.load(addr.to(tl.pointer_type(tl.float32)) + offs, mask=mask, other=0.0)
  else:
    b = tl.load(addr.to(tl.pointer_type(tl.uint16)) + offs, mask=mask, other=0)
    return widen_bits(b.to(tl.uint32), KIND)


@triton.jit
def store_bits(addr, offs, mask, bits):
  tl.store(addr.to(tl.pointer_type(tl.uint16)) + offs, bits.to(tl.uint16), mask=mask)


@triton.jit
def store_rounded(addr, offs, mask, x, KIND: tl.constexpr):
  """fp32 ``x`` rounded to nearest into a KIND tensor."""
  if KIND == F32:
    tl.store(addr.to(tl.pointer_type(tl.float32)) + offs, x, mask=mask)
  else:
    store_bits(addr, offs, mask, nearest_bits(x, KIND))


@triton.jit
def store_moment(addr, offs, mask, x, word, KIND: tl.constexpr, SR: tl.constexpr):
  """A moment written by round_moments: stochastically with ``word`` (SR, 16-bit), else nearest."""
  if SR and KIND != F32:
    store_bits(addr, offs, mask, stochastic_bits(x, word, KIND))
  else:
    store_rounded(addr, offs, mask, x, KIND)


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


@triton.jit(do_not_specialize=["key_p", "key_m"])
def adamw_kernel(table_ptr, blocks_ptr, scalars_ptr, inv_scale_ptr, found_inf_ptr, key_p, key_m,
                 P: tl.constexpr, G: tl.constexpr, M: tl.constexpr, V: tl.constexpr,
                 BUF: tl.constexpr, MODE: tl.constexpr, SR_MOMENTS: tl.constexpr,
                 MAXIMIZE: tl.constexpr, HAS_INV_SCALE: tl.constexpr,
                 HAS_FOUND_INF: tl.constexpr, BLOCK: tl.constexpr):
  """One AdamW step of one block of one tensor of the table: adam.adamw_step
  op for op. ``blocks_ptr``: (tensor row, block number) per program;
  ``key_p``, ``key_m``: the step's stream keys (int32 bits; each tensor's key
  is mix32(stream key ^ leaf)); ``BUF``: the buffer's storage kind."""
  pid = tl.program_id(0)
  t = tl.load(blocks_ptr + 2 * pid).to(tl.int64)
  block = tl.load(blocks_ptr + 2 * pid + 1).to(tl.int64)
  row = table_ptr + t * ROW
  p_addr = tl.load(row)
  g_addr = tl.load(row + 1)
  mu_addr = tl.load(row + 2)
  nu_addr = tl.load(row + 3)
  buf_addr = tl.load(row + 4)
  numel = tl.load(row + 5)
  index0 = tl.load(row + 6)
  leaf = tl.load(row + 7).to(tl.uint32)
  if HAS_FOUND_INF:  # GradScaler's skip: no element, every load and store masked off
    numel = numel * (tl.load(found_inf_ptr) == 0).to(tl.int64)
  offs = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
  mask = offs < numel

  lr = tl.load(scalars_ptr)
  b1 = tl.load(scalars_ptr + 1)
  b2 = tl.load(scalars_ptr + 2)
  one_minus_b1 = tl.load(scalars_ptr + 3)
  one_minus_b2 = tl.load(scalars_ptr + 4)
  inv_bc1 = tl.load(scalars_ptr + 5)
  inv_bc2 = tl.load(scalars_ptr + 6)
  eps = tl.load(scalars_ptr + 7)
  weight_decay = tl.load(scalars_ptr + 8)

  g = load_f32(g_addr, offs, mask, G)
  if HAS_INV_SCALE:
    g = g * tl.load(inv_scale_ptr)
  if MAXIMIZE:
    g = -g
  pw = load_f32(p_addr, offs, mask, P)
  if MODE == MASTER:  # the master follows a param written from outside
    master = load_f32(buf_addr, offs, mask, F32)
    x = tl.where(widen_bits(nearest_bits(master, P), P) == pw, master, pw)
  elif MODE == SPLIT:
    lo = tl.load(buf_addr.to(tl.pointer_type(tl.int16)) + offs, mask=mask, other=0)
    hi = tl.load(p_addr.to(tl.pointer_type(tl.uint16)) + offs, mask=mask, other=0)
    x = ((hi.to(tl.uint32) << 16) + lo.to(tl.int32).to(tl.uint32, bitcast=True)).to(
        tl.float32, bitcast=True)
  elif MODE == KAHAN:
    x = pw + load_f32(buf_addr, offs, mask, BUF)
  else:
    x = pw
  m32 = b1 * load_f32(mu_addr, offs, mask, M) + one_minus_b1 * g
  v32 = b2 * load_f32(nu_addr, offs, mask, V) + one_minus_b2 * (g * g)
  m_hat = m32 * inv_bc1
  v_hat = v32 * inv_bc2
  u = tl.div_rn(m_hat, tl.sqrt_rn(v_hat) + eps)
  u = tl.where(weight_decay != 0.0, u + weight_decay * x, u)  # none at 0 (an Inf x stays one)
  u = -lr * u

  counter = (offs + index0).to(tl.uint32)  # the random-bit counter, mod 2^32
  if MODE == DIRECT:
    tl.store(p_addr.to(tl.pointer_type(tl.float32)) + offs, pw + u, mask=mask)
  else:
    x_new = x + u
    if MODE == MASTER:  # the param is the master's rounding, the master x_new
      landed = nearest_bits(x_new, P)
      tl.store(buf_addr.to(tl.pointer_type(tl.float32)) + offs, x_new, mask=mask)
    elif MODE == SPLIT:  # the param is the high half, the buffer the low half
      landed = split_high(x_new)
      store_bits(buf_addr, offs, mask, split_low(x_new))
    elif MODE == KAHAN:
      landed = land_bits(pw, widen_bits(nearest_bits(x_new, P), P), P)
      store_rounded(buf_addr, offs, mask, x_new - widen_bits(landed, P), BUF)
    elif MODE == STOCHASTIC:
      word = mix32(counter ^ mix32(key_p.to(tl.uint32, bitcast=True) ^ leaf))
      landed = land_bits(pw, widen_bits(stochastic_bits(x_new, word, P), P), P)
    else:
      landed = land_bits(pw, widen_bits(nearest_bits(x_new, P), P), P)
    store_bits(p_addr, offs, mask, landed)

  # rounding.round_moments: one word w, swap_halves(w) for nu
  w = counter
  if SR_MOMENTS:
    w = mix32(counter ^ mix32(key_m.to(tl.uint32, bitcast=True) ^ leaf))
  store_moment(mu_addr, offs, mask, m32, w, M, SR_MOMENTS)
  store_moment(nu_addr, offs, mask, v32, (w << 16) | (w >> 16), V, SR_MOMENTS)
