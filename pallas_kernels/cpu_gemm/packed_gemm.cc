// out f32[M, n] = x f32[M, K] @ W, W held packed: w f32[L, P, K, 32] (P = ceil(n / 32)
// panels of 32 output columns, each K x 32 contiguous; columns past n are zero), layer
// ``layer`` of L. Only the first ``rows`` rows of x are multiplied; the rest of out is
// zero (a step's buffer is padded to its bucket: its padding rows cost no FLOPs).
// XLA FFI, fp32, the CPU. The gated handler computes silu(x @ gate) * (x @ up) instead,
// gate's and up's panels interleaved in w (f32[L, 2P, K, 32]): a SwiGLU MLP's first half
// in one call, its silu and product on each 32-column tile while it is in L1. The QKV
// handler stores a fused projection's Q, K and V in three buffers, Q and K rotated (RoPE)
// as each pair of tiles holding a head's two halves is stored.
//
// Why packed: a decode step's GEMMs have few rows (1-64), so they stream their weights
// from memory once and are bound by how fast one core pulls them. A panel read front to back
// is one sequential stream the core can prefetch far ahead; W's plain [K, N] rows would be
// K strided streams. Each 32-column panel is split into blocks of kKBlock rows of K, each
// kept in cache for all the row tiles of x. The passes of the first two row tiles over a
// block prefetch the next block into L2 (kPrefetchFloats ahead), one of a panel row's two
// cache lines each: with only the first pass prefetching, memory sat idle while the other
// row tiles computed, and prefetching into L1 evicted the block in use from a 32 KiB L1
// (16 rows: 1.3x faster on a Zen 4 host; bench/RESULTS.md). Prefill's hundreds of rows
// are taken in row blocks that fit L2 (RowBlock). Panels are split over the CPU handlers'
// spinning workers (cpu_parallel.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "cpu_math.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;             // output columns of a panel
constexpr int64_t kKBlock = 256;           // rows of K per block (32 KiB of a panel)
constexpr int64_t kPrefetchFloats = 8192;  // 32 KiB (a block) ahead, into L2
constexpr int64_t kMinWorkPerPart = 1 << 20;  // weight floats x (rows + 4) per thread

struct Problem {
  const float* x;  // f32[M, K]
  const float* w;  // f32[W, K, 32] one layer (W = panels, or 2 panels when gated)
  float* out;      // f32[M, n]
  int64_t m, k, n, panels;  // panels: output panels (a gated product reads two each)
  bool gated;      // out = silu(x @ gate) * (x @ up), their panels interleaved in w
  bool add;        // out = residual + x @ w: out holds the residual (aliased) on entry
  // Rotary embedding of out's first rope_cols columns (whole heads of 2 * half columns,
  // rotate-half form), by row: cos, sin f32[M, half]. rope_cols = 0: none.
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t half = 0, rope_cols = 0;
  // The output columns as consecutive segments, each its own buffer f32[M, cols[i]] (a
  // fused QKV projection's Q, K and V: no slicing afterwards). None: out, all n columns.
  static constexpr int kMaxSegments = 3;
  int segments = 0;
  float* seg_out[kMaxSegments] = {};
  int64_t seg_cols[kMaxSegments] = {};

  // Where output column c lies: its buffer at row 0 and that column, and its row stride.
  std::pair<float*, int64_t> At(int64_t c) const {
    for (int i = 0; i + 1 < segments; c -= seg_cols[i], ++i) {
      if (c < seg_cols[i]) return {seg_out[i] + c, seg_cols[i]};
    }
    return segments ? std::pair{seg_out[segments - 1] + c, seg_cols[segments - 1]}
                    : std::pair{out + c, n};
  }
};

}  // namespace

// The kernel once per ISA, each in its own namespace under its own target: V is the
// widest vector (lanes floats); a register tile is MR_MAX rows by VECS vectors of a panel's
// columns (MR_MAX x VECS accumulators plus VECS weight vectors fit the ISA's registers:
// AVX-512 8 x 2 zmm, the whole panel; AVX2 6 x 2 ymm, half of it, or 3 x 4 ymm).
#define CONFLUX_GEMM_ISA(NS, TARGET, LANES, VECS, MR_MAX)                                   \
  namespace NS {                                                                           \
  typedef float V __attribute__((vector_size(LANES * 4), aligned(4), may_alias));          \
  constexpr int kLanes = LANES, kVecs = VECS, kMaxRows = MR_MAX;                           \
  constexpr int64_t kTileCols = LANES * VECS;                                              \
  static_assert(kPanel % kTileCols == 0, "a tile's columns must divide a panel");          \
                                                                                           \
  /* out[r, c] (+)= x[r, k0:k0+kn] @ panel[k0:k0+kn, c] for MR rows r, kTileCols
     columns c (panel and out already offset to the tile's first column). STREAM (the
     cache lines it prefetches, StreamLines) is fixed per instance and k unrolled by 4:
     per-k tests and counters took issue slots from the FMAs (256 rows: 1.06-1.09x). */  \
  template <int MR, int STREAM>                                                            \
  __attribute__((target(TARGET), noinline)) void Tile(                                     \
      const float* x, int64_t ldx, const float* panel, int64_t kn, float* out,              \
      int64_t ldo, bool first) {                                                           \
    V acc[MR][kVecs];                                                                      \
    for (int r = 0; r < MR; ++r)                                                           \
      for (int v = 0; v < kVecs; ++v)                                                      \
        acc[r][v] = first ? V{} : *reinterpret_cast<const V*>(out + r * ldo + v * kLanes); \
    auto step = [&](int64_t k) __attribute__((always_inline)) {                            \
      const float* row = panel + k * kPanel;                                               \
      if (STREAM & 1) __builtin_prefetch(row + kPrefetchFloats, 0, 2);                     \
      if (STREAM & 2) __builtin_prefetch(row + kPrefetchFloats + 16, 0, 2);                \
      V w[kVecs];                                                                          \
      for (int v = 0; v < kVecs; ++v) w[v] = *reinterpret_cast<const V*>(row + v * kLanes); \
      _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r) {                              \
        const float s = x[r * ldx + k];                                                    \
        for (int v = 0; v < kVecs; ++v) acc[r][v] += w[v] * s;                             \
      }                                                                                    \
    };                                                                                     \
    int64_t k = 0;                                                                         \
    for (; k + 4 <= kn; k += 4) { step(k); step(k + 1); step(k + 2); step(k + 3); }        \
    for (; k < kn; ++k) step(k);                                                           \
    for (int r = 0; r < MR; ++r)                                                           \
      for (int v = 0; v < kVecs; ++v)                                                      \
        *reinterpret_cast<V*>(out + r * ldo + v * kLanes) = acc[r][v];                     \
  }                                                                                        \
                                                                                           \
  template <int MR>                                                                        \
  void Rows(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t kn,      \
            float* out, int64_t ldo, bool first, int stream) {                             \
    if constexpr (MR > 0) {                                                                \
      if (rows == MR) {                                                                    \
        switch (stream) {                                                                  \
          case 0: return Tile<MR, 0>(x, ldx, panel, kn, out, ldo, first);                  \
          case 1: return Tile<MR, 1>(x, ldx, panel, kn, out, ldo, first);                  \
          case 2: return Tile<MR, 2>(x, ldx, panel, kn, out, ldo, first);                  \
          default: return Tile<MR, 3>(x, ldx, panel, kn, out, ldo, first);                 \
        }                                                                                  \
      }                                                                                    \
      Rows<MR - 1>(rows, x, ldx, panel, kn, out, ldo, first, stream);                      \
    }                                                                                      \
  }                                                                                        \
                                                                                           \
  /* Which cache lines of the next block's panel rows the pass of the row tile at r
     prefetches (bit 0: the first, bit 1: the second): both when it is the only pass. */  \
  inline int StreamLines(int64_t m, int64_t r) {                                           \
    if (m <= kMaxRows) return 3;                                                           \
    return r == 0 ? 1 : r == kMaxRows ? 2 : 0;                                             \
  }                                                                                        \
                                                                                           \
  /* out[0:rn, 0:32] (row stride ldo) = x[0:rn] @ panel, x's rows k apart; added to what
     out holds when ``add``. */                                                            \
  void PanelProduct(const float* x, int64_t k, int64_t rn, const float* panel, float* out,  \
                    int64_t ldo, bool add = false) {                                       \
    for (int64_t k0 = 0; k0 < k; k0 += kKBlock) {                                          \
      const int64_t kn = std::min(kKBlock, k - k0);                                        \
      for (int64_t c = 0; c < kPanel; c += kTileCols) {                                    \
        for (int64_t r = 0; r < rn; r += kMaxRows) {                                       \
          Rows<kMaxRows>(std::min<int64_t>(kMaxRows, rn - r), x + r * k + k0, k,           \
                         panel + k0 * kPanel + c, kn, out + r * ldo + c, ldo,              \
                         k0 == 0 && !add,                                                  \
                         c != 0 ? 0 : StreamLines(rn, r));                                 \
        }                                                                                  \
      }                                                                                    \
    }                                                                                      \
  }                                                                                        \
                                                                                           \
  /* out[r, 0:cols] = silu(gate[r]) * up[r] for rn rows (gate, up: rows of 32). */        \
  __attribute__((target(TARGET))) void GatedStore(const float* gate, const float* up,      \
                                                  int64_t rn, int64_t cols, float* out,    \
                                                  int64_t ldo) {                           \
    for (int64_t r = 0; r < rn; ++r) {                                                     \
      const float* g = gate + r * kPanel;                                                  \
      const float* u = up + r * kPanel;                                                    \
      float* o = out + r * ldo;                                                            \
      _Pragma("omp simd") for (int64_t c = 0; c < cols; ++c)                               \
        o[c] = conflux::Silu(g[c]) * u[c];                                                 \
    }                                                                                      \
  }                                                                                        \
                                                                                           \
  /* A head's column c < 32 of panels a (first half) and b (second half), rn rows:
     out_a = a cos - b sin, out_b = b cos + a sin, cos and sin read at row r's
     cs[r * ldc + c] (the rotate-half form of transformers' Llama). */                   \
  __attribute__((target(TARGET))) void RotaryStore(const float* a, const float* b,         \
                                                   int64_t rn, const float* cs,            \
                                                   const float* sn, int64_t ldc,           \
                                                   float* out_a, float* out_b,             \
                                                   int64_t ldo) {                          \
    for (int64_t r = 0; r < rn; ++r) {                                                     \
      const float* ar = a + r * kPanel;                                                    \
      const float* br = b + r * kPanel;                                                    \
      const float* c = cs + r * ldc;                                                       \
      const float* s = sn + r * ldc;                                                       \
      float* oa = out_a + r * ldo;                                                         \
      float* ob = out_b + r * ldo;                                                         \
      _Pragma("omp simd") for (int64_t i = 0; i < kPanel; ++i) {                           \
        oa[i] = ar[i] * c[i] - br[i] * s[i];                                               \
        ob[i] = br[i] * c[i] + ar[i] * s[i];                                               \
      }                                                                                    \
    }                                                                                      \
  }                                                                                        \
                                                                                           \
  /* Output panels [p0, p1) of the product, rows in blocks of mb (x's block stays in L2
     while every panel passes over it; the panels are re-read per block, from L3). A
     gated product's output panel p is weight panels 2p (gate) and 2p + 1 (up). */        \
  void Panels(const Problem& pr, int64_t p0, int64_t p1, int64_t mb) {                     \
    std::vector<float> tile;  /* panels' rows on their way to a partial or gated store */ \
    for (int64_t r0 = 0; r0 < pr.m; r0 += mb) {                                            \
      const int64_t rn = std::min(mb, pr.m - r0);                                          \
      const float* x = pr.x + r0 * pr.k;                                                   \
      for (int64_t p = p0; p < p1; ++p) {                                                  \
        const int64_t cols = std::min(kPanel, pr.n - p * kPanel);                          \
        const auto [at, ldo] = pr.At(p * kPanel);                                          \
        float* out = at + r0 * ldo;                                                        \
        const int64_t panel_floats = pr.k * kPanel;                                        \
        if (p * kPanel < pr.rope_cols) {  /* a rotated head: panels in first/second half */\
          const int64_t hp = pr.half / kPanel;                                             \
          const int64_t j = p * kPanel % (2 * pr.half) / kPanel;  /* panel in its head */  \
          if (j >= hp) continue;  /* a second half: done with its first */                 \
          tile.resize(2 * rn * kPanel);                                                    \
          float* second = tile.data() + rn * kPanel;                                       \
          PanelProduct(x, pr.k, rn, pr.w + p * panel_floats, tile.data(), kPanel);         \
          PanelProduct(x, pr.k, rn, pr.w + (p + hp) * panel_floats, second, kPanel);       \
          const int64_t at = r0 * pr.half + j * kPanel;  /* row r0, frequency j * 32 */    \
          RotaryStore(tile.data(), second, rn, pr.cos + at, pr.sin + at, pr.half, out,     \
                      out + hp * kPanel, ldo);                                             \
        } else if (pr.gated) {                                                             \
          tile.resize(2 * rn * kPanel);                                                    \
          float* up = tile.data() + rn * kPanel;                                           \
          PanelProduct(x, pr.k, rn, pr.w + 2 * p * panel_floats, tile.data(), kPanel);     \
          PanelProduct(x, pr.k, rn, pr.w + (2 * p + 1) * panel_floats, up, kPanel);        \
          GatedStore(tile.data(), up, rn, cols, out, ldo);                                 \
        } else if (cols < kPanel) {  /* the last panel, n not a multiple of 32 */         \
          tile.resize(rn * kPanel);                                                        \
          PanelProduct(x, pr.k, rn, pr.w + p * panel_floats, tile.data(), kPanel);         \
          for (int64_t r = 0; r < rn; ++r) {                                               \
            const float* t = tile.data() + r * kPanel;                                     \
            float* o = out + r * ldo;                                                      \
            for (int64_t c = 0; c < cols; ++c) o[c] = pr.add ? o[c] + t[c] : t[c];         \
          }                                                                                \
        } else {                                                                           \
          PanelProduct(x, pr.k, rn, pr.w + p * panel_floats, out, ldo, pr.add);            \
        }                                                                                  \
      }                                                                                    \
    }                                                                                      \
  }                                                                                        \
  }  // namespace NS

#if defined(__x86_64__) && defined(__GNUC__)
CONFLUX_GEMM_ISA(avx512, "avx512f", 16, 2, 8)
CONFLUX_GEMM_ISA(avx2, "avx2,fma", 8, 2, 6)
// AVX2 for few rows: 3 rows by the whole panel (4 ymm), so one pass reads each panel row
// whole (both cache lines) instead of two passes over alternate lines: 1.4x faster at one
// row and no slower at 16 on a Zen 3 host (bench/RESULTS.md); more rows keep the taller
// tile, whose half-panel block stays in a 32 KiB L1 beside its rows of x.
CONFLUX_GEMM_ISA(avx2_few, "avx2,fma", 8, 4, 3)
#endif
CONFLUX_GEMM_ISA(generic, "default", 4, 4, 4)

namespace {

using PanelsFn = void (*)(const Problem&, int64_t, int64_t, int64_t);

constexpr int64_t kFewRows = 16;  // AVX2: up to this many rows, the whole-panel tile

// The host's widest kernel for m rows; $CONFLUX_GEMM_ISA (avx2 or generic) picks a
// narrower one, so that tests run every kernel on a wide host. Read per call: a getenv is
// nothing next to a GEMM.
PanelsFn HostPanels(int64_t m) {
  const char* forced = std::getenv("CONFLUX_GEMM_ISA");
  const std::string want = forced ? forced : "";
#if defined(__x86_64__) && defined(__GNUC__)
  if (want.empty() || want == "avx512") {
    if (__builtin_cpu_supports("avx512f")) return avx512::Panels;
  }
  if (want.empty() || want == "avx512" || want == "avx2") {
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      return m <= kFewRows ? avx2_few::Panels : avx2::Panels;
    }
  }
#endif
  return generic::Panels;
}

// Rows of x per block of Panels: all of them while x fits in L2; past that, equal blocks
// of at most a quarter of L2 each (a multiple of 8 rows, the AVX-512 tile), so that each
// block is read from L2, not L3, by every panel. Without blocks the kernel lost 1.1x at
// 1024 rows and 1.3x at 2048 (bench/RESULTS.md). Blocks of fewer than 128 rows re-read the
// panels too often (56-row blocks: 0.94x at 256 rows): a small L2 gets blocks of 128 rows
// that overflow it rather than more of them. $CONFLUX_GEMM_XBLOCK_KB sets the block's KiB
// (0: one block; no floor), as tests do.
int64_t RowBlock(int64_t k, int64_t m) {
  constexpr int64_t kMinBlockRows = 128;
  const char* env = std::getenv("CONFLUX_GEMM_XBLOCK_KB");
  const int64_t bytes = m * k * static_cast<int64_t>(sizeof(float));
  int64_t budget, least = 8;
  if (env && *env) {
    budget = std::atoll(env) * 1024;
  } else {
    static const int64_t l2 = [] {
      const long v = sysconf(_SC_LEVEL2_CACHE_SIZE);
      return v > 0 ? static_cast<int64_t>(v) : int64_t{1} << 20;
    }();
    budget = bytes <= l2 ? 0 : l2 / 4;
    least = kMinBlockRows;
  }
  if (budget <= 0) return std::max<int64_t>(m, 1);
  const int64_t blocks = (bytes + budget - 1) / budget;
  const int64_t rows = (m + blocks - 1) / blocks;
  return std::max<int64_t>(least, (rows + 7) / 8 * 8);
}

// The handlers: x f32[M, K], w f32[L, W, K, 32] (W weight panels: P, or 2P gated),
// layer i32[1], rows i32[1] (, residual f32[M, n] aliased to out | , cos, sin f32[M, half])
// -> out f32[M, n] (or Q, K, V f32[M, n_i]), P = ceil(n / 32) output panels.
enum class Form { kPlain, kGated, kResidual };

// What a handler adds to the call: where the product goes (``dest``'s out and n, or its
// segments, and its rotary tables; the call fills in the rest of the Problem), the rows it
// must have, the residual's data (kResidual), the norm.
struct Extras {
  Problem dest{};
  int64_t out_rows = 0;
  const float* residual = nullptr;
  const float* norm = nullptr;  // f32[L, K]: x RMS-normed by layer's row first (null: not)
  float eps = 0.0f;
};

// Rows [r0, r1) of x f32[M, K] RMS-normed into out: x * rsqrt(mean(x^2) + eps) * g, in
// fp32 as transformers computes it.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void RmsNormRows(const float* x, int64_t k, int64_t r0, int64_t r1, const float* g, float eps,
                 float* out) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * k;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < k; ++i) sum += xr[i] * xr[i];
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(k) + eps);
    float* o = out + r * k;
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) o[i] = g[i] * (xr[i] * scale);
  }
}

// Output rows [r0, r1) zeroed, in every segment.
void ZeroRows(const Problem& pr, int64_t r0, int64_t r1) {
  if (pr.segments == 0) {
    std::memset(pr.out + r0 * pr.n, 0, sizeof(float) * (r1 - r0) * pr.n);
    return;
  }
  for (int i = 0; i < pr.segments; ++i) {
    std::memset(pr.seg_out[i] + r0 * pr.seg_cols[i], 0,
                sizeof(float) * (r1 - r0) * pr.seg_cols[i]);
  }
}

template <Form kForm>
ffi::Error PackedGemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> layer,
                          ffi::Buffer<ffi::S32> rows, const Extras& extra) {
  const float* residual = extra.residual;
  constexpr bool kGated = kForm == Form::kGated, kAdd = kForm == Form::kResidual;
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[3] != kPanel) {
    return ffi::Error::InvalidArgument(
        "packed_gemm: x must be f32[M, K], w f32[L, P, K, 32], out f32[M, n]");
  }
  const int64_t weight_panels = wd[1];
  Problem pr = extra.dest;
  pr.x = x.typed_data();
  pr.m = xd[0];
  pr.k = xd[1];
  pr.panels = kGated ? weight_panels / 2 : weight_panels;
  pr.gated = kGated;
  pr.add = kAdd;
  if (wd[2] != pr.k || extra.out_rows != pr.m || pr.n > pr.panels * kPanel ||
      pr.n <= (pr.panels - 1) * kPanel || (kGated && weight_panels % 2)) {
    return ffi::Error::InvalidArgument("packed_gemm: inconsistent shapes");
  }
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("packed_gemm: layer out of range");
  // XLA keeps the alias unless it had to copy the residual to keep it: then copy it in.
  if (kAdd && residual != pr.out) std::memcpy(pr.out, residual, sizeof(float) * pr.m * pr.n);
  const int64_t live = std::clamp<int64_t>(rows.typed_data()[0], 0, pr.m);
  // Padding rows: zero, or the residual as it came.
  if (!kAdd) ZeroRows(pr, live, pr.m);
  pr.m = live;
  const PanelsFn panels_fn = HostPanels(pr.m);
  if (pr.m == 0 || pr.n == 0) return ffi::Error::Success();
  pr.w = w.typed_data() + static_cast<int64_t>(l) * weight_panels * pr.k * kPanel;
  if (extra.norm != nullptr && pr.k > 0) {
    // The normed rows in a buffer of this thread's (XLA's caller), kept between calls
    // (a fresh one per call page-faults), split over the workers for many rows.
    // (A pointer, not the thread_local itself, goes to the workers: in their code the
    // name would mean their own, empty, vector.)
    thread_local std::vector<float> normed;
    normed.resize(std::max(normed.size(), static_cast<size_t>(pr.m * pr.k)));
    float* const into = normed.data();
    const float* g = extra.norm + static_cast<int64_t>(l) * pr.k;
    const int64_t norm_parts = std::min<int64_t>(
        conflux::PartsFor(pool, pr.m * pr.k, kMinWorkPerPart / 16), pr.m);
    auto norm_run = [&](int64_t part) {
      RmsNormRows(pr.x, pr.k, pr.m * part / norm_parts, pr.m * (part + 1) / norm_parts, g,
                  extra.eps, into);
    };
    conflux::RunParts(pool, norm_parts, norm_run);
    pr.x = into;
  }
  if (pr.k == 0) {  // silu(0) * 0 = 0 too; a residual stays
    if (!kAdd) ZeroRows(pr, 0, pr.m);
    return ffi::Error::Success();
  }
  const int64_t total = weight_panels * pr.k * kPanel * (pr.m + 4);
  const int64_t parts = std::min(conflux::PartsFor(pool, total, kMinWorkPerPart), pr.panels);
  const int64_t mb = RowBlock(pr.k, pr.m);
  auto run = [&](int64_t part) {
    panels_fn(pr, pr.panels * part / parts, pr.panels * (part + 1) / parts, mb);
  };
  conflux::RunParts(pool, parts, run);
  return ffi::Error::Success();
}

// ``extra`` with one result buffer f32[M, n] as where the product goes.
Extras Into(ffi::Result<ffi::Buffer<ffi::F32>>& out, Extras extra = {}) {
  auto od = out->dimensions();
  extra.dest.out = out->typed_data();
  extra.out_rows = od.size() == 2 ? od[0] : -1;
  extra.dest.n = od.size() == 2 ? od[1] : 0;
  return extra;
}

ffi::Error PackedGemm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows,
                      ffi::ResultBuffer<ffi::F32> out) {
  return PackedGemmImpl<Form::kPlain>(pool, x, w, layer, rows, Into(out));
}

// The norm argument of the forms that take one, into ``extra``: f32[L, K] (layer
// ``layer``'s row normalizes x first) or f32[0] (no norm); a bad shape is an error.
ffi::Error NormOf(const ffi::Buffer<ffi::F32>& norm, const ffi::Buffer<ffi::F32>& x,
                  const ffi::Buffer<ffi::F32>& w, float eps, Extras& extra) {
  auto nd = norm.dimensions();
  if (nd.size() == 1 && nd[0] == 0) return ffi::Error::Success();
  if (nd.size() != 2 || x.dimensions().size() != 2 || w.dimensions().size() != 4 ||
      nd[0] != w.dimensions()[0] || nd[1] != x.dimensions()[1] || !(eps >= 0.0f)) {
    return ffi::Error::InvalidArgument("packed_gemm: the norm must be f32[L, K] or f32[0]");
  }
  extra.norm = norm.typed_data();
  extra.eps = eps;
  return ffi::Error::Success();
}

// silu(norm(x) @ gate) * (norm(x) @ up): a SwiGLU MLP's first half with its RMSNorm (when
// given) on x's rows first: no pass of XLA's own over them (~6 ms a 512-token SmolLM2 step).
ffi::Error PackedGemmGated(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> norm,
                           ffi::ResultBuffer<ffi::F32> out, float eps) {
  Extras extra;
  if (ffi::Error bad = NormOf(norm, x, w, eps, extra); bad.failure()) return bad;
  return PackedGemmImpl<Form::kGated>(pool, x, w, layer, rows, Into(out, extra));
}

// A fused QKV projection into its three parts, Q f32[M, nq], K f32[M, nk], V f32[M, nv]
// (each a whole number of panels), Q and K rotated by row (cos, sin f32[M, half]; half = 0:
// no rotation) as each tile is stored: neither XLA's slices of one [M, nq + nk + nv] output
// nor its RoPE pass over them, which together ran at ~12 GB/s on data in L2 (~11 ms of a
// 512-token SmolLM2 step; bench/RESULTS.md).
ffi::Error PackedGemmQkv(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                         ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> cos,
                         ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::F32> norm,
                         ffi::ResultBuffer<ffi::F32> q, ffi::ResultBuffer<ffi::F32> k,
                         ffi::ResultBuffer<ffi::F32> v, float eps) {
  Extras extra;
  if (ffi::Error bad = NormOf(norm, x, w, eps, extra); bad.failure()) return bad;
  Problem& dest = extra.dest;
  dest.segments = 3;
  ffi::Result<ffi::Buffer<ffi::F32>>* parts[3] = {&q, &k, &v};
  const int64_t m = x.dimensions().size() == 2 ? x.dimensions()[0] : -1;
  for (int i = 0; i < 3; ++i) {
    auto d = (*parts[i])->dimensions();
    if (d.size() != 2 || d[0] != m || d[1] % kPanel != 0) {
      return ffi::Error::InvalidArgument(
          "packed_gemm: Q, K and V must be f32[M, n_i], each n_i a multiple of 32");
    }
    dest.seg_out[i] = (*parts[i])->typed_data();
    dest.seg_cols[i] = d[1];
    dest.n += d[1];
  }
  extra.out_rows = m;
  auto cd = cos.dimensions();
  if (cd.size() != 2 || sin.dimensions().size() != 2 || sin.dimensions()[0] != cd[0] ||
      sin.dimensions()[1] != cd[1] || cd[0] != m) {
    return ffi::Error::InvalidArgument("packed_gemm: cos and sin must be f32[M, half]");
  }
  dest.half = cd[1];
  if (dest.half > 0) {
    dest.rope_cols = dest.seg_cols[0] + dest.seg_cols[1];
    if (dest.half % kPanel != 0 || dest.seg_cols[0] % (2 * dest.half) != 0 ||
        dest.seg_cols[1] % (2 * dest.half) != 0) {
      return ffi::Error::InvalidArgument(
          "packed_gemm: rotary halves must be whole panels of 32, Q and K whole heads");
    }
    dest.cos = cos.typed_data();
    dest.sin = sin.typed_data();
  }
  return PackedGemmImpl<Form::kPlain>(pool, x, w, layer, rows, extra);
}

ffi::Error PackedGemmResidual(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> layer,
                              ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> residual,
                              ffi::ResultBuffer<ffi::F32> out) {
  if (residual.dimensions().size() != 2 || out->dimensions().size() != 2 ||
      residual.dimensions()[0] != out->dimensions()[0] ||
      residual.dimensions()[1] != out->dimensions()[1]) {
    return ffi::Error::InvalidArgument("packed_gemm: the residual must be f32[M, n]");
  }
  Extras extra;
  extra.residual = residual.typed_data();
  return PackedGemmImpl<Form::kResidual>(pool, x, w, layer, rows, Into(out, extra));
}

auto PackedGemmBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()  // x
      .Arg<ffi::Buffer<ffi::F32>>()  // w packed
      .Arg<ffi::Buffer<ffi::S32>>()  // layer
      .Arg<ffi::Buffer<ffi::S32>>();  // rows: live rows of x
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConfluxPackedGemm, PackedGemm,
                              PackedGemmBinding().Ret<ffi::Buffer<ffi::F32>>());
// silu(x @ gate) * (x @ up) (a SwiGLU MLP's first half) in one pass: the gate and up
// panels of each 32 output columns interleaved in w.
XLA_FFI_DEFINE_HANDLER_SYMBOL(ConfluxPackedGemmGated, PackedGemmGated,
                              PackedGemmBinding()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));
// A fused QKV projection as Q, K and V, Q and K rotated (cos, sin f32[M, half] by row).
XLA_FFI_DEFINE_HANDLER_SYMBOL(ConfluxPackedGemmQkv, PackedGemmQkv,
                              PackedGemmBinding()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm
                                  .Ret<ffi::Buffer<ffi::F32>>()  // q
                                  .Ret<ffi::Buffer<ffi::F32>>()  // k
                                  .Ret<ffi::Buffer<ffi::F32>>()  // v
                                  .Attr<float>("eps"));
// residual + x @ w into the residual's buffer (aliased to out): a block's residual add
// without a pass of its own over the [M, n] activations.
XLA_FFI_DEFINE_HANDLER_SYMBOL(ConfluxPackedGemmResidual, PackedGemmResidual,
                              PackedGemmBinding()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // residual
                                  .Ret<ffi::Buffer<ffi::F32>>());
