// Paged decode attention on the CPU: one query token per sequence against its KV pages,
// read where they lie in the pool. XLA:CPU's own form gathers every page into a new
// buffer first and runs small batched dots over it: ~1.1 ms per layer for 16 sequences of
// ~150 tokens (SmolLM2 shapes), several times what reading that KV once costs.
//
// q f32[S, Hq, d]; k_pages, v_pages f32[P, page_size, Hkv, d]; kv_lens i32[S];
// page_indices i32[S, W]; num_seqs i32[1]; out f32[S, Hq, d]. Sequences past num_seqs and
// empty ones give zero rows. Query head h reads KV head h / (Hq / Hkv) (GQA).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// One sequence: scores for all Hq heads token by token (a token's Hkv*d row is contiguous),
// softmax per head, then the weighted sum of V rows in the same order.
CONFLUX_CLONES
static void AttendOne(const float* q, const float* k, const float* v, const int32_t* pages,
                      int64_t len, int64_t num_pages, int64_t page_size, int64_t hq,
                      int64_t hkv, int64_t d, float scale, float* scores, float* out) {
  const int64_t group = hq / hkv;
  const int64_t row = hkv * d;  // floats per token in a page
  for (int64_t t = 0; t < len; ++t) {
    const int64_t page = std::clamp<int64_t>(pages[t / page_size], 0, num_pages - 1);
    const float* krow = k + (page * page_size + t % page_size) * row;
    for (int64_t h = 0; h < hq; ++h) {
      const float* qh = q + h * d;
      const float* kh = krow + (h / group) * d;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < d; ++i) acc += qh[i] * kh[i];
      scores[h * len + t] = acc * scale;
    }
  }
  for (int64_t h = 0; h < hq; ++h) {
    float* s = scores + h * len;
    float m = s[0];
    for (int64_t t = 1; t < len; ++t) m = std::max(m, s[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      s[t] = expf(s[t] - m);
      sum += s[t];
    }
    const float inv = 1.0f / sum;
    for (int64_t t = 0; t < len; ++t) s[t] *= inv;
  }
  std::memset(out, 0, sizeof(float) * hq * d);
  for (int64_t t = 0; t < len; ++t) {
    const int64_t page = std::clamp<int64_t>(pages[t / page_size], 0, num_pages - 1);
    const float* vrow = v + (page * page_size + t % page_size) * row;
    for (int64_t h = 0; h < hq; ++h) {
      const float p = scores[h * len + t];
      const float* vh = vrow + (h / group) * d;
      float* oh = out + h * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) oh[i] += p * vh[i];
    }
  }
}

static ffi::Error PagedDecode(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
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
  // at the memory's bandwidth. Split the sequences into runs of about equal KV, one thread
  // each (the calling thread takes the first); small calls stay on one thread.
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t parts = std::clamp<int64_t>(total / kMinKeysPerThread, 1,
                                            std::min<int64_t>(cores, kMaxThreads));
  auto run = [&](int64_t part) {
    std::vector<float> scores(static_cast<size_t>(hq * width * page_size));
    for (int64_t s = 0; s < n; ++s) {
      const int64_t owner = std::min(parts - 1, (ends[s] - lens[s]) * parts / total);
      if (owner != part || lens[s] == 0) continue;
      AttendOne(q.typed_data() + s * hq * d, k_pages.typed_data(), v_pages.typed_data(),
                page_indices.typed_data() + s * width, lens[s], num_pages, page_size, hq, hkv,
                d, sm_scale, scores.data(), o + s * hq * d);
    }
  };
  if (total == 0) return ffi::Error::Success();
  std::vector<std::thread> helpers;
  for (int64_t part = 1; part < parts; ++part) helpers.emplace_back(run, part);
  run(0);
  for (auto& t : helpers) t.join();
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConfluxPagedDecode, PagedDecode,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale"));
