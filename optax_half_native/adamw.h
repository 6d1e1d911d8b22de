// The AdamW core of optax_half / torch_bridge as one loop over the elements,
// for a CPU kernel behind both frameworks. Spec: docs/algorithms.md#adamw-core
// and docs/algorithms.md#native-cpu-kernel. Every line mirrors
// torch_bridge.adam.adamw_step (and optax_half.adam.scale_by_adamw): the same
// operations in the same order, each rounded to fp32 (built with
// -ffp-contract=off and without -ffast-math, so no FMA and no reassociation),
// so the bits equal theirs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#if defined(__SSE__)
#include <xmmintrin.h>  // _mm_getcsr
#endif
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace oh {

struct bf16 {
  uint16_t bits;
};

// IEEE binary16 (fp16) storage: params (modes kMaster, kKahan with an fp16
// buffer, kStochastic, kNearest), their gradients and moments. Converted by
// the F16C instructions (vcvtph2ps exactly; vcvtps2ph rounding to nearest
// even, subnormals and NaN payloads kept), which is what torch's and XLA's
// CPU conversions do (docs/algorithms.md#fp16-params); without F16C there is
// no fp16 kernel (OH_F16 undefined) and fp16 params take the framework code.
struct f16 {
  uint16_t bits;
};

constexpr uint16_t kBf16QuietNan = 0x7FC0;
constexpr uint32_t kM1 = 0x21F0AAADu, kM2 = 0x735A2D97u, kGolden = 0x9E3779B9u;

inline uint32_t as_u32(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float as_f32(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

// The integer halves of the bf16 roundings, on the bits u of an fp32 value:
// one word (uint32_t) or each lane of a vector of words (Lanes8, Pairs8, Lanes16),
// so every lane width computes the same expression. Each returns the bf16
// bits in the low 16 bits; NaNs are each caller's to handle.
// The *_high forms are the same before the final >> 16 (the bf16 bits in
// the high half, garbage below).
template <typename U>
inline U nearest_even_high(U u) { return u + 0x7FFFu + ((u >> 16) & 1u); }
template <typename U>
inline U nearest_even_bits(U u) {  // round to nearest, ties to even
  return nearest_even_high(u) >> 16;
}
template <typename U>
inline U stochastic_high(U u, U random) { return u + (random >> 16); }
template <typename U>
inline U stochastic_bits(U u, U random) {  // add 16 random bits below the bf16 mantissa, truncate
  return stochastic_high(u, random) >> 16;
}
// split_f32's bf16 half (the int16 half is u - (high << 16)).
template <typename U>
inline U split_high(U u) { return (u + 0x8000u) >> 16; }

// Exact widening to fp32.
inline float widen(bf16 h) { return as_f32(uint32_t(h.bits) << 16); }
inline float widen(float x) { return x; }

// fp32 -> bf16, round to nearest even; NaN -> the quiet NaN 0x7FC0.
inline bf16 round_nearest(float x, bf16) {
  uint32_t u = as_u32(x);
  uint16_t r = uint16_t(nearest_even_bits(u));
  return bf16{x != x ? kBf16QuietNan : r};
}
inline float round_nearest(float x, float) { return x; }
// x's high half, the truncation to bf16 (a NaN as round_nearest's): the
// bf16 update of a landing (docs/algorithms.md#landing-exactly).
inline bf16 truncate(float x, bf16) { return bf16{x != x ? kBf16QuietNan : uint16_t(as_u32(x) >> 16)}; }

// Stores through the element, not the struct: GCC does not vectorize a loop
// that copies a struct local to memory.
inline void store(bf16* to, bf16 v) { to->bits = v.bits; }
inline void store(float* to, float v) { *to = v; }

#if defined(__F16C__)
#define OH_F16 1
inline float widen(f16 h) { return _cvtsh_ss(h.bits); }
inline f16 round_nearest(float x, f16) {
  return f16{uint16_t(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT))};
}
inline void store(f16* to, f16 v) { to->bits = v.bits; }

// rounding.stochastic_round to fp16 (_stochastic_round_f16) with the word
// `bits`: the neighbours of x towards and away from zero by integer steps of
// the 15-bit magnitude of its nearest fp16, the fraction of the gap x has
// passed, and up where the 24-bit uniform (bits >> 8) * 2^-24 is below it;
// a non-finite x rounds to nearest. Every fp32 op is the framework's.
inline f16 round_stochastic(float x, uint32_t bits, f16 like) {
  const f16 nearest = round_nearest(x, like);
  const float ax = std::fabs(x);
  const bool over = std::fabs(widen(nearest)) > ax;  // nearest is away from zero
  const int32_t magnitude = int32_t(nearest.bits & 0x7FFFu) - int32_t(over);
  const uint16_t sign = nearest.bits & 0x8000u;
  const f16 down{uint16_t(sign | magnitude)}, up{uint16_t(sign | (magnitude + 1))};
  const float down32 = std::fabs(widen(down));
  const float frac = (ax - down32) / (std::fabs(widen(up)) - down32);
  const float u = float(bits >> 8) * 0x1p-24f;
  return std::isfinite(x) ? (u < frac ? up : down) : nearest;
}
#endif

// mix32 after its first x ^= x >> 16 (Pairs8::mix_counter shares that one).
template <typename U>
inline U mix32_rest(U x) {
  x *= kM1;
  x ^= x >> 15;
  x *= kM2;
  x ^= x >> 15;
  return x;
}

// rounding.mix32: a bijective 32-bit hash (of one word, or of each lane of
// a vector of words).
template <typename U>
inline U mix32(U x) {
  return mix32_rest(x ^ (x >> 16));
}

// rounding.leaf_key: the key of one (seed, step, stream, leaf).
inline uint32_t leaf_key(uint32_t seed, uint32_t step, uint32_t stream, uint32_t leaf) {
  uint32_t k = mix32(seed);
  k = mix32(k ^ step);
  k = mix32(k ^ (stream * kGolden));
  return mix32(k ^ leaf);
}

// rounding.stochastic_round to bf16 with the word mix32(index ^ key): add 16
// random bits below the bf16 mantissa and truncate; NaN rounds to nearest.
inline bf16 round_stochastic(float x, uint32_t bits, bf16 like) {
  uint16_t y = uint16_t(stochastic_bits(as_u32(x), bits));
  return x != x ? round_nearest(x, like) : bf16{y};
}
inline float round_stochastic(float x, uint32_t, float) { return x; }

// rounding.split_f32 / join_f32: fp32 = bf16 high half + int16 low half.
inline void split(float x, bf16* hi, int16_t* lo) {
  uint32_t bits = as_u32(x);
  uint32_t h = split_high(bits);
  uint32_t l = bits - (h << 16);
  bool nan = x != x;
  hi->bits = nan ? kBf16QuietNan : uint16_t(h);
  *lo = nan ? int16_t(0) : int16_t(uint16_t(l));
}
inline float join(bf16 hi, int16_t lo) {
  return as_f32((uint32_t(hi.bits) << 16) + uint32_t(int32_t(lo)));
}

// How a param is read into fp32 and written back (torch_bridge.adam._mode).
// kUpdate (fp32 params, for JAX): p_out receives the update u itself, which
// optax.apply_updates adds to the param as the framework core's update would.
enum Mode : int {
  kDirect = 0, kMaster = 1, kSplit = 2, kKahan = 3, kStochastic = 4, kNearest = 5, kUpdate = 6
};

// The fp32 scalars of one tensor's step, as torch_bridge.adam computes them,
// then how each gradient element is read (read_grad). grad_scale: the factor
// every gradient element is multiplied by as it is read: 1 / the loss scale
// when the step unscales (optax_half's dynamic_loss_scale, which widens and
// multiplies exactly so), else 1, which changes no bit of the result (x * 1
// is x, a NaN stays a NaN, and with subnormal inputs read as 0 the products
// that read gi read it as 0 too). clip_div, clip_mul: optax's
// clip_by_global_norm of the gradient first, (g / norm) * max_norm in the
// gradient's type G (norm and max_norm rounded to G, then widened), where the
// step clips (optax_half.chain of clip_by_global_norm and the optimizer);
// both 1 where it does not (the branch that keeps g), and the kernel skips it.
// Mirrored by optax_half_native.ADAMW_SCALARS.
struct Scalars {
  float lr, b1, b2, one_minus_b1, one_minus_b2, inv_bc1, inv_bc2, eps, weight_decay, grad_scale,
      clip_div, clip_mul;
};

// Whether read_grad clips with these scalars (a branch per tensor, not per element).
inline bool clips(const Scalars& s) { return s.clip_div != 1.0f || s.clip_mul != 1.0f; }

// One element at a time: the reference the wide lanes below must equal, and
// the tail of every range. `get` reads an element widened to fp32, `to`
// rounds fp32 to a storage type (nearest, or stochastically with `bits`),
// `put` stores a rounded value.
struct Scalar {
  using F = float;
  using U = uint32_t;
  static constexpr int kWidth = 1;
  template <typename T> static F get(const T* a, int64_t i) { return oh::widen(a[i]); }
  template <typename T> static F widen(T v) { return oh::widen(v); }
  template <typename T> static F widen(T v, T) { return oh::widen(v); }  // a rounded value of T
  static F join_at(const bf16* hi, const int16_t* lo, int64_t i) { return join(hi[i], lo[i]); }
  static F sqrt(F x) { return std::sqrt(x); }
  static bool any_bits(F x) { return as_u32(x) != 0; }  // whether a lane has a bit set
  // x where a == b (IEEE: false for a NaN, true for -0 == +0), else y.
  static F where_equal(F a, F b, F x, F y) { return a == b ? x : y; }
  static U counter(uint64_t first) { return uint32_t(first); }
  static U bits(F x) { return as_u32(x); }
  static F floats(U u) { return as_f32(u); }
  // x rounded to nearest even bf16, as fp32; x neither NaN nor subnormal
  // (kClipFinite, kClipFiniteUnit), where every lane type's rounding gives these bits.
  static F rounded_bf16(F x) { return as_f32(nearest_even_bits(as_u32(x)) << 16); }
  template <typename T> static T to(F x, T tag) { return round_nearest(x, tag); }
  static bf16 truncated(F x, bf16 tag) { return truncate(x, tag); }
  template <typename T> static T to_stochastic(F x, U bits, T tag) {
    return round_stochastic(x, bits, tag);
  }
  template <typename T> static void put(T* a, int64_t i, T v) { store(&a[i], v); }
  static void split_put(bf16* hi, int16_t* lo, int64_t i, F x) { split(x, &hi[i], &lo[i]); }
};

}  // namespace oh

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512BF16__)
#include <immintrin.h>
#define OH_LANES16 1

namespace oh {

// 16 elements at a time with AVX-512, the same operations lane by lane as
// Scalar (every fp32 op is the same IEEE op; integer ops wrap alike), so the
// bits are Scalar's. Rounding to bf16 uses vcvtneps2bf16, which rounds to
// nearest even exactly as round_nearest does except that it reads
// subnormals as 0 and writes NaNs of its own: lanes holding a subnormal or
// a NaN (fpclass, one instruction) take round_nearest's integer rounding.
struct Lanes16 {
  static constexpr bool kThreeStages = true;  // adamw_range's loop (32 vector registers)
  using F = __m512;
  typedef uint32_t U __attribute__((vector_size(64)));
  static constexpr int kWidth = 16;
  static constexpr int kNanOrSubnormal = 0x01 | 0x80 | 0x20;  // fpclass: QNaN, SNaN, denormal

  static U bits(F x) { return (U)_mm512_castps_si512(x); }
  static F floats(U u) { return _mm512_castsi512_ps((__m512i)u); }
  static U widen16(__m256i h) { return (U)_mm512_cvtepu16_epi32(h); }
  static __m256i narrow16(U u) { return _mm512_cvtepi32_epi16((__m512i)u); }

  static F get(const float* a, int64_t i) { return _mm512_loadu_ps(a + i); }
  static F get(const bf16* a, int64_t i) { return widen(load16(a, i)); }
  static F get(const f16* a, int64_t i) { return _mm512_cvtph_ps(load16(a, i)); }
  static __m256i load16(const void* a, int64_t i) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(a) + i));
  }
  // bf16 word j into the high half of fp32 lane j, zeros in the low halves:
  // one word permute (vpermw with a zeroing mask) for vpmovzxwd + vpslld.
  static F widen(__m256i h) {
    const __m512i high_halves = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0,
                                                 8, 0, 7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0,
                                                 0, 0);
    return _mm512_castsi512_ps(
        _mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, high_halves, _mm512_castsi256_si512(h)));
  }
  static F widen(F x) { return x; }
  // A vector rounded to P, widened back (the Kahan buffer's subtrahend).
  static F widen(F x, float) { return x; }
  static F widen(__m256i h, bf16) { return widen(h); }
  static F widen(__m256i h, f16) { return _mm512_cvtph_ps(h); }
  static F join_at(const bf16* hi, const int16_t* lo, int64_t i) {
    const U l = (U)_mm512_cvtepi16_epi32(load16(lo, i));  // sign-extended, as int32(lo)
    return floats((widen16(load16(hi, i)) << 16) + l);
  }
  static F sqrt(F x) { return _mm512_sqrt_ps(x); }
  static bool any_bits(F x) { return _mm512_test_epi32_mask((__m512i)x, (__m512i)x) != 0; }
  static F where_equal(F a, F b, F x, F y) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ), y, x);
  }
  static U counter(uint64_t first) {
    const U step = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return uint32_t(first) + step;
  }
  static __mmask16 nan_mask(F x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); }

  static F to(F x, float) { return x; }
  // Scalar::rounded_bf16: vcvtneps2bf16 rounds to nearest even, and x has no
  // subnormal (read as 0 by it) or NaN lane.
  static F rounded_bf16(F x) { return widen((__m256i)_mm512_cvtneps_pbh(x)); }
  static __m256i to(F x, f16) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT); }
  static __m256i to(F x, bf16) {
    __m256i r = (__m256i)_mm512_cvtneps_pbh(x);
    const __mmask16 odd = _mm512_fpclass_ps_mask(x, kNanOrSubnormal);
    if (__builtin_expect(odd != 0, 0)) {  // round_nearest's integer rounding for those lanes
      const U u = bits(x);
      U exact = nearest_even_bits(u);
      exact = (U)_mm512_mask_mov_epi32((__m512i)exact, nan_mask(x),
                                       _mm512_set1_epi32(kBf16QuietNan));
      r = _mm256_mask_blend_epi16(odd, r, narrow16(exact));
    }
    return r;
  }
  // The lanes whose landing (adamw_write) is exact: d = t - pw has no bits
  // below bf16's, so u = round(d) is d, and pw + d is t (bit for bit, a zero's
  // sign included), so the landed param is t. The same fp32 ops as the
  // landing's, on this thread's MXCSR (where XLA flushes d, d is 0 here too).
  static __mmask16 landed_lanes(F t, F pw) {
    const F d = t - pw;
    const __mmask16 whole = _mm512_testn_epi32_mask((__m512i)bits(d), _mm512_set1_epi32(0xFFFF));
    return _mm512_mask_cmpeq_epi32_mask(whole, (__m512i)bits(pw + d), (__m512i)bits(t));
  }
  static bool lands(F t, F pw) { return landed_lanes(t, pw) == 0xFFFF; }
  // truncate: the high halves, NaN lanes as to()'s.
  static __m256i truncated(F x, bf16) {
    const __m256i r = narrow16(bits(x) >> 16);
    const __mmask16 nan = nan_mask(x);
    if (__builtin_expect(nan != 0, 0))
      return _mm256_mask_blend_epi16(nan, r, _mm256_set1_epi16(kBf16QuietNan));
    return r;
  }
  // lands(t, pw), and x has no NaN or subnormal lane.
  static bool lands_normal(F t, F pw, F x) {
    return (landed_lanes(t, pw) & ~_mm512_fpclass_ps_mask(x, kNanOrSubnormal)) == 0xFFFF;
  }
  // x, a bf16 value (the low half of each lane 0), as bf16: its high halves.
  static __m256i exact(F x, bf16) { return narrow16(bits(x) >> 16); }
  // to(x, bf16) where x has no NaN or subnormal lane (vcvtneps2bf16 alone).
  static __m256i to_normal(F x, bf16) { return (__m256i)_mm512_cvtneps_pbh(x); }
  static F to_stochastic(F x, U, float) { return x; }
  static __m256i to_stochastic(F x, U r, bf16) {
    U y = stochastic_bits(bits(x), r);
    y = (U)_mm512_mask_mov_epi32((__m512i)y, nan_mask(x), _mm512_set1_epi32(kBf16QuietNan));
    return narrow16(y);
  }
  // round_stochastic(x, r, f16), lane by lane.
  static __m256i to_stochastic(F x, U r, f16) {
    const __m256i nearest = to(x, f16{});
    const F ax = _mm512_abs_ps(x);
    const __mmask16 over = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_cvtph_ps(nearest)), ax,
                                              _CMP_GT_OQ);
    const U word = widen16(nearest);
    const U magnitude = (U)_mm512_mask_sub_epi32((__m512i)(word & 0x7FFFu), over,
                                                 (__m512i)(word & 0x7FFFu), _mm512_set1_epi32(1));
    const U down = (word & 0x8000u) | magnitude, up = (word & 0x8000u) | (magnitude + 1u);
    const F down32 = _mm512_abs_ps(_mm512_cvtph_ps(narrow16(down)));
    const F frac = (ax - down32) / (_mm512_abs_ps(_mm512_cvtph_ps(narrow16(up))) - down32);
    const F u = _mm512_cvtepi32_ps((__m512i)(r >> 8)) * 0x1p-24f;
    U y = (U)_mm512_mask_mov_epi32((__m512i)down, _mm512_cmp_ps_mask(u, frac, _CMP_LT_OQ),
                                   (__m512i)up);
    const __mmask16 nonfinite = _mm512_fpclass_ps_mask(x, 0x01 | 0x80 | 0x08 | 0x10);
    y = (U)_mm512_mask_mov_epi32((__m512i)y, nonfinite, (__m512i)word);
    return narrow16(y);
  }
  static void put(float* a, int64_t i, F v) { _mm512_storeu_ps(a + i, v); }
  static void put(bf16* a, int64_t i, __m256i v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(a) + i), v);
  }
  static void put(f16* a, int64_t i, __m256i v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(a) + i), v);
  }
  // put_moments_stochastic for two bf16 moments: both sums, then one word
  // permute takes the high half of every lane of each into one vector (mu's
  // 16 words, then nu's), and one unordered compare finds a NaN in either.
  static void put_moments_stochastic(bf16* mu, bf16* nu, int64_t i, F m32, F v32, U w) {
    const U ym = bits(m32) + (w >> 16);  // stochastic_bits(., w) before its >> 16
    const U yv = bits(v32) + (w & 0xFFFFu);  // the same with (w << 16) >> 16
    const __m512i high_halves = _mm512_set_epi16(
        63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
        31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    __m512i both = _mm512_permutex2var_epi16((__m512i)ym, high_halves, (__m512i)yv);
    if (__builtin_expect(_mm512_cmp_ps_mask(m32, v32, _CMP_UNORD_Q) != 0, 0)) {
      both = _mm512_inserti64x4(_mm512_castsi256_si512(to_stochastic(m32, w, bf16{})),
                                to_stochastic(v32, w << 16, bf16{}), 1);
    }
    put(mu, i, _mm512_castsi512_si256(both));
    put(nu, i, _mm512_extracti64x4_epi64(both, 1));
  }
  static void split_put(bf16* hi, int16_t* lo, int64_t i, F x) {
    const U b = bits(x);
    U h = split_high(b);
    U l = b - (h << 16);
    const __mmask16 nan = nan_mask(x);
    h = (U)_mm512_mask_mov_epi32((__m512i)h, nan, _mm512_set1_epi32(kBf16QuietNan));
    l = (U)_mm512_maskz_mov_epi32(__mmask16(~nan), (__m512i)l);
    put(hi, i, narrow16(h));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), narrow16(l));
  }
};

}  // namespace oh

#elif defined(__AVX2__)
#include <immintrin.h>
#define OH_LANES8 1

namespace oh {

// 8 elements at a time with AVX2 (CPUs without AVX-512: GCC does not
// vectorize Scalar's loop for AVX2). Every operation is Scalar's, lane by
// lane, rounding to bf16 included (the integer round to nearest even, a NaN
// written as 0x7FC0), so the bits are Scalar's.
struct Lanes8 {
  static constexpr bool kThreeStages = false;
  using F = __m256;
  typedef uint32_t U __attribute__((vector_size(32)));
  static constexpr int kWidth = 8;

  static U bits(F x) { return (U)_mm256_castps_si256(x); }
  static F floats(U u) { return _mm256_castsi256_ps((__m256i)u); }
  static __m128i load8(const void* a, int64_t i) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(a) + i));
  }
  static U widen16(__m128i h) { return (U)_mm256_cvtepu16_epi32(h); }
  // The low 16 bits of each lane (truncation, as uint16_t(x)).
  static __m128i narrow16(U u) {
    const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1,
                                          -1, 0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1,
                                          -1, -1);
    const __m256i t = _mm256_shuffle_epi8((__m256i)u, pick);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(t, 0x08));
  }
  static U nan_lanes(F x) { return bits(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }  // all ones if NaN
  static U select(U mask, U a, U b) { return (a & mask) | (b & ~mask); }

  static F get(const float* a, int64_t i) { return _mm256_loadu_ps(a + i); }
  static F get(const bf16* a, int64_t i) { return widen(load8(a, i)); }
#if defined(OH_F16)  // F16C
  static F get(const f16* a, int64_t i) { return _mm256_cvtph_ps(load8(a, i)); }
#endif
  static F widen(__m128i h) { return floats(widen16(h) << 16); }
  static F widen(F x) { return x; }
  // A vector rounded to P, widened back (the Kahan buffer's subtrahend).
  static F widen(F x, float) { return x; }
  static F widen(__m128i h, bf16) { return widen(h); }
#if defined(OH_F16)
  static F widen(__m128i h, f16) { return _mm256_cvtph_ps(h); }
#endif
  static F join_at(const bf16* hi, const int16_t* lo, int64_t i) {
    const U l = (U)_mm256_cvtepi16_epi32(load8(lo, i));  // sign-extended, as int32(lo)
    return floats((widen16(load8(hi, i)) << 16) + l);
  }
  static F sqrt(F x) { return _mm256_sqrt_ps(x); }
  static bool any_bits(F x) { return !_mm256_testz_si256((__m256i)x, (__m256i)x); }
  static F where_equal(F a, F b, F x, F y) {
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_EQ_OQ));
  }
  static U counter(uint64_t first) {
    const U step = {0, 1, 2, 3, 4, 5, 6, 7};
    return uint32_t(first) + step;
  }

  static F to(F x, float) { return x; }
  static F rounded_bf16(F x) {  // Scalar::rounded_bf16, lane by lane
    return floats(nearest_even_bits(bits(x)) << 16);
  }
#if defined(OH_F16)  // F16C
  static __m128i to(F x, f16) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT); }
#endif
  static __m128i to(F x, bf16) {  // round_nearest
    const U u = bits(x);
    const U r = nearest_even_bits(u);
    return narrow16(select(nan_lanes(x), U{} + kBf16QuietNan, r));
  }
  static __m128i truncated(F x, bf16) {  // truncate, lane by lane
    return narrow16(select(nan_lanes(x), U{} + kBf16QuietNan, bits(x) >> 16));
  }
  static F to_stochastic(F x, U, float) { return x; }
  static __m128i to_stochastic(F x, U r, bf16) {
    const U y = stochastic_bits(bits(x), r);
    return narrow16(select(nan_lanes(x), U{} + kBf16QuietNan, y));
  }
#if defined(OH_F16)
  // round_stochastic(x, r, f16), lane by lane.
  static __m128i to_stochastic(F x, U r, f16) {
    const __m128i nearest = to(x, f16{});
    const U abs_mask = U{} + 0x7FFFFFFFu;
    const F ax = floats(bits(x) & abs_mask);
    const U over = bits(_mm256_cmp_ps(floats(bits(_mm256_cvtph_ps(nearest)) & abs_mask), ax,
                                      _CMP_GT_OQ));  // all ones where |nearest| > |x|
    const U word = widen16(nearest);
    const U magnitude = (word & 0x7FFFu) + over;  // minus one where over
    const U down = (word & 0x8000u) | magnitude, up = (word & 0x8000u) | (magnitude + 1u);
    const F down32 = floats(bits(_mm256_cvtph_ps(narrow16(down))) & abs_mask);
    const F up32 = floats(bits(_mm256_cvtph_ps(narrow16(up))) & abs_mask);
    const F frac = (ax - down32) / (up32 - down32);
    const F u = _mm256_cvtepi32_ps((__m256i)(r >> 8)) * _mm256_set1_ps(0x1p-24f);
    const U y = select(bits(_mm256_cmp_ps(u, frac, _CMP_LT_OQ)), up, down);
    const U nonfinite = (U)((bits(x) & 0x7F800000u) == 0x7F800000u);  // all ones where Inf/NaN
    return narrow16(select(nonfinite, word, y));
  }
#endif
  static void put(float* a, int64_t i, F v) { _mm256_storeu_ps(a + i, v); }
  static void put(bf16* a, int64_t i, __m128i v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(reinterpret_cast<uint16_t*>(a) + i), v);
  }
#if defined(OH_F16)
  static void put(f16* a, int64_t i, __m128i v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(reinterpret_cast<uint16_t*>(a) + i), v);
  }
#endif
  static void split_put(bf16* hi, int16_t* lo, int64_t i, F x) {
    const U b = bits(x);
    const U h = split_high(b);
    const U l = b - (h << 16);
    const U nan = nan_lanes(x);
    put(hi, i, narrow16(select(nan, U{} + kBf16QuietNan, h)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + i), narrow16(l & ~nan));
  }
};

// A pair of vectors (the even and the odd elements of a block, Pairs8) with
// each operator of its vector type applied to both; a scalar operand goes to
// both, as with one vector.
template <typename V>
struct Pair {
  V e, o;
};
#define OH_PAIR_OP(op)                                                                   \
  template <typename V>                                                                  \
  inline Pair<V> operator op(Pair<V> a, Pair<V> b) { return {a.e op b.e, a.o op b.o}; }   \
  template <typename V, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>> \
  inline Pair<V> operator op(Pair<V> a, S b) { return {a.e op b, a.o op b}; }             \
  template <typename V, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>> \
  inline Pair<V> operator op(S a, Pair<V> b) { return {a op b.e, a op b.o}; }             \
  template <typename V, typename B>                                                      \
  inline Pair<V>& operator op##=(Pair<V>& a, B b) { return a = a op b; }
OH_PAIR_OP(+)
OH_PAIR_OP(-)
OH_PAIR_OP(*)
OH_PAIR_OP(/)
OH_PAIR_OP(&)
OH_PAIR_OP(|)
OH_PAIR_OP(^)
OH_PAIR_OP(<<)
OH_PAIR_OP(>>)
#undef OH_PAIR_OP

// 16 elements at a time with AVX2, as two vectors of 8: lane k of `e` holds
// element 2k of the block, lane k of `o` element 2k + 1. That order is the
// one 16-bit arrays have for free: 16 bf16 words loaded as 8 words of 32 bits
// hold the even elements in their low halves and the odd ones in their high
// halves, so widening is one shift (even) and one mask (odd), and narrowing
// one shift and one or; Lanes8 spends a zero-extension and a shift on each
// 8 read and two shuffles (one across the 128-bit halves) on each 8 written.
// fp32 arrays are deinterleaved as they are read and interleaved as they are
// written (two shuffles per 8 each way). Every operation is Scalar's, lane by
// lane (the random-bit counter of each lane is its element's index), so the
// bits are Scalar's. A bf16 rounding takes round_nearest's NaN (0x7FC0) by a
// branch on an unordered compare of the pair: rare, it costs less than a
// select in every block. fp16 arrays take Lanes8 (adamw_range).
struct Pairs8 {
  static constexpr bool kThreeStages = false;  // adamw_range's loop (16 vector registers)
  using V = Lanes8::U;
  typedef float F8 __attribute__((vector_size(32)));  // __m256 without its attributes
  using F = Pair<F8>;
  using U = Pair<V>;
  static constexpr int kWidth = 16;

  static U bits(F x) { return {Lanes8::bits(x.e), Lanes8::bits(x.o)}; }
  static F floats(U u) { return {Lanes8::floats(u.e), Lanes8::floats(u.o)}; }
  static V load16(const void* a, int64_t i) {
    return (V)_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(a) + i));
  }
  static void store16(void* a, int64_t i, V words) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(a) + i),
                        (__m256i)words);
  }
  // The 16 words of a block, each in the high half of its element's lane.
  static U high_halves(V words) { return {words << 16, words & 0xFFFF0000u}; }
  // The block's 16 words from each lane's low 16 bits (each lane < 2^16:
  // the roundings' results after their >> 16).
  static V words(U low) { return low.e | (low.o << 16); }
  // The same from each lane's high 16 bits: the even lanes' shifted down,
  // blended with the odd lanes' in place (vpblendw, words 1, 3, 5, 7 of each
  // 128-bit half from the odd vector).
  static V high_words(U u) {
    return (V)_mm256_blend_epi16((__m256i)(u.e >> 16), (__m256i)u.o, 0xAA);
  }
  static bool any_nan(F x) {
    return _mm256_movemask_ps(_mm256_cmp_ps(x.e, x.o, _CMP_UNORD_Q)) != 0;
  }
  // `nan` (round_nearest's NaN, shifted as r is) in the lanes where x is a
  // NaN (the rare branch).
  static U with_nan(F x, U r, uint32_t nan) {
    return {Lanes8::select(Lanes8::nan_lanes(x.e), V{} + nan, r.e),
            Lanes8::select(Lanes8::nan_lanes(x.o), V{} + nan, r.o)};
  }

  static F get(const bf16* a, int64_t i) { return floats(high_halves(load16(a, i))); }
  // fp32 elements i..i+15 into (even, odd): two shuffles per vector.
  static F get(const float* a, int64_t i) {
    const __m256 lo = _mm256_loadu_ps(a + i), hi = _mm256_loadu_ps(a + i + 8);
    const auto order = [](__m256 x) {  // 0 2 8 10 4 6 12 14 -> 0 2 4 6 8 10 12 14
      return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(x), 0xD8));
    };
    return {order(_mm256_shuffle_ps(lo, hi, 0x88)), order(_mm256_shuffle_ps(lo, hi, 0xDD))};
  }
  static void put(float* a, int64_t i, F v) {
    const auto order = [](__m256 x) {  // 0 2 4 6 8 10 12 14 -> 0 2 8 10 4 6 12 14
      return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(x), 0xD8));
    };
    const __m256 e = order(v.e), o = order(v.o);
    _mm256_storeu_ps(a + i, _mm256_unpacklo_ps(e, o));
    _mm256_storeu_ps(a + i + 8, _mm256_unpackhi_ps(e, o));
  }
  static void put(bf16* a, int64_t i, V words) { store16(a, i, words); }
  static F widen(V words) { return floats(high_halves(words)); }
  static F widen(F x, float) { return x; }
  static F widen(V words, bf16) { return widen(words); }
  static F join_at(const bf16* hi, const int16_t* lo, int64_t i) {
    // int32(lo): the low halves' words shifted up and back (arithmetic), the
    // high halves' shifted down (arithmetic).
    typedef int32_t I __attribute__((vector_size(32)));
    const I l = (I)load16(lo, i);
    const U low = {(V)((l << 16) >> 16), (V)(l >> 16)};
    return floats(high_halves(load16(hi, i)) + low);
  }
  static F sqrt(F x) { return {_mm256_sqrt_ps(x.e), _mm256_sqrt_ps(x.o)}; }
  static bool any_bits(F x) {
    return Lanes8::any_bits((__m256)x.e) || Lanes8::any_bits((__m256)x.o);
  }
  static F where_equal(F a, F b, F x, F y) {
    return {Lanes8::where_equal(a.e, b.e, x.e, y.e), Lanes8::where_equal(a.o, b.o, x.o, y.o)};
  }
  static U counter(uint64_t first) {
    const V even = uint32_t(first) + V{0, 2, 4, 6, 8, 10, 12, 14};
    return {even, even + 1u};
  }
  // mix32(counter(first) ^ key) for an even `first` (adamw_range starts
  // Pairs8's blocks at even counters): an odd lane's counter is its even
  // neighbour's with bit 0 set, so its word after the key and mix32's first
  // x ^= x >> 16 is the even lane's with bit 0 flipped, and only the rest of
  // mix32 is computed for both.
  static U mix_counter(uint64_t first, uint32_t key) {
    V x = (uint32_t(first) + V{0, 2, 4, 6, 8, 10, 12, 14}) ^ key;
    x ^= x >> 16;
    return mix32_rest(U{x, x ^ 1u});
  }

  static F to(F x, float) { return x; }
  static F rounded_bf16(F x) { return floats(nearest_even_high(bits(x)) & 0xFFFF0000u); }
  // The bf16 words of a rounding of x whose high halves are y (a *_high
  // form), round_nearest's NaN where x is a NaN.
  static V rounded_words(F x, U y) {
    return high_words(__builtin_expect(any_nan(x), 0) ? with_nan(x, y, kBf16QuietNan << 16) : y);
  }
  static V to(F x, bf16) { return rounded_words(x, nearest_even_high(bits(x))); }
  static V truncated(F x, bf16) { return rounded_words(x, bits(x)); }  // truncate
  static F to_stochastic(F x, U, float) { return x; }
  static V to_stochastic(F x, U r, bf16) { return rounded_words(x, stochastic_high(bits(x), r)); }
  // put_moments_stochastic for two bf16 moments: stochastic_bits before its
  // >> 16, each narrowed by its high halves; one unordered compare of m and v
  // finds a NaN in either.
  static void put_moments_stochastic(bf16* mu, bf16* nu, int64_t i, F m32, F v32, U w) {
    const F nan_either = {_mm256_cmp_ps(m32.e, v32.e, _CMP_UNORD_Q),
                          _mm256_cmp_ps(m32.o, v32.o, _CMP_UNORD_Q)};
    if (__builtin_expect(_mm256_movemask_ps(_mm256_or_ps(nan_either.e, nan_either.o)) != 0, 0)) {
      put(mu, i, to_stochastic(m32, w, bf16{}));
      put(nu, i, to_stochastic(v32, w << 16, bf16{}));
      return;
    }
    put(mu, i, high_words(bits(m32) + (w >> 16)));
    put(nu, i, high_words(bits(v32) + (w & 0xFFFFu)));
  }
  static void split_put(bf16* hi, int16_t* lo, int64_t i, F x) {
    const U b = bits(x);
    U h = split_high(b);
    U l = (b - (h << 16)) & 0xFFFFu;
    if (__builtin_expect(any_nan(x), 0)) {
      h = with_nan(x, h, kBf16QuietNan);
      l = {l.e & ~Lanes8::nan_lanes(x.e), l.o & ~Lanes8::nan_lanes(x.o)};
    }
    store16(hi, i, words(h));
    store16(lo, i, words(l));
  }
};

}  // namespace oh
#endif

namespace oh {

// Whether any of the types is fp16 (whose AVX2 conversions take Lanes8).
template <typename... T>
constexpr bool any_f16() { return (std::is_same_v<T, f16> || ...); }

// How many elements one step of the loop takes: 16 (AVX-512), 8 (AVX2) or 1.
#if defined(OH_LANES16)
constexpr int kLanes = 16;
#elif defined(OH_LANES8)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 1;
#endif

// Whether lanes L hash their counters themselves (mix_counter: Pairs8, whose
// blocks then start at even counters).
template <typename L, typename = void>
struct mixes_counter : std::false_type {};
template <typename L>
struct mixes_counter<L, std::void_t<decltype(L::mix_counter(0, 0))>> : std::true_type {};

// The random words of the elements from counter `first` on (each element's
// index): rounding.random_bits' mix32(index ^ key), lane by lane.
template <typename L>
inline typename L::U counter_hash(uint64_t first, uint32_t key) {
  if constexpr (mixes_counter<L>::value) return L::mix_counter(first, key);
  else return mix32(L::counter(first) ^ key);
}

// The stochastic moment writes of rounding.round_moments with the word w of
// each element: mu rounded with w, nu with swap_halves(w) = (w << 16) |
// (w >> 16); the roundings read a word's high half only (stochastic_bits:
// random >> 16), and w << 16 has the same one in two instructions fewer.
// Lanes16 has its own for two bf16 moments (the same bits).
template <typename L, typename M, typename V>
inline void put_moments_stochastic(M* mu, V* nu, int64_t i, typename L::F m32,
                                   typename L::F v32, typename L::U w) {
  if constexpr (L::kWidth == 16 && std::is_same_v<M, bf16> && std::is_same_v<V, bf16>) {
    L::put_moments_stochastic(mu, nu, i, m32, v32, w);
  } else {
    L::put(mu, i, L::to_stochastic(m32, w, M{}));
    // swap_halves(w); a bf16 nu reads its high half only, which w << 16 is.
    if constexpr (std::is_same_v<V, bf16>) L::put(nu, i, L::to_stochastic(v32, w << 16, V{}));
    else L::put(nu, i, L::to_stochastic(v32, (w << 16) | (w >> 16), V{}));
  }
}

// How the step reads its gradients: as they are (times grad_scale), or
// clipped (clips(s): optax's clip_by_global_norm, XLA's ops on G, then
// grad_scale). kClipFinite is kClip's fast form for bf16 gradients where the
// norm is finite, so no gradient is NaN or infinite (a NaN or an Inf makes the
// norm NaN or Inf), and where fp32 results flush to zero (MXCSR.FTZ, as in
// XLA's threads), so no quotient or product is subnormal: the roundings to
// bf16 then need no NaN or subnormal fix-up (clip_read picks the mode).
// kClipFiniteUnit is kClipFinite where G(max_norm) is 1 (the usual
// max_norm): the quotient, a bf16 value, times 1 is itself, and rounding it
// to bf16 again changes nothing, so the product and its rounding are left out.
// XLA:CPU divides bf16 gradients by the norm as a product with the norm's
// fp32 reciprocal (its rewrite of a division by a broadcast scalar), and
// fp32 ones by a true division; the reads do the same (read_grad).
enum GradRead : int { kPlain = 0, kClip = 1, kClipFinite = 2, kClipFiniteUnit = 3 };

// Whether this thread's fp32 results flush to zero (x86 MXCSR.FTZ).
inline bool flushes_to_zero() {
#if defined(__SSE__)
  return (_mm_getcsr() & 0x8000u) != 0;
#else
  return false;
#endif
}

// Whether the kernel reads gradients of type G clipped: bf16 and fp32, the
// types optax_half clips in the kernel (clipping.ClipRead.folds; XLA may
// divide fp16 ones through a rounded reciprocal); the JAX entry refuses a
// clipped read of any other type.
template <typename G>
constexpr bool clip_reads() { return std::is_same_v<G, bf16> || std::is_same_v<G, float>; }

// The read of a tensor's gradients of type G with scalars s (once per
// tensor, on the thread that steps it: kClipFinite reads its MXCSR).
template <typename G>
inline GradRead clip_read(const Scalars& s) {
  if (!clip_reads<G>() || !clips(s)) return kPlain;
  const bool finite = std::isnormal(s.clip_div) && std::isfinite(s.clip_mul);
  if (!(std::is_same_v<G, bf16> && finite && flushes_to_zero())) return kClip;
  return s.clip_mul == 1.0f ? kClipFiniteUnit : kClipFinite;
}

// The factor a clipped read of G multiplies by: for bf16, 1 / norm in fp32,
// as XLA computes it (on the thread that steps, whose MXCSR is XLA's);
// unused otherwise.
template <typename G, int READ>
inline float clip_reciprocal(const Scalars& s) {
  return std::is_same_v<G, bf16> && READ != kPlain ? 1.0f / s.clip_div : 1.0f;
}

// Gradient element(s) i widened to fp32 as the step reads them (READ: a
// GradRead): optax's clip is (g / norm) * max_norm, each op in fp32 and
// rounded to G, the division as XLA computes it (GradRead: for bf16 the
// product with recip = clip_reciprocal<G, READ>(s)), then * grad_scale.
template <typename L, typename G, int READ>
inline typename L::F read_grad(const G* g, int64_t i, const Scalars& s, float recip) {
  typename L::F gi = L::get(g, i);
  if constexpr (READ == kClipFinite || READ == kClipFiniteUnit) {
    gi = L::rounded_bf16(gi * recip);
    if constexpr (READ == kClipFinite) gi = L::rounded_bf16(gi * s.clip_mul);
  } else if constexpr (READ == kClip) {
    const auto divided = [&] {
      if constexpr (std::is_same_v<G, bf16>) return gi * recip;
      else return gi / s.clip_div;
    };
    const auto quotient = L::to(divided(), G{});
    gi = L::widen(L::to(L::widen(quotient, G{}) * s.clip_mul, G{}), G{});
  }
  return gi * s.grad_scale;
}

// The AdamW step of the L::kWidth elements from i, on lanes L (Scalar,
// Lanes8, Pairs8 or Lanes16): one source for all, line for line
// torch_bridge.adam.adamw_step, in two halves. adamw_math reads the elements
// (gi: the gradient elements as read, read_grad), writes the moments and
// returns the fp32 value the param's write rounds: the new param x + u, or
// the update u (kDirect, kUpdate); adamw_write rounds and writes it. The
// vector loop runs the math of the next block before the write of this one
// (adamw_range), so the write's roundings overlap the next block's divide
// and square root.
template <typename L, typename P, typename M, typename V, int MODE, bool SR>
inline __attribute__((always_inline)) typename L::F adamw_math(
    int64_t i, uint64_t index0, const P* p, typename L::F gi, M* __restrict mu, V* __restrict nu,
    const float* master, const int16_t* low, const P* comp, const Scalars& s, uint32_t key_m,
    bool keep) {
  using F = typename L::F;
  F x;
  if constexpr (MODE == kMaster) {
    // The master follows the param: where the param is not the master's
    // rounding (it was written from outside the optimizer: a checkpoint
    // loaded into the model), the step starts from the param; with keep
    // (those elements are where the last update missed) from the master.
    const F m = L::get(master, i);
    if (keep) {
      x = m;
    } else {
      const F pw = L::get(p, i);
      x = L::where_equal(L::widen(L::to(m, P{}), P{}), pw, m, pw);
    }
  } else if constexpr (MODE == kSplit) x = L::join_at(p, low, i);
  else if constexpr (MODE == kKahan) x = L::get(p, i) + L::get(comp, i);
  else x = L::get(p, i);
  const F m32 = s.b1 * L::get(mu, i) + s.one_minus_b1 * gi;
  const F v32 = s.b2 * L::get(nu, i) + s.one_minus_b2 * (gi * gi);
  const F m_hat = m32 * s.inv_bc1;
  const F v_hat = v32 * s.inv_bc2;
  F u = m_hat / (L::sqrt(v_hat) + s.eps);
  if (s.weight_decay != 0.0f) u = u + s.weight_decay * x;  // none at 0: an Inf x stays one
  u = -s.lr * u;
  if constexpr (SR) {  // rounding.round_moments: one word w, swap_halves(w) for nu
    // The element index is the random-bit counter, a uint32 (mod 2^32) as in
    // rounding.random_bits; counting it in 32 bits keeps its vector lanes 32-bit.
    put_moments_stochastic<L>(mu, nu, i, m32, v32, counter_hash<L>(index0 + uint64_t(i), key_m));
  } else {
    L::put(mu, i, L::to(m32, M{}));
    L::put(nu, i, L::to(v32, V{}));
  }
  if constexpr (MODE == kDirect || MODE == kUpdate) return u;
  else return x + u;
}

// Whether lanes L check a block for an exact landing (L::lands: Lanes16,
// bf16 params), so that a block that lands on its targets skips the
// landing's two roundings. (Pairs8 has 16 vector registers: the checks and
// their bookkeeping made its loop spill, slower than the roundings.)
template <typename L, typename P, typename = void>
struct lands_fast : std::false_type {};
template <typename L>
struct lands_fast<L, bf16, std::void_t<decltype(L::lands(typename L::F{}, typename L::F{}))>>
    : std::true_type {};
template <typename L, typename P>
inline bool all_land(typename L::F t32, typename L::F pw) {
  if constexpr (lands_fast<L, P>::value) return L::lands(t32, pw);
  else return false;
}

// The update d = t - p in P (docs/algorithms.md#landing-exactly), and its
// fp32 value: bf16 truncates d (its high half, one AND), fp16 rounds it to
// nearest (one conversion either way). Exact where d fits P.
template <typename L, typename P>
inline auto update_of(typename L::F d, P) {
  if constexpr (std::is_same_v<P, bf16>) {
    return std::make_pair(L::truncated(d, bf16{}), L::floats(L::bits(d) & 0xFFFF0000u));
  } else {
    const auto u = L::to(d, P{});
    return std::make_pair(u, L::widen(u, P{}));
  }
}

// A block's miss marks in the vector lanes (Lanes16, Lanes8, Pairs8; Scalar
// hashes element by element): lane masks, 16-bit words one per lane, sums.
template <typename L, typename = void>
struct is_pairs : std::false_type {};  // Pairs8: even and odd elements apart
template <typename L>
struct is_pairs<L, std::void_t<typename L::V>> : std::true_type {};

// All ones in the lanes where a == b (ordered: a NaN equals nothing), and
// in the others.
template <typename L>
inline typename L::U equal_lanes(typename L::F a, typename L::F b) {
  const typename L::F zero = L::floats(L::bits(a) & 0u);
  return L::bits(L::where_equal(a, b, L::floats(L::bits(zero) ^ 0xFFFFFFFFu), zero));
}
template <typename L>
inline typename L::U unequal_lanes(typename L::F a, typename L::F b) {
  return equal_lanes<L>(a, b) ^ 0xFFFFFFFFu;
}

// 16-bit words as the lanes' loads and roundings hold them, one per lane
// (zero-extended), and back.
template <typename L, typename W>
inline typename L::U lane_words16(W words) {
  if constexpr (is_pairs<L>::value) return {words & 0xFFFFu, words >> 16};
  else return L::widen16(words);
}
template <typename L>
inline auto words16_of(typename L::U lanes) {
  if constexpr (is_pairs<L>::value) return L::words(lanes);
  else return L::narrow16(lanes);
}
template <typename L, typename P>
inline typename L::U words16(const P* p, int64_t i) {
  if constexpr (is_pairs<L>::value || L::kWidth == 16) return lane_words16<L>(L::load16(p, i));
  else return L::widen16(L::load8(p, i));
}

template <typename U>
inline uint32_t lane_sum(U x) {
  uint32_t sum = 0;
  for (size_t j = 0; j < sizeof(U) / sizeof(uint32_t); ++j) sum += x[j];
  return sum;
}
#if defined(OH_LANES8)
template <typename V>
inline uint32_t lane_sum(Pair<V> x) { return lane_sum(x.e) + lane_sum(x.o); }
#endif

// compensation.landing_mark summed over the `counted` lanes of a block whose
// first element has index `first`: mix32(index ^ mix32(bits | 0x10000)) each
// (bits: the landed param's 16 bits; 0xFFFF for any NaN), mod 2^32.
template <typename L>
inline uint32_t lane_marks(uint64_t first, typename L::U bits, typename L::U counted) {
  return lane_sum(mix32(L::counter(first) ^ mix32(bits | 0x10000u)) & counted);
}

// y: adamw_math's value (x + u; u for kDirect and kUpdate). A 16-bit param
// lands (docs/algorithms.md#landing-exactly): the mode rounds x' = y to its
// target t (nearest, stochastic, split's high half), the update is
// u = update_of(f32(t) - f32(p)), the param lands on round(f32(p) + f32(u))
// (what optax.apply_updates, p + u and torch's add_ compute), and the buffer
// is written against the landed param. p_out takes u (UPDATE: JAX's
// tx.update) or the landed param.
template <typename L, typename P, int MODE, bool UPDATE = false, bool CHECK = false>
inline __attribute__((always_inline)) bool adamw_write(
    int64_t i, uint64_t index0, const P* p, P* p_out, typename L::F y, float* __restrict master,
    int16_t* __restrict low, P* __restrict comp, uint32_t key_p, uint32_t* mark = nullptr) {
  using F = typename L::F;
  if constexpr (MODE == kDirect) {
    L::put(p_out, i, L::to(L::get(p, i) + y, P{}));
  } else if constexpr (MODE == kUpdate) {
    L::put(p_out, i, L::to(y, P{}));
  } else {
    const F x_new = y;
    const F pw = L::get(p, i);  // before p_out's element is written (p_out may be p)
    const auto update_to = [&](F t32) { return update_of<L>(t32 - pw, P{}); };
    const auto landing = [&](auto u) { return L::to(pw + u.second, P{}); };
    const auto put_out = [&](auto u, auto landed) {
      if constexpr (UPDATE) L::put(p_out, i, u);
      else L::put(p_out, i, landed);
    };
    // CHECK (adamw_range): whether every lane of the block lands on its target
    // t32 (L::lands, where L has it): u = t - p and p + u = t then need no
    // rounding, and the landed param is t. The write returns whether the
    // check failed.
    constexpr bool kFast = CHECK && lands_fast<L, P>::value;
    bool missed = false;
    const auto lands = [&](F t32) {
      const bool all = __builtin_expect(all_land<L, P>(t32, pw), 1);
      missed = !all;
      return all;
    };
    // Writes u or the landed param for the target t; returns the landed param
    // widened. (Kahan's write makes its own block check: `checks` false.)
    const auto land = [&](auto t, auto checks) {
      const F t32 = L::widen(t, P{});
      if constexpr (kFast && decltype(checks)::value) {
        if (lands(t32)) {
          put_out(L::exact(t32 - pw, P{}), t);
          return t32;
        }
      }
      const auto u = update_to(t32);
      const auto landed = landing(u);
      put_out(u.first, landed);
      return L::widen(landed, P{});
    };
    if constexpr (MODE == kMaster && !UPDATE) {
      // In place the param is written: the master's rounding; the master x_new, never rounded.
      L::put(p_out, i, L::to(x_new, P{}));
      L::put(master, i, x_new);
    } else if constexpr (MODE == kMaster) {
      // u towards the master's rounding t; the master x_new, never rounded (where p + u
      // misses, it is marked: the mark's sum, below).
      L::put(master, i, x_new);
      const auto t = L::to(x_new, P{});
      const F t32 = L::widen(t, P{});
      if constexpr (kFast) {
        if (lands(t32)) {
          put_out(L::exact(t32 - pw, P{}), t);
          return false;
        }
      }
      // Where p + u misses t and t is out of reach from where it lands too, u = -p: the
      // param lands on 0, from which the next step reaches its target (rounding.land_master;
      // a NaN t, or an Inf or NaN p, lands as land's). Rare: fixed up element by element.
      const auto u = update_to(t32);
      put_out(u.first, t32);
      const auto landed16 = landing(u);
      const F zero = L::floats(L::bits(t32) & 0u), one = L::floats(L::bits(zero) | 0x3F800000u);
      const F off = L::where_equal(L::widen(landed16, P{}), t32, zero, one);
      if constexpr (L::kWidth > 1) {
        if (L::any_bits(off)) {  // in the lanes: near zero crossings miss often
          using U = typename L::U;
          const F lj = L::widen(landed16, P{});
          const U missed = unequal_lanes<L>(lj, t32);  // off, as a mask
          const U t_nan = unequal_lanes<L>(t32, t32);
          const F again = L::widen(L::to(lj + update_of<L>(t32 - lj, P{}).second, P{}), P{});
          const U to_zero = missed & unequal_lanes<L>(again, t32) & (t_nan ^ 0xFFFFFFFFu) &
                            equal_lanes<L>(pw - pw, zero);
          const U kept = to_zero ^ 0xFFFFFFFFu;  // the lanes left where p + u lands
          if (L::any_bits(L::floats(to_zero))) {  // -p: lands on +0
            L::put(p_out, i, words16_of<L>(((words16<L>(p, i) ^ 0x8000u) & to_zero) |
                                           (lane_words16<L>(u.first) & kept)));
          }
          if (mark != nullptr) {
            const F at = L::floats(L::bits(lj) & kept);
            const U at_nan = unequal_lanes<L>(at, at);
            const U counted = missed & unequal_lanes<L>(at, t32) & ((at_nan & t_nan) ^ 0xFFFFFFFFu);
            const U bits = (at_nan & 0xFFFFu) |
                           ((at_nan ^ 0xFFFFFFFFu) & kept & lane_words16<L>(landed16));
            *mark += lane_marks<L>(index0 + uint64_t(i), bits, counted);
          }
        }
      } else if (__builtin_expect(L::any_bits(off), 0)) {  // rare: element by element
        alignas(64) float missed[L::kWidth], targets[L::kWidth];
        L::put(missed, 0, off);
        alignas(64) P lands[L::kWidth];
        L::put(targets, 0, t32);
        L::put(lands, 0, landed16);
        for (int j = 0; j < L::kWidth; ++j) {
          if (missed[j] == 0.0f) continue;
          const float tj = targets[j], lj = widen(lands[j]), pj = widen(p[i + j]);
          const float again = widen(Scalar::to(lj + update_of<Scalar>(tj - lj, P{}).second, P{}));
          const bool to_zero = again != tj && tj == tj && pj - pj == 0.0f;
          if (to_zero) p_out[i + j].bits = p[i + j].bits ^ 0x8000u;  // -p: lands on +0
          // The mark of where p + u misses t (compensation.landing_mark; every NaN alike).
          const float at = to_zero ? 0.0f : lj;
          if (mark != nullptr && at != tj && !(at != at && tj != tj)) {  // NaN: like any NaN
            const uint32_t bits = at != at ? 0xFFFFu : to_zero ? 0u : lands[j].bits;
            *mark += mix32(uint32_t(index0 + uint64_t(i + j)) ^ mix32(bits | 0x10000u));
          }
        }
      }
    } else if constexpr (MODE == kSplit && !UPDATE) {
      // In place the param is the high half and the buffer the low half: the master exactly.
      L::split_put(reinterpret_cast<bf16*>(p_out), low, i, x_new);
    } else if constexpr (MODE == kSplit) {
      // split's high half through p_out (read back); the master, split again, against what
      // landed; then u over the high half.
      L::split_put(reinterpret_cast<bf16*>(p_out), low, i, x_new);
      const F t32 = L::get(p_out, i);
      if constexpr (kFast) {
        if (lands(t32)) {  // the high half is the landed param
          L::put(p_out, i, L::exact(t32 - pw, P{}));
          return false;
        }
      }
      const auto u = update_to(t32);
      const auto landed = landing(u);
      const F landed32 = L::widen(landed, P{});
      L::split_put(reinterpret_cast<bf16*>(p_out), low, i,
                   L::where_equal(landed32, t32, x_new, landed32));
      put_out(u.first, landed);
    } else if constexpr (MODE == kKahan) {
      if constexpr (kFast) {
        // One check for the block's three roundings: x' rounded to t without
        // fix-ups (to_normal), the residual r = x' - t (a NaN where x' is a
        // NaN or an Inf, subnormal where x' is, which vcvtneps2bf16 reads as
        // 0) and the landing; a block that needs more takes the general write.
        const auto t = L::to_normal(x_new, P{});
        const F t32 = L::widen(t, P{});
        const F r = x_new - t32;
        if (__builtin_expect(L::lands_normal(t32, pw, r), 1)) {
          put_out(L::exact(t32 - pw, P{}), t);
          L::put(comp, i, L::to_normal(r, P{}));
          return false;
        }
        missed = true;
      }
      const F landed = land(L::to(x_new, P{}), std::false_type{});
      L::put(comp, i, L::to(x_new - landed, P{}));
    } else if constexpr (MODE == kStochastic) {
      land(L::to_stochastic(x_new, counter_hash<L>(index0 + uint64_t(i), key_p), P{}),
           std::true_type{});
    } else {
      land(L::to(x_new, P{}), std::true_type{});
    }
    return missed;
  }
  return false;
}

// One AdamW step on elements [begin, end) of one tensor, whose element 0 has
// random-bit counter `index0` (its row-major index in the whole tensor: 0, or
// a shard's offset in it). P: param, G: grad,
// M, V: moment types; Buf: the per-mode buffer (fp32 master, int16 low half,
// or the Kahan compensation of type P); SR: stochastic moment writes.
// The new param goes to p_out, which may be p itself (torch: in place) or
// another array, possibly the gradient's (JAX, whose update needs the old
// param too); the elements of p and g are read before p_out's same elements
// are written. The moments and the buffer are updated in place. READ: how
// the gradients are read (GradRead). With L::kThreeStages (Lanes16) the
// vector loop is three stages deep: while it rounds and writes block k's
// param (adamw_write), it has computed block k + 1's fp32 values and written
// its moments (adamw_math), and read block k + 2's gradients (read_grad: a
// clip's divide and roundings), so each block's roundings overlap the next
// block's divide and square root and the read is off the chain. AVX2's 16
// registers do not hold that loop: it spills, and its speed then depends on
// where the thread's stack lies (docs/algorithms.md#vector-lanes), so Pairs8
// and Lanes8 take one stage with the gradients read one block ahead. Every
// element of p and g is read before p_out's same element is written (reads
// only run ahead).
template <typename P, typename G, typename M, typename V, int MODE, bool SR, int READ = kPlain,
          bool UPDATE = false>
void adamw_range(int64_t begin, int64_t end, uint64_t index0, const P* p, P* p_out, const G* g,
                 M* __restrict mu, V* __restrict nu, void* buffer, const Scalars& scalars,
                 uint32_t key_p, uint32_t key_m, bool keep = false, uint32_t* marks = nullptr) {
  uint32_t mark_sum = 0;  // the mark of this range's misses (kMaster update), added to *marks
  uint32_t* const mark = (MODE == kMaster && UPDATE && marks != nullptr) ? &mark_sum : nullptr;
  float* master = static_cast<float*>(buffer);
  int16_t* low = static_cast<int16_t*>(buffer);
  P* comp = static_cast<P*>(buffer);
  const Scalars s = scalars;  // a local copy: the stores cannot alias it, it stays in registers
  const float clip_recip = clip_reciprocal<G, READ>(s);
  int64_t i = begin;
#if defined(OH_LANES16) || defined(OH_LANES8)
#if defined(OH_LANES16)
  using L = Lanes16;
#else
  using L = std::conditional_t<any_f16<P, G, M, V>(), Lanes8, Pairs8>;
#endif
  constexpr int64_t W = L::kWidth;
  using F = typename L::F;
  // (Every lambda of the loop always inlined: GCC's own choice left some as
  // calls in the torch library, passing vectors through memory.)
  const auto read = [&](int64_t j) __attribute__((always_inline)) {
    return read_grad<L, G, READ>(g, j, s, clip_recip);
  };
  const auto math = [&](int64_t j, F gj) __attribute__((always_inline)) {
    return adamw_math<L, P, M, V, MODE, SR>(j, index0, p, gj, mu, nu, master, low, comp, s,
                                            key_m, keep);
  };
  if constexpr (mixes_counter<L>::value && (SR || MODE == kStochastic)) {  // even counters
    if (i < end && ((index0 + uint64_t(i)) & 1u)) {  // that element alone, as the tail's
      const float y = adamw_math<Scalar, P, M, V, MODE, SR>(
          i, index0, p, read_grad<Scalar, G, READ>(g, i, s, clip_recip), mu, nu, master, low,
          comp, s, key_m, keep);
      adamw_write<Scalar, P, MODE, UPDATE>(i, index0, p, p_out, y, master, low, comp, key_p, mark);
      ++i;
    }
  }
  // The blocks from i to stop (stop - i a multiple of W, or the range's end),
  // with the write's block check for an exact landing (CHECK: adamw_write) or
  // without; returns how many blocks failed it.
  const auto blocks = [&](auto check, int64_t stop) __attribute__((always_inline)) {
    int misses = 0;
    const auto write = [&](int64_t j, F y) __attribute__((always_inline)) {
      misses += adamw_write<L, P, MODE, UPDATE, decltype(check)::value>(
          j, index0, p, p_out, y, master, low, comp, key_p, mark);
    };
    if constexpr (L::kThreeStages) {
      if (i + 2 * W <= stop) {
        F y = math(i, read(i));
        F g_next = read(i + W);
        for (; i + 3 * W <= stop; i += W) {
          const F g_after = read(i + 2 * W);
          const F y_next = math(i + W, g_next);
          write(i, y);
          y = y_next;
          g_next = g_after;
        }
        const F y_next = math(i + W, g_next);
        write(i, y);
        write(i + W, y_next);
        i += 2 * W;
      }
    } else if (i + 2 * W <= stop) {  // one stage, the gradients read one block ahead
      F g_next = read(i);
      for (; i + 2 * W <= stop; i += W) {
        const F g_after = read(i + W);
        write(i, math(i, g_next));
        g_next = g_after;
      }
      write(i, math(i, g_next));
      i += W;
    }
    if (i + W <= stop) {  // a range of one block (W to 2W - 1 elements)
      write(i, math(i, read(i)));
      i += W;
    }
    return misses;
  };
  // The check saves the landing's roundings where blocks pass it, and costs a
  // mispredicted branch where one fails, as near zero crossings (weights
  // within a step of 0) often do. So the blocks go in windows of kWindow:
  // where more than 1 in 8 of a checked window failed, the next kRest windows
  // go without the check (each kind of window a loop of its own, so the
  // unchecked one is the plain write's loop).
  if constexpr (lands_fast<L, P>::value) {
    constexpr int64_t kWindow = 64 * W;
    constexpr int kRest = 31;
    int rest = 0;
    while (i + W <= end) {
      const int64_t stop = std::min(end, i + kWindow);
      if (rest == 0) {
        if (blocks(std::true_type{}, stop) > kWindow / W / 8) rest = kRest;
      } else {
        blocks(std::false_type{}, stop);
        --rest;
      }
    }
  } else {
    blocks(std::false_type{}, end);
  }
#endif
  // The tail, one element at a time (Scalar). (Written out, as the odd first
  // element above: a lambda here that takes s by reference keeps s in memory,
  // and the vector loop then reloads it after its stores.)
  for (; i < end; ++i) {
    const float y = adamw_math<Scalar, P, M, V, MODE, SR>(
        i, index0, p, read_grad<Scalar, G, READ>(g, i, s, clip_recip), mu, nu, master, low, comp,
        s, key_m, keep);
    adamw_write<Scalar, P, MODE, UPDATE>(i, index0, p, p_out, y, master, low, comp, key_p, mark);
  }
  if (mark != nullptr && mark_sum != 0) __atomic_fetch_add(marks, mark_sum, __ATOMIC_RELAXED);
}

// Whether fl(widen(g[i]) * scale) is finite for every i in [begin, end): the
// gradient check of optax_half's dynamic_loss_scale (scale = 1 / the loss
// scale) and skip_nonfinite (scale = 1), as XLA computes it (the same fp32
// multiply; whether subnormals are flushed changes no product's finiteness).
// One pass over g: a NaN or an Inf has all exponent bits set.
template <typename L, typename G>
inline typename L::U nonfinite_lanes(const G* g, int64_t i, float scale) {
  const typename L::U exponent = L::bits(L::get(g, i) * scale) & 0x7F800000u;
  return (typename L::U)(exponent == 0x7F800000u);
}

template <typename G>
bool all_finite_range(const G* g, int64_t begin, int64_t end, float scale) {
  int64_t i = begin;
  uint32_t bad = 0;
#if defined(OH_LANES16) || defined(OH_LANES8)
#if defined(OH_LANES16)
  using L = Lanes16;
#else
  using L = Lanes8;
#endif
  typename L::U any = {};
  for (; i + L::kWidth <= end; i += L::kWidth) any |= nonfinite_lanes<L>(g, i, scale);
  for (int k = 0; k < L::kWidth; ++k) bad |= any[k];
#endif
  for (; i < end; ++i) bad |= nonfinite_lanes<Scalar>(g, i, scale);
  return bad == 0;
}

}  // namespace oh
