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
bool run_sr(bool sr, const oh::Tensor* ts, int n, const oh::ParallelFor& parallel) {
  if (sr) {
    if constexpr (std::is_same_v<M, float> && std::is_same_v<V, float>) {
      return false;
    } else {
      oh::step_all<P, G, M, V, MODE, true>(ts, n, 1, &parallel);
      return true;
    }
  }
  oh::step_all<P, G, M, V, MODE, false>(ts, n, 1, &parallel);
  return true;
}

template <typename P, typename G, typename M, typename V>
bool run_mode(int mode, bool sr, const oh::Tensor* ts, int n, const oh::ParallelFor& parallel) {
  if constexpr (std::is_same_v<P, float>) {
    if (sr || !(std::is_same_v<G, float> && std::is_same_v<M, float> && std::is_same_v<V, float>))
      return false;
    if (mode == oh::kDirect) {
      oh::step_all<float, float, float, float, oh::kDirect, false>(ts, n, 1, &parallel);
      return true;
    }
    if (mode == oh::kUpdate) {
      oh::step_all<float, float, float, float, oh::kUpdate, false>(ts, n, 1, &parallel);
      return true;
    }
    return false;
  } else {
    switch (mode) {
      case oh::kMaster: return run_sr<P, G, M, V, oh::kMaster>(sr, ts, n, parallel);
      case oh::kSplit: return run_sr<P, G, M, V, oh::kSplit>(sr, ts, n, parallel);
      case oh::kKahan: return run_sr<P, G, M, V, oh::kKahan>(sr, ts, n, parallel);
      case oh::kStochastic: return run_sr<P, G, M, V, oh::kStochastic>(sr, ts, n, parallel);
      case oh::kNearest: return run_sr<P, G, M, V, oh::kNearest>(sr, ts, n, parallel);
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

// Runs the step over ts[0..n) with the dtypes (p, g, mu, nu); false for an
// unsupported combination or mode.
bool dispatch(const ffi::DataType (&types)[4], int mode, bool sr, const oh::Tensor* ts, int n,
              const oh::ParallelFor& parallel) {
  return with_type(types[0], [&](auto pt) {
    return with_type(types[1], [&](auto gt) {
      return with_type(types[2], [&](auto mt) {
        return with_type(types[3], [&](auto vt) {
          return run_mode<decltype(pt), decltype(gt), decltype(mt), decltype(vt)>(
              mode, sr, ts, n, parallel);
        });
      });
    });
  });
}

// The buffer each mode reads: fp32 master, int16 low half, Kahan buffer of the param type.
bool needs_buffer(int mode) { return mode == oh::kMaster || mode == oh::kSplit || mode == oh::kKahan; }
ffi::DataType buffer_type(int mode, ffi::DataType p) {
  return mode == oh::kMaster ? ffi::DataType::F32 : mode == oh::kSplit ? ffi::DataType::S16 : p;
}

void set_scalars(oh::Tensor& t, const ffi::Buffer<ffi::F32>& scalars, const uint32_t* key) {
  std::memcpy(&t.s, scalars.typed_data(), sizeof(oh::Scalars));
  t.key_p = key[0];
  t.key_m = key[1];
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
      p_out->element_count() != n || mu_out->element_count() != n ||
      nu_out->element_count() != n) {
    return ffi::Error::InvalidArgument("oh_adamw: p, g, mu, nu and p_out must have one size");
  }
  if (mu_out->element_type() != mu.element_type() || nu_out->element_type() != nu.element_type() ||
      buffer_out->element_type() != buffer.element_type() ||
      buffer_out->element_count() != buffer.element_count()) {
    return ffi::Error::InvalidArgument("oh_adamw: a state result differs from its operand");
  }
  if (needs_buffer(mode) && n > 0 && (buffer.element_count() != n ||
                                      buffer.element_type() != buffer_type(mode, p.element_type()))) {
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
  set_scalars(t, scalars, keys.typed_data());
  const ffi::DataType types[4] = {p.element_type(), g.element_type(), mu.element_type(),
                                  nu.element_type()};
  if (!dispatch(types, mode, sr, &t, 1, pool_parallel_for(pool, nthreads))) {
    return ffi::Error::InvalidArgument("oh_adamw: unsupported dtypes or mode");
  }
  return ffi::Error::Success();
}

// Every leaf of a flat state (adamw_bf16 / adam_fp32_master with
// flat_state=True) in one call. Operands: scalars f32[10], keys u32[n, 2]
// (leaf k's pair in row k), then p_0..p_{n-1}, g_0..g_{n-1}, mu, nu, buffer:
// the flat state, leaf k's elements at the sum of the sizes of leaves 0..k-1
// (a 0-element buffer for modes without one). Results: p_out_0..p_out_{n-1},
// mu, nu, buffer (aliased to their operands). All leaves share the dtypes of
// leaf 0. The elements of all leaves, concatenated, are split into chunks
// across XLA's pool (oh::step_all): n small leaves cost one call.
ffi::Error AdamwFlatImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scalars,
                         ffi::Buffer<ffi::U32> keys, ffi::RemainingArgs args,
                         ffi::RemainingRets rets, int32_t mode, bool sr, int32_t nthreads) {
  if (args.size() < 5 || (args.size() - 3) % 2 != 0) {
    return ffi::Error::InvalidArgument("oh_adamw_flat: operands p..., g..., mu, nu, buffer");
  }
  const size_t n = (args.size() - 3) / 2;
  if (rets.size() != n + 3) {
    return ffi::Error::InvalidArgument("oh_adamw_flat: results p_out..., mu, nu, buffer");
  }
  if (scalars.element_count() != 10 || keys.element_count() != 2 * n) {
    return ffi::Error::InvalidArgument("oh_adamw_flat: scalars must be f32[10], keys u32[n, 2]");
  }
  auto state_arg = [&](size_t k) { return args.get<ffi::AnyBuffer>(2 * n + k); };
  auto state_ret = [&](size_t k) { return rets.get<ffi::AnyBuffer>(n + k); };
  ffi::ErrorOr<ffi::AnyBuffer> st[3] = {state_arg(0), state_arg(1), state_arg(2)};
  ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> st_out[3] = {state_ret(0), state_ret(1), state_ret(2)};
  for (auto& x : st) if (x.has_error()) return x.error();
  for (auto& x : st_out) if (x.has_error()) return x.error();
  for (int k = 0; k < 3; ++k) {
    if ((*st_out[k])->element_count() != st[k]->element_count() ||
        (*st_out[k])->element_type() != st[k]->element_type()) {
      return ffi::Error::InvalidArgument("oh_adamw_flat: a state result differs from its operand");
    }
  }
  std::vector<oh::Tensor> ts(n);
  ffi::DataType types[4] = {};
  int64_t offset = 0;
  const size_t sizes[3] = {
      size_t(ffi::ByteWidth(st[0]->element_type())), size_t(ffi::ByteWidth(st[1]->element_type())),
      size_t(ffi::ByteWidth(st[2]->element_type()))};
  char* base[3] = {static_cast<char*>((*st_out[0])->untyped_data()),
                   static_cast<char*>((*st_out[1])->untyped_data()),
                   static_cast<char*>((*st_out[2])->untyped_data())};
  for (size_t k = 0; k < n; ++k) {
    ffi::ErrorOr<ffi::AnyBuffer> p = args.get<ffi::AnyBuffer>(k), g = args.get<ffi::AnyBuffer>(n + k);
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> p_out = rets.get<ffi::AnyBuffer>(k);
    if (p.has_error()) return p.error();
    if (g.has_error()) return g.error();
    if (p_out.has_error()) return p_out.error();
    const ffi::DataType here[2] = {p->element_type(), g->element_type()};
    if (k == 0) {
      types[0] = here[0];
      types[1] = here[1];
      types[2] = st[0]->element_type();
      types[3] = st[1]->element_type();
    } else if (here[0] != types[0] || here[1] != types[1]) {
      return ffi::Error::InvalidArgument("oh_adamw_flat: the leaves of one call share dtypes");
    }
    const int64_t numel = int64_t(p->element_count());
    if (int64_t(g->element_count()) != numel || int64_t((*p_out)->element_count()) != numel ||
        (*p_out)->element_type() != here[0]) {
      return ffi::Error::InvalidArgument("oh_adamw_flat: p, g and p_out must have one size, "
                                         "p_out p's dtype");
    }
    oh::Tensor& t = ts[k];
    t = oh::Tensor{};
    t.numel = numel;
    t.p = reinterpret_cast<uint64_t>(p->untyped_data());
    t.p_out = reinterpret_cast<uint64_t>((*p_out)->untyped_data());
    t.g = reinterpret_cast<uint64_t>(g->untyped_data());
    t.mu = reinterpret_cast<uint64_t>(base[0] + offset * sizes[0]);
    t.nu = reinterpret_cast<uint64_t>(base[1] + offset * sizes[1]);
    t.buffer = st[2]->element_count() ? reinterpret_cast<uint64_t>(base[2] + offset * sizes[2]) : 0;
    set_scalars(t, scalars, keys.typed_data() + 2 * k);
    offset += numel;
  }
  const bool buffer_ok = needs_buffer(mode)
      ? (st[2]->element_count() == size_t(offset) &&
         (offset == 0 || st[2]->element_type() == buffer_type(mode, types[0])))
      : st[2]->element_count() == 0;
  if (st[0]->element_count() != size_t(offset) || st[1]->element_count() != size_t(offset) ||
      !buffer_ok) {
    return ffi::Error::InvalidArgument(
        "oh_adamw_flat: mu, nu (and the mode's buffer) must hold every leaf's elements");
  }
  // Checked: the moments and the buffer into their results (in place when aliased).
  for (int k = 0; k < 3; ++k) same_or_copy(*st[k], *st_out[k]);
  if (n > 0 && !dispatch(types, mode, sr, ts.data(), int(n), pool_parallel_for(pool, nthreads))) {
    return ffi::Error::InvalidArgument("oh_adamw_flat: unsupported dtypes or mode");
  }
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(OhAdamwFlat, AdamwFlatImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int32_t>("mode")
                                  .Attr<bool>("sr")
                                  .Attr<int32_t>("nthreads"));
