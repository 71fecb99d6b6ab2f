// Paged decode attention on the CPU: one query token per sequence against its KV pages,
// read where they lie in the pool. XLA:CPU's own form gathers every page into a new
// buffer first and runs small batched dots over it: ~1.1 ms per layer for 16 sequences of
// ~150 tokens (SmolLM2 shapes), several times what reading that KV once costs.
//
// q f32[S, Hq, d]; k_pages, v_pages f32[P, page_size, Hkv, d]; kv_lens i32[S];
// page_indices i32[S, W]; num_seqs i32[1]; out f32[S, Hq, d]. Sequences past num_seqs and
// empty ones give zero rows. Query head h reads KV head h / (Hq / Hkv) (GQA).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Keys one thread must have before another starts (a thread costs ~20-50 us to start).
constexpr int64_t kMinKeysPerThread = 512;
constexpr int64_t kMaxThreads = 8;

// Built for the host's widest vectors at load time (GCC function multi-versioning), so one
// cached library serves every x86 host of a shared cache.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CONFLUX_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CONFLUX_CLONES
#endif

// exp(x) for the softmax's x <= 0, in plain arithmetic the compiler vectorizes (libm's
// expf is a call per element; -ffast-math would vectorize it, but see paged_decode.py).
// x = n ln2 + r with |r| <= ln2/2 (ln2 in two parts, so r is exact to float rounding), then
// exp(r) by its Taylor series to r^7 (truncation < 6e-9 relative) and 2^n from the
// exponent bits. Below -87 the result would leave the normal floats: 0, as exp underflows.
static inline float ExpNonPositive(float x) {
  const float clamped = x < -87.0f ? -87.0f : x;
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  const float r = (clamped - n * 0.693359375f) + n * 2.12194440054690583e-4f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// One sequence, page by page (no index arithmetic per token): scores of every query head
// for each key (a key's Hkv*d row is contiguous; the query heads of one KV head read it
// together), softmax per head, then the weighted sum of the V rows in the same order.
// ``kD`` > 0 fixes the head size at compile time: the many short loops over d (two per
// query head and key) are then unrolled, which at d = 64 more than halves the call.
template <int64_t kD>
CONFLUX_CLONES
static void AttendOneD(const float* q, const float* k, const float* v, const int32_t* pages,
                       int64_t len, int64_t num_pages, int64_t page_size, int64_t hq,
                       int64_t hkv, int64_t head_dim, float scale, float* scores, float* out,
                       const float* next_k) {
  const int64_t d = kD > 0 ? kD : head_dim;
  const int64_t group = hq / hkv;
  const int64_t row = hkv * d;  // floats per token in a page
  const int64_t page_floats = page_size * row;
  for (int64_t t0 = 0; t0 < len; t0 += page_size) {
    const int64_t page = std::clamp<int64_t>(pages[t0 / page_size], 0, num_pages - 1);
    const float* kpage = k + page * page_floats;
    const int64_t n = std::min(page_size, len - t0);
    // The pages lie scattered over the pool and each spans a few 4 KiB memory pages, where
    // the hardware prefetcher stops: ask for the next K page while this one is scored, and
    // for this page's V, which the weighted sum reads after the softmax (a sequence's KV
    // fits in L2).
    const float* vpage = v + page * page_floats;
    const float* knext = t0 + page_size < len
        ? k + std::clamp<int64_t>(pages[t0 / page_size + 1], 0, num_pages - 1) * page_floats
        : nullptr;
    for (int64_t j = 0; j < n; ++j) {
      const float* krow = kpage + j * row;
      // A row's worth of lines each, spread over the rows: a burst of a whole page of
      // requests would wait on the core's few outstanding-miss slots.
      for (int64_t f = j * row; f < (j + 1) * row; f += 16) {
        __builtin_prefetch(vpage + f, 0, 2);
        if (knext != nullptr) __builtin_prefetch(knext + f, 0, 3);
      }
      for (int64_t h = 0; h < hq; ++h) {
        const float* qh = q + h * d;
        const float* kh = krow + (h / group) * d;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < d; ++i) acc += qh[i] * kh[i];
        scores[h * len + t0 + j] = acc * scale;
      }
    }
  }
  for (int64_t h = 0; h < hq; ++h) {
    float* s = scores + h * len;
    float m = s[0];
#pragma omp simd reduction(max : m)
    for (int64_t t = 1; t < len; ++t) m = m > s[t] ? m : s[t];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      s[t] = ExpNonPositive(s[t] - m);
      sum += s[t];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) s[t] *= inv;
  }
  std::memset(out, 0, sizeof(float) * hq * d);
  for (int64_t t0 = 0; t0 < len; t0 += page_size) {
    const int64_t page = std::clamp<int64_t>(pages[t0 / page_size], 0, num_pages - 1);
    const float* vpage = v + page * page_floats;
    const int64_t n = std::min(page_size, len - t0);
    for (int64_t j = 0; j < n; ++j) {
      const float* vrow = vpage + j * row;
      if (t0 == 0 && next_k != nullptr) {  // the next sequence's first K page, meanwhile
        for (int64_t f = j * row; f < (j + 1) * row; f += 16) __builtin_prefetch(next_k + f, 0, 2);
      }
      for (int64_t h = 0; h < hq; ++h) {
        const float p = scores[h * len + t0 + j];
        const float* vh = vrow + (h / group) * d;
        float* oh = out + h * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) oh[i] += p * vh[i];
      }
    }
  }
}

static void AttendOne(const float* q, const float* k, const float* v, const int32_t* pages,
                      int64_t len, int64_t num_pages, int64_t page_size, int64_t hq,
                      int64_t hkv, int64_t d, float scale, float* scores, float* out,
                      const float* next_k) {
  switch (d) {
    case 64:
      return AttendOneD<64>(q, k, v, pages, len, num_pages, page_size, hq, hkv, d, scale,
                            scores, out, next_k);
    case 128:
      return AttendOneD<128>(q, k, v, pages, len, num_pages, page_size, hq, hkv, d, scale,
                             scores, out, next_k);
    default:
      return AttendOneD<0>(q, k, v, pages, len, num_pages, page_size, hq, hkv, d, scale,
                           scores, out, next_k);
  }
}

static ffi::Error PagedDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::F32> k_pages,
                              ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> kv_lens,
                              ffi::Buffer<ffi::S32> page_indices,
                              ffi::Buffer<ffi::S32> num_seqs, ffi::ResultBuffer<ffi::F32> out,
                              float sm_scale) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  auto pd = page_indices.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 2) {
    return ffi::Error::InvalidArgument("paged_decode: q must be 3-D, pages 4-D, table 2-D");
  }
  const int64_t seqs = qd[0], hq = qd[1], d = qd[2];
  const int64_t num_pages = kd[0], page_size = kd[1], hkv = kd[2];
  const int64_t width = pd[1];
  if (kd[3] != d || hkv <= 0 || hq % hkv != 0 || pd[0] != seqs) {
    return ffi::Error::InvalidArgument("paged_decode: inconsistent shapes");
  }
  float* o = out->typed_data();
  std::memset(o, 0, sizeof(float) * seqs * hq * d);
  const int64_t n = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, seqs);
  if (n == 0 || num_pages == 0) return ffi::Error::Success();
  std::vector<int64_t> lens(n), ends(n);
  int64_t total = 0;
  for (int64_t s = 0; s < n; ++s) {
    lens[s] = std::clamp<int64_t>(kv_lens.typed_data()[s], 0, width * page_size);
    total += lens[s];
    ends[s] = total;
  }
  // The KV of a step's sequences is scattered over the pool: one core alone cannot pull it
  // at the memory's bandwidth. Split the sequences into runs of about equal KV; the calling
  // thread and tasks on XLA's own intra-op pool (starting a thread per call cost more than
  // a small call) take runs until none is left. Small calls stay on the calling thread.
  const int64_t cores = std::max<int64_t>(1, pool.num_threads());
  const int64_t parts = std::clamp<int64_t>(total / kMinKeysPerThread, 1,
                                            std::min<int64_t>(cores, kMaxThreads));
  const float* k_data = k_pages.typed_data();
  const int32_t* table = page_indices.typed_data();
  const int64_t page_floats = page_size * hkv * d;
  auto run = [&](int64_t part) {
    std::vector<float> scores(static_cast<size_t>(hq * width * page_size));
    std::vector<int64_t> mine;  // this run's sequences, in order
    for (int64_t s = 0; s < n; ++s) {
      const int64_t owner = std::min(parts - 1, (ends[s] - lens[s]) * parts / total);
      if (owner == part && lens[s] > 0) mine.push_back(s);
    }
    for (size_t i = 0; i < mine.size(); ++i) {
      const int64_t s = mine[i];
      const float* next_k = i + 1 < mine.size()
          ? k_data + std::clamp<int64_t>(table[mine[i + 1] * width], 0, num_pages - 1) *
                         page_floats
          : nullptr;
      AttendOne(q.typed_data() + s * hq * d, k_data, v_pages.typed_data(), table + s * width,
                lens[s], num_pages, page_size, hq, hkv, d, sm_scale, scores.data(),
                o + s * hq * d, next_k);
    }
  };
  if (total == 0) return ffi::Error::Success();
  // A task may start only after the call has returned (every run taken): it then finds
  // none left and touches nothing but this shared state.
  struct Runs {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto runs = std::make_shared<Runs>();
  auto take = [runs, parts, &run] {
    for (int64_t part; (part = runs->next.fetch_add(1)) < parts;) {
      run(part);
      runs->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t part = 1; part < parts; ++part) pool.Schedule(decltype(take)(take));
  take();
  while (runs->done.load(std::memory_order_acquire) < parts) std::this_thread::yield();
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConfluxPagedDecode, PagedDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale"));
