// Work split over XLA's intra-op thread pool, shared by the CPU FFI handlers
// (pallas_kernels/cpu_attention, pallas_kernels/cpu_gemm).
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

// Runs ``run(part)`` for every part in [0, parts): the calling thread and tasks on XLA's own
// intra-op pool (starting a thread per call cost more than a small call) take parts until
// none is left; returns when all are done.
template <typename Run>
void RunParts(ffi::ThreadPool& pool, int64_t parts, Run& run) {
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
