// Multi-tensor entry points of the AdamW kernel (adamw.h) for ctypes callers
// (torch_bridge): one call steps a list of tensors that share one
// configuration (dtypes, mode, moment rounding), on `nthreads` threads.
#include "adamw_threads.h"

#define OH_ENTRY(NAME, P, G, M, V, MODE, SR)                                    \
  extern "C" void oh_adamw_##NAME##_##MODE##_##SR(const void* ts, int n,       \
                                                 int nthreads) {               \
    oh::step_all<P, G, M, V, MODE, SR>(static_cast<const oh::Tensor*>(ts), n, nthreads); \
  }

using oh::bf16;
// Names: param, grad, mu, nu types (B = bf16, F = fp32, H = fp16), mode (oh::Mode), SR.
#define OH_MOMENTS(P, PN, G, GN, MODE)             \
  OH_ENTRY(PN##GN##BB, P, G, bf16, bf16, MODE, 0)  \
  OH_ENTRY(PN##GN##BB, P, G, bf16, bf16, MODE, 1)  \
  OH_ENTRY(PN##GN##BF, P, G, bf16, float, MODE, 0) \
  OH_ENTRY(PN##GN##BF, P, G, bf16, float, MODE, 1) \
  OH_ENTRY(PN##GN##FB, P, G, float, bf16, MODE, 0) \
  OH_ENTRY(PN##GN##FB, P, G, float, bf16, MODE, 1) \
  OH_ENTRY(PN##GN##FF, P, G, float, float, MODE, 0)
#define OH_MODES(G, GN)         \
  OH_MOMENTS(bf16, B, G, GN, 1) \
  OH_MOMENTS(bf16, B, G, GN, 2) \
  OH_MOMENTS(bf16, B, G, GN, 3) \
  OH_MOMENTS(bf16, B, G, GN, 4) \
  OH_MOMENTS(bf16, B, G, GN, 5)

OH_MODES(bf16, B)
OH_MODES(float, F)
OH_ENTRY(FFFF, float, float, float, float, 0, 0)

#if defined(OH_F16)
// fp16 params (H = fp16) with fp16 or fp32 gradients and moments, in the
// modes that do not split the param (kMaster, kKahan, kStochastic, kNearest).
using oh::f16;
#define OH_F16_MOMENTS(G, GN, MODE)               \
  OH_ENTRY(H##GN##HH, f16, G, f16, f16, MODE, 0)   \
  OH_ENTRY(H##GN##HH, f16, G, f16, f16, MODE, 1)   \
  OH_ENTRY(H##GN##HF, f16, G, f16, float, MODE, 0) \
  OH_ENTRY(H##GN##HF, f16, G, f16, float, MODE, 1) \
  OH_ENTRY(H##GN##FH, f16, G, float, f16, MODE, 0) \
  OH_ENTRY(H##GN##FH, f16, G, float, f16, MODE, 1) \
  OH_ENTRY(H##GN##FF, f16, G, float, float, MODE, 0)
#define OH_F16_MODES(G, GN)    \
  OH_F16_MOMENTS(G, GN, 1)     \
  OH_F16_MOMENTS(G, GN, 3)     \
  OH_F16_MOMENTS(G, GN, 4)     \
  OH_F16_MOMENTS(G, GN, 5)
OH_F16_MODES(f16, H)
OH_F16_MODES(float, F)
#endif

extern "C" int oh_lanes() { return oh::kLanes; }
