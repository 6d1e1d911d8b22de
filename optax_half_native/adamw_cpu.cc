// Multi-tensor entry points of the AdamW kernel (adamw.h) for ctypes callers
// (torch_bridge): one call steps a list of tensors that share one
// configuration (dtypes, mode, moment rounding), on `nthreads` threads.
#include "adamw_threads.h"
#include "scaled_adam.h"

#define OH_ENTRY(NAME, P, G, M, V, MODE, SR)                                    \
  extern "C" void oh_adamw_##NAME##_##MODE##_##SR(const void* ts, int n,       \
                                                 int nthreads) {               \
    oh::step_all<P, G, M, V, MODE, SR>(static_cast<const oh::Tensor*>(ts), n, nthreads); \
  }

using oh::bf16;
// Names: param, grad, mu, nu types (B = bf16, F = fp32, H = fp16), mode (oh::Mode), SR.
// Moments of the 16-bit type M16 (code MN) or fp32, each; SR for a 16-bit one.
#define OH_MOMENTS(P, PN, G, GN, MODE, M16, MN)        \
  OH_ENTRY(PN##GN##MN##MN, P, G, M16, M16, MODE, 0)   \
  OH_ENTRY(PN##GN##MN##MN, P, G, M16, M16, MODE, 1)   \
  OH_ENTRY(PN##GN##MN##F, P, G, M16, float, MODE, 0)  \
  OH_ENTRY(PN##GN##MN##F, P, G, M16, float, MODE, 1)  \
  OH_ENTRY(PN##GN##F##MN, P, G, float, M16, MODE, 0)  \
  OH_ENTRY(PN##GN##F##MN, P, G, float, M16, MODE, 1)  \
  OH_ENTRY(PN##GN##FF, P, G, float, float, MODE, 0)
// The modes that do not split the param: kMaster, kKahan, kStochastic, kNearest.
#define OH_UNSPLIT_MODES(P, PN, G, GN)  \
  OH_MOMENTS(P, PN, G, GN, 1, P, PN)    \
  OH_MOMENTS(P, PN, G, GN, 3, P, PN)    \
  OH_MOMENTS(P, PN, G, GN, 4, P, PN)    \
  OH_MOMENTS(P, PN, G, GN, 5, P, PN)

// bf16 params: every mode (kSplit too), bf16 or fp32 gradients and moments.
OH_UNSPLIT_MODES(bf16, B, bf16, B)
OH_MOMENTS(bf16, B, bf16, B, 2, bf16, B)
OH_UNSPLIT_MODES(bf16, B, float, F)
OH_MOMENTS(bf16, B, float, F, 2, bf16, B)
OH_ENTRY(FFFF, float, float, float, float, 0, 0)

#if defined(OH_F16)
// fp16 params (H = fp16) with fp16 or fp32 gradients and moments, in the
// modes that do not split them (kSplit needs a bf16 high half).
using oh::f16;
OH_UNSPLIT_MODES(f16, H, f16, H)
OH_UNSPLIT_MODES(f16, H, float, F)
#endif

// ScaledAdam (scaled_adam.h): names are param, grad, exp_avg_sq types.
#define OH_SCALED_ADAM(NAME, P, G, V)                                              \
  extern "C" void oh_scaled_adam_sums_##NAME(const void* ts, int n, int nthreads) { \
    oh::scaled_adam_sums_all<P, G>(static_cast<const oh::ScaledAdamTensor*>(ts), n, nthreads); \
  }                                                                                 \
  extern "C" void oh_scaled_adam_step_##NAME(const void* ts, int n, int nthreads) { \
    oh::scaled_adam_step_all<P, G, V>(static_cast<const oh::ScaledAdamTensor*>(ts), n, nthreads); \
  }
OH_SCALED_ADAM(FFF, float, float, float)
OH_SCALED_ADAM(FBF, float, bf16, float)
OH_SCALED_ADAM(BBB, bf16, bf16, bf16)
OH_SCALED_ADAM(BFB, bf16, float, bf16)
#if defined(OH_F16)
OH_SCALED_ADAM(HHF, f16, f16, float)
OH_SCALED_ADAM(HFF, f16, float, float)
OH_SCALED_ADAM(FHF, float, f16, float)
#endif

extern "C" int oh_lanes() { return oh::kLanes; }
