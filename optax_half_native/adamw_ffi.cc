// The AdamW kernel (adamw.h) as an XLA FFI custom call for JAX on CPU.
//
// Operands: p, g, mu, nu, buffer (a 0-element array for modes without one),
// scalars f32[10] (lr, b1, b2, 1 - b1, 1 - b2, 1 / bc1, 1 / bc2, eps, wd,
// grad_scale), keys
// u32[2] (the leaf keys of the param and moments streams). Results: p_out (a new array), mu, nu, buffer
// (aliased to their operands: updated in place). Attributes: mode (oh::Mode;
// kUpdate for fp32 params: p_out is the update),
// sr (stochastic moment writes), nthreads.
#include <atomic>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "adamw_threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using oh::bf16;

namespace {

template <typename P, typename G, typename M, typename V, int MODE>
bool run_sr(bool sr, const oh::Tensor& t, const oh::ParallelFor& parallel) {
  if (sr) {
    if constexpr (std::is_same_v<M, float> && std::is_same_v<V, float>) {
      return false;
    } else {
      oh::step_all<P, G, M, V, MODE, true>(&t, 1, 1, &parallel);
      return true;
    }
  }
  oh::step_all<P, G, M, V, MODE, false>(&t, 1, 1, &parallel);
  return true;
}

template <typename P, typename G, typename M, typename V>
bool run_mode(int mode, bool sr, const oh::Tensor& t, const oh::ParallelFor& parallel) {
  if constexpr (std::is_same_v<P, float>) {
    if (sr || !(std::is_same_v<G, float> && std::is_same_v<M, float> && std::is_same_v<V, float>))
      return false;
    if (mode == oh::kDirect) {
      oh::step_all<float, float, float, float, oh::kDirect, false>(&t, 1, 1, &parallel);
      return true;
    }
    if (mode == oh::kUpdate) {
      oh::step_all<float, float, float, float, oh::kUpdate, false>(&t, 1, 1, &parallel);
      return true;
    }
    return false;
  } else {
    switch (mode) {
      case oh::kMaster: return run_sr<P, G, M, V, oh::kMaster>(sr, t, parallel);
      case oh::kSplit: return run_sr<P, G, M, V, oh::kSplit>(sr, t, parallel);
      case oh::kKahan: return run_sr<P, G, M, V, oh::kKahan>(sr, t, parallel);
      case oh::kStochastic: return run_sr<P, G, M, V, oh::kStochastic>(sr, t, parallel);
      case oh::kNearest: return run_sr<P, G, M, V, oh::kNearest>(sr, t, parallel);
      default: return false;
    }
  }
}

// Chunks on XLA's intra-op thread pool, claimed one at a time by the calling
// thread and by up to nthreads - 1 helpers scheduled on the pool: threads of
// our own would compete with XLA's (measured: a 16.8M-param Kahan step took
// 15 ms on 2 threads of ours, 12 on 1). The caller works until every chunk is
// claimed and then waits only for chunks being stepped, so it never waits for
// a helper that has not started (the pool may be busy, even with another call
// like this one); a helper that starts late finds nothing left and returns.
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
    const int64_t helpers = std::min({pool.num_threads(), nthreads - 1, nchunks - 1});
    for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));  // a copy each
    work();
    while (counters->done.load(std::memory_order_acquire) < nchunks) std::this_thread::yield();
  };
}

// Calls f(type tag) for BF16 or F32; false for any other type.
template <typename F>
bool with_type(ffi::DataType d, F&& f) {
  if (d == ffi::DataType::BF16) return f(bf16{});
  if (d == ffi::DataType::F32) return f(float{});
  return false;
}

void same_or_copy(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out) {
  if (out->untyped_data() != in.untyped_data() && in.size_bytes() > 0) {
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  }
}

ffi::Error AdamwImpl(ffi::ThreadPool pool, ffi::AnyBuffer p, ffi::AnyBuffer g, ffi::AnyBuffer mu,
                     ffi::AnyBuffer nu,
                     ffi::AnyBuffer buffer, ffi::Buffer<ffi::F32> scalars,
                     ffi::Buffer<ffi::U32> keys, ffi::Result<ffi::AnyBuffer> p_out,
                     ffi::Result<ffi::AnyBuffer> mu_out, ffi::Result<ffi::AnyBuffer> nu_out,
                     ffi::Result<ffi::AnyBuffer> buffer_out, int32_t mode, bool sr,
                     int32_t nthreads) {
  if (scalars.element_count() != 10 || keys.element_count() != 2) {
    return ffi::Error::InvalidArgument("oh_adamw: scalars must be f32[10] and keys u32[2]");
  }
  const size_t n = p.element_count();
  if (g.element_count() != n || mu.element_count() != n || nu.element_count() != n ||
      p_out->element_count() != n) {
    return ffi::Error::InvalidArgument("oh_adamw: p, g, mu, nu and p_out must have one size");
  }
  // The buffer each mode reads: fp32 master, int16 low half, Kahan buffer of the param type.
  const bool needs = mode == oh::kMaster || mode == oh::kSplit || mode == oh::kKahan;
  const ffi::DataType want = mode == oh::kMaster ? ffi::DataType::F32
                             : mode == oh::kSplit ? ffi::DataType::S16 : p.element_type();
  if (needs && n > 0 && (buffer.element_count() != n || buffer.element_type() != want)) {
    return ffi::Error::InvalidArgument("oh_adamw: the mode's buffer is missing or mistyped");
  }
  // The moments and the buffer are updated in place (aliased by the caller).
  same_or_copy(mu, mu_out);
  same_or_copy(nu, nu_out);
  same_or_copy(buffer, buffer_out);
  oh::Tensor t{};
  t.numel = int64_t(p.element_count());
  t.p = reinterpret_cast<uint64_t>(p.untyped_data());
  t.p_out = reinterpret_cast<uint64_t>(p_out->untyped_data());
  t.g = reinterpret_cast<uint64_t>(g.untyped_data());
  t.mu = reinterpret_cast<uint64_t>(mu_out->untyped_data());
  t.nu = reinterpret_cast<uint64_t>(nu_out->untyped_data());
  t.buffer = buffer.element_count() ? reinterpret_cast<uint64_t>(buffer_out->untyped_data()) : 0;
  std::memcpy(&t.s, scalars.typed_data(), sizeof(oh::Scalars));
  const uint32_t* key = keys.typed_data();
  t.key_p = key[0];
  t.key_m = key[1];
  const oh::ParallelFor parallel = pool_parallel_for(pool, nthreads);
  const bool ok = with_type(p.element_type(), [&](auto pt) {
    return with_type(g.element_type(), [&](auto gt) {
      return with_type(mu.element_type(), [&](auto mt) {
        return with_type(nu.element_type(), [&](auto vt) {
          return run_mode<decltype(pt), decltype(gt), decltype(mt), decltype(vt)>(
              mode, sr, t, parallel);
        });
      });
    });
  });
  if (!ok) return ffi::Error::InvalidArgument("oh_adamw: unsupported dtypes or mode");
  return ffi::Error::Success();
}

// all(isfinite(widen(g) * scale)) of one gradient (oh::all_finite_range),
// in chunks on XLA's pool. Operands: g (bf16 or fp32), scale f32[1] (1 / the
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
  const bool typed = with_type(g.element_type(), [&](auto gt) {
    using G = decltype(gt);
    const G* data = static_cast<const G*>(g.untyped_data());
    pool_parallel_for(pool, nthreads)(nchunks, [&](int64_t c) {
      ok[size_t(c)] = oh::all_finite_range(data, c * oh::kMinPerThread,
                                           std::min(n, (c + 1) * oh::kMinPerThread), s);
    });
    return true;
  });
  if (!typed) return ffi::Error::InvalidArgument("oh_all_finite: g must be bf16 or fp32");
  bool all = true;
  for (char c : ok) all = all && c;
  finite->typed_data()[0] = all;
  return ffi::Error::Success();
}

}  // namespace

extern "C" int oh_lanes() { return oh::kLanes; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(OhAllFinite, AllFiniteImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Attr<int32_t>("nthreads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OhAdamw, AdamwImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("mode")
                                  .Attr<bool>("sr")
                                  .Attr<int32_t>("nthreads"));
