// GGUF's Q4_1 weights, as the file stores them, times float32 activations (`--quantization
// gguf`): y = x @ W (+ bias) (+ residual), where each output channel n keeps, per block of 32
// inputs g, a 4-bit code q in 0..15 per weight, a fp16 scale d and a fp16 minimum m:
//   W[k, n] = d[g, n] * q[k, n] + m[g, n]          (llama.cpp's dequantize_row_q4_1)
//   y[r, n] = sum_g  d[g, n] * sum_{k in g} x[r, k] * q[k, n]  +  m[g, n] * sum_{k in g} x[r, k]
// so per block the codes are summed against x in float registers and the scale and minimum
// cost one FMA each (the block's sum of x is computed once per row and call).
//
// Why a kernel of our own: the default model ships as Q4_1, and `--quantization none` runs it
// dequantized to float32 (8 x the bytes a step reads); w8g32 rounds the same weights again to
// int8 (a second rounding: 66% greedy agreement with float32). This runs the file's own weights,
// at 0.625 bytes a weight (w8g32: 1.06), with the float32 result to rounding.
//
// Layout (made by quant_gguf.pack_q4_1 from the file's blocks): outputs in tiles of 16
// channels; q[tile][k / 2][16] bytes, the low nibble input k (even) and the high nibble input
// k + 1 of one channel; d, m [tile][group][16] fp16. A tile is read front to back.
//
// Two builds of this file (never -march=native), picked at run time like w8g32's:
// `-mavx2 -mfma -mf16c` and `-mavx512f -mavx512bw -mavx512vl -mf16c -mfma` (16 channels per
// register). Per channel both sum in the same order.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t kTile = 16;   // output channels per tile
constexpr int64_t kGroup = 32;  // inputs per block (d, m)
constexpr int64_t kPairs = kGroup / 2;  // 16-byte rows per block
// Prefetch distance in the weight stream, one per 64-byte line (as w8g32: the hardware
// prefetcher alone leaves one thread short of the read bandwidth).
constexpr int64_t kPrefetch = 4096;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The sum of 32 floats, 8 lanes at a time (a scalar chain of 32 dependent adds cost ~2 us a
// call at K = 1536); the same order in both builds.
inline float sum32(const float* p) {
  const __m256 a = _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
  const __m256 b = _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24));
  const __m256 s = _mm256_add_ps(a, b);
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

#if defined(__AVX512F__)
constexpr int64_t kRows = 8;
constexpr const char* kIsa = "avx512";

// 16 codes (one nibble per byte, already masked) -> 16 floats.
inline __m512 codes16(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }

// Rows [0, NR) of x (row stride ldx) against one tile; xs[r * G + g] is the sum of row r's
// inputs in block g. out[r * 16 + c].
template <int NR, int U>
void tile_rows(const float* x, int64_t ldx, const float* xs, int64_t G, const uint8_t* q,
               const at::Half* d, const at::Half* m, float* out) {
  const __m128i low = _mm_set1_epi8(0x0f);
  __m512 tot[NR];
  for (int r = 0; r < NR; ++r) tot[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* qg = q + g * kPairs * kTile;
    const float* xg = x + g * kGroup;
    __m512 acc[U][NR];
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < NR; ++r) acc[u][r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kPairs; p += U) {
      if (U >= 4 || (p & 3) == 0)
        _mm_prefetch(reinterpret_cast<const char*>(qg + p * kTile + kPrefetch), _MM_HINT_T0);
      for (int u = 0; u < U; ++u) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + (p + u) * kTile));
        const __m512 w0 = codes16(_mm_and_si128(v, low));
        const __m512 w1 = codes16(_mm_and_si128(_mm_srli_epi16(v, 4), low));
        for (int r = 0; r < NR; ++r) {
          const float* xr = xg + r * ldx + 2 * (p + u);
          acc[u][r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[0]), w0, acc[u][r]);
          acc[u][r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[1]), w1, acc[u][r]);
        }
      }
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g * kTile)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + g * kTile)));
    for (int r = 0; r < NR; ++r) {
      __m512 a = acc[0][r];
      for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[u][r]);
      tot[r] = _mm512_fmadd_ps(a, dv, tot[r]);
      tot[r] = _mm512_fmadd_ps(_mm512_set1_ps(xs[r * G + g]), mv, tot[r]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(out + r * kTile, tot[r]);
}
#else
constexpr int64_t kRows = 4;
constexpr const char* kIsa = "avx2";

// 8 codes (the low 8 bytes of b, masked) -> 8 floats.
inline __m256 codes8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }

template <int NR, int U>
void tile_rows(const float* x, int64_t ldx, const float* xs, int64_t G, const uint8_t* q,
               const at::Half* d, const at::Half* m, float* out) {
  const __m128i low = _mm_set1_epi8(0x0f);
  __m256 tot[NR][2];
  for (int r = 0; r < NR; ++r) tot[r][0] = tot[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* qg = q + g * kPairs * kTile;
    const float* xg = x + g * kGroup;
    __m256 acc[U][NR][2];
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < NR; ++r) acc[u][r][0] = acc[u][r][1] = _mm256_setzero_ps();
    for (int64_t p = 0; p < kPairs; p += U) {
      if (U >= 4 || (p & 3) == 0)
        _mm_prefetch(reinterpret_cast<const char*>(qg + p * kTile + kPrefetch), _MM_HINT_T0);
      for (int u = 0; u < U; ++u) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + (p + u) * kTile));
        const __m128i c0 = _mm_and_si128(v, low), c1 = _mm_and_si128(_mm_srli_epi16(v, 4), low);
        const __m256 w0lo = codes8(c0), w0hi = codes8(_mm_unpackhi_epi64(c0, c0));
        const __m256 w1lo = codes8(c1), w1hi = codes8(_mm_unpackhi_epi64(c1, c1));
        for (int r = 0; r < NR; ++r) {
          const float* xr = xg + r * ldx + 2 * (p + u);
          const __m256 x0 = _mm256_broadcast_ss(xr), x1 = _mm256_broadcast_ss(xr + 1);
          acc[u][r][0] = _mm256_fmadd_ps(x0, w0lo, acc[u][r][0]);
          acc[u][r][1] = _mm256_fmadd_ps(x0, w0hi, acc[u][r][1]);
          acc[u][r][0] = _mm256_fmadd_ps(x1, w1lo, acc[u][r][0]);
          acc[u][r][1] = _mm256_fmadd_ps(x1, w1hi, acc[u][r][1]);
        }
      }
    }
    const __m256 dlo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g * kTile)));
    const __m256 dhi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g * kTile + 8)));
    const __m256 mlo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g * kTile)));
    const __m256 mhi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g * kTile + 8)));
    for (int r = 0; r < NR; ++r) {
      __m256 lo = acc[0][r][0], hi = acc[0][r][1];
      for (int u = 1; u < U; ++u) {
        lo = _mm256_add_ps(lo, acc[u][r][0]);
        hi = _mm256_add_ps(hi, acc[u][r][1]);
      }
      const __m256 sx = _mm256_set1_ps(xs[r * G + g]);
      tot[r][0] = _mm256_fmadd_ps(sx, mlo, _mm256_fmadd_ps(lo, dlo, tot[r][0]));
      tot[r][1] = _mm256_fmadd_ps(sx, mhi, _mm256_fmadd_ps(hi, dhi, tot[r][1]));
    }
  }
  for (int r = 0; r < NR; ++r) {
    _mm256_storeu_ps(out + r * kTile, tot[r][0]);
    _mm256_storeu_ps(out + r * kTile + 8, tot[r][1]);
  }
}
#endif

// Pairs per accumulator set: >= 4 FMA chains per output register at 1-2 rows; from 3 rows on
// the rows are the chains.
template <int NR>
constexpr int unroll() { return NR == 1 ? 4 : NR == 2 ? 2 : 1; }

void check_packed(const torch::Tensor& q, const torch::Tensor& d, const torch::Tensor& m,
                  int64_t K, int64_t N) {
  const int64_t T = ceil_div(N, kTile);
  TORCH_CHECK(K % kGroup == 0, "Q4_1: the input size must be a multiple of 32, got ", K);
  TORCH_CHECK(q.dtype() == torch::kUInt8 && q.is_contiguous() && q.dim() == 3 &&
                  q.size(0) == T && q.size(1) == K / 2 && q.size(2) == kTile,
              "q: uint8 [T, K/2, 16] matching K, N");
  for (const auto* t : {&d, &m})
    TORCH_CHECK(t->dtype() == torch::kHalf && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == T && t->size(1) == K / kGroup && t->size(2) == kTile,
                "d, m: fp16 [T, K/32, 16] matching K, N");
}

}  // namespace

// x float32 [M, K] -> y float32 [M, N] (+ bias [N]) (+ residual [M, N]). Work items: (tile,
// block of kRows rows), tile-major, over torch's intra-op threads.
torch::Tensor matmul(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m,
                     int64_t N, c10::optional<torch::Tensor> bias,
                     c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat, "x: float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), T = ceil_div(N, kTile), G = K / kGroup;
  check_packed(q, d, m, K, N);
  const float* bp = bias_ptr(bias, N);
  int64_t ldr;
  const float* rp = residual_ptr(residual, M, N, &ldr);
  const float* xp = x.data_ptr<float>();
  std::vector<float> xs(M * G);  // each row's sum over each block (what m multiplies)
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) xs[r * G + g] = sum32(xp + r * K + g * kGroup);
  auto y = torch::empty({M, N}, torch::kFloat);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = m.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  const int64_t row_blocks = ceil_div(M, kRows);
  at::parallel_for(0, T * row_blocks, 1, [&](int64_t a, int64_t b) {
    float out[kRows * kTile];
    for (int64_t item = a; item < b; ++item) {
      const int64_t t = item / row_blocks, r0 = (item % row_blocks) * kRows;
      const int64_t nr = std::min(kRows, M - r0);
      const float* xr = xp + r0 * K;
      const float* sr = xs.data() + r0 * G;
      const uint8_t* qt = qp + t * (K / 2) * kTile;
      const at::Half* dt = dp + t * G * kTile;
      const at::Half* mt = mp + t * G * kTile;
      switch (nr) {
#if defined(__AVX512F__)
        case 8: tile_rows<8, unroll<8>()>(xr, K, sr, G, qt, dt, mt, out); break;
        case 7: tile_rows<7, unroll<7>()>(xr, K, sr, G, qt, dt, mt, out); break;
        case 6: tile_rows<6, unroll<6>()>(xr, K, sr, G, qt, dt, mt, out); break;
        case 5: tile_rows<5, unroll<5>()>(xr, K, sr, G, qt, dt, mt, out); break;
#endif
        case 4: tile_rows<4, unroll<4>()>(xr, K, sr, G, qt, dt, mt, out); break;
        case 3: tile_rows<3, unroll<3>()>(xr, K, sr, G, qt, dt, mt, out); break;
        case 2: tile_rows<2, unroll<2>()>(xr, K, sr, G, qt, dt, mt, out); break;
        default: tile_rows<1, unroll<1>()>(xr, K, sr, G, qt, dt, mt, out); break;
      }
      const int64_t n0 = t * kTile, nc = std::min(kTile, N - n0);
      for (int64_t r = 0; r < nr; ++r)
        add_store(out + r * kTile, bp ? bp + n0 : nullptr,
                  rp ? rp + (r0 + r) * ldr + n0 : nullptr, nc, yp + (r0 + r) * N + n0);
    }
  });
  return y;
}

// 16 channels' codes of one input (16 bytes, masked) -> their weights d * q + m, multiplied then
// added (never fused: numpy's `d * q + m`, the gguf package's Q4_1 dequantization that
// `--quantization none` loads, rounds twice, so prefill here computes with bit-identical weights).
__attribute__((optimize("fp-contract=off"))) inline void weights16(
    __m128i codes, const __m256 d[2], const __m256 m[2], float* dst) {
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(codes, codes)));
  _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_mul_ps(d[0], lo), m[0]));
  _mm256_storeu_ps(dst + 8, _mm256_add_ps(_mm256_mul_ps(d[1], hi), m[1]));
}

// Columns [n0, n1) of the float32 weight into out [K, n1 - n0], n0 a multiple of 16: the
// scratch prefill hands to torch's GEMM. AVX2 in both builds.
torch::Tensor dequantize(torch::Tensor q, torch::Tensor d, torch::Tensor m, int64_t N, int64_t n0,
                         int64_t n1, torch::Tensor w) {
  const int64_t K = q.size(1) * 2;
  check_packed(q, d, m, K, N);
  TORCH_CHECK(n0 % kTile == 0 && 0 <= n0 && n0 < n1 && n1 <= N, "bad column range");
  const int64_t W = n1 - n0, G = K / kGroup, t0 = n0 / kTile, t1 = ceil_div(n1, kTile);
  TORCH_CHECK(w.dtype() == torch::kFloat && w.is_contiguous() && w.dim() == 2 &&
                  w.size(0) == K && w.size(1) == W,
              "out: float32 [K, n1 - n0], contiguous");
  float* wp = w.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = m.data_ptr<at::Half>();
  const __m128i low = _mm_set1_epi8(0x0f);
  // Blocks of 8 tiles (128 columns), input pairs outer: per input one 512-byte contiguous write
  // (tile by tile, each input's 64 bytes would land in another page of a wide matrix: 1.4 ns a
  // weight, against ~0.1 this way).
  constexpr int64_t kBlock = 8;
  at::parallel_for(0, ceil_div(t1 - t0, kBlock), 1, [&](int64_t ba, int64_t bb) {
    float tmp[2][kTile];
    for (int64_t blk = ba; blk < bb; ++blk) {
      const int64_t ta = t0 + blk * kBlock, tb = std::min(t1, ta + kBlock);
      for (int64_t g = 0; g < G; ++g) {
        __m256 dv[kBlock][2], mv[kBlock][2];
        for (int64_t t = ta; t < tb; ++t) {
          const at::Half* dg = dp + (t * G + g) * kTile;
          const at::Half* mg = mp + (t * G + g) * kTile;
          for (int h = 0; h < 2; ++h) {
            dv[t - ta][h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dg + 8 * h)));
            mv[t - ta][h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mg + 8 * h)));
          }
        }
        for (int64_t p = g * kPairs; p < (g + 1) * kPairs; ++p) {
          for (int64_t t = ta; t < tb; ++t) {
            const __m128i v =
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(qp + (t * (K / 2) + p) * kTile));
            float* row0 = wp + 2 * p * W + (t * kTile - n0);
            float* row1 = row0 + W;
            const int64_t nc = std::min(kTile, n1 - t * kTile);
            const bool whole = nc == kTile;
            weights16(_mm_and_si128(v, low), dv[t - ta], mv[t - ta], whole ? row0 : tmp[0]);
            weights16(_mm_and_si128(_mm_srli_epi16(v, 4), low), dv[t - ta], mv[t - ta],
                      whole ? row1 : tmp[1]);
            if (!whole) {
              std::memcpy(row0, tmp[0], nc * sizeof(float));
              std::memcpy(row1, tmp[1], nc * sizeof(float));
            }
          }
        }
      }
    }
  });
  return w;
}

// Every call lets go of the GIL (call_guard): a worker's heartbeat thread must answer while
// a long prompt step runs these, or the router takes a busy worker for dead (no_heartbeat).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("matmul", &matmul, py::call_guard<py::gil_scoped_release>(), "x [M, K] @ Q4_1 tiles (+ bias) (+ residual [M, N])", py::arg("x"),
        py::arg("q"), py::arg("d"), py::arg("m"), py::arg("n"), py::arg("bias") = py::none(),
        py::arg("residual") = py::none());
  m.def("dequantize", &dequantize, py::call_guard<py::gil_scoped_release>(), "columns [n0, n1) of the Q4_1 weight into out, float32 [K, n]");
  m.attr("isa") = kIsa;
  m.attr("rows") = kRows;
}
