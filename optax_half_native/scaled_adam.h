// ScaledAdam's per-element work (docs/algorithms.md#scaledadam-and-eden) as
// two loops over a tensor's elements, for torch_bridge.scaled_adam's CPU path:
//
//  * scaled_adam_sums: the tensor-wide sums a step needs, in one pass over
//    the param and the gradient: sum(p g) (the scale gradient, before the
//    clipping factor) and, where asked, sum((g r)^2) (the clipping norm's
//    term, r the tensor's stored RMS) and sum(p p) (the RMS at a size
//    update); a sum not asked for is 0. Each product
//    is the framework's fp32 product; the sums are float64, per fixed block
//    of kSumBlock elements in 16 lanes, the blocks then added in order: the
//    result depends on neither the thread count nor the lane width, and is
//    the exact sum of the fp32 products to about 1e-13 relative.
//  * scaled_adam_range: the step itself, line for line
//    torch_bridge.scaled_adam.ScaledAdam._step_one after its tensor-wide
//    scalars are known, every operation rounded to fp32 as torch's eager
//    ops round it (built like adamw.h: no FMA, no reassociation).
//
// KAHAN: the param is the 16-bit p with its Kahan compensation c (the
// wrapper optax_half.kahan_summation around ScaledAdam): both passes read
// x = p + c in fp32 where they read the param, delta and v are fp32 (the
// state ScaledAdam keeps for the fp32 x), and the step ends as the wrapper
// does: x' = x + delta, u = round(round(x') - p), p' = round(p + u),
// c' = round(x' - p') (docs/algorithms.md#landing-exactly); p' is written to
// `p_out` (param dtype: the param's own buffer in place), or u with UPDATE
// (JAX's tx.update, into the gradient's buffer).
#pragma once

#include <vector>

#include "adamw_threads.h"

namespace oh {

constexpr int64_t kSumBlock = 4096;  // elements of one tensor per float64 partial sum
constexpr int kSumLanes = 16;

// The fp32 scalars of one tensor's ScaledAdam step (ScaledAdam._step_one):
// grad_scale, the clipping factor every gradient element is multiplied by
// as it is read (1: no clipping); inv_bc2, 1 / (1 - b2^t) or 1 where the
// step does not correct (x * 1 is x); alpha = -lr (1 - b1) max(rms, min_rms);
// scale_step, the size update's log-scale step (used where `size` is set).
struct ScaledAdamScalars {
  float grad_scale, b1, b2, one_minus_b1, one_minus_b2, inv_bc2, eps, alpha, scale_step, rms;
};

// One tensor of a ScaledAdam call. Mirrored by optax_half_native.SCALED_ADAM_DTYPE.
struct ScaledAdamTensor {
  int64_t numel;
  uint64_t p, g, delta, v;  // addresses: param, gradient, delta (param dtype), exp_avg_sq
  uint64_t sums;            // double[3 * blocks]: per block, sum (g r)^2, sum p g, sum p p
  ScaledAdamScalars s;
  int32_t size;             // 1: this step is a size update (adds (1 - b1) p scale_step)
  int32_t want;             // sums: 1 | 2 takes sum (g r)^2 | sum p p too (sum p g always)
  uint64_t comp;            // KAHAN: the compensation (param dtype), else 0
  uint64_t p_out;           // KAHAN: where p' goes (param dtype; p's own buffer in place), else 0
};

extern "C" int oh_scaled_adam_struct_size() { return int(sizeof(ScaledAdamTensor)); }
extern "C" int oh_scaled_adam_field_offset(int k) {
  const size_t offsets[] = {offsetof(ScaledAdamTensor, numel), offsetof(ScaledAdamTensor, p),
                            offsetof(ScaledAdamTensor, g), offsetof(ScaledAdamTensor, delta),
                            offsetof(ScaledAdamTensor, v), offsetof(ScaledAdamTensor, sums),
                            offsetof(ScaledAdamTensor, s), offsetof(ScaledAdamTensor, size),
                            offsetof(ScaledAdamTensor, want), offsetof(ScaledAdamTensor, comp),
                            offsetof(ScaledAdamTensor, p_out)};
  return k >= 0 && k < int(sizeof(offsets) / sizeof(offsets[0])) ? int(offsets[k]) : -1;
}

// The fp32 products of the sums for the L::kWidth elements from i, stored
// at `at` into each of the three arrays.
template <typename L, bool KAHAN, typename P, typename G>
inline __attribute__((always_inline)) typename L::F param_at(const P* p, const P* c, int64_t i) {
  if constexpr (KAHAN) return L::get(p, i) + L::get(c, i);
  else return L::get(p, i);
}

template <typename L, bool KAHAN, typename P, typename G>
inline __attribute__((always_inline)) void sum_products(const P* p, const P* c, const G* g,
                                                        int64_t i, float r, int at, float* clip,
                                                        float* pg, float* pp) {
  using F = typename L::F;
  const F gi = L::get(g, i), pi = param_at<L, KAHAN, P, G>(p, c, i);
  const F gr = gi * r;
  L::put(clip, at, gr * gr);
  L::put(pg, at, pi * gi);
  L::put(pp, at, pi * pi);
}

// The three partial sums of elements [begin, end) of one tensor (one block):
// element begin + j goes to float64 lane j mod kSumLanes, the lanes then
// added in order (so every lane width L gives the same sums).
template <typename P, typename G, bool CLIP, bool PP, bool KAHAN>
void scaled_adam_block_sums(const P* p, const P* c, const G* g, int64_t begin, int64_t end,
                            float r, double out[3]) {
  double clip[kSumLanes] = {}, pg[kSumLanes] = {}, pp[kSumLanes] = {};
  float c32[kSumLanes], pg32[kSumLanes], pp32[kSumLanes];
  int64_t i = begin;
#if defined(OH_LANES16)
  // The same lanes in registers: elements 0-7 of each 16 in one float64
  // vector, 8-15 in the other.
  __m512d acc[6] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(),
                    _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd()};
  for (; i + kSumLanes <= end; i += kSumLanes) {
    const __m512 gi = Lanes16::get(g, i), pi = param_at<Lanes16, KAHAN, P, G>(p, c, i);
    const __m512 gr = gi * r;
    const __m512 products[3] = {gr * gr, pi * gi, pi * pi};
    for (int j = 0; j < 3; ++j) {
      if ((j == 0 && !CLIP) || (j == 2 && !PP)) continue;
      acc[2 * j] += _mm512_cvtps_pd(_mm512_castps512_ps256(products[j]));
      acc[2 * j + 1] += _mm512_cvtps_pd(_mm512_extractf32x8_ps(products[j], 1));
    }
  }
  double* sums[3] = {clip, pg, pp};
  for (int j = 0; j < 3; ++j) {
    _mm512_storeu_pd(sums[j], acc[2 * j]);
    _mm512_storeu_pd(sums[j] + 8, acc[2 * j + 1]);
  }
#endif
  for (; i + kSumLanes <= end; i += kSumLanes) {
#if defined(OH_LANES8)
    sum_products<Lanes8, KAHAN>(p, c, g, i, r, 0, c32, pg32, pp32);
    sum_products<Lanes8, KAHAN>(p, c, g, i + 8, r, 8, c32, pg32, pp32);
#else
    for (int k = 0; k < kSumLanes; ++k) {
      sum_products<Scalar, KAHAN>(p, c, g, i + k, r, k, c32, pg32, pp32);
    }
#endif
    for (int k = 0; k < kSumLanes; ++k) {
      clip[k] += double(c32[k]);
      pg[k] += double(pg32[k]);
      pp[k] += double(pp32[k]);
    }
  }
  for (int k = 0; i < end; ++i, ++k) {
    sum_products<Scalar, KAHAN>(p, c, g, i, r, 0, c32, pg32, pp32);
    clip[k] += double(c32[0]);
    pg[k] += double(pg32[0]);
    pp[k] += double(pp32[0]);
  }
  out[0] = out[1] = out[2] = 0.0;
  for (int k = 0; k < kSumLanes; ++k) {
    out[0] += clip[k];
    out[1] += pg[k];
    out[2] += pp[k];
  }
  if (!CLIP) out[0] = 0.0;
  if (!PP) out[2] = 0.0;
}

// The step of one tensor's elements [begin, end), as ScaledAdam._step_one.
// WRITE_P: p takes the new param (torch, and JAX in place); otherwise only
// delta and v are written (JAX's update is the new delta).
// UPDATE (KAHAN only): p_out takes the update in the param dtype (JAX's tx.update), not the
// landed param.
template <typename L, typename P, typename G, typename V, typename D, bool SIZE, bool WRITE_P,
          bool KAHAN, bool UPDATE = false>
inline __attribute__((always_inline)) void scaled_adam_lanes(
    int64_t i, P* p, P* __restrict c, const G* g, D* __restrict delta_buf, V* __restrict v_buf,
    P* p_out, const ScaledAdamScalars& s) {
  using F = typename L::F;
  const F gi = L::get(g, i) * s.grad_scale;
  const F p32 = param_at<L, KAHAN, P, G>(p, c, i);
  F delta = s.b1 * L::get(delta_buf, i);
  const auto v_new = L::to(s.b2 * L::get(v_buf, i) + s.one_minus_b2 * (gi * gi), V{});
  const F v32 = L::widen(v_new, V{});
  if constexpr (SIZE) delta = delta + s.one_minus_b1 * (p32 * s.scale_step);
  const F denom = L::sqrt(v32 * s.inv_bc2) + s.eps;
  delta = delta + (gi / denom) * s.alpha;
  const auto delta_new = L::to(delta, D{});
  L::put(v_buf, i, v_new);
  L::put(delta_buf, i, delta_new);
  if constexpr (KAHAN) {  // kahan_summation's end of the step: p' into p_out (may be p)
    static_assert(!WRITE_P, "the Kahan step writes p' to p_out");
    // It lands as adamw.h's adamw_write: u = update_of(t - p), p + u, c against what landed.
    const F x_new = p32 + L::widen(delta_new, D{});
    const F pw = L::get(p, i);
    const auto u = update_of<L>(L::widen(L::to(x_new, P{}), P{}) - pw, P{});
    const auto landed = L::to(pw + u.second, P{});
    L::put(c, i, L::to(x_new - L::widen(landed, P{}), P{}));
    if constexpr (UPDATE) L::put(p_out, i, u.first);
    else L::put(p_out, i, landed);
  } else if constexpr (WRITE_P) {
    L::put(p, i, L::to(p32 + L::widen(delta_new, P{}), P{}));
  }
}

template <typename P, typename G, typename V, typename D, bool SIZE, bool WRITE_P, bool KAHAN,
          bool UPDATE = false>
void scaled_adam_range(int64_t begin, int64_t end, P* p, P* c, const G* g, D* __restrict delta,
                       V* __restrict v, P* p_out, const ScaledAdamScalars& scalars) {
  const ScaledAdamScalars s = scalars;  // a local copy: stays in registers
  int64_t i = begin;
#if defined(OH_LANES16)
  for (; i + Lanes16::kWidth <= end; i += Lanes16::kWidth) {
    scaled_adam_lanes<Lanes16, P, G, V, D, SIZE, WRITE_P, KAHAN, UPDATE>(i, p, c, g, delta, v, p_out, s);
  }
#elif defined(OH_LANES8)
  for (; i + Lanes8::kWidth <= end; i += Lanes8::kWidth) {
    scaled_adam_lanes<Lanes8, P, G, V, D, SIZE, WRITE_P, KAHAN, UPDATE>(i, p, c, g, delta, v, p_out, s);
  }
#endif
  for (; i < end; ++i) {
    scaled_adam_lanes<Scalar, P, G, V, D, SIZE, WRITE_P, KAHAN, UPDATE>(i, p, c, g, delta, v, p_out, s);
  }
}

// The sums of every tensor of a call: each block is summed by the thread
// whose span holds its first element, then each tensor's blocks are added in
// order into its first three slots (the totals: sum (g r)^2, sum p g, sum p p).
template <typename P, typename G, bool KAHAN = false>
void scaled_adam_sums_all(const ScaledAdamTensor* ts, int n, int nthreads,
                          const ParallelFor* parallel = nullptr) {
  std::vector<int64_t> starts(n + 1, 0);
  for (int k = 0; k < n; ++k) starts[k + 1] = starts[k] + ts[k].numel;
  for_spans(starts[n], nthreads, parallel, [&](int64_t lo, int64_t hi) {
    for (int k = 0; k < n; ++k) {
      if (starts[k + 1] <= lo || starts[k] >= hi) continue;
      const ScaledAdamTensor& t = ts[k];
      double* sums = reinterpret_cast<double*>(t.sums);
      // The blocks whose first element lies in [lo, hi).
      const int64_t first = std::max<int64_t>(0, lo - starts[k]);
      for (int64_t b = (first + kSumBlock - 1) / kSumBlock * kSumBlock;
           b < t.numel && starts[k] + b < hi; b += kSumBlock) {
        const P* tp = reinterpret_cast<const P*>(t.p);
        const P* tc = reinterpret_cast<const P*>(t.comp);
        const G* tg = reinterpret_cast<const G*>(t.g);
        const int64_t e = std::min(t.numel, b + kSumBlock);
        double* out = sums + 3 * (b / kSumBlock);
        const float r = t.s.rms;
        switch (t.want & 3) {
          case 0: scaled_adam_block_sums<P, G, false, false, KAHAN>(tp, tc, tg, b, e, r, out); break;
          case 1: scaled_adam_block_sums<P, G, true, false, KAHAN>(tp, tc, tg, b, e, r, out); break;
          case 2: scaled_adam_block_sums<P, G, false, true, KAHAN>(tp, tc, tg, b, e, r, out); break;
          default: scaled_adam_block_sums<P, G, true, true, KAHAN>(tp, tc, tg, b, e, r, out);
        }
      }
    }
  });
  for (int k = 0; k < n; ++k) {
    double* sums = reinterpret_cast<double*>(ts[k].sums);
    const int64_t blocks = (ts[k].numel + kSumBlock - 1) / kSumBlock;
    for (int64_t b = 1; b < blocks; ++b) {
      for (int j = 0; j < 3; ++j) sums[j] += sums[3 * b + j];
    }
  }
}

// The steps of every tensor of a call, their elements split over threads.
template <typename P, typename G, typename V, bool WRITE_P = true, typename D = P,
          bool KAHAN = false, bool UPDATE = false>
void scaled_adam_step_all(const ScaledAdamTensor* ts, int n, int nthreads,
                          const ParallelFor* parallel = nullptr) {
  int64_t total = 0;
  for (int k = 0; k < n; ++k) total += ts[k].numel;
  for_spans(total, nthreads, parallel, [&](int64_t lo, int64_t hi) {
    int64_t start = 0;
    for (int k = 0; k < n && start < hi; ++k) {
      const ScaledAdamTensor& t = ts[k];
      const int64_t end = start + t.numel;
      const int64_t b = std::max(lo, start), e = std::min(hi, end);
      if (b < e) {
        P* p = reinterpret_cast<P*>(t.p);
        P* c = reinterpret_cast<P*>(t.comp);
        const G* g = reinterpret_cast<const G*>(t.g);
        D* delta = reinterpret_cast<D*>(t.delta);
        V* v = reinterpret_cast<V*>(t.v);
        P* p_out = reinterpret_cast<P*>(t.p_out);
        if (t.size) {
          scaled_adam_range<P, G, V, D, true, WRITE_P, KAHAN, UPDATE>(b - start, e - start, p, c, g, delta,
                                                             v, p_out, t.s);
        } else {
          scaled_adam_range<P, G, V, D, false, WRITE_P, KAHAN, UPDATE>(b - start, e - start, p, c, g,
                                                              delta, v, p_out, t.s);
        }
      }
      start = end;
    }
  });
}

}  // namespace oh
