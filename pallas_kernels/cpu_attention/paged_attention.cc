// Paged attention on the CPU, reading KV pages where they lie in the pool (XLA FFI).
// XLA:CPU's own forms gather every page into a new buffer first and run small batched dots
// (decode) or tiled loops (prefill) over it: several times what reading that KV once costs.
//
// Two handlers, both in ragged paged attention's layout: k_pages, v_pages
// f32[P, page_size, Hkv, d]; kv_lens i32[S]; page_indices i32[S, W]; num_seqs i32[1].
// Query head h reads KV head h / (Hq / Hkv) (GQA); sequences past num_seqs, empty ones and
// rows outside every live sequence give zero rows.
// - ConfluxPagedDecode: q f32[S, Hq, d], one query token per sequence.
// - ConfluxPagedPrefill: q f32[T, Hq, d] packed ragged, cu_q_lens i32[S+1]: sequence s
//   owns rows cu_q_lens[s]..cu_q_lens[s+1], the last positions of its kv_lens[s] keys,
//   each attending causally.
// - ConfluxPagedKvWrite: a step's new K or V rows into the stacked pool, in place.
// - ConfluxPagedCopyPages: whole pages of one layer copied to other pages, in place.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "cpu_math.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using conflux::ExpNonPositive;
using conflux::PartOf;
using conflux::PartsFor;
using conflux::RunParts;

// Keys one thread must have before another starts (a thread costs ~20-50 us to start).
constexpr int64_t kMinKeysPerThread = 512;

// Built for the host's widest vectors at load time (GCC function multi-versioning), so one
// cached library serves every x86 host of a shared cache.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CONFLUX_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CONFLUX_CLONES
#endif

// Each of ``rows`` rows of ``len`` scores -> its softmax, in place.
static inline __attribute__((always_inline)) void SoftmaxRows(float* scores, int64_t rows,
                                                             int64_t len) {
  for (int64_t h = 0; h < rows; ++h) {
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
}

// 16 floats as one vector (GCC's vector extension: one zmm under AVX-512, split into
// narrower registers by the other clones).
typedef float V16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t I16 __attribute__((vector_size(64)));

// The lane sums of a[0..15] as one vector (lane t = the sum of a[t]'s lanes): four levels of
// pairwise two-source shuffles and adds, 45 operations where 16 separate horizontal sums
// take ~8 each.
static inline __attribute__((always_inline)) V16 SumLanes16(V16* a) {
  const I16 lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const I16 hi1 = lo1 + 8;
  const I16 lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const I16 hi2 = lo2 + 4;
  const I16 lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const I16 hi3 = lo3 + 2;
  const I16 lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const I16 hi4 = lo4 + 1;
  for (int i = 0; i < 8; ++i)  // lanes 0-7: a[2i]'s 8 partial sums, 8-15: a[2i+1]'s
    a[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo1) +
           __builtin_shuffle(a[2 * i], a[2 * i + 1], hi1);
  for (int i = 0; i < 4; ++i)  // 4 partials each of 4 vectors
    a[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo2) +
           __builtin_shuffle(a[2 * i], a[2 * i + 1], hi2);
  for (int i = 0; i < 2; ++i)  // 2 partials each of 8
    a[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo3) +
           __builtin_shuffle(a[2 * i], a[2 * i + 1], hi3);
  return __builtin_shuffle(a[0], a[1], lo4) + __builtin_shuffle(a[0], a[1], hi4);
}

// Whether the host has AVX-512, where the 16-float vectors below are one register and
// SumLanes16's shuffles one instruction each. The AVX2 and plain clones build the shuffles
// from single lanes and spill the vectors: the call ran 3x slower (an AVX2 build on an
// AVX-512 host), so there the per-key loops serve.
static bool WideShuffles() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool wide = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return wide;
#else
  return false;
#endif
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
  SoftmaxRows(scores, hq, len);
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

#if defined(__x86_64__) && defined(__GNUC__)
// AttendOneD for AVX-512 hosts and head sizes that are a multiple of 16 (64, 128): a page's
// keys scored 16 at a time per query head (their dot products as vectors of partial sums,
// then SumLanes16: ~3 operations per key and head where a horizontal sum takes ~8), and V
// summed one query head at a time with its output in registers (no load and store of the
// output per key). At SmolLM2's shapes the call runs 1.4x faster with the KV in cache,
// 1.02-1.05x with it coming from memory (bench/RESULTS.md).
template <int64_t kD>
__attribute__((target("avx512f"))) static void AttendOneWide(
    const float* q, const float* k, const float* v, const int32_t* pages, int64_t len,
    int64_t num_pages, int64_t page_size, int64_t hq, int64_t hkv, float scale,
    float* scores, float* out, const float* next_k) {
  static_assert(kD > 0 && kD % 16 == 0, "head size: a multiple of 16");
  constexpr int64_t kC = kD / 16;  // vectors per head
  const int64_t group = hq / hkv;
  const int64_t row = hkv * kD;  // floats per token in a page
  const int64_t page_floats = page_size * row;
  for (int64_t t0 = 0; t0 < len; t0 += page_size) {
    const int64_t page = std::clamp<int64_t>(pages[t0 / page_size], 0, num_pages - 1);
    const float* kpage = k + page * page_floats;
    const float* vpage = v + page * page_floats;
    const int64_t n = std::min(page_size, len - t0);
    const float* knext = t0 + page_size < len
        ? k + std::clamp<int64_t>(pages[t0 / page_size + 1], 0, num_pages - 1) * page_floats
        : nullptr;
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int64_t m = std::min<int64_t>(16, n - j0);
      for (int64_t j = j0; j < j0 + m; ++j) {  // as AttendOneD: this page's V, the next K
        for (int64_t f = j * row; f < (j + 1) * row; f += 16) {
          __builtin_prefetch(vpage + f, 0, 2);
          if (knext != nullptr) __builtin_prefetch(knext + f, 0, 3);
        }
      }
      for (int64_t h = 0; h < hq; ++h) {
        V16 qv[kC];
        std::memcpy(qv, q + h * kD, sizeof(qv));
        const float* kh = kpage + j0 * row + (h / group) * kD;
        V16 acc[16];
        if (m == 16) {
          _Pragma("GCC unroll 16") for (int64_t j = 0; j < 16; ++j) {
            const V16* kv = reinterpret_cast<const V16*>(kh + j * row);
            acc[j] = qv[0] * kv[0];
            _Pragma("GCC unroll 8") for (int64_t c = 1; c < kC; ++c) acc[j] += qv[c] * kv[c];
          }
        } else {
          for (int64_t j = 0; j < 16; ++j) {
            acc[j] = V16{};
            if (j < m) {
              const V16* kv = reinterpret_cast<const V16*>(kh + j * row);
              for (int64_t c = 0; c < kC; ++c) acc[j] += qv[c] * kv[c];
            }
          }
        }
        const V16 sums = SumLanes16(acc) * scale;
        std::memcpy(scores + h * len + t0 + j0, &sums, sizeof(float) * m);
      }
    }
  }
  SoftmaxRows(scores, hq, len);
  for (int64_t h = 0; h < hq; ++h) {
    V16 o[kC] = {};
    const float* p = scores + h * len;
    for (int64_t t0 = 0; t0 < len; t0 += page_size) {
      const int64_t page = std::clamp<int64_t>(pages[t0 / page_size], 0, num_pages - 1);
      const float* vh = v + page * page_floats + (h / group) * kD;
      const int64_t n = std::min(page_size, len - t0);
      for (int64_t j = 0; j < n; ++j) {
        if (h == 0 && t0 == 0 && next_k != nullptr) {  // the next sequence's first K page
          for (int64_t f = j * row; f < (j + 1) * row; f += 16)
            __builtin_prefetch(next_k + f, 0, 2);
        }
        const V16* vr = reinterpret_cast<const V16*>(vh + j * row);
        const float w = p[t0 + j];
        for (int64_t c = 0; c < kC; ++c) o[c] += w * vr[c];
      }
    }
    std::memcpy(out + h * kD, o, sizeof(o));
  }
}
#endif

// Calls ``f(std::integral_constant<int64_t, kD>)`` with the head size fixed at compile time
// where it is a common one (kD = d), else kD = 0 (read at run time).
template <typename F>
static void WithHeadDim(int64_t d, F&& f) {
  switch (d) {
    case 64:
      return f(std::integral_constant<int64_t, 64>{});
    case 128:
      return f(std::integral_constant<int64_t, 128>{});
    default:
      return f(std::integral_constant<int64_t, 0>{});
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
  // at the memory's bandwidth. Split the sequences into runs of about equal KV, taken by
  // the CPU handlers' workers (RunParts). Small calls stay on the calling thread.
  const int64_t parts = PartsFor(pool, total, kMinKeysPerThread);
  const float* k_data = k_pages.typed_data();
  const int32_t* table = page_indices.typed_data();
  const int64_t page_floats = page_size * hkv * d;
  auto run = [&](int64_t part) {
    std::vector<float> scores(static_cast<size_t>(hq * width * page_size));
    std::vector<int64_t> mine;  // this run's sequences, in order
    for (int64_t s = 0; s < n; ++s) {
      if (lens[s] > 0 && PartOf(ends[s] - lens[s], parts, total) == part) mine.push_back(s);
    }
    for (size_t i = 0; i < mine.size(); ++i) {
      const int64_t s = mine[i];
      const float* next_k = i + 1 < mine.size()
          ? k_data + std::clamp<int64_t>(table[mine[i + 1] * width], 0, num_pages - 1) *
                         page_floats
          : nullptr;
      WithHeadDim(d, [&](auto kd) {
#if defined(__x86_64__) && defined(__GNUC__)
        if constexpr (kd() > 0 && kd() % 16 == 0) {
          if (WideShuffles()) {
            return AttendOneWide<kd()>(q.typed_data() + s * hq * d, k_data,
                                       v_pages.typed_data(), table + s * width, lens[s],
                                       num_pages, page_size, hq, hkv, sm_scale,
                                       scores.data(), o + s * hq * d, next_k);
          }
        }
#endif
        AttendOneD<kd()>(q.typed_data() + s * hq * d, k_data, v_pages.typed_data(),
                         table + s * width, lens[s], num_pages, page_size, hq, hkv, d,
                         sm_scale, scores.data(), o + s * hq * d, next_k);
      });
    }
  };
  if (total == 0) return ffi::Error::Success();
  RunParts(pool, parts, run);
  return ffi::Error::Success();
}

// ---- Prefill: blocks of query rows against blocks of keys ------------------------------
// A work item is one KV head of a run of a sequence's query tokens: its rows are the
// (token, query head) pairs of that head's group, so each key row loaded serves them all.
// Keys go in blocks of kKeyBlock, transposed so that a row's scores are a vector FMA per
// head dimension, with an online softmax across blocks (scratch stays ~0.25 MiB whatever
// the context). Each row tile scores and sums only the keys its last row sees. Items of
// 192 rows transpose a sequence's keys a third as often as items of 64, and 32-key score
// tiles waste less past the diagonal than 64-key ones: 1.04-1.22x on SmolLM2's prefills of
// 128-512 tokens (bench/RESULTS.md).
constexpr int64_t kTargetRows = 192;  // query rows of a work item (tokens x group)
constexpr int64_t kKeyBlock = 128;    // keys scored at once
constexpr int64_t kRowTile = 4;       // query rows sharing each key load
constexpr int64_t kKeyTile = 32;      // keys sharing each query load (kKeyBlock's divisor)
constexpr int64_t kMinWorkPerThread = 1 << 15;  // row-key pairs before a second thread

struct PrefillItem {
  int64_t seq;    // sequence
  int64_t head;   // KV head
  int64_t row0;   // first query row (token) in q
  int64_t ntok;   // tokens
  int64_t pos0;   // position of the first token
};

static int64_t ScratchFloats(int64_t rows, int64_t d) {
  return 2 * rows * d + rows * kKeyBlock + d * kKeyBlock + 2 * rows;
}

template <int64_t kD>
CONFLUX_CLONES
static void AttendBlockD(const PrefillItem& it, const float* __restrict__ q, const float* k,
                         const float* v, const int32_t* pages, int64_t num_pages,
                         int64_t page_size, int64_t hq, int64_t hkv, int64_t head_dim,
                         float scale, float* __restrict__ scratch, const float** vrows,
                         float* __restrict__ out) {
  const int64_t d = kD > 0 ? kD : head_dim;
  const int64_t group = hq / hkv;
  const int64_t rows = it.ntok * group;
  const int64_t row_floats = hkv * d;  // floats per token in a page
  float* __restrict__ qs = scratch;               // [rows, d] scaled queries
  float* __restrict__ acc = qs + rows * d;        // [rows, d] unnormalized outputs
  float* __restrict__ s = acc + rows * d;         // [rows, kKeyBlock] scores, then weights
  float* __restrict__ kt = s + rows * kKeyBlock;  // [d, kKeyBlock] the block's keys
  float* __restrict__ m = kt + d * kKeyBlock;     // [rows] running max
  float* __restrict__ l = m + rows;               // [rows] running sum of weights
  for (int64_t t = 0; t < it.ntok; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const float* src = q + ((it.row0 + t) * hq + it.head * group + g) * d;
      float* dst = qs + (t * group + g) * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) dst[i] = src[i] * scale;
    }
  }
  std::memset(acc, 0, sizeof(float) * rows * d);
  std::fill(m, m + rows, -INFINITY);
  std::fill(l, l + rows, 0.0f);
  const int64_t visible = it.pos0 + it.ntok;  // keys the last token sees
  for (int64_t k0 = 0; k0 < visible; k0 += kKeyBlock) {
    const int64_t nk = std::min(kKeyBlock, visible - k0);
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t key = k0 + j;
      const int64_t page = std::clamp<int64_t>(pages[key / page_size], 0, num_pages - 1);
      const int64_t at = (page * page_size + key % page_size) * row_floats + it.head * d;
      const float* krow = k + at;
      for (int64_t i = 0; i < d; ++i) kt[i * kKeyBlock + j] = krow[i];
      vrows[j] = v + at;
    }
    for (int64_t i = 0; i < d; ++i) {  // a short last block scores zeros, not stale keys
      std::fill(kt + i * kKeyBlock + nk, kt + (i + 1) * kKeyBlock, 0.0f);
    }
    // Keys of this block that row tile r0's last row sees (causal): the scores and the
    // weighted sum stop there (0 for a tile that sees none of the block).
    auto tile_keys = [&](int64_t r0, int64_t nr) {
      return std::clamp<int64_t>(it.pos0 + (r0 + nr - 1) / group - k0 + 1, 0, nk);
    };
    // Scores: kRowTile rows at a time, 16 keys a vector, summed over the head dimension.
    for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
      const int64_t nr = std::min(kRowTile, rows - r0);
      const int64_t seen = tile_keys(r0, nr);
      for (int64_t j0 = 0; j0 < seen; j0 += kKeyTile) {
        float tile[kRowTile][kKeyTile] = {};
        for (int64_t i = 0; i < d; ++i) {
          const float* kv = kt + i * kKeyBlock + j0;
          for (int64_t r = 0; r < kRowTile; ++r) {
            const float qv = qs[(r0 + std::min(r, nr - 1)) * d + i];
#pragma omp simd
            for (int64_t j = 0; j < kKeyTile; ++j) tile[r][j] += qv * kv[j];
          }
        }
        for (int64_t r = 0; r < nr; ++r) {
          std::memcpy(s + (r0 + r) * kKeyBlock + j0, tile[r], sizeof(tile[r]));
        }
      }
    }
    // Causal mask and the online softmax: row r (token r / group) sees keys <= its position.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t seen = std::min(nk, it.pos0 + r / group - k0 + 1);
      float* sr = s + r * kKeyBlock;
      if (seen <= 0) {  // nothing visible in this block (only in blocks after the first)
        std::fill(sr, sr + nk, 0.0f);
        continue;
      }
      float mx = m[r];
#pragma omp simd reduction(max : mx)
      for (int64_t j = 0; j < seen; ++j) mx = mx > sr[j] ? mx : sr[j];
      const float alpha = ExpNonPositive(m[r] - mx);  // 0 on the first block (m = -inf)
#pragma omp simd
      for (int64_t j = 0; j < seen; ++j) sr[j] = ExpNonPositive(sr[j] - mx);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < seen; ++j) sum += sr[j];
      std::fill(sr + seen, sr + nk, 0.0f);
      m[r] = mx;
      l[r] = l[r] * alpha + sum;
      if (alpha != 1.0f) {
        float* ar = acc + r * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) ar[i] *= alpha;
      }
    }
    // Weighted V rows: kRowTile output rows at a time, each V row read once per tile;
    // with the head size fixed, the tile's sums stay in registers across the keys.
    for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
      const int64_t nr = std::min(kRowTile, rows - r0);
      const int64_t seen = tile_keys(r0, nr);  // the weights past it are zero
      if constexpr (kD > 0) {
        if (nr == kRowTile) {
          float tile[kRowTile][kD];
          std::memcpy(tile, acc + r0 * kD, sizeof(tile));
          for (int64_t j = 0; j < seen; ++j) {
            const float* vr = vrows[j];
            for (int64_t r = 0; r < kRowTile; ++r) {
              const float w = s[(r0 + r) * kKeyBlock + j];
#pragma omp simd
              for (int64_t i = 0; i < kD; ++i) tile[r][i] += w * vr[i];
            }
          }
          std::memcpy(acc + r0 * kD, tile, sizeof(tile));
          continue;
        }
      }
      for (int64_t j = 0; j < seen; ++j) {
        const float* vr = vrows[j];
        for (int64_t r = 0; r < nr; ++r) {
          const float w = s[(r0 + r) * kKeyBlock + j];
          float* ar = acc + (r0 + r) * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) ar[i] += w * vr[i];
        }
      }
    }
  }
  for (int64_t t = 0; t < it.ntok; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = t * group + g;
      const float inv = 1.0f / l[r];
      float* dst = out + ((it.row0 + t) * hq + it.head * group + g) * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) dst[i] = acc[r * d + i] * inv;
    }
  }
}

static ffi::Error PagedPrefill(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                               ffi::Buffer<ffi::S32> kv_lens,
                               ffi::Buffer<ffi::S32> page_indices,
                               ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                               ffi::ResultBuffer<ffi::F32> out, float sm_scale) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  auto pd = page_indices.dimensions();
  auto cd = cu_q_lens.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 2 || cd.size() != 1) {
    return ffi::Error::InvalidArgument(
        "paged_prefill: q must be 3-D, pages 4-D, table 2-D, cu_q_lens 1-D");
  }
  const int64_t tokens = qd[0], hq = qd[1], d = qd[2];
  const int64_t num_pages = kd[0], page_size = kd[1], hkv = kd[2];
  const int64_t seqs = pd[0], width = pd[1];
  if (kd[3] != d || hkv <= 0 || hq % hkv != 0 || cd[0] != seqs + 1 ||
      kv_lens.dimensions()[0] != seqs) {
    return ffi::Error::InvalidArgument("paged_prefill: inconsistent shapes");
  }
  float* o = out->typed_data();
  std::memset(o, 0, sizeof(float) * tokens * hq * d);
  const int64_t n = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, seqs);
  if (n == 0 || num_pages == 0) return ffi::Error::Success();
  const int32_t* cu = cu_q_lens.typed_data();
  const int64_t group = hq / hkv;
  const int64_t block_tokens = std::max<int64_t>(1, kTargetRows / group);
  std::vector<PrefillItem> items;
  std::vector<int64_t> ends;  // running work (row-key pairs) at each item's end
  int64_t total = 0;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t a = std::clamp<int64_t>(cu[s], 0, tokens);
    const int64_t b = std::clamp<int64_t>(cu[s + 1], a, tokens);
    const int64_t len = std::clamp<int64_t>(kv_lens.typed_data()[s], 0, width * page_size);
    // Tokens at negative positions (more queries than keys) see nothing: zero rows.
    const int64_t first = std::max<int64_t>(a, a + (b - a) - len);
    for (int64_t t0 = first; t0 < b; t0 += block_tokens) {
      const int64_t ntok = std::min(block_tokens, b - t0);
      const int64_t pos0 = len - (b - a) + (t0 - a);
      for (int64_t h = 0; h < hkv; ++h) {
        items.push_back({s, h, t0, ntok, pos0});
        total += ntok * group * (pos0 + ntok);
        ends.push_back(total);
      }
    }
  }
  if (items.empty()) return ffi::Error::Success();
  const int64_t parts = PartsFor(pool, total, kMinWorkPerThread);
  const int64_t rows = block_tokens * group;
  auto run = [&](int64_t part) {
    // Kept per thread, not allocated anew per call and part (a call per layer); the
    // step's profile showed page faults beside this handler.
    thread_local std::vector<float> scratch;
    thread_local std::vector<const float*> vrows;
    scratch.resize(std::max(scratch.size(), static_cast<size_t>(ScratchFloats(rows, d))));
    vrows.resize(kKeyBlock);
    // Items in order, split into runs of about equal work.
    for (size_t i = 0; i < items.size(); ++i) {
      if (PartOf(i == 0 ? 0 : ends[i - 1], parts, total) != part) continue;
      const PrefillItem& it = items[i];
      WithHeadDim(d, [&](auto kd) {
        AttendBlockD<kd()>(it, q.typed_data(), k_pages.typed_data(), v_pages.typed_data(),
                           page_indices.typed_data() + it.seq * width, num_pages, page_size,
                           hq, hkv, d, sm_scale, scratch.data(), vrows.data(), o);
      });
    }
  };
  RunParts(pool, parts, run);
  return ffi::Error::Success();
}

// Both handlers take the pool, then kv_lens and page_indices, (cu_q_lens,) num_seqs.
static auto PagedBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()  // q
      .Arg<ffi::Buffer<ffi::F32>>()  // k_pages
      .Arg<ffi::Buffer<ffi::F32>>()  // v_pages
      .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
      .Arg<ffi::Buffer<ffi::S32>>();  // page_indices
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConfluxPagedDecode, PagedDecode,
                              PagedBinding()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConfluxPagedPrefill, PagedPrefill,
                              PagedBinding()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale"));

// Out's bytes of layer ``layer`` of the pool, once out holds the pool: XLA aliases out to
// the pool unless it had to copy the pool to keep the alias (then out is fresh and gets
// the pool first). Null for a layer out of range.
static char* WrittenLayer(const ffi::AnyBuffer& pool, ffi::Result<ffi::AnyBuffer>& out,
                          int32_t layer) {
  const int64_t num_layers = pool.dimensions()[0];
  if (layer < 0 || layer >= num_layers) return nullptr;
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != pool.untyped_data()) std::memcpy(dst, pool.untyped_data(), pool.size_bytes());
  return dst + static_cast<int64_t>(layer) * (pool.size_bytes() / num_layers);
}

// pool [L, ...] aliased to the output, each layer's elements taken as S slots of one row
// of ``rows`` [T, ...] each; layer i32[1]; slots i32[T]. Row t lands in slot slots[t] of
// layer ``layer``; a slot outside [0, S) (padding) writes nothing. The pool keeps its own
// shape (a reshape before the call made XLA copy the pool around it in the layer loop).
// XLA's scatter for the same write walks index by index through generic code: 14 ms of a
// 512-token SmolLM2 prefill step (30 layers, K and V) for ~0.8 MB of copies. Any element
// type: rows are bytes here.
static ffi::Error PagedKvWrite(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> layer,
                               ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> slots,
                               ffi::Result<ffi::AnyBuffer> out) {
  const auto pd = pool.dimensions();
  const auto rd = rows.dimensions();
  if (pd.size() < 2 || rd.size() < 1 || pool.element_type() != rows.element_type() ||
      static_cast<int64_t>(slots.element_count()) != rd[0]) {
    return ffi::Error::InvalidArgument(
        "paged_kv_write: pool must be [L, ...], rows [T, ...] of its dtype, slots i32[T]");
  }
  char* base = WrittenLayer(pool, out, layer.typed_data()[0]);
  if (base == nullptr) return ffi::Error::InvalidArgument("paged_kv_write: layer out of range");
  const int64_t t = rd[0];
  if (t == 0) return ffi::Error::Success();
  const int64_t layer_bytes = pool.size_bytes() / pd[0];
  const int64_t row_bytes = static_cast<int64_t>(rows.size_bytes()) / t;
  if (row_bytes == 0 || layer_bytes % row_bytes) {
    return ffi::Error::InvalidArgument("paged_kv_write: a layer is not whole rows");
  }
  const int64_t num_slots = layer_bytes / row_bytes;
  const char* src = static_cast<const char*>(rows.untyped_data());
  const int32_t* slot = slots.typed_data();
  for (int64_t i = 0; i < t; ++i) {
    if (slot[i] >= 0 && slot[i] < num_slots) {
      std::memcpy(base + slot[i] * row_bytes, src + i * row_bytes, row_bytes);
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConfluxPagedKvWrite, PagedKvWrite,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::AnyBuffer>()         // rows
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Ret<ffi::AnyBuffer>());       // the pool, written

// pool [L, P, ...] aliased to the output; layer i32[1]; src i32[X]; start i32[1]; dst
// i32[Y]; count i32[1]. Page src[start + j] of layer ``layer`` is copied onto its page
// dst[j], for j < count; a page id outside [0, P) (padding) copies nothing. One rank's
// KV transfers (a completed prefill's pages to its decode pages) and prefix-cache loads
// are such copies; XLA's gather, mask and scatter for them cost a 512-token SmolLM2
// prefill step ~16 ms whether any page moved or not.
static ffi::Error PagedCopyPages(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> layer,
                                 ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> start,
                                 ffi::Buffer<ffi::S32> dst, ffi::Buffer<ffi::S32> count,
                                 ffi::Result<ffi::AnyBuffer> out) {
  const auto pd = pool.dimensions();
  if (pd.size() < 2) {
    return ffi::Error::InvalidArgument("paged_copy_pages: pool must be [L, P, ...]");
  }
  char* base = WrittenLayer(pool, out, layer.typed_data()[0]);
  if (base == nullptr) return ffi::Error::InvalidArgument("paged_copy_pages: layer out of range");
  const int64_t num_pages = pd[1];
  if (num_pages == 0) return ffi::Error::Success();
  const int64_t page_bytes = pool.size_bytes() / (pd[0] * num_pages);
  const int64_t first = std::max<int64_t>(0, start.typed_data()[0]);
  const int64_t n = std::min<int64_t>({count.typed_data()[0],
                                       static_cast<int64_t>(dst.element_count()),
                                       static_cast<int64_t>(src.element_count()) - first});
  for (int64_t j = 0; j < n; ++j) {
    const int64_t s = src.typed_data()[first + j], d = dst.typed_data()[j];
    if (s >= 0 && s < num_pages && d >= 0 && d < num_pages && s != d) {
      std::memcpy(base + d * page_bytes, base + s * page_bytes, page_bytes);
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConfluxPagedCopyPages, PagedCopyPages,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // src
                                  .Arg<ffi::Buffer<ffi::S32>>()  // start
                                  .Arg<ffi::Buffer<ffi::S32>>()  // dst
                                  .Arg<ffi::Buffer<ffi::S32>>()  // count
                                  .Ret<ffi::AnyBuffer>());       // the pool, copied within
