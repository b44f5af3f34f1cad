// Group-wise int8 weight-only matmul for CPU: y = x @ W (+ bias), x float32 [M, K],
// W int8 with one fp16 scale per 32 inputs per output channel.
//
// Layout (made by pack()): outputs in tiles of 16 channels; a tile's weights are
// q[tile][k][16] int8 (one 16-byte row per input k, read front to back: pure streaming) and its
// scales s[tile][group][16] fp16. Per group of 32 inputs a tile accumulates x[k] * q[k] in float
// registers (int8 -> float in-register: vpmovsxbd + vcvtdq2ps), then adds group_sum * scale
// into the running total, so the scale costs one FMA per 32 inputs, not one per weight.
// Decode (few rows) is bound by reading the int8 weights: 1/4 of float32's bytes.
// Prefill (many rows) calls dequantize() into a float scratch and leaves the GEMM to torch/MKL.
// Two builds of this one file (never -march=native), picked at run time by
// kernels.w8g32_module(): `-mavx2 -mfma -mf16c` (AVX2-only AMD EPYC, and any AVX2 CPU) and
// `-mavx512f -mavx512bw -mavx512vl -mf16c -mfma` when torch reports AVX512 (16 channels per
// zmm register, up to 8 rows per pass). Same packed layout, same per-channel summation order.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common.h"

namespace {

constexpr int64_t kTile = 16;   // output channels per tile (two 8-float registers)
constexpr int64_t kGroup = 32;  // inputs per scale
// Software prefetch this many bytes ahead of the weight stream (the next tile follows the
// current one in memory, so it runs across tiles): the hardware prefetcher alone left a single
// thread at ~half of the read bandwidth on matrices that come from L3 / DRAM (the LM head).
constexpr int64_t kPrefetch = 2048;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// 16 int8 weights at p -> two float registers (dequantize(), both builds).
inline void load_w(const int8_t* p, __m256& lo, __m256& hi) {
  lo = _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  hi = _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
}

// Rows [r0, r0 + nr) (nr <= kRows) of x against one tile; writes 16 outputs per row to out
// (row stride kTile), before bias and before trimming a partial tile.
//
// Each accumulator register is one FMA dependency chain (4-cycle latency): with one row and one
// accumulator set per k the loop would wait on that latency, not on memory. So inputs are
// unrolled U ways into U independent accumulator sets, summed at the end of each group (before
// the group's scale), keeping >= 4 chains in flight whatever the row count. Per output channel
// the summation order is the same in both builds (lane c of the AVX-512 register does what lane
// c of the two AVX2 registers does), so the two builds agree to rounding of the same operations.
#if defined(__AVX512F__)
constexpr int64_t kRows = 8;  // 32 zmm registers: up to 8 rows x (acc + total)
constexpr const char* kIsa = "avx512";

template <int NR, int U>
void tile_rows(const float* x, int64_t ldx, const int8_t* q, const at::Half* s, int64_t K,
               float* out) {
  __m512 tot[NR];
  for (int r = 0; r < NR; ++r) tot[r] = _mm512_setzero_ps();
  const int64_t groups = ceil_div(K, kGroup);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[U][NR];
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < NR; ++r) acc[u][r] = _mm512_setzero_ps();
    const int64_t k0 = g * kGroup, k1 = std::min(K, k0 + kGroup);
    int64_t k = k0;
    for (; k + U <= k1; k += U) {
      if (U >= 4 || (k & 3) == 0)  // one prefetch per 64-byte line (4 inputs)
        _mm_prefetch(reinterpret_cast<const char*>(q + k * kTile + kPrefetch), _MM_HINT_T0);
      for (int u = 0; u < U; ++u) {
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (k + u) * kTile))));
        for (int r = 0; r < NR; ++r)
          acc[u][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k + u]), w, acc[u][r]);
      }
    }
    for (int u = 0; k < k1; ++k, ++u) {  // ragged end of the last group: u < U
      const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * kTile))));
      for (int r = 0; r < NR; ++r)
        acc[u][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w, acc[u][r]);
    }
    const __m512 sc = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + g * kTile)));
    for (int r = 0; r < NR; ++r) {
      __m512 a = acc[0][r];
      for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[u][r]);
      tot[r] = _mm512_fmadd_ps(a, sc, tot[r]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(out + r * kTile, tot[r]);
}
#else
constexpr int64_t kRows = 4;  // 16 ymm registers: up to 4 rows x 2 x (acc + total)
constexpr const char* kIsa = "avx2";

// 16 int8 weights at p -> two float registers. Two 8-byte sign-extending loads
// (vpmovsxbd ymm, m64) rather than one 16-byte load + shift: one shuffle-port uop fewer.
inline void load_w16(const int8_t* p, __m256& lo, __m256& hi) {
  lo = _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  hi = _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
}

template <int NR, int U>
void tile_rows(const float* x, int64_t ldx, const int8_t* q, const at::Half* s, int64_t K,
               float* out) {
  __m256 tot[NR][2];
  for (int r = 0; r < NR; ++r) tot[r][0] = tot[r][1] = _mm256_setzero_ps();
  const int64_t groups = ceil_div(K, kGroup);
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[U][NR][2];
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < NR; ++r) acc[u][r][0] = acc[u][r][1] = _mm256_setzero_ps();
    const int64_t k0 = g * kGroup, k1 = std::min(K, k0 + kGroup);
    int64_t k = k0;
    for (; k + U <= k1; k += U) {
      if (U >= 4 || (k & 3) == 0)  // one prefetch per 64-byte line (4 inputs)
        _mm_prefetch(reinterpret_cast<const char*>(q + k * kTile + kPrefetch), _MM_HINT_T0);
      for (int u = 0; u < U; ++u) {
        __m256 wlo, whi;
        load_w16(q + (k + u) * kTile, wlo, whi);
        for (int r = 0; r < NR; ++r) {
          const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k + u);
          acc[u][r][0] = _mm256_fmadd_ps(xv, wlo, acc[u][r][0]);
          acc[u][r][1] = _mm256_fmadd_ps(xv, whi, acc[u][r][1]);
        }
      }
    }
    for (int u = 0; k < k1; ++k, ++u) {  // ragged end of the last group: u < U
      __m256 wlo, whi;
      load_w16(q + k * kTile, wlo, whi);
      for (int r = 0; r < NR; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
        acc[u][r][0] = _mm256_fmadd_ps(xv, wlo, acc[u][r][0]);
        acc[u][r][1] = _mm256_fmadd_ps(xv, whi, acc[u][r][1]);
      }
    }
    const __m256 slo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g * kTile)));
    const __m256 shi = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g * kTile + 8)));
    for (int r = 0; r < NR; ++r) {
      __m256 lo = acc[0][r][0], hi = acc[0][r][1];
      for (int u = 1; u < U; ++u) {
        lo = _mm256_add_ps(lo, acc[u][r][0]);
        hi = _mm256_add_ps(hi, acc[u][r][1]);
      }
      tot[r][0] = _mm256_fmadd_ps(lo, slo, tot[r][0]);
      tot[r][1] = _mm256_fmadd_ps(hi, shi, tot[r][1]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    _mm256_storeu_ps(out + r * kTile, tot[r][0]);
    _mm256_storeu_ps(out + r * kTile + 8, tot[r][1]);
  }
}
#endif

// Input unroll per row count: the same in both builds (see tile_rows), at least 4 chains
// per output register for 1-2 rows; from 3 rows on, the rows themselves are the chains.
template <int NR>
constexpr int unroll() { return NR == 1 ? 4 : NR == 2 ? 2 : 1; }

template <int NR>
void run_rows(const float* x, int64_t ldx, const int8_t* q, const at::Half* s, int64_t K,
              float* out) {
  tile_rows<NR, unroll<NR>()>(x, ldx, q, s, K, out);
}

void check_packed(const torch::Tensor& q, const torch::Tensor& s, int64_t K, int64_t N) {
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.is_contiguous() && q.dim() == 3, "q: int8 [T,K,16]");
  TORCH_CHECK(s.dtype() == torch::kHalf && s.is_contiguous() && s.dim() == 3, "s: fp16 [T,G,16]");
  TORCH_CHECK(q.size(0) == ceil_div(N, kTile) && q.size(1) == K && q.size(2) == kTile,
              "q shape does not match K, N");
  TORCH_CHECK(s.size(0) == q.size(0) && s.size(1) == ceil_div(K, kGroup) && s.size(2) == kTile,
              "s shape does not match K, N");
}

}  // namespace

// w: float32 [K, N] (y = x @ w). Returns (q int8 [T, K, 16], s fp16 [T, G, 16]); a partial last
// tile / group is zero-padded (padding weights are 0, so they add nothing).
std::vector<torch::Tensor> pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.dtype() == torch::kFloat, "w: float32 [K, N]");
  w = w.contiguous();
  const int64_t K = w.size(0), N = w.size(1), T = ceil_div(N, kTile), G = ceil_div(K, kGroup);
  auto q = torch::zeros({T, K, kTile}, torch::kInt8);
  auto s = torch::zeros({T, G, kTile}, torch::kHalf);
  const float* wp = w.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  at::Half* sp = s.data_ptr<at::Half>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t c = 0; c < kTile && t * kTile + c < N; ++c) {
        const int64_t n = t * kTile + c;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t k0 = g * kGroup, k1 = std::min(K, k0 + kGroup);
          float amax = 0.f;
          for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::abs(wp[k * N + n]));
          // The scale is stored as fp16; quantize against the rounded scale so that
          // dequantization (q * fp16 scale) is what the weights were rounded to.
          const at::Half sh = static_cast<at::Half>(std::max(amax / 127.f, 1e-7f));
          const float scale = static_cast<float>(sh);
          sp[(t * G + g) * kTile + c] = sh;
          for (int64_t k = k0; k < k1; ++k) {
            const float v = std::nearbyint(wp[k * N + n] / scale);
            qp[(t * K + k) * kTile + c] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
          }
        }
      }
    }
  });
  return {q, s};
}

// One tile's sums (`rows` rows of kTile, row stride kTile) into y's columns [n0, n0 + 16),
// trimmed at N, plus the bias and then the residual (row stride ldr) where given: (sum + bias)
// + residual, the order of torch's `residual + (x @ W + bias)`. `y` and `res` point at the
// first row's start.
inline void store_tile(const float* sums, int64_t rows, float* y, int64_t N, int64_t n0,
                       const float* bias, const float* res = nullptr, int64_t ldr = 0) {
  const int64_t nc = std::min(kTile, N - n0);
  for (int64_t r = 0; r < rows; ++r)
    add_store(sums + r * kTile, bias ? bias + n0 : nullptr, res ? res + r * ldr + n0 : nullptr,
              nc, y + r * N + n0);
}

// x float32 [M, K] -> y float32 [M, N] (+ bias [N]). Work items: (tile, block of kRows rows),
// spread over torch's intra-op threads (torch.get_num_threads()).
torch::Tensor matmul(torch::Tensor x, torch::Tensor q, torch::Tensor s, int64_t N,
                     c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat, "x: float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), T = ceil_div(N, kTile);
  check_packed(q, s, K, N);
  const float* bp = bias_ptr(bias, N);
  int64_t ldr;
  const float* rp = residual_ptr(residual, M, N, &ldr);
  auto y = torch::empty({M, N}, torch::kFloat);
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const at::Half* sp = s.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  const int64_t G = ceil_div(K, kGroup), row_blocks = ceil_div(M, kRows);
  // Tile-major order: consecutive items reuse the same tile while it is in cache.
  at::parallel_for(0, T * row_blocks, 1, [&](int64_t a, int64_t b) {
    float out[kRows * kTile];
    for (int64_t item = a; item < b; ++item) {
      const int64_t t = item / row_blocks, r0 = (item % row_blocks) * kRows;
      const int64_t nr = std::min(kRows, M - r0);
      const float* xr = xp + r0 * K;
      const int8_t* qt = qp + t * K * kTile;
      const at::Half* st = sp + t * G * kTile;
      switch (nr) {
#if defined(__AVX512F__)
        case 8: run_rows<8>(xr, K, qt, st, K, out); break;
        case 7: run_rows<7>(xr, K, qt, st, K, out); break;
        case 6: run_rows<6>(xr, K, qt, st, K, out); break;
        case 5: run_rows<5>(xr, K, qt, st, K, out); break;
#endif
        case 4: run_rows<4>(xr, K, qt, st, K, out); break;
        case 3: run_rows<3>(xr, K, qt, st, K, out); break;
        case 2: run_rows<2>(xr, K, qt, st, K, out); break;
        default: run_rows<1>(xr, K, qt, st, K, out); break;
      }
      store_tile(out, nr, yp + r0 * N, N, t * kTile, bp, rp ? rp + r0 * ldr : nullptr, ldr);
    }
  });
  return y;
}

// Columns [n0, n1) of the float32 weight, [K, n1 - n0], with n0 a multiple of 16: the scratch
// that prefill hands to torch's GEMM.
// `out` (float32 [K, n1 - n0], contiguous) is the caller's reused scratch: a fresh 16 MB buffer
// per call would cost more in page faults than the dequantization itself.
torch::Tensor dequantize(torch::Tensor q, torch::Tensor s, int64_t N, int64_t n0, int64_t n1,
                         torch::Tensor w) {
  const int64_t K = q.size(1);
  check_packed(q, s, K, N);
  TORCH_CHECK(n0 % kTile == 0 && 0 <= n0 && n0 < n1 && n1 <= N, "bad column range");
  const int64_t W = n1 - n0, G = ceil_div(K, kGroup), t0 = n0 / kTile, t1 = ceil_div(n1, kTile);
  TORCH_CHECK(w.dtype() == torch::kFloat && w.is_contiguous() && w.dim() == 2 && w.size(0) == K &&
                  w.size(1) == W, "out: float32 [K, n1 - n0], contiguous");
  float* wp = w.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const at::Half* sp = s.data_ptr<at::Half>();
  // Blocks of 8 tiles (128 columns): per input k, 8 sequential read streams and one 512-byte
  // contiguous write.
  constexpr int64_t kBlock = 8;
  at::parallel_for(0, ceil_div(t1 - t0, kBlock), 1, [&](int64_t ba, int64_t bb) {
    for (int64_t blk = ba; blk < bb; ++blk) {
      const int64_t ta = t0 + blk * kBlock, tb = std::min(t1, ta + kBlock);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t g = k / kGroup;
        for (int64_t t = ta; t < tb; ++t) {
          __m256 lo, hi;
          load_w(qp + (t * K + k) * kTile, lo, hi);
          const at::Half* st = sp + (t * G + g) * kTile;
          lo = _mm256_mul_ps(lo, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(st))));
          hi = _mm256_mul_ps(hi, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(st + 8))));
          float* dst = wp + k * W + (t * kTile - n0);
          const int64_t nc = std::min(kTile, n1 - t * kTile);
          if (nc == kTile) {
            _mm256_storeu_ps(dst, lo);
            _mm256_storeu_ps(dst + 8, hi);
          } else {
            float tmp[kTile];
            _mm256_storeu_ps(tmp, lo);
            _mm256_storeu_ps(tmp + 8, hi);
            std::memcpy(dst, tmp, nc * sizeof(float));
          }
        }
      }
    }
  });
  return w;
}

// ---------------------------------------------------------------- float32 weights, few rows
// The same 16-channel tiles with float32 weights, for `--quantization none` decode steps
// (engine/quant.py: F32TileLinear). Why: torch's GEMM (MKL 2024 in torch 2.13) is slow at
// 2-16 rows: measured one thread on an AVX2-only AMD EPYC, the default model's projections at
// 8 rows took 2.7-4x the time of 1 row, though the weight read is the same (the 8-row product is
// ~17 GFLOP/s, a fifth of the FMA peak). Streaming the tiles once per step for every row keeps
// the step bound by the weight read up to ~8 rows.
//
// AVX2 intrinsics only, in both builds: one code path to test on either machine kind.
// Loop order: chunks of kChunk inputs outer, blocks of 4 rows inner, so a chunk of the tile
// (kChunk x 64 bytes, 4 KB) is read from memory once and from L1 by the other row blocks; the
// running sums live in a small buffer between chunks. Every pass prefetches the next chunk, so
// the memory stream keeps running while later row blocks compute.

namespace {

constexpr int64_t kChunk = 64;        // inputs per chunk: 4 KB of float32 tile
constexpr int64_t kF32MaxRows = 64;   // rows one call takes (the sums buffer: 4 KB)

template <int NR, int U>
void f32_chunk(const float* x, int64_t ldx, const float* p, int64_t k0, int64_t k1, bool first,
               float* sums) {
  __m256 acc[U][NR][2];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < NR; ++r) {
      acc[u][r][0] = (u == 0 && !first) ? _mm256_loadu_ps(sums + r * kTile) : _mm256_setzero_ps();
      acc[u][r][1] =
          (u == 0 && !first) ? _mm256_loadu_ps(sums + r * kTile + 8) : _mm256_setzero_ps();
    }
  int64_t k = k0;
  for (; k + U <= k1; k += U) {
    for (int u = 0; u < U; ++u) {
      const float* w = p + (k + u) * kTile;
      _mm_prefetch(reinterpret_cast<const char*>(w + kChunk * kTile), _MM_HINT_T0);
      const __m256 wlo = _mm256_loadu_ps(w), whi = _mm256_loadu_ps(w + 8);
      for (int r = 0; r < NR; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k + u);
        acc[u][r][0] = _mm256_fmadd_ps(xv, wlo, acc[u][r][0]);
        acc[u][r][1] = _mm256_fmadd_ps(xv, whi, acc[u][r][1]);
      }
    }
  }
  for (int u = 0; k < k1; ++k, ++u) {  // ragged end (K not a multiple of U): u < U
    const float* w = p + k * kTile;
    const __m256 wlo = _mm256_loadu_ps(w), whi = _mm256_loadu_ps(w + 8);
    for (int r = 0; r < NR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
      acc[u][r][0] = _mm256_fmadd_ps(xv, wlo, acc[u][r][0]);
      acc[u][r][1] = _mm256_fmadd_ps(xv, whi, acc[u][r][1]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    __m256 lo = acc[0][r][0], hi = acc[0][r][1];
    for (int u = 1; u < U; ++u) {
      lo = _mm256_add_ps(lo, acc[u][r][0]);
      hi = _mm256_add_ps(hi, acc[u][r][1]);
    }
    _mm256_storeu_ps(sums + r * kTile, lo);
    _mm256_storeu_ps(sums + r * kTile + 8, hi);
  }
}

// One tile (16 output channels) against all M rows; sums [M, 16].
void f32_tile(const float* x, int64_t K, int64_t M, const float* p, float* sums) {
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t k1 = std::min(K, k0 + kChunk);
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
      const float* xr = x + r0 * K;
      float* sr = sums + r0 * kTile;
      const bool first = k0 == 0;
      switch (std::min<int64_t>(4, M - r0)) {  // 1-2 rows: unrolled for >= 4 FMA chains
        case 4: f32_chunk<4, 1>(xr, K, p, k0, k1, first, sr); break;
        case 3: f32_chunk<3, 1>(xr, K, p, k0, k1, first, sr); break;
        case 2: f32_chunk<2, 2>(xr, K, p, k0, k1, first, sr); break;
        default: f32_chunk<1, 4>(xr, K, p, k0, k1, first, sr); break;
      }
    }
  }
}

}  // namespace

// w: float32 [K, N] -> p float32 [T, K, 16] (a partial last tile zero-padded).
torch::Tensor pack_f32(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.dtype() == torch::kFloat, "w: float32 [K, N]");
  const int64_t K = w.size(0), N = w.size(1), T = ceil_div(N, kTile);
  auto padded = torch::zeros({K, T * kTile}, torch::kFloat);
  padded.narrow(1, 0, N).copy_(w);
  return padded.view({K, T, kTile}).permute({1, 0, 2}).contiguous();
}

// x float32 [M, K] (M <= kF32MaxRows) @ packed p [T, K, 16] -> y [M, N] (+ bias [N]).
torch::Tensor matmul_f32(torch::Tensor x, torch::Tensor p, int64_t N,
                         c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat, "x: float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), T = ceil_div(N, kTile);
  TORCH_CHECK(M <= kF32MaxRows, "matmul_f32 takes at most ", kF32MaxRows, " rows");
  TORCH_CHECK(p.dtype() == torch::kFloat && p.is_contiguous() && p.dim() == 3 &&
                  p.size(0) == T && p.size(1) == K && p.size(2) == kTile,
              "p: float32 [T, K, 16] matching K, N");
  const float* bp = bias_ptr(bias, N);
  int64_t ldr;
  const float* rp = residual_ptr(residual, M, N, &ldr);
  auto y = torch::empty({M, N}, torch::kFloat);
  const float* xp = x.data_ptr<float>();
  const float* pp = p.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t a, int64_t b) {
    float sums[kF32MaxRows * kTile];
    for (int64_t t = a; t < b; ++t) {
      f32_tile(xp, K, M, pp + t * K * kTile, sums);
      store_tile(sums, M, yp, N, t * kTile, bp, rp, ldr);
    }
  });
  return y;
}

// ---------------------------------------------------------------- small fused ops
// A decode step at batch 1 runs ~60 RMSNorms and 30 RoPEs on vectors of a few hundred floats:
// torch runs each as 5-8 separate ops (~20-30 us a call on one thread, mostly dispatch), here
// one pass. Used only by quantized models (engine/quant.py: FusedOps): their rounding differs
// from torch's (one float sum, FMA), which the exact HF parity of `--quantization none` forbids.

// y = x / sqrt(mean(x^2) + eps) * w, per row of x [M, N] (float32, contiguous rows).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat && x.stride(1) == 1, "x: float32 [M, N]");
  TORCH_CHECK(w.dtype() == torch::kFloat && w.is_contiguous() && w.numel() == x.size(1),
              "w: float32 [N]");
  const int64_t M = x.size(0), N = x.size(1), ld = x.stride(0);
  auto y = torch::empty({M, N}, torch::kFloat);
  const float* wp = w.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = x.data_ptr<float>() + r * ld;
    float* yr = y.data_ptr<float>() + r * N;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < N; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(N) + static_cast<float>(eps));
#pragma omp simd
    for (int64_t i = 0; i < N; ++i) yr[i] = xr[i] * inv * wp[i];
  }
  return y;
}

// RoPE (HF rotate-half layout) over the first `heads` heads of x [T, >= heads * D] (the fused
// q|k columns of the qkv output, rows may be strided): out [T, heads, D] =
// x * cos + rotate_half(x) * sin, with cos [T, D] and signed_sin [T, D] = (-sin | sin).
torch::Tensor rope(torch::Tensor x, int64_t heads, torch::Tensor cos, torch::Tensor ssin) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat && x.stride(1) == 1, "x: float32 [T, *]");
  TORCH_CHECK(cos.dtype() == torch::kFloat && ssin.dtype() == torch::kFloat &&
                  cos.is_contiguous() && ssin.is_contiguous() && cos.dim() == 2 &&
                  cos.sizes() == ssin.sizes() && cos.size(0) == x.size(0),
              "cos, signed_sin: float32 [T, D], contiguous");
  const int64_t T = x.size(0), D = cos.size(1), half = D / 2, ld = x.stride(0);
  TORCH_CHECK(D % 2 == 0 && heads >= 1 && heads * D <= x.size(1), "rope: bad head count / dim");
  auto y = torch::empty({T, heads, D}, torch::kFloat);
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos.data_ptr<float>() + t * D;
    const float* sn = ssin.data_ptr<float>() + t * D;
    for (int64_t h = 0; h < heads; ++h) {
      const float* xr = x.data_ptr<float>() + t * ld + h * D;
      float* yr = y.data_ptr<float>() + (t * heads + h) * D;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) yr[d] = xr[d] * c[d] + xr[d + half] * sn[d];
#pragma omp simd
      for (int64_t d = half; d < D; ++d) yr[d] = xr[d] * c[d] + xr[d - half] * sn[d];
    }
  }
  return y;
}

// y [T, I] = silu(x[:, :I]) * x[:, I:] for the gate|up output x [T, 2I] (rows may be strided):
// the MLP's activation as one pass instead of torch's silu, two slices and a product (~10-20 us
// a layer at decode sizes). silu(g) = g / (1 + exp(-g)) with exp8 (common.h, ~2 ulp).
torch::Tensor silu_mul(torch::Tensor x, int64_t I) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat && x.stride(1) == 1 && I >= 1 &&
                  x.size(1) == 2 * I,
              "x: float32 [T, 2 * I] with unit column stride");
  const int64_t T = x.size(0), ld = x.stride(0);
  auto y = torch::empty({T, I}, torch::kFloat);
  const __m256 one = _mm256_set1_ps(1.f), neg = _mm256_set1_ps(-0.f);
  auto silu_mul8 = [&](__m256 g, __m256 u) {
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, neg)))), u);
  };
  for (int64_t t = 0; t < T; ++t) {
    const float* g = x.data_ptr<float>() + t * ld;
    const float* u = g + I;
    float* yr = y.data_ptr<float>() + t * I;
    int64_t i = 0;
    for (; i + 8 <= I; i += 8)
      _mm256_storeu_ps(yr + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < I) {  // the tail through the same vector code (the same values as a whole vector)
      float gt[8] = {}, ut[8] = {}, yt[8];
      std::memcpy(gt, g + i, (I - i) * sizeof(float));
      std::memcpy(ut, u + i, (I - i) * sizeof(float));
      _mm256_storeu_ps(yt, silu_mul8(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut)));
      std::memcpy(yr + i, yt, (I - i) * sizeof(float));
    }
  }
  return y;
}

// Every call lets go of the GIL (call_guard): a worker's heartbeat thread must answer while
// a long prompt step runs these, or the router takes a busy worker for dead (no_heartbeat).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, py::call_guard<py::gil_scoped_release>(), "float32 [K, N] -> (int8 tiles [T, K, 16], fp16 scales [T, G, 16])");
  m.def("matmul", &matmul, py::call_guard<py::gil_scoped_release>(), "x [M, K] @ packed W [K, N] (+ bias) (+ residual [M, N])",
        py::arg("x"), py::arg("q"), py::arg("s"), py::arg("n"), py::arg("bias") = py::none(),
        py::arg("residual") = py::none());
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>(), "RMSNorm of each row of x [M, N] by w [N]");
  m.def("rope", &rope, py::call_guard<py::gil_scoped_release>(), "rotate-half RoPE of the first `heads` heads of x [T, *]");
  m.def("silu_mul", &silu_mul, py::call_guard<py::gil_scoped_release>(), "silu(x[:, :I]) * x[:, I:] for x [T, 2I]");
  m.attr("isa") = kIsa;  // which build this is: "avx2" or "avx512"
  m.attr("rows") = kRows;  // rows per pass over a weight tile
  m.def("pack_f32", &pack_f32, py::call_guard<py::gil_scoped_release>(), "float32 [K, N] -> float32 tiles [T, K, 16]");
  m.def("matmul_f32", &matmul_f32, py::call_guard<py::gil_scoped_release>(),
        "x [M, K] (M <= f32_max_rows) @ float32 tiles (+ bias) (+ residual [M, N])",
        py::arg("x"), py::arg("p"), py::arg("n"), py::arg("bias") = py::none(),
        py::arg("residual") = py::none());
  m.attr("f32_max_rows") = kF32MaxRows;
  m.def("dequantize", &dequantize, py::call_guard<py::gil_scoped_release>(), "columns [n0, n1) of the packed weight into out, float32 [K, n]");
}
