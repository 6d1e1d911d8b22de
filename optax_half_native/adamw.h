// The AdamW core of optax_half / torch_bridge as one loop over the elements,
// for a CPU kernel behind both frameworks. Spec: docs/algorithms.md, "AdamW
// core" and "Native CPU kernel". Every line mirrors torch_bridge.adam.adamw_step
// (and optax_half.adam.scale_by_adamw): the same operations in the same order,
// each rounded to fp32 (built with -ffp-contract=off and without -ffast-math,
// so no FMA and no reassociation), so the bits equal theirs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace oh {

struct bf16 {
  uint16_t bits;
};

constexpr uint16_t kBf16QuietNan = 0x7FC0;
constexpr uint32_t kM1 = 0x21F0AAADu, kM2 = 0x735A2D97u, kGolden = 0x9E3779B9u;

inline uint32_t as_u32(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float as_f32(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

// Exact widening to fp32.
inline float widen(bf16 h) { return as_f32(uint32_t(h.bits) << 16); }
inline float widen(float x) { return x; }

// fp32 -> bf16, round to nearest even; NaN -> the quiet NaN 0x7FC0.
inline bf16 round_nearest(float x, bf16) {
  uint32_t u = as_u32(x);
  uint16_t r = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return bf16{x != x ? kBf16QuietNan : r};
}
inline float round_nearest(float x, float) { return x; }

// Stores through the element, not the struct: GCC does not vectorize a loop
// that copies a struct local to memory.
inline void store(bf16* to, bf16 v) { to->bits = v.bits; }
inline void store(float* to, float v) { *to = v; }

// rounding.mix32: a bijective 32-bit hash.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= kM1;
  x ^= x >> 15;
  x *= kM2;
  x ^= x >> 15;
  return x;
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
  uint16_t y = uint16_t((as_u32(x) + (bits >> 16)) >> 16);
  return x != x ? round_nearest(x, like) : bf16{y};
}
inline float round_stochastic(float x, uint32_t, float) { return x; }

// rounding.split_f32 / join_f32: fp32 = bf16 high half + int16 low half.
inline void split(float x, bf16* hi, int16_t* lo) {
  uint32_t bits = as_u32(x);
  uint32_t h = (bits + 0x8000u) >> 16;
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

// The fp32 scalars of one tensor's step, as torch_bridge.adam computes them.
struct Scalars {
  float lr, b1, b2, one_minus_b1, one_minus_b2, inv_bc1, inv_bc2, eps, weight_decay;
};

// One AdamW step on elements [begin, end) of one tensor, whose element 0 has
// random-bit counter `index0` (its row-major index in the whole tensor: 0, or
// a shard's offset in it). P: param, G: grad,
// M, V: moment types; Buf: the per-mode buffer (fp32 master, int16 low half,
// or the Kahan compensation of type P); SR: stochastic moment writes.
// The new param goes to p_out, which may be p itself (torch: in place) or
// another array, possibly the gradient's (JAX, whose update needs the old
// param too); element i of p and g is read before p_out[i] is written. The
// moments and the buffer are updated in place.
template <typename P, typename G, typename M, typename V, int MODE, bool SR>
void adamw_range(int64_t begin, int64_t end, uint64_t index0, const P* p, P* p_out, const G* g,
                 M* __restrict mu, V* __restrict nu, void* buffer, const Scalars& s,
                 uint32_t key_p, uint32_t key_mu, uint32_t key_nu) {
  float* __restrict master = static_cast<float*>(buffer);
  int16_t* __restrict low = static_cast<int16_t*>(buffer);
  P* __restrict comp = static_cast<P*>(buffer);
  const float lr = s.lr, b1 = s.b1, b2 = s.b2, omb1 = s.one_minus_b1, omb2 = s.one_minus_b2;
  const float ibc1 = s.inv_bc1, ibc2 = s.inv_bc2, eps = s.eps, wd = s.weight_decay;
  // The element index is the random-bit counter, a uint32 (mod 2^32) as in
  // rounding.random_bits; counting it in 32 bits keeps its vector lanes 32-bit.
  uint32_t index = uint32_t(index0 + uint64_t(begin));
  for (int64_t i = begin; i < end; ++i, ++index) {
    const float gi = widen(g[i]);
    float x;
    if constexpr (MODE == kMaster) x = master[i];
    else if constexpr (MODE == kSplit) x = join(p[i], low[i]);
    else if constexpr (MODE == kKahan) x = widen(p[i]) + widen(comp[i]);
    else x = widen(p[i]);
    const float m32 = b1 * widen(mu[i]) + omb1 * gi;
    const float v32 = b2 * widen(nu[i]) + omb2 * (gi * gi);
    const float m_hat = m32 * ibc1;
    const float v_hat = v32 * ibc2;
    float u = m_hat / (std::sqrt(v_hat) + eps);
    u = u + wd * x;
    u = -lr * u;
    if constexpr (MODE == kDirect) {
      store(&p_out[i], round_nearest(widen(p[i]) + u, P{}));
    } else if constexpr (MODE == kUpdate) {
      store(&p_out[i], u);
    } else {
      const float x_new = x + u;
      if constexpr (MODE == kMaster) {
        master[i] = x_new;
        store(&p_out[i], round_nearest(x_new, P{}));
      } else if constexpr (MODE == kSplit) {
        split(x_new, reinterpret_cast<bf16*>(&p_out[i]), &low[i]);
      } else if constexpr (MODE == kKahan) {
        const P new_p = round_nearest(x_new, P{});
        store(&comp[i], round_nearest(x_new - widen(new_p), P{}));
        store(&p_out[i], new_p);
      } else if constexpr (MODE == kStochastic) {
        store(&p_out[i], round_stochastic(x_new, mix32(index ^ key_p), P{}));
      } else {
        store(&p_out[i], round_nearest(x_new, P{}));
      }
    }
    store(&mu[i], SR ? round_stochastic(m32, mix32(index ^ key_mu), M{}) : round_nearest(m32, M{}));
    store(&nu[i], SR ? round_stochastic(v32, mix32(index ^ key_nu), V{}) : round_nearest(v32, V{}));
  }
}

}  // namespace oh
