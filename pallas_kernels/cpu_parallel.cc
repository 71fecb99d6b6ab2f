// The process's spinning workers behind ConfluxRunPartsV1 (cpu_parallel.h).
//
// Why our own workers: a step calls the CPU handlers ~150 times (a GEMM per projection
// per layer, attention per layer), each a few hundred microseconds at decode sizes. XLA's
// pool parks its idle threads, and on a VM a parked vCPU took 50-400 us to wake (measured:
// the second core joined a 500 us GEMM late or not at all). These workers spin after each
// call, yielding to any runnable thread, before they sleep: within a step they are awake,
// and across the step boundary too (the sampler, the host's launch of the next step: ~1 ms
// at one decode row). With 1 ms they slept about once a step there, and the next step's
// first call paid their wake-up (bench/RESULTS.md).
#include "cpu_parallel.h"

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>

#if defined(__x86_64__)
#include <immintrin.h>
#define CONFLUX_RELAX() _mm_pause()
#else
#define CONFLUX_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace {

using Fn = void (*)(void* ctx, int64_t part);

// Workers that take the parts of one call at a time beside its calling thread.
class SpinPool {
 public:
  // ``threads`` workers (the calling thread makes one more), spinning ``spin_us`` after a
  // call before they sleep.
  SpinPool(int threads, int64_t spin_us) : pid_(getpid()), spin_(spin_us) {
    for (int i = 0; i < threads; ++i) std::thread([this] { Work(); }).detach();
  }

  // Runs fn(ctx, part) for every part in [0, parts) on the caller and the workers; returns
  // when all are done. False (nothing run) when another call holds the workers or this is
  // a forked child (the workers were not forked with it).
  bool Run(int64_t parts, Fn fn, void* ctx) {
    if (getpid() != pid_ || busy_.exchange(true, std::memory_order_acquire)) return false;
    fn_.store(fn, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    parts_.store(parts, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = ((ticket_.load(std::memory_order_relaxed) >> 32) + 1) & 0xffffffffu;
    ticket_.store(gen << 32, std::memory_order_seq_cst);  // publishes the call
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    Take(gen, fn, ctx, parts);
    // Pausing, and yielding now and then: a worker that lost its core gets it back.
    for (int spins = 1; done_.load(std::memory_order_acquire) < parts; ++spins) {
      CONFLUX_RELAX();
      if (spins % 64 == 0) std::this_thread::yield();
    }
    busy_.store(false, std::memory_order_release);
    return true;
  }

 private:
  // Takes parts of call ``gen`` until none is left (a part is taken by moving the ticket
  // from (gen, n) to (gen, n + 1): a worker late for a finished call takes nothing).
  void Take(uint64_t gen, Fn fn, void* ctx, int64_t parts) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    while ((t >> 32) == gen && static_cast<int64_t>(t & 0xffffffffu) < parts) {
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      fn(ctx, static_cast<int64_t>(t & 0xffffffffu));
      done_.fetch_add(1, std::memory_order_release);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  void Work() {
    uint64_t seen = ticket_.load(std::memory_order_acquire) >> 32;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_);
      uint64_t gen;
      while ((gen = ticket_.load(std::memory_order_acquire) >> 32) == seen) {
        for (int i = 0; i < 64; ++i) CONFLUX_RELAX();
        std::this_thread::yield();  // a runnable thread of XLA's or Python's goes first
        if (std::chrono::steady_clock::now() < until) continue;
        std::unique_lock<std::mutex> lock(mu_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lock, [&] { return (ticket_.load(std::memory_order_seq_cst) >> 32) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      seen = gen;
      // The call's fields were stored before its ticket; a finished call's are never used.
      Take(gen, fn_.load(std::memory_order_relaxed), ctx_.load(std::memory_order_relaxed),
           parts_.load(std::memory_order_relaxed));
    }
  }

  const pid_t pid_;
  const int64_t spin_;
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> ticket_{0};  // call generation << 32 | next part
  std::atomic<Fn> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int64_t> parts_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace

// $CONFLUX_SPIN_US: how long a worker spins after a call before it sleeps (default 5 ms).
extern "C" bool ConfluxRunPartsV1(int threads, int64_t parts, Fn fn, void* ctx) {
  // Never destroyed: detached workers use it until the process exits.
  static SpinPool* pool = [threads] {
    const char* env = std::getenv("CONFLUX_SPIN_US");
    return new SpinPool(threads, env ? std::atoll(env) : 5000);
  }();
  return pool->Run(parts, fn, ctx);
}
