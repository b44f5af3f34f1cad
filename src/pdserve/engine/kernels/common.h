// Helpers shared by the native kernels (AVX2 + FMA: every build of every kernel has them).
// A header, not a copy in each source: kernels.build_dir hashes it into every build's key.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

// exp of 8 floats: a Cephes-style polynomial, within ~2 ulp of std::exp; 0 below -87.3 (and
// for -inf), clamped at exp(88.38) above.
inline __m256 exp8(__m256 x) {
  // exp(x) = 2^n * exp(r), n = round(x / ln2), r = x - n ln2 in [-ln2/2, ln2/2].
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447505531f);
  const __m256 zero_below = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);  // underflow (and -inf): 0
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(zero_below, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// dst[c] = (src[c] + bias[c]) + res[c] for c < n, bias and res optional (nullptr): a matmul's
// store, in the order of torch's `residual + (x @ W + bias)`. One loop per case, so each
// vectorises (a test inside the loop made the compiler emit scalar code: +30% on an 8-row
// w8a8 call).
inline void add_store(const float* src, const float* bias, const float* res, int64_t n,
                      float* dst) {
  if (bias && res) {
    for (int64_t c = 0; c < n; ++c) dst[c] = (src[c] + bias[c]) + res[c];
  } else if (res) {
    for (int64_t c = 0; c < n; ++c) dst[c] = src[c] + res[c];
  } else if (bias) {
    for (int64_t c = 0; c < n; ++c) dst[c] = src[c] + bias[c];
  } else {
    std::memcpy(dst, src, n * sizeof(float));
  }
}

// The optional bias of a matmul: float32 [N], or nullptr.
inline const float* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->dtype() == torch::kFloat && bias->is_contiguous() && bias->numel() == N,
              "bias: float32 [N]");
  return bias->data_ptr<float>();
}

// The optional residual a matmul adds to its output (a layer's `x + proj(h)` in one pass):
// float32 [M, N] with unit column stride, or nullptr. Its row stride goes to *ld.
inline const float* residual_ptr(const c10::optional<torch::Tensor>& res, int64_t M, int64_t N,
                                 int64_t* ld) {
  *ld = 0;
  if (!res.has_value()) return nullptr;
  TORCH_CHECK(res->dtype() == torch::kFloat && res->dim() == 2 && res->size(0) == M &&
                  res->size(1) == N && res->stride(1) == 1,
              "residual: float32 [M, N] with unit column stride");
  *ld = res->stride(0);
  return res->data_ptr<float>();
}

}  // namespace
