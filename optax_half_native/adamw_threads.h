// Running adamw.h over a list of tensors on several threads: the elements of
// all the tensors, concatenated, are split evenly (at multiples of kAlign
// elements of the concatenation), so many small tensors cost one call and one
// large one is shared by all threads.
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <thread>
#include <type_traits>
#include <vector>

#include "adamw.h"

namespace oh {

// One tensor's step. Mirrored by optax_half_native.TENSOR_DTYPE (numpy, aligned).
struct Tensor {
  int64_t numel;
  uint64_t p, p_out, g, mu, nu, buffer;  // addresses; p_out may equal p; buffer may be 0
  Scalars s;
  uint32_t key_p, key_m;                 // rounding.leaf_key(seed, step, stream, leaf), streams 0, 1
  uint32_t keep;                         // kMaster: nonzero keeps the master where p is not its rounding
  uint64_t index;                        // random-bit counter of element 0 (a shard's offset)
  uint64_t marks;                        // kMaster update: a uint32 the mark of p + u's misses adds to (0: none)
};

// The layout of Tensor, which optax_half_native checks TENSOR_DTYPE against
// on loading a library: its size and each field's offset, in TENSOR_DTYPE's
// order (key_p is the start of its "keys"). Each library is one translation
// unit.
extern "C" int oh_tensor_struct_size() { return int(sizeof(Tensor)); }
// Whether this build steps fp16 params (F16C: OH_F16 in adamw.h).
extern "C" int oh_has_f16() {
#if defined(OH_F16)
  return 1;
#else
  return 0;
#endif
}
extern "C" int oh_tensor_field_offset(int k) {
  const size_t offsets[] = {offsetof(Tensor, numel), offsetof(Tensor, p),
                            offsetof(Tensor, p_out), offsetof(Tensor, g),
                            offsetof(Tensor, mu), offsetof(Tensor, nu),
                            offsetof(Tensor, buffer), offsetof(Tensor, s),
                            offsetof(Tensor, key_p), offsetof(Tensor, keep),
                            offsetof(Tensor, index), offsetof(Tensor, marks)};
  return k >= 0 && k < int(sizeof(offsets) / sizeof(offsets[0])) ? int(offsets[k]) : -1;
}

constexpr int64_t kAlign = 256;          // elements of the concatenation
constexpr int64_t kMinPerThread = 1 << 16;

// Runs fn(lo, hi) over [0, total) split into one span per worker (at most
// nthreads, each at least kMinPerThread elements, spans at multiples of
// kAlign), on an OpenMP team where built with OpenMP, else on std::threads.
template <typename Fn>
void split_evenly(int64_t total, int nthreads, const Fn& fn) {
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(nthreads, total / kMinPerThread));
  int64_t per = (total + workers - 1) / workers;
  per = (per + kAlign - 1) / kAlign * kAlign;
#ifdef _OPENMP
#pragma omp parallel for num_threads(workers) schedule(static, 1)
  for (int64_t w = 0; w < workers; ++w) {
    fn(std::min(total, w * per), std::min(total, (w + 1) * per));
  }
#else
  std::vector<std::thread> threads;
  for (int64_t w = 1; w < workers; ++w) {
    threads.emplace_back([&fn, w, per, total] { fn(w * per, std::min(total, (w + 1) * per)); });
  }
  fn(0, std::min(total, per));
  for (auto& th : threads) th.join();
#endif
}

// kClipRead: the build reads clipped gradients where a tensor's scalars
// clip (clip_read: the JAX entry's optax_half.chain with
// clip_by_global_norm); without it (the torch library, whose callers never
// clip) only the plain read is compiled.
// kUpdateOut: p_out takes the 16-bit update u, not the landed param (adamw_write's UPDATE:
// the JAX entry's tx.update).
template <typename P, typename G, typename M, typename V, int MODE, bool SR, bool kClipRead,
          bool kUpdateOut = false>
void step_span(const Tensor* ts, int n, int64_t lo, int64_t hi) {
  int64_t start = 0;
  for (int k = 0; k < n && start < hi; ++k) {
    const Tensor& t = ts[k];
    const int64_t end = start + t.numel;
    const int64_t b = std::max(lo, start), e = std::min(hi, end);
    if (b < e) {
      auto range = [&](auto read) {
        adamw_range<P, G, M, V, MODE, SR, decltype(read)::value, kUpdateOut>(
            b - start, e - start, t.index, reinterpret_cast<const P*>(t.p),
            reinterpret_cast<P*>(t.p_out), reinterpret_cast<const G*>(t.g),
            reinterpret_cast<M*>(t.mu), reinterpret_cast<V*>(t.nu),
            reinterpret_cast<void*>(t.buffer), t.s, t.key_p, t.key_m, t.keep != 0,
            reinterpret_cast<uint32_t*>(t.marks));
      };
      // Only the reads clip_read can pick are compiled for G.
      const GradRead read = kClipRead ? clip_read<G>(t.s) : kPlain;
      if constexpr (kClipRead && std::is_same_v<G, bf16>) {
        if (read == kClipFinite) range(std::integral_constant<int, kClipFinite>{});
        if (read == kClipFiniteUnit) range(std::integral_constant<int, kClipFiniteUnit>{});
      }
      if constexpr (kClipRead && clip_reads<G>()) {
        if (read == kClip) range(std::integral_constant<int, kClip>{});
      }
      if (read == kPlain) range(std::integral_constant<int, kPlain>{});
    }
    start = end;
  }
}

// Runs fn(0), ..., fn(nchunks - 1) on a caller's thread pool (the XLA FFI one).
using ParallelFor = std::function<void(int64_t nchunks, const std::function<void(int64_t)>& fn)>;

// Given a ParallelFor, the elements go in chunks of kMinPerThread to its
// threads. Built with OpenMP (the torch library: torch's own libgomp.so.1 is then the
// one loaded, so the step runs on torch's thread team instead of competing
// with its workers, which spin for milliseconds after each parallel op), the
// spans go to an OpenMP team; otherwise (the XLA FFI library) to std::threads.
// Which thread steps which span changes no bit.
template <typename Fn>
void for_spans(int64_t total, int nthreads, const ParallelFor* parallel, const Fn& fn) {
  if (parallel != nullptr && total > kMinPerThread) {
    (*parallel)((total + kMinPerThread - 1) / kMinPerThread, [&](int64_t c) {
      fn(c * kMinPerThread, std::min(total, (c + 1) * kMinPerThread));
    });
    return;
  }
  split_evenly(total, nthreads, fn);
}

template <typename P, typename G, typename M, typename V, int MODE, bool SR,
          bool kClipRead = false, bool kUpdateOut = false>
void step_all(const Tensor* ts, int n, int nthreads, const ParallelFor* parallel = nullptr) {
  int64_t total = 0;
  for (int k = 0; k < n; ++k) total += ts[k].numel;
  for_spans(total, nthreads, parallel, [&](int64_t lo, int64_t hi) {
    step_span<P, G, M, V, MODE, SR, kClipRead, kUpdateOut>(ts, n, lo, hi);
  });
}

}  // namespace oh
