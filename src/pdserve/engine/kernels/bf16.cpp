// The prefill format's glue (engine/prefill_format.py): the element-wise ops around its
// bfloat16 GEMMs, each one pass that reads bfloat16 where the GEMM wrote it and writes bfloat16
// where the next GEMM reads it. torch's bfloat16 element-wise ops widen, compute and narrow as
// separate passes: at a 2000-token prompt they cost ~40% of the projections' time (measured on
// a Xeon with AMX, one thread); here they run as one pass over the rows, split across threads.
// Built with -mavx2 -mfma -mf16c only (the bf16 <-> f32 conversions are integer shifts and
// a round-to-nearest-even add), so it runs on both machine kinds.
#include "common.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace {

constexpr int64_t kGrain = 16;  // rows per parallel task

// 8 bfloat16 -> 8 float32 (exact: the bits shifted up).
inline __m256 load_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// float32 -> bfloat16, rounded to nearest even (torch's rounding; no NaNs reach these ops).
inline uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  b += 0x7FFFu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

inline float from_bf16(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// 8 float32 -> 8 bfloat16 (round to nearest even), stored.
inline void store_bf16(uint16_t* p, __m256 v) {
  __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  b = _mm256_srli_epi32(b, 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

const uint16_t* bf16_ptr(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

uint16_t* bf16_ptr_mut(torch::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

}  // namespace

// y [T, I] (bfloat16) = silu(x[:, :I]) * x[:, I:] for the gate|up GEMM's bfloat16 output x
// [T, 2I]: the MLP's activation read and written in the GEMMs' own type.
torch::Tensor silu_mul(torch::Tensor x, int64_t I) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kBFloat16 && x.stride(1) == 1 && I >= 1 &&
                  x.size(1) == 2 * I,
              "x: bfloat16 [T, 2 * I] with unit column stride");
  const int64_t T = x.size(0), ld = x.stride(0);
  auto y = torch::empty({T, I}, torch::kBFloat16);
  const uint16_t* xp = bf16_ptr(x);
  uint16_t* yp = bf16_ptr_mut(y);
  at::parallel_for(0, T, kGrain, [&](int64_t t0, int64_t t1) {
    const __m256 one = _mm256_set1_ps(1.f), neg = _mm256_set1_ps(-0.f);
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* g = xp + t * ld;
      const uint16_t* u = g + I;
      uint16_t* yr = yp + t * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) {
        const __m256 gv = load_bf16(g + i), uv = load_bf16(u + i);
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, neg))));
        store_bf16(yr + i, _mm256_mul_ps(s, uv));
      }
      for (; i < I; ++i) {
        const float gv = from_bf16(g[i]);
        yr[i] = to_bf16(gv / (1.f + std::exp(-gv)) * from_bf16(u[i]));
      }
    }
  });
  return y;
}

// out [T, N] (float32) = y (+ bias) (+ residual): a bfloat16 GEMM output widened as it is
// stored, in the order of torch's `residual + (x @ W + bias)`.
torch::Tensor widen_add(torch::Tensor y, const c10::optional<torch::Tensor>& bias,
                        const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(y.dim() == 2 && y.dtype() == torch::kBFloat16 && y.is_contiguous(),
              "y: bfloat16 [T, N], contiguous");
  const int64_t T = y.size(0), N = y.size(1);
  int64_t ld = 0;
  const float* bp = bias_ptr(bias, N);
  const float* rp = residual_ptr(residual, T, N, &ld);
  auto out = torch::empty({T, N}, torch::kFloat);
  const uint16_t* yp = bf16_ptr(y);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, kGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* yr = yp + t * N;
      float* o = op + t * N;
#pragma omp simd
      for (int64_t c = 0; c < N; ++c) o[c] = from_bf16(yr[c]);
      if (bp || rp) add_store(o, bp, rp ? rp + t * ld : nullptr, N, o);
    }
  });
  return out;
}

// y [M, N] (bfloat16) = RMSNorm of x [M, N] (float32, the residual stream) by w [N]: the norm
// and the GEMM input's rounding in one pass (the sums as w8g32.cpp's rms_norm).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat && x.stride(1) == 1, "x: float32 [M, N]");
  TORCH_CHECK(w.dtype() == torch::kFloat && w.is_contiguous() && w.numel() == x.size(1),
              "w: float32 [N]");
  const int64_t M = x.size(0), N = x.size(1), ld = x.stride(0);
  auto y = torch::empty({M, N}, torch::kBFloat16);
  const float* wp = w.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  uint16_t* yp = bf16_ptr_mut(y);
  at::parallel_for(0, M, kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * ld;
      uint16_t* yr = yp + r * N;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < N; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(N) + static_cast<float>(eps));
      int64_t i = 0;
      const __m256 iv = _mm256_set1_ps(inv);
      for (; i + 8 <= N; i += 8)
        store_bf16(yr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), iv),
                                         _mm256_loadu_ps(wp + i)));
      for (; i < N; ++i) yr[i] = to_bf16(xr[i] * inv * wp[i]);
    }
  });
  return y;
}

// Every call lets go of the GIL (call_guard): a worker's heartbeat thread must answer while
// a long prompt step runs these, or the router takes a busy worker for dead (no_heartbeat).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("silu_mul", &silu_mul, py::call_guard<py::gil_scoped_release>(), "bfloat16 silu(x[:, :I]) * x[:, I:] for bfloat16 x [T, 2I]");
  m.def("widen_add", &widen_add, py::call_guard<py::gil_scoped_release>(), "float32 y (+ bias) (+ residual) for bfloat16 y [T, N]",
        py::arg("y"), py::arg("bias") = py::none(), py::arg("residual") = py::none());
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>(), "bfloat16 RMSNorm of float32 x [M, N] by w [N]");
}
