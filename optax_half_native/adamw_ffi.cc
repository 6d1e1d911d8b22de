// The AdamW kernel (adamw.h) as XLA FFI custom calls for JAX on CPU: one
// call steps a list of leaves that share their dtypes (oh::step_all splits
// their elements, concatenated, into chunks on XLA's pool).
//
// optax_half_adamw (OhAdamw), the tree layout. Operands: scalars f32[12]
// (oh::Scalars: lr, b1, b2, 1 - b1, 1 - b2, 1 / bc1, 1 / bc2, eps, wd,
// grad_scale, clip_div, clip_mul), keys
// u32[n, 3] (row k: leaf k's keys of the param and moments streams, and in
// the master mode its mark, MasterWeightsState.missed: set_keeps), then
// p_0..p_{n-1}, g_0..g_{n-1}, mu_0.., nu_0.., buffer_0.. (a 0-element buffer
// for modes without one). Results: p_out_0.. (new arrays, or aliased to p or
// g by the caller), mu.., nu.., buffer.. (aliased to their operands: updated
// in place), and for a master's update the new marks u32[n] (oh::Tensor::marks).
// optax_half_adamw_flat (OhAdamwFlat), the flat state
// (flat_state=True): the same with one mu, one nu and one buffer holding all
// leaves, leaf k's elements at the sum of the sizes of leaves 0..k-1.
// Attributes: mode (oh::Mode; kUpdate for fp32 params: p_out is the update),
// sr (stochastic moment writes), update (16-bit params: p_out is the update
// in the param dtype, not the landed param), nthreads.
//
// optax_half_scaled_adam_sums and optax_half_scaled_adam_step
// (OhScaledAdamSums, OhScaledAdamStep): ScaledAdam's two passes
// (scaled_adam.h) over a list of leaves that share their dtypes.
#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "adamw_threads.h"
#include "scaled_adam.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using oh::bf16;

namespace {

template <typename P, typename G, typename M, typename V, int MODE, bool UPDATE>
bool run_out(bool sr, const oh::Tensor* ts, int n, const oh::ParallelFor& parallel) {
  if (sr) {
    if constexpr (std::is_same_v<M, float> && std::is_same_v<V, float>) {
      return false;
    } else {
      oh::step_all<P, G, M, V, MODE, true, true, UPDATE>(ts, n, 1, &parallel);
      return true;
    }
  }
  oh::step_all<P, G, M, V, MODE, false, true, UPDATE>(ts, n, 1, &parallel);
  return true;
}

// update: p_out takes the 16-bit update (tx.update), else the landed param.
template <typename P, typename G, typename M, typename V, int MODE>
bool run_sr(bool sr, bool update, const oh::Tensor* ts, int n, const oh::ParallelFor& parallel) {
  return update ? run_out<P, G, M, V, MODE, true>(sr, ts, n, parallel)
                : run_out<P, G, M, V, MODE, false>(sr, ts, n, parallel);
}

// Calls f(type tag) for the 16-bit type H (bf16, or fp16 where built) or
// F32; false for any other type.
template <typename H, typename F>
bool with_type(ffi::DataType d, F&& f) {
  constexpr ffi::DataType half = std::is_same_v<H, bf16> ? ffi::DataType::BF16 : ffi::DataType::F16;
  if (d == half) return f(H{});
  if (d == ffi::DataType::F32) return f(float{});
  return false;
}

}  // namespace

// The compile's bulk, the step of every (gradient, mu, nu) type of one
// 16-bit param type H and mode MODE (run_typed), is a library of its own,
// built on first use of that param type and mode (optax_half_native.ffi_steps):
// -DOH_STEP_MODE=<oh::Mode> -DOH_STEP_F16=<0 bf16, 1 fp16> builds one step.
// Built without them, the file is the handlers, which call the steps loaded
// into their table (oh_ffi_set_step).
namespace oh_ffi {

using Step = bool (*)(const ffi::DataType (&)[4], bool, bool, const oh::Tensor*, int,
                      const oh::ParallelFor&);

template <typename H, int MODE>
bool run_typed(const ffi::DataType (&types)[4], bool sr, bool update, const oh::Tensor* ts,
               int n, const oh::ParallelFor& parallel) {
  return with_type<H>(types[1], [&](auto gt) {
    return with_type<H>(types[2], [&](auto mt) {
      return with_type<H>(types[3], [&](auto vt) {
        return run_sr<H, decltype(gt), decltype(mt), decltype(vt), MODE>(sr, update, ts, n,
                                                                         parallel);
      });
    });
  });
}

}  // namespace oh_ffi

#if defined(OH_STEP_MODE)
#if OH_STEP_F16 && !defined(OH_F16)
#error "an fp16 step needs F16C (OH_F16)"
#endif
static_assert(!(OH_STEP_F16 && OH_STEP_MODE == oh::kSplit), "split takes bf16 params");
namespace {
#if OH_STEP_F16
using StepParam = oh::f16;
#else
using StepParam = bf16;
#endif
}  // namespace
// The step this library holds, its param type (1: fp16) and mode, for the handlers' table.
extern "C" void* oh_ffi_step() {
  return reinterpret_cast<void*>(&oh_ffi::run_typed<StepParam, OH_STEP_MODE>);
}
extern "C" int oh_ffi_step_f16() { return OH_STEP_F16; }
extern "C" int oh_ffi_step_mode() { return OH_STEP_MODE; }
#endif

#if !defined(OH_STEP_MODE)  // the handlers
namespace {

// fp32 params (the wrappers hand them to the core as they are): fp32
// gradients and moments, kDirect or kUpdate.
bool run_f32(const ffi::DataType (&types)[4], int mode, bool sr, const oh::Tensor* ts, int n,
             const oh::ParallelFor& parallel) {
  using T = ffi::DataType;
  if (sr || types[1] != T::F32 || types[2] != T::F32 || types[3] != T::F32) return false;
  if (mode == oh::kDirect) {
    oh::step_all<float, float, float, float, oh::kDirect, false, true>(ts, n, 1, &parallel);
    return true;
  }
  if (mode == oh::kUpdate) {
    oh::step_all<float, float, float, float, oh::kUpdate, false, true>(ts, n, 1, &parallel);
    return true;
  }
  return false;
}

// Chunks on XLA's intra-op thread pool, claimed one at a time by the calling
// thread and by up to nthreads helpers scheduled on the pool: threads of
// our own would compete with XLA's (measured: a 16.8M-param Kahan step took
// 15 ms on 2 threads of ours, 12 on 1). One helper per thread, not nthreads - 1:
// the caller may itself be one of the pool's threads, and a single helper
// often never ran while the caller stepped (a 16.8M-param Kahan step in
// place took 11-14 ms, one thread's time, in 17 of 40 steps, 6.6-8.5 in
// the rest; with a helper per thread, 6.5-7.5 in 76 of 80, 7.8-10.4 in 4). The
// caller works until every chunk is claimed and then waits only for chunks
// being stepped, so it never waits for a helper that has not started (the
// pool may be busy, even with another call like this one); a helper that
// starts late finds nothing left and returns.
oh::ParallelFor pool_parallel_for(ffi::ThreadPool& pool, int64_t nthreads) {
  return [&pool, nthreads](int64_t nchunks, const std::function<void(int64_t)>& fn) {
    struct Counters {
      std::atomic<int64_t> next{0}, done{0};
    };
    auto counters = std::make_shared<Counters>();
    const std::function<void(int64_t)>* f = &fn;  // only dereferenced for a claimed chunk
    auto work = [counters, nchunks, f] {
      for (int64_t c = counters->next.fetch_add(1); c < nchunks;
           c = counters->next.fetch_add(1)) {
        (*f)(c);
        counters->done.fetch_add(1, std::memory_order_release);
      }
    };
    const int64_t helpers = std::min({pool.num_threads(), nthreads, nchunks - 1});
    for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));  // a copy each
    work();
    while (counters->done.load(std::memory_order_acquire) < nchunks) std::this_thread::yield();
  };
}

// The loaded steps, [fp16][mode]: set by oh_ffi_set_step from the step
// libraries (optax_half_native.ffi_steps).
constexpr int kModes = 8;
std::atomic<oh_ffi::Step> steps[2][kModes];

// The step of 16-bit params of type param (bf16, or fp16 where built) in mode, or null.
oh_ffi::Step step_of(ffi::DataType param, int mode) {
  const bool f16 = param == ffi::DataType::F16;
#if !defined(OH_F16)
  if (f16) return nullptr;
#endif
  if ((!f16 && param != ffi::DataType::BF16) || mode < 0 || mode >= kModes) return nullptr;
  return steps[f16][mode].load(std::memory_order_acquire);
}

void same_or_copy(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out) {
  if (out->untyped_data() != in.untyped_data() && in.size_bytes() > 0) {
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  }
}

// Runs the step over ts[0..n) with the dtypes (p, g, mu, nu); false for an
// unsupported combination or mode (a 16-bit one's step loaded: step_of).
bool dispatch(const ffi::DataType (&types)[4], int mode, bool sr, bool update,
              const oh::Tensor* ts, int n, const oh::ParallelFor& parallel) {
  if (types[0] == ffi::DataType::F32) return run_f32(types, mode, sr, ts, n, parallel);
  const oh_ffi::Step step = step_of(types[0], mode);
  return step != nullptr && step(types, sr, update, ts, n, parallel);
}

// The buffer each mode reads: fp32 master, int16 low half, Kahan buffer of the param type.
bool needs_buffer(int mode) { return mode == oh::kMaster || mode == oh::kSplit || mode == oh::kKahan; }
ffi::DataType buffer_type(int mode, ffi::DataType p) {
  return mode == oh::kMaster ? ffi::DataType::F32 : mode == oh::kSplit ? ffi::DataType::S16 : p;
}

// compensation.landing_mark of the elements where a master mode's param p is
// not its master's rounding (the read's check, compensation.kept), summed over
// chunks on XLA's pool: wrapping uint32 sums, the same whatever the order.
// The read's lanes: the kernel's (adamw_range's choice).
#if defined(OH_LANES16)
template <typename P> using MarkLanes = oh::Lanes16;
#elif defined(OH_LANES8)
template <typename P>
using MarkLanes = std::conditional_t<std::is_same_v<P, bf16>, oh::Pairs8, oh::Lanes8>;
#else
template <typename P> using MarkLanes = oh::Scalar;
#endif

template <typename P>
uint32_t off_mark(const oh::Tensor& t, const oh::ParallelFor& parallel) {
  using L = MarkLanes<P>;
  using F = typename L::F;
  const P* p = reinterpret_cast<const P*>(t.p);
  const float* master = reinterpret_cast<const float*>(t.buffer);
  const int64_t n = t.numel;
  const int64_t nchunks = std::max<int64_t>(1, (n + oh::kMinPerThread - 1) / oh::kMinPerThread);
  std::vector<uint32_t> part(size_t(nchunks), 0u);
  parallel(nchunks, [&](int64_t c) {
    uint32_t sum = 0;
    // Other values: -0 and +0 alike, a NaN like any NaN (compensation._differ); every NaN
    // hashes alike.
    const auto add = [&](int64_t i) {
      const float pw = oh::Scalar::get(p, i);
      const float t = oh::Scalar::widen(oh::Scalar::to(master[i], P{}), P{});
      if (pw != pw && t != t) return;
      const uint32_t bits = pw != pw ? 0xFFFFu : p[i].bits;
      sum += oh::mix32(uint32_t(i) ^ oh::mix32(bits | 0x10000u));
    };
    int64_t i = c * oh::kMinPerThread;
    const int64_t e = std::min(n, i + oh::kMinPerThread);
    // Whole blocks in the kernel's lanes (its rounding's bits); the off lanes hashed in the
    // lanes too (near zero crossings many blocks have one).
    for (; i + L::kWidth <= e; i += L::kWidth) {
      const F pw = L::get(p, i);
      const F zero = L::floats(L::bits(pw) & 0u), one = L::floats(L::bits(zero) | 0x3F800000u);
      const F t = L::widen(L::to(L::get(master, i), P{}), P{});
      const F off = L::where_equal(t, pw, zero, one);
      if constexpr (L::kWidth > 1) {
        if (L::any_bits(off)) {
          using U = typename L::U;
          const U p_nan = oh::unequal_lanes<L>(pw, pw);
          const U counted = oh::unequal_lanes<L>(t, pw) &
                            ((p_nan & oh::unequal_lanes<L>(t, t)) ^ 0xFFFFFFFFu);
          const U bits = (p_nan & 0xFFFFu) | ((p_nan ^ 0xFFFFFFFFu) & oh::words16<L>(p, i));
          sum += oh::lane_marks<L>(uint64_t(i), bits, counted);
        }
      } else if (__builtin_expect(L::any_bits(off), 0)) {
        alignas(64) float lanes[L::kWidth];
        L::put(lanes, 0, off);
        for (int j = 0; j < L::kWidth; ++j) {
          if (lanes[j] != 0.0f) add(i + j);
        }
      }
    }
    for (; i < e; ++i) {
      if (oh::Scalar::widen(oh::Scalar::to(master[i], P{}), P{}) != oh::Scalar::get(p, i)) add(i);
    }
    part[size_t(c)] = sum;
  });
  uint32_t sum = 0;
  for (uint32_t v : part) sum += v;
  return sum;
}

// The master mode's keep flags: a leaf whose mark (keys column 2,
// MasterWeightsState.missed) is nonzero keeps its master where the param is
// not its rounding if those elements are exactly the marked ones.
bool set_keeps(ffi::DataType param, oh::Tensor* ts, size_t n, const oh::ParallelFor& parallel) {
  for (size_t k = 0; k < n; ++k) {
    const uint32_t mark = ts[k].keep;
    ts[k].keep = 0;
    if (mark == 0) continue;
    auto check = [&](auto tag) {
      using P = decltype(tag);
      if constexpr (std::is_same_v<P, float>) {
        return false;
      } else {
        ts[k].keep = off_mark<P>(ts[k], parallel) == mark;
        return true;
      }
    };
    bool typed = with_type<bf16>(param, check);
#if defined(OH_F16)
    typed = typed || with_type<oh::f16>(param, check);
#endif
    if (!typed) return false;
  }
  return true;
}

void set_scalars(oh::Tensor& t, const ffi::Buffer<ffi::F32>& scalars, const uint32_t* key) {
  std::memcpy(&t.s, scalars.typed_data(), sizeof(oh::Scalars));
  t.key_p = key[0];
  t.key_m = key[1];
  t.keep = key[2];
}

// The leaves' state arrays: per leaf (kFlat false: leaf k's moments and
// buffer are arrays of their own) or flat (kFlat true: one array per field,
// leaf k's elements at the sum of the sizes of leaves 0..k-1).
template <bool kFlat>
ffi::Error AdamwLeavesImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scalars,
                           ffi::Buffer<ffi::U32> keys, ffi::RemainingArgs args,
                           ffi::RemainingRets rets, int32_t mode, bool sr, bool update,
                           int32_t nthreads) {
  const char* name = kFlat ? "oh_adamw_flat" : "oh_adamw";
  auto invalid = [name](const std::string& what) {
    return ffi::Error::InvalidArgument(std::string(name) + ": " + what);
  };
  constexpr size_t kScalars = sizeof(oh::Scalars) / sizeof(float);
  if (scalars.element_count() != kScalars || keys.element_count() % 3 != 0 ||
      keys.element_count() == 0) {
    return invalid("scalars must be f32[" + std::to_string(kScalars) +
                   "] (oh::Scalars) and keys u32[n, 3] with n >= 1");
  }
  const size_t n = keys.element_count() / 3;
  // Per field (mu, nu, buffer): 1 array (flat) or n (per leaf). A master's update also
  // returns each leaf's mark (u32[n], last).
  const size_t per_field = kFlat ? 1 : n;
  const bool marked = mode == oh::kMaster && update;
  if (args.size() != 2 * n + 3 * per_field || rets.size() != n + 3 * per_field + marked) {
    return invalid(kFlat ? "operands p..., g..., mu, nu, buffer; results p_out..., mu, nu, buffer"
                         : "operands p..., g..., mu..., nu..., buffer...; results p_out..., "
                           "mu..., nu..., buffer...");
  }
  // State field f of leaf k (k = 0 for a flat state), operand and result.
  std::vector<ffi::AnyBuffer> st;
  std::vector<ffi::Result<ffi::AnyBuffer>> st_out;
  for (size_t j = 0; j < 3 * per_field; ++j) {
    ffi::ErrorOr<ffi::AnyBuffer> a = args.get<ffi::AnyBuffer>(2 * n + j);
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> r = rets.get<ffi::AnyBuffer>(n + j);
    if (a.has_error()) return a.error();
    if (r.has_error()) return r.error();
    if ((*r)->element_count() != a->element_count() || (*r)->element_type() != a->element_type()) {
      return invalid("a state result differs from its operand");
    }
    st.push_back(*a);
    st_out.push_back(*r);
  }
  auto state_at = [&](int field, size_t k) { return size_t(field) * per_field + (kFlat ? 0 : k); };
  std::vector<oh::Tensor> ts(n);
  ffi::DataType types[4] = {ffi::DataType::INVALID, ffi::DataType::INVALID,
                            st[state_at(0, 0)].element_type(), st[state_at(1, 0)].element_type()};
  const bool buffered = needs_buffer(mode);
  if (kFlat) {  // the flat arrays hold every leaf's elements (checked before any pointer is formed)
    size_t total = 0;
    for (size_t k = 0; k < n; ++k) {
      ffi::ErrorOr<ffi::AnyBuffer> p = args.get<ffi::AnyBuffer>(k);
      if (p.has_error()) return p.error();
      total += p->element_count();
    }
    if (st[0].element_count() != total || st[1].element_count() != total ||
        st[2].element_count() != (buffered ? total : 0)) {
      return invalid("mu, nu (and the mode's buffer) must hold every leaf's elements");
    }
  }
  int64_t offset = 0;  // of leaf k in a flat state
  for (size_t k = 0; k < n; ++k) {
    ffi::ErrorOr<ffi::AnyBuffer> p = args.get<ffi::AnyBuffer>(k), g = args.get<ffi::AnyBuffer>(n + k);
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> p_out = rets.get<ffi::AnyBuffer>(k);
    if (p.has_error()) return p.error();
    if (g.has_error()) return g.error();
    if (p_out.has_error()) return p_out.error();
    if (k == 0) {
      types[0] = p->element_type();
      types[1] = g->element_type();
    } else if (p->element_type() != types[0] || g->element_type() != types[1]) {
      return invalid("the leaves of one call share dtypes");
    }
    const int64_t numel = int64_t(p->element_count());
    if (int64_t(g->element_count()) != numel || int64_t((*p_out)->element_count()) != numel ||
        (*p_out)->element_type() != types[0]) {
      return invalid("p, g and p_out must have one size, p_out p's dtype");
    }
    char* state[3];
    for (int f = 0; f < 3; ++f) {
      const ffi::AnyBuffer& a = st[state_at(f, k)];
      if (a.element_type() != (f < 2 ? types[2 + f] : st[state_at(2, 0)].element_type())) {
        return invalid("the leaves of one call share dtypes");
      }
      // A state array per leaf holds that leaf's elements (the buffer: none for
      // a mode without one); a flat one was checked against the total above.
      const size_t want = (f < 2 || buffered) ? size_t(numel) : 0;
      if (!kFlat && a.element_count() != want) {
        return invalid("mu, nu (and the mode's buffer) must have the param's size");
      }
      state[f] = static_cast<char*>(st_out[state_at(f, k)]->untyped_data()) +
                 (kFlat ? offset * ffi::ByteWidth(a.element_type()) : 0);
    }
    oh::Tensor& t = ts[k];
    t = oh::Tensor{};
    t.numel = numel;
    t.p = reinterpret_cast<uint64_t>(p->untyped_data());
    t.p_out = reinterpret_cast<uint64_t>((*p_out)->untyped_data());
    t.g = reinterpret_cast<uint64_t>(g->untyped_data());
    t.mu = reinterpret_cast<uint64_t>(state[0]);
    t.nu = reinterpret_cast<uint64_t>(state[1]);
    t.buffer = buffered ? reinterpret_cast<uint64_t>(state[2]) : 0;
    set_scalars(t, scalars, keys.typed_data() + 3 * k);
    offset += numel;
  }
  if (buffered && offset > 0 && st[state_at(2, 0)].element_type() != buffer_type(mode, types[0])) {
    return invalid("the mode's buffer is mistyped");
  }
  if (n > 0 && oh::clips(ts[0].s) && types[1] == ffi::DataType::F16) {  // oh::clip_reads
    return invalid("a clipped read takes bf16 or fp32 gradients (fp16 ones are clipped first)");
  }
  // Checked: the moments and the buffers into their results (in place when aliased).
  for (size_t j = 0; j < st.size(); ++j) same_or_copy(st[j], st_out[j]);
  if (marked) {  // summed into by the step's threads
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> r = rets.get<ffi::AnyBuffer>(n + 3 * per_field);
    if (r.has_error()) return r.error();
    if ((*r)->element_type() != ffi::DataType::U32 || (*r)->element_count() != n) {
      return invalid("a master's update returns the marks u32[n] last");
    }
    uint32_t* marks = static_cast<uint32_t*>((*r)->untyped_data());
    for (size_t k = 0; k < n; ++k) {
      marks[k] = 0;
      ts[k].marks = reinterpret_cast<uint64_t>(&marks[k]);
    }
  }
  const oh::ParallelFor parallel = pool_parallel_for(pool, nthreads);
  if (mode == oh::kMaster && !set_keeps(types[0], ts.data(), n, parallel)) {
    return invalid("the master mode takes bf16 or fp16 params");
  }
  if (types[0] != ffi::DataType::F32 && step_of(types[0], mode) == nullptr) {
    return invalid("no step of this param dtype and mode is loaded "
                   "(optax_half_native.ffi_step loads it; optax_half does so as it traces)");
  }
  if (!dispatch(types, mode, sr, update, ts.data(), int(n), parallel)) {
    return invalid("unsupported dtypes or mode");
  }
  return ffi::Error::Success();
}

// all(isfinite(widen(g) * scale)) of one gradient (oh::all_finite_range),
// in chunks on XLA's pool. Operands: g (bf16, fp32 or, with F16C, fp16), scale f32[1] (1 / the
// loss scale, or 1). Result: pred[].
ffi::Error AllFiniteImpl(ffi::ThreadPool pool, ffi::AnyBuffer g, ffi::Buffer<ffi::F32> scale,
                         ffi::Result<ffi::Buffer<ffi::PRED>> finite, int32_t nthreads) {
  if (scale.element_count() != 1) {
    return ffi::Error::InvalidArgument("oh_all_finite: scale must be f32[1]");
  }
  const int64_t n = int64_t(g.element_count());
  const float s = scale.typed_data()[0];
  const int64_t nchunks = std::max<int64_t>(1, (n + oh::kMinPerThread - 1) / oh::kMinPerThread);
  std::vector<char> ok(size_t(nchunks), 1);
  auto check = [&](auto gt) {
    using G = decltype(gt);
    const G* data = static_cast<const G*>(g.untyped_data());
    pool_parallel_for(pool, nthreads)(nchunks, [&](int64_t c) {
      ok[size_t(c)] = oh::all_finite_range(data, c * oh::kMinPerThread,
                                           std::min(n, (c + 1) * oh::kMinPerThread), s);
    });
    return true;
  };
  bool typed = with_type<bf16>(g.element_type(), check);
#if defined(OH_F16)
  typed = typed || with_type<oh::f16>(g.element_type(), check);
#endif
  if (!typed) return ffi::Error::InvalidArgument("oh_all_finite: g must be bf16, fp16 or fp32");
  bool all = true;
  for (char c : ok) all = all && c;
  finite->typed_data()[0] = all;
  return ffi::Error::Success();
}

// Calls f(P, G, V tags) for ScaledAdam's configurations: fp32 params with
// fp32, bf16 or fp16 gradients (the wrappers' fp32 x with the 16-bit
// params' gradients); bf16 params with bf16 or fp32 gradients (bf16 second
// moments); fp16 params with fp16 or fp32 gradients (fp32 second moments);
// fp16 only where built; false for others.
template <typename F>
bool with_scaled_adam_types(ffi::DataType p, ffi::DataType g, F&& f) {
  using T = ffi::DataType;
  if (p == T::F32 && g == T::F32) return f(float{}, float{}, float{});
  if (p == T::F32 && g == T::BF16) return f(float{}, bf16{}, float{});  // kahan_summation's x
  if (p == T::BF16 && g == T::BF16) return f(bf16{}, bf16{}, bf16{});
  if (p == T::BF16 && g == T::F32) return f(bf16{}, float{}, bf16{});
#if defined(OH_F16)
  if (p == T::F16 && g == T::F16) return f(oh::f16{}, oh::f16{}, float{});
  if (p == T::F16 && g == T::F32) return f(oh::f16{}, float{}, float{});
  if (p == T::F32 && g == T::F16) return f(float{}, oh::f16{}, float{});
#endif
  return false;
}

// Operands: rms f32[n] (each leaf's stored RMS, widened), want s32[n] (the
// sums each needs: 1 sum (g r)^2, 2 sum p p), p_0..p_{n-1}, g_0..g_{n-1},
// and with kahan the compensations c_0..c_{n-1} (the param is p + c).
// Result: f32[n, 3]: per leaf sum((g r)^2), sum(p g) and mean(p p), each
// the float64 sum (scaled_adam_sums_all) rounded once, the mean divided in
// float64 first; a sum not asked for is 0.
ffi::Error ScaledAdamSumsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rms,
                              ffi::Buffer<ffi::S32> want, ffi::RemainingArgs args,
                              ffi::Result<ffi::Buffer<ffi::F32>> out, bool kahan,
                              int32_t nthreads) {
  auto invalid = [](const std::string& what) {
    return ffi::Error::InvalidArgument("oh_scaled_adam_sums: " + what);
  };
  const size_t n = rms.element_count();
  if (n == 0 || want.element_count() != n || args.size() != (kahan ? 3 : 2) * n ||
      out->element_count() != 3 * n) {
    return invalid("operands rms f32[n], want s32[n], p..., g... (c... with kahan); "
                   "result f32[n, 3]");
  }
  std::vector<oh::ScaledAdamTensor> ts(n);
  std::vector<int64_t> offsets(n);
  int64_t blocks = 0;
  ffi::DataType types[2] = {ffi::DataType::INVALID, ffi::DataType::INVALID};
  for (size_t k = 0; k < n; ++k) {
    ffi::ErrorOr<ffi::AnyBuffer> p = args.get<ffi::AnyBuffer>(k), g = args.get<ffi::AnyBuffer>(n + k);
    if (p.has_error()) return p.error();
    if (g.has_error()) return g.error();
    if (k == 0) {
      types[0] = p->element_type();
      types[1] = g->element_type();
    } else if (p->element_type() != types[0] || g->element_type() != types[1]) {
      return invalid("the leaves of one call share dtypes");
    }
    if (g->element_count() != p->element_count()) return invalid("p and g must have one size");
    oh::ScaledAdamTensor& t = ts[k];
    t = oh::ScaledAdamTensor{};
    if (kahan) {
      ffi::ErrorOr<ffi::AnyBuffer> c = args.get<ffi::AnyBuffer>(2 * n + k);
      if (c.has_error()) return c.error();
      if (c->element_type() != types[0] || c->element_count() != p->element_count() ||
          types[0] == ffi::DataType::F32) {
        return invalid("c must be a 16-bit param's compensation, of its dtype and size");
      }
      t.comp = reinterpret_cast<uint64_t>(c->untyped_data());
    }
    t.numel = int64_t(p->element_count());
    t.p = reinterpret_cast<uint64_t>(p->untyped_data());
    t.g = reinterpret_cast<uint64_t>(g->untyped_data());
    t.s.rms = rms.typed_data()[k];
    t.want = want.typed_data()[k];
    offsets[k] = blocks;
    blocks += (t.numel + oh::kSumBlock - 1) / oh::kSumBlock;
  }
  std::vector<double> scratch(size_t(3 * std::max<int64_t>(blocks, 1)), 0.0);
  for (size_t k = 0; k < n; ++k) ts[k].sums = reinterpret_cast<uint64_t>(&scratch[3 * offsets[k]]);
  const oh::ParallelFor parallel = pool_parallel_for(pool, nthreads);
  if (!with_scaled_adam_types(types[0], types[1], [&](auto pt, auto gt, auto) {
        using P = decltype(pt);
        using G = decltype(gt);
        if (kahan) oh::scaled_adam_sums_all<P, G, true>(ts.data(), int(n), 1, &parallel);
        else oh::scaled_adam_sums_all<P, G, false>(ts.data(), int(n), 1, &parallel);
        return true;
      })) {
    return invalid("unsupported dtypes");
  }
  float* o = out->typed_data();
  for (size_t k = 0; k < n; ++k) {
    const double* s = &scratch[3 * offsets[k]];
    o[3 * k] = ts[k].numel ? float(s[0]) : 0.0f;
    o[3 * k + 1] = ts[k].numel ? float(s[1]) : 0.0f;
    o[3 * k + 2] = ts[k].numel ? float(s[2] / double(ts[k].numel)) : 0.0f;
  }
  return ffi::Error::Success();
}

// Operands: scalars f32[n, 10] (oh::ScaledAdamScalars per leaf), size s32[n]
// (1: the leaf's step adds the size term), p..., g..., delta..., v..., and
// with kahan the compensations c... (delta and v fp32). Results: delta...,
// v... (aliased to their operands: updated in place), with kahan c... (the
// same) and the new params p'... (param dtype; aliased to p for the in-place
// step), or with update the updates in the param dtype (new buffers). Without kahan, with results delta..., v... the
// params are only read (JAX's update is the new delta); with a third group
// p'... (aliased to p: JAX's in-place step) the step writes the new params.
ffi::Error ScaledAdamStepImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scalars,
                              ffi::Buffer<ffi::S32> size, ffi::RemainingArgs args,
                              ffi::RemainingRets rets, bool kahan, bool update,
                              int32_t nthreads) {
  auto invalid = [](const std::string& what) {
    return ffi::Error::InvalidArgument("oh_scaled_adam_step: " + what);
  };
  const size_t n = size.element_count();
  const bool write_p = !kahan && n > 0 && rets.size() == 3 * n;
  const size_t nrets = kahan ? 4 : write_p ? 3 : 2;
  if (n == 0 || scalars.element_count() != 10 * n || args.size() != (kahan ? 5 : 4) * n ||
      rets.size() != nrets * n) {
    return invalid("operands scalars f32[n, 10], size s32[n], p..., g..., delta..., v... "
                   "(c... with kahan); results delta..., v... (p'... in place; c..., p'... "
                   "with kahan)");
  }
  std::vector<oh::ScaledAdamTensor> ts(n);
  ffi::DataType types[3] = {ffi::DataType::INVALID, ffi::DataType::INVALID,
                            ffi::DataType::INVALID};
  std::vector<std::pair<ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>>> copies;
  std::vector<ffi::AnyBuffer> compensations;
  compensations.reserve(n);  // no reallocation: sources point into it
  for (size_t k = 0; k < n; ++k) {
    ffi::ErrorOr<ffi::AnyBuffer> in[4] = {args.get<ffi::AnyBuffer>(k), args.get<ffi::AnyBuffer>(n + k),
                                          args.get<ffi::AnyBuffer>(2 * n + k),
                                          args.get<ffi::AnyBuffer>(3 * n + k)};
    for (auto& a : in) {
      if (a.has_error()) return a.error();
    }
    const ffi::AnyBuffer &p = *in[0], &g = *in[1], &d = *in[2], &v = *in[3];
    if (k == 0) {
      types[0] = p.element_type();
      types[1] = g.element_type();
      types[2] = v.element_type();
    } else if (p.element_type() != types[0] || g.element_type() != types[1] ||
               v.element_type() != types[2]) {
      return invalid("the leaves of one call share dtypes");
    }
    const size_t numel = p.element_count();
    const ffi::DataType delta_type = kahan ? ffi::DataType::F32 : types[0];
    if (g.element_count() != numel || d.element_count() != numel || v.element_count() != numel ||
        d.element_type() != delta_type) {
      return invalid("p, g, delta and v must have one size, delta p's dtype (fp32 with kahan)");
    }
    // Results: delta, v, (c, or p in place), each its operand's copy unless
    // aliased to it; (with kahan the new params p', written by the step: p's
    // buffer or a new one).
    const ffi::AnyBuffer* sources[3] = {&d, &v, write_p ? &p : nullptr};
    uint64_t at[4] = {0, 0, 0, 0};
    if (kahan) {
      ffi::ErrorOr<ffi::AnyBuffer> c = args.get<ffi::AnyBuffer>(4 * n + k);
      if (c.has_error()) return c.error();
      if (c->element_type() != types[0] || c->element_count() != numel ||
          types[0] == ffi::DataType::F32) {
        return invalid("c must be a 16-bit param's compensation, of its dtype and size");
      }
      compensations.push_back(*c);
      sources[2] = &compensations.back();
    }
    for (size_t field = 0; field < nrets; ++field) {
      ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> res = rets.get<ffi::AnyBuffer>(field * n + k);
      if (res.has_error()) return res.error();
      const ffi::DataType want_type = field == 3 ? types[0] : sources[field]->element_type();
      if ((*res)->element_count() != numel || (*res)->element_type() != want_type) {
        return invalid("a result differs from its operand");
      }
      if (field < 3) copies.emplace_back(*sources[field], *res);
      at[field] = reinterpret_cast<uint64_t>((*res)->untyped_data());
    }
    oh::ScaledAdamTensor& t = ts[k];
    t = oh::ScaledAdamTensor{};
    t.numel = int64_t(numel);
    t.p = write_p ? at[2] : reinterpret_cast<uint64_t>(p.untyped_data());
    t.comp = kahan ? at[2] : 0;
    t.p_out = at[3];
    t.g = reinterpret_cast<uint64_t>(g.untyped_data());
    t.delta = at[0];
    t.v = at[1];
    std::memcpy(&t.s, scalars.typed_data() + 10 * k, sizeof(oh::ScaledAdamScalars));
    t.size = size.typed_data()[k];
  }
  // Checked: the state (and params) into their results (in place when aliased).
  for (auto& c : copies) same_or_copy(c.first, c.second);
  const oh::ParallelFor parallel = pool_parallel_for(pool, nthreads);
  const bool ok = with_scaled_adam_types(types[0], types[1], [&](auto pt, auto gt, auto vt) {
    using P = decltype(pt);
    using G = decltype(gt);
    using V = decltype(vt);
    if (kahan) {  // fp32 state: the x = p + c ScaledAdam steps
      if constexpr (std::is_same_v<P, float>) {
        return false;
      } else {
        if (types[2] != ffi::DataType::F32) return false;
        if (update) {
          oh::scaled_adam_step_all<P, G, float, false, float, true, true>(ts.data(), int(n), 1,
                                                                          &parallel);
        } else {
          oh::scaled_adam_step_all<P, G, float, false, float, true>(ts.data(), int(n), 1,
                                                                    &parallel);
        }
        return true;
      }
    }
    if (types[2] != (std::is_same_v<V, float> ? ffi::DataType::F32 : types[0])) return false;
    if (write_p) {
      oh::scaled_adam_step_all<P, G, V, true>(ts.data(), int(n), 1, &parallel);
    } else {
      oh::scaled_adam_step_all<P, G, V, false>(ts.data(), int(n), 1, &parallel);
    }
    return true;
  });
  return ok ? ffi::Error::Success() : invalid("unsupported dtypes");
}

}  // namespace

extern "C" int oh_lanes() { return oh::kLanes; }

// Puts a step library's step (oh_ffi_step) into the table; false for a param type or
// mode this library does not step.
extern "C" bool oh_ffi_set_step(int f16, int mode, void* step) {
#if !defined(OH_F16)
  if (f16) return false;
#endif
  if (f16 < 0 || f16 > 1 || mode < 0 || mode >= kModes || step == nullptr) return false;
  steps[f16][mode].store(reinterpret_cast<oh_ffi::Step>(step), std::memory_order_release);
  return true;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OhScaledAdamSums, ScaledAdamSumsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("kahan")
                                  .Attr<int32_t>("nthreads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OhScaledAdamStep, ScaledAdamStepImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<bool>("kahan")
                                  .Attr<bool>("update")
                                  .Attr<int32_t>("nthreads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OhAllFinite, AllFiniteImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Attr<int32_t>("nthreads"));

#define OH_LEAVES_HANDLER(NAME, FLAT)                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, AdamwLeavesImpl<FLAT>, \
                                ffi::Ffi::Bind()           \
                                    .Ctx<ffi::ThreadPool>()   \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::Buffer<ffi::U32>>() \
                                    .RemainingArgs()          \
                                    .RemainingRets()          \
                                    .Attr<int32_t>("mode")    \
                                    .Attr<bool>("sr")         \
                                    .Attr<bool>("update")     \
                                    .Attr<int32_t>("nthreads"));

OH_LEAVES_HANDLER(OhAdamw, false)
OH_LEAVES_HANDLER(OhAdamwFlat, true)
#endif  // the handlers
