// out f32[M, N] = x f32[M, K] @ w[layer], w f32[L, K, N] (or w[layer]^T, w f32[L, N, K]),
// through OpenBLAS's sgemm. The point is the operand: XLA:CPU hands a custom call the whole
// stacked weight buffer without copying it, where its own dot inside a layer scan first
// copies w[layer] out (a dynamic slice it does not fold into the dot).
#include <cstdint>

#include "cblas.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error StackedGemm(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                              ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out,
                              bool transpose_w) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3) {
    return ffi::Error::InvalidArgument("stacked_gemm: x must be 2-D and w 3-D");
  }
  const int64_t m = xd[0], k = xd[1], layers = wd[0];
  const int64_t n = transpose_w ? wd[1] : wd[2];
  if ((transpose_w ? wd[2] : wd[1]) != k) {
    return ffi::Error::InvalidArgument("stacked_gemm: contracting dimensions differ");
  }
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= layers) {
    return ffi::Error::InvalidArgument("stacked_gemm: layer index out of range");
  }
  const float* w_l = w.typed_data() + static_cast<int64_t>(l) * wd[1] * wd[2];
  if (m > 0 && n > 0) {
    scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, transpose_w ? CblasTrans : CblasNoTrans,
                      m, n, k, 1.0f, x.typed_data(), k, w_l, transpose_w ? k : n, 0.0f,
                      out->typed_data(), n);
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConfluxStackedGemm, StackedGemm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transpose_w"));
