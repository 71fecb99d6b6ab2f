// Work split over threads, shared by the CPU FFI handlers (pallas_kernels/cpu_attention,
// pallas_kernels/cpu_gemm): the split, and the call that runs the parts (cpu_parallel.cc).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace conflux {

namespace ffi = xla::ffi;

constexpr int64_t kMaxThreads = 8;

// How many runs ``total`` work splits into: one per ``min_per_part`` of it, at most one per
// thread of XLA's pool (and kMaxThreads).
inline int64_t PartsFor(ffi::ThreadPool& pool, int64_t total, int64_t min_per_part) {
  const int64_t cores = std::max<int64_t>(1, pool.num_threads());
  return std::clamp<int64_t>(total / min_per_part, 1, std::min<int64_t>(cores, kMaxThreads));
}

// The run that work starting at ``start`` of ``total`` falls in: runs of about equal work.
inline int64_t PartOf(int64_t start, int64_t parts, int64_t total) {
  return std::min(parts - 1, start * parts / total);
}

}  // namespace conflux

// Runs fn(ctx, part) for every part in [0, parts) on the calling thread and the process's
// spinning workers (``threads`` of them, made on the first call); returns when all are
// done. Returns false, having run nothing, while another call holds the workers or in a
// forked child. Defined in cpu_parallel.cc, one library loaded RTLD_GLOBAL before any handler
// (pallas_kernels/cpu_gemm/stacked_gemm.py, load_parallel), so every handler shares one set.
extern "C" bool ConfluxRunPartsV1(int threads, int64_t parts, void (*fn)(void*, int64_t),
                                  void* ctx);

namespace conflux {

// Runs ``run(part)`` for every part in [0, parts): the calling thread and the spinning
// workers take parts until none is left; returns when all are done. While another call
// holds the workers, the parts go to XLA's own pool instead.
template <typename Run>
void RunParts(ffi::ThreadPool& pool, int64_t parts, Run& run) {
  if (parts <= 1) {
    if (parts == 1) run(0);
    return;
  }
  const int threads = static_cast<int>(std::min<int64_t>(pool.num_threads(), kMaxThreads)) - 1;
  if (threads > 0) {
    auto call = [](void* ctx, int64_t part) { (*static_cast<Run*>(ctx))(part); };
    if (ConfluxRunPartsV1(threads, parts, call, &run)) return;
  }
  // A task may start only after the call has returned (every part taken): it then finds
  // none left and touches nothing but this shared state.
  struct Parts {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<Parts>();
  auto take = [state, parts, &run] {
    for (int64_t part; (part = state->next.fetch_add(1)) < parts;) {
      run(part);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t part = 1; part < parts; ++part) pool.Schedule(decltype(take)(take));
  take();
  while (state->done.load(std::memory_order_acquire) < parts) std::this_thread::yield();
}

}  // namespace conflux
