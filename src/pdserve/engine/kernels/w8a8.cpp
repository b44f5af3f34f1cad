// Group-wise int8 x int8 matmul for CPU (`--quantization w8a8`): y = x @ W (+ bias) with
// W int8, one fp16 scale per 32 inputs per output channel (the same weights as w8g32), and x
// quantized on the fly to int8 with one float scale per 32 inputs per row (as llama.cpp's Q8
// activations). Each group's 32 products are summed exactly in int32, then scaled once:
//   y[r, n] = sum_g  sx[r, g] * sw[g, n] * sum_{k in g} xq[r, k] * wq[k, n].
//
// Why: w8g32 (float activations) widens every weight to float and spends one FMA per 16
// products; at 8 rows that is compute-bound at ~2.5x the tokens/s of 1 row (the target is 5x).
// Integer dot products do 4 products per 32-bit lane per instruction.
//
// Layout: outputs in tiles of 16 channels; inputs padded to whole groups of 32 and stored in
// quads: q[tile][k / 4][16][4] int8, so one 64-byte line holds 4 inputs x 16 channels, channel
// c's 4 weights in 32-bit lane c. Scales s[tile][group][16] fp16. quant.W8A8Linear builds it
// from w8g32's pack() (same weights, same scales: only the byte order differs), so the weight
// rounding lives in one place.
//
// Two builds of this file (never -march=native), picked at run time by kernels.w8a8_module():
//  * "vnni" (`-mavx512f -mavx512bw -mavx512vl -mavx512vnni`): vpdpbusd multiplies unsigned by
//    signed bytes, so this build's weights are stored offset by 128 (wq + 128, 1..255: the
//    module's `weight_offset`, applied by quant.W8A8Linear) and each row's group subtracts
//    128 * sum(xq) (summed as the row is quantized). The offset went on the activations before,
//    which needed 128 * sum(w) per quad: one more vpdpbusd per quad, 1/9 of the work at 8 rows.
//  * "avx2" (`-mavx2 -mfma -mf16c`): vpmaddubsw with the sign trick (|w| times x carrying w's
//    sign); |xq|, |wq| <= 127 so a pair sum (<= 32258) never saturates int16.
// Both compute the same int32 group sums exactly, then the same float operations in the same
// order: the builds agree bit for bit.
//
// matmul_q4_1 (`--quantization gguf-a8`) runs a GGUF file's own Q4_1 weights the same way (as
// llama.cpp does: its Q4_1 x Q8 dot product): per block of 32 inputs a fp16 scale d, a fp16
// minimum m and 4-bit codes q in 0..15 (w = d * q + m), so
//   y[r, n] = sum_g  d[g, n] * sx[r, g] * sum_{k in g} xq[r, k] * q[k, n]  +  m[g, n] * S[r, g]
// with S[r, g] = sx[r, g] * sum_{k in g} xq[r, k]: the product of the quantized row with the
// weights as they are (llama.cpp's Q8_1 sum). The row's exact float sum instead would leave
// the activations' rounding error times (w - m), not times w: the minimum is an offset of the
// whole block, so that error does not cancel (2x w8a8's output error on the default model,
// agreement with float32 34% against llama.cpp's 49%).
// The codes are unsigned already (vpdpbusd's unsigned operand, vpmaddubsw's too): no offset.
// Layout (quant_gguf.pack_q4_1_a8): per tile and block 4 lines of 64 bytes; line i's 32-bit
// lane c holds channel c's codes of inputs 4i..4i+3 in its low nibbles and of 16+4i..16+4i+3
// in its high ones (ggml's own pairing of code j with code j + 16). 0.625 bytes a weight.
//
// matmul_q4_1_a16 (`--quantization gguf-a16`) runs the same tiles against activations rounded to
// int16, one scale per 32 inputs per row (sx = max |x| / 32767): 2^-16 of the block's largest
// input, under the float16 KV cache's own rounding (60 chat prompts x 64 greedy tokens: the
// same 98.4% agreement with float32 as float activations, KL 3.0e-7 against 2.4e-7). Why: with
// float activations every code is widened to float (zero-extend, convert) and costs an FMA per
// 16 products; int16 pairs are multiplied and summed 32 at a time by vpdpwssd (AVX2: vpmaddwd
// + vpaddd), and a code needs a shift and a mask. A line's 32-bit lane c, masked with
// 0x000F000F after a shift of 0 / 4 / 8 / 12 bits, holds two codes as int16 (bytes 0 and 2,
// low then high nibbles, then bytes 1 and 3): inputs (4i, 4i+2), (16+4i, 16+4i+2), (4i+1,
// 4i+3), (16+4i+1, 16+4i+3). The row is quantized into that pair order, so each pair is one
// 32-bit broadcast. The minimum term is sx * sum(xq), as gguf-a8's.
// matmul_a16 runs w8a8's quads (int8 codes, no offset in either build) against the same int16
// activations: gguf-a16's Q8_0 LM head. A quad's 32-bit lane holds inputs 4j..4j+3 of one
// channel; a 16-bit shift left then arithmetic right by 8 leaves (4j, 4j+2) as int16, a shift
// right by 8 (4j+1, 4j+3).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t kTile = 16;   // output channels per tile
constexpr int64_t kGroup = 32;  // inputs per scale (weights and activations)
constexpr int64_t kQuads = kGroup / 4;
constexpr int64_t kQ4Block = kGroup * kTile / 2;  // bytes of Q4_1 codes per tile and block
// Software prefetch this many bytes ahead in the weight stream, one per 64-byte line (see
// w8g32.cpp: the hardware prefetcher alone left one thread at ~half the read bandwidth). 8192
// ran best of 1024 / 2048 / 4096 / 8192 on Zen 4 (VNNI build, LM head and [576 x 3072] from
// DRAM, 1 and 8 rows).
constexpr int64_t kPrefetch = 8192;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A tile's scales: fp16 as a Q4_1 / Q8_0 file stores them, or float32 for the K-quants, whose
// scale is a product (fp16 super-block scale x 6- or 8-bit sub-block scale) that fp16 cannot
// hold exactly and float32 can (<= 19 significant bits).
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
#if defined(__AVX512F__)
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
#endif

#if defined(__AVX512VNNI__)
constexpr const char* kIsa = "vnni";
constexpr int64_t kRows = 8;
constexpr int kWeightOffset = 128;  // weights stored as wq + 128 (vpdpbusd's unsigned operand)

// Rows [0, NR) of xq (row stride ldx bytes) against one tile; out[r * 16 + c]. xc[r * G + g]
// is 128 * the sum of row r's codes in group g: what the weights' offset adds to each dot.
// U accumulator sets take alternate quads: with few rows, U = 2 keeps >= 2 dependency chains
// per row; from 4 rows on the rows are the chains and U = 1 leaves registers for them (an
// accumulator indexed by a run-time j & 1 made the compiler keep them all on the stack).
template <int NR, int U>
void tile_rows(const int8_t* xq, int64_t ldx, const float* xs, const int32_t* xc, int64_t G,
               const int8_t* q, const at::Half* s, float* out) {
  __m512 tot[NR];
  for (int r = 0; r < NR; ++r) tot[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int8_t* qg = q + g * kQuads * 64;
    const int8_t* xg = xq + g * kGroup;
    __m512i acc[U][NR];
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < NR; ++r) acc[u][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < kQuads; j += U) {
#pragma GCC unroll 2
      for (int u = 0; u < U; ++u) {
        _mm_prefetch(reinterpret_cast<const char*>(qg + (j + u) * 64 + kPrefetch), _MM_HINT_T0);
        const __m512i w = _mm512_loadu_si512(qg + (j + u) * 64);
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) {
          int32_t quad;
          std::memcpy(&quad, xg + r * ldx + (j + u) * 4, 4);
          acc[u][r] = _mm512_dpbusd_epi32(acc[u][r], w, _mm512_set1_epi32(quad));
        }
      }
    }
    const __m512 sw = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + g * kTile)));
    for (int r = 0; r < NR; ++r) {
      __m512i dot = acc[0][r];
      for (int u = 1; u < U; ++u) dot = _mm512_add_epi32(dot, acc[u][r]);
      dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(xc[r * G + g]));
      const __m512 scale = _mm512_mul_ps(sw, _mm512_set1_ps(xs[r * G + g]));
      tot[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, tot[r]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(out + r * kTile, tot[r]);
}

// Q4_1 tiles (see the top): rows [0, NR) of xq against one tile; xs / xsum [r * G + g] the
// rows' scales and quantized sums per block. The low and high nibbles feed two accumulators.
template <int NR>
void tile_rows_q4(const int8_t* xq, int64_t ldx, const float* xs, const float* xsum, int64_t G,
                  const uint8_t* q, const at::Half* d, const at::Half* m, float* out) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512 tot[NR];
  for (int r = 0; r < NR; ++r) tot[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* qg = q + g * kQ4Block;
    const int8_t* xg = xq + g * kGroup;
    __m512i lo[NR], hi[NR];
    for (int r = 0; r < NR; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(qg + i * 64 + kPrefetch), _MM_HINT_T0);
      const __m512i w = _mm512_loadu_si512(qg + i * 64);
      const __m512i wl = _mm512_and_si512(w, low);
      const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        int32_t a, b;
        std::memcpy(&a, xg + r * ldx + 4 * i, 4);
        std::memcpy(&b, xg + r * ldx + 16 + 4 * i, 4);
        lo[r] = _mm512_dpbusd_epi32(lo[r], wl, _mm512_set1_epi32(a));
        hi[r] = _mm512_dpbusd_epi32(hi[r], wh, _mm512_set1_epi32(b));
      }
    }
    const __m512 dv = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g * kTile)));
    const __m512 mv = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + g * kTile)));
    for (int r = 0; r < NR; ++r) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(lo[r], hi[r]));
      tot[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, _mm512_set1_ps(xs[r * G + g])), tot[r]);
      tot[r] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * G + g]), mv, tot[r]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(out + r * kTile, tot[r]);
}

// gguf-a16 (see the top): rows [0, NR) of xq (int16, pair order, row stride ldx) against one
// Q4_1 tile. U accumulator sets take alternate pairs (>= 2 chains a row with few rows).
template <int NR, int U, class S>
void tile_rows_q4_a16(const int16_t* xq, int64_t ldx, const float* xs, const float* xsum,
                      int64_t G, const uint8_t* q, const S* d, const S* m, float* out) {
  const __m512i mask = _mm512_set1_epi32(0x000F000F);
  __m512 tot[NR];
  for (int r = 0; r < NR; ++r) tot[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* qg = q + g * kQ4Block;
    const int16_t* xg = xq + g * kGroup;
    __m512i acc[U][NR];
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < NR; ++r) acc[u][r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(qg + i * 64 + kPrefetch), _MM_HINT_T0);
      const __m512i line = _mm512_loadu_si512(qg + i * 64);
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m512i w = _mm512_and_si512(p == 0 ? line : _mm512_srli_epi32(line, 4 * p), mask);
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) {
          int32_t pair;
          std::memcpy(&pair, xg + r * ldx + 8 * i + 2 * p, 4);
          acc[p % U][r] = _mm512_dpwssd_epi32(acc[p % U][r], w, _mm512_set1_epi32(pair));
        }
      }
    }
    const __m512 dv = load16(d + g * kTile);
    const __m512 mv = load16(m + g * kTile);
    for (int r = 0; r < NR; ++r) {
      __m512i dot = acc[0][r];
      for (int u = 1; u < U; ++u) dot = _mm512_add_epi32(dot, acc[u][r]);
      tot[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                               _mm512_mul_ps(dv, _mm512_set1_ps(xs[r * G + g])), tot[r]);
      tot[r] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * G + g]), mv, tot[r]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(out + r * kTile, tot[r]);
}
// gguf-a16's Q8_0 head (see the top): rows [0, NR) of xq (int16, quad pair order) against one
// tile of w8a8's quads, stored without the offset.
template <int NR, int U>
void tile_rows_a16(const int16_t* xq, int64_t ldx, const float* xs, int64_t G, const int8_t* q,
                   const at::Half* s, float* out) {
  __m512 tot[NR];
  for (int r = 0; r < NR; ++r) tot[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int8_t* qg = q + g * kQuads * 64;
    const int16_t* xg = xq + g * kGroup;
    __m512i acc[U][NR];
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < NR; ++r) acc[u][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < kQuads; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(qg + j * 64 + kPrefetch), _MM_HINT_T0);
      const __m512i line = _mm512_loadu_si512(qg + j * 64);
      const __m512i w[2] = {_mm512_srai_epi16(_mm512_slli_epi16(line, 8), 8),
                            _mm512_srai_epi16(line, 8)};
#pragma GCC unroll 2
      for (int p = 0; p < 2; ++p) {
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) {
          int32_t pair;
          std::memcpy(&pair, xg + r * ldx + 4 * j + 2 * p, 4);
          acc[p % U][r] = _mm512_dpwssd_epi32(acc[p % U][r], w[p], _mm512_set1_epi32(pair));
        }
      }
    }
    const __m512 sw = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + g * kTile)));
    for (int r = 0; r < NR; ++r) {
      __m512i dot = acc[0][r];
      for (int u = 1; u < U; ++u) dot = _mm512_add_epi32(dot, acc[u][r]);
      tot[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                               _mm512_mul_ps(sw, _mm512_set1_ps(xs[r * G + g])), tot[r]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(out + r * kTile, tot[r]);
}

// K-quants and 5-bit formats (matmul_k_a16, see the top): rows [0, NR) of xq (int16, quad pair
// order) against one tile of int8 codes in w8a8's quads, without the offset; one float32 scale
// per 16 inputs (s [G][2][16]: Q6_K's sub-blocks are 16 inputs) and, when Min, one float32
// minimum per 32 (mn [G][16], times the row's quantized sum as Q4_1's). Quads 0-3 of a group
// are its first 16 inputs, quads 4-7 the rest: one int32 sum per half, each scaled.
template <int NR, bool Min>
void tile_rows_k_a16(const int16_t* xq, int64_t ldx, const float* xs, const float* xsum,
                     int64_t G, const int8_t* q, const float* s, const float* mn, float* out) {
  __m512 tot[NR];
  for (int r = 0; r < NR; ++r) tot[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int8_t* qg = q + g * kQuads * 64;
    const int16_t* xg = xq + g * kGroup;
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      __m512i acc[2][NR];
      for (int u = 0; u < 2; ++u)
        for (int r = 0; r < NR; ++r) acc[u][r] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int j = 4 * half; j < 4 * half + 4; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(qg + j * 64 + kPrefetch), _MM_HINT_T0);
        const __m512i line = _mm512_loadu_si512(qg + j * 64);
        const __m512i w[2] = {_mm512_srai_epi16(_mm512_slli_epi16(line, 8), 8),
                              _mm512_srai_epi16(line, 8)};
#pragma GCC unroll 2
        for (int p = 0; p < 2; ++p) {
#pragma GCC unroll 8
          for (int r = 0; r < NR; ++r) {
            int32_t pair;
            std::memcpy(&pair, xg + r * ldx + 4 * j + 2 * p, 4);
            acc[p][r] = _mm512_dpwssd_epi32(acc[p][r], w[p], _mm512_set1_epi32(pair));
          }
        }
      }
      const __m512 sw = load16(s + (2 * g + half) * kTile);
      for (int r = 0; r < NR; ++r)
        tot[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc[0][r], acc[1][r])),
                                 _mm512_mul_ps(sw, _mm512_set1_ps(xs[r * G + g])), tot[r]);
    }
    if (Min) {
      const __m512 mv = load16(mn + g * kTile);
      for (int r = 0; r < NR; ++r)
        tot[r] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * G + g]), mv, tot[r]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(out + r * kTile, tot[r]);
}
#else
constexpr const char* kIsa = "avx2";
constexpr int64_t kRows = 4;
constexpr int kWeightOffset = 0;

template <int NR, int U>
void tile_rows(const int8_t* xq, int64_t ldx, const float* xs, const int32_t*, int64_t G,
               const int8_t* q, const at::Half* s, float* out) {
  __m256 tot[NR][2];
  for (int r = 0; r < NR; ++r) tot[r][0] = tot[r][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < G; ++g) {
    const int8_t* qg = q + g * kQuads * 64;
    __m256i acc[NR][2];
    for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < kQuads; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(qg + j * 64 + kPrefetch), _MM_HINT_T0);
      const __m256i wlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + j * 64));
      const __m256i whi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + j * 64 + 32));
      const __m256i alo = _mm256_abs_epi8(wlo), ahi = _mm256_abs_epi8(whi);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        int32_t quad;
        std::memcpy(&quad, xq + r * ldx + g * kGroup + j * 4, 4);
        const __m256i xb = _mm256_set1_epi32(quad);
        const __m256i plo = _mm256_maddubs_epi16(alo, _mm256_sign_epi8(xb, wlo));
        const __m256i phi = _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(xb, whi));
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(plo, ones));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(phi, ones));
      }
    }
    const __m256 slo =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g * kTile)));
    const __m256 shi =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g * kTile + 8)));
    for (int r = 0; r < NR; ++r) {
      const __m256 xsv = _mm256_set1_ps(xs[r * G + g]);
      tot[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][0]), _mm256_mul_ps(slo, xsv),
                                  tot[r][0]);
      tot[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][1]), _mm256_mul_ps(shi, xsv),
                                  tot[r][1]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    _mm256_storeu_ps(out + r * kTile, tot[r][0]);
    _mm256_storeu_ps(out + r * kTile + 8, tot[r][1]);
  }
}

// Q4_1 tiles with vpmaddubsw (codes <= 15 unsigned, |xq| <= 127: a pair sum is <= 3810, a
// block's four lines of low + high pairs <= 30480, so the block sums in int16 and widens once).
// One half tile (8 channels) at a time: both at once would not fit the 16 registers.
template <int NR>
void tile_rows_q4(const int8_t* xq, int64_t ldx, const float* xs, const float* xsum, int64_t G,
                  const uint8_t* q, const at::Half* d, const at::Half* m, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 tot[NR];
    for (int r = 0; r < NR; ++r) tot[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* qg = q + g * kQ4Block + h * 32;
      const int8_t* xg = xq + g * kGroup;
      __m256i acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        if (h == 0)
          _mm_prefetch(reinterpret_cast<const char*>(qg + i * 64 + kPrefetch), _MM_HINT_T0);
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + i * 64));
        const __m256i wl = _mm256_and_si256(w, low);
        const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) {
          int32_t a, b;
          std::memcpy(&a, xg + r * ldx + 4 * i, 4);
          std::memcpy(&b, xg + r * ldx + 16 + 4 * i, 4);
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(wl, _mm256_set1_epi32(a)),
                                             _mm256_maddubs_epi16(wh, _mm256_set1_epi32(b)));
          acc[r] = _mm256_add_epi16(acc[r], p);
        }
      }
      const __m256 dv = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g * kTile + 8 * h)));
      const __m256 mv = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g * kTile + 8 * h)));
      for (int r = 0; r < NR; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r], ones));
        tot[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dv, _mm256_set1_ps(xs[r * G + g])), tot[r]);
        tot[r] = _mm256_fmadd_ps(_mm256_set1_ps(xsum[r * G + g]), mv, tot[r]);
      }
    }
    for (int r = 0; r < NR; ++r) _mm256_storeu_ps(out + r * kTile + 8 * h, tot[r]);
  }
}

// gguf-a16 with vpmaddwd (a pair's two int16 products summed in int32, <= 2 * 15 * 32767), one
// half tile at a time as tile_rows_q4. The same int32 sums and float operations as the VNNI
// build: the builds agree bit for bit.
template <int NR, int U, class S>
void tile_rows_q4_a16(const int16_t* xq, int64_t ldx, const float* xs, const float* xsum,
                      int64_t G, const uint8_t* q, const S* d, const S* m, float* out) {
  const __m256i mask = _mm256_set1_epi32(0x000F000F);
  for (int h = 0; h < 2; ++h) {
    __m256 tot[NR];
    for (int r = 0; r < NR; ++r) tot[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* qg = q + g * kQ4Block + h * 32;
      const int16_t* xg = xq + g * kGroup;
      __m256i acc[U][NR];
      for (int u = 0; u < U; ++u)
        for (int r = 0; r < NR; ++r) acc[u][r] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        if (h == 0)
          _mm_prefetch(reinterpret_cast<const char*>(qg + i * 64 + kPrefetch), _MM_HINT_T0);
        const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + i * 64));
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
          const __m256i w =
              _mm256_and_si256(p == 0 ? line : _mm256_srli_epi32(line, 4 * p), mask);
#pragma GCC unroll 4
          for (int r = 0; r < NR; ++r) {
            int32_t pair;
            std::memcpy(&pair, xg + r * ldx + 8 * i + 2 * p, 4);
            acc[p % U][r] = _mm256_add_epi32(
                acc[p % U][r], _mm256_madd_epi16(w, _mm256_set1_epi32(pair)));
          }
        }
      }
      const __m256 dv = load8(d + g * kTile + 8 * h);
      const __m256 mv = load8(m + g * kTile + 8 * h);
      for (int r = 0; r < NR; ++r) {
        __m256i dot = acc[0][r];
        for (int u = 1; u < U; ++u) dot = _mm256_add_epi32(dot, acc[u][r]);
        tot[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                 _mm256_mul_ps(dv, _mm256_set1_ps(xs[r * G + g])), tot[r]);
        tot[r] = _mm256_fmadd_ps(_mm256_set1_ps(xsum[r * G + g]), mv, tot[r]);
      }
    }
    for (int r = 0; r < NR; ++r) _mm256_storeu_ps(out + r * kTile + 8 * h, tot[r]);
  }
}
// gguf-a16's Q8_0 head with vpmaddwd (|w| <= 127: a pair sum <= 2 * 127 * 32767), one half
// tile at a time; the same int32 sums and float operations as the VNNI build.
template <int NR, int U>
void tile_rows_a16(const int16_t* xq, int64_t ldx, const float* xs, int64_t G, const int8_t* q,
                   const at::Half* s, float* out) {
  for (int h = 0; h < 2; ++h) {
    __m256 tot[NR];
    for (int r = 0; r < NR; ++r) tot[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* qg = q + g * kQuads * 64 + h * 32;
      const int16_t* xg = xq + g * kGroup;
      __m256i acc[U][NR];
      for (int u = 0; u < U; ++u)
        for (int r = 0; r < NR; ++r) acc[u][r] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int j = 0; j < kQuads; ++j) {
        if (h == 0)
          _mm_prefetch(reinterpret_cast<const char*>(qg + j * 64 + kPrefetch), _MM_HINT_T0);
        const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + j * 64));
        const __m256i w[2] = {_mm256_srai_epi16(_mm256_slli_epi16(line, 8), 8),
                              _mm256_srai_epi16(line, 8)};
#pragma GCC unroll 2
        for (int p = 0; p < 2; ++p) {
#pragma GCC unroll 4
          for (int r = 0; r < NR; ++r) {
            int32_t pair;
            std::memcpy(&pair, xg + r * ldx + 4 * j + 2 * p, 4);
            acc[p % U][r] = _mm256_add_epi32(
                acc[p % U][r], _mm256_madd_epi16(w[p], _mm256_set1_epi32(pair)));
          }
        }
      }
      const __m256 sw = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g * kTile + 8 * h)));
      for (int r = 0; r < NR; ++r) {
        __m256i dot = acc[0][r];
        for (int u = 1; u < U; ++u) dot = _mm256_add_epi32(dot, acc[u][r]);
        tot[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                 _mm256_mul_ps(sw, _mm256_set1_ps(xs[r * G + g])), tot[r]);
      }
    }
    for (int r = 0; r < NR; ++r) _mm256_storeu_ps(out + r * kTile + 8 * h, tot[r]);
  }
}

// As the VNNI build's tile_rows_k_a16 with vpmaddwd, one half tile at a time; the same int32
// sums and float operations (the builds agree bit for bit).
template <int NR, bool Min>
void tile_rows_k_a16(const int16_t* xq, int64_t ldx, const float* xs, const float* xsum,
                     int64_t G, const int8_t* q, const float* s, const float* mn, float* out) {
  for (int h = 0; h < 2; ++h) {
    __m256 tot[NR];
    for (int r = 0; r < NR; ++r) tot[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* qg = q + g * kQuads * 64 + h * 32;
      const int16_t* xg = xq + g * kGroup;
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        __m256i acc[2][NR];
        for (int u = 0; u < 2; ++u)
          for (int r = 0; r < NR; ++r) acc[u][r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 4 * half; j < 4 * half + 4; ++j) {
          if (h == 0)
            _mm_prefetch(reinterpret_cast<const char*>(qg + j * 64 + kPrefetch), _MM_HINT_T0);
          const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + j * 64));
          const __m256i w[2] = {_mm256_srai_epi16(_mm256_slli_epi16(line, 8), 8),
                                _mm256_srai_epi16(line, 8)};
#pragma GCC unroll 2
          for (int p = 0; p < 2; ++p) {
#pragma GCC unroll 4
            for (int r = 0; r < NR; ++r) {
              int32_t pair;
              std::memcpy(&pair, xg + r * ldx + 4 * j + 2 * p, 4);
              acc[p][r] = _mm256_add_epi32(acc[p][r],
                                           _mm256_madd_epi16(w[p], _mm256_set1_epi32(pair)));
            }
          }
        }
        const __m256 sw = load8(s + (2 * g + half) * kTile + 8 * h);
        for (int r = 0; r < NR; ++r)
          tot[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(acc[0][r], acc[1][r])),
                                   _mm256_mul_ps(sw, _mm256_set1_ps(xs[r * G + g])), tot[r]);
      }
      if (Min) {
        const __m256 mv = load8(mn + g * kTile + 8 * h);
        for (int r = 0; r < NR; ++r)
          tot[r] = _mm256_fmadd_ps(_mm256_set1_ps(xsum[r * G + g]), mv, tot[r]);
      }
    }
    for (int r = 0; r < NR; ++r) _mm256_storeu_ps(out + r * kTile + 8 * h, tot[r]);
  }
}
#endif

// One row of x (K floats) -> G groups of 32 int8 codes, their scales and 128 * the sum of
// each group's codes (what the VNNI build's weight offset adds; unused by the AVX2 build); the
// padding past K is 0 (its weights are 0 too). Whole groups run in AVX2 (both builds): a scalar
// loop with one nearbyint per input cost ~1 ms of a batch-8 decode step of the default model (90
// calls of 8 rows). The vector path does the scalar path's float operations (max |x|, then
// x * (127 / amax), rounded to nearest even as nearbyint does under the default rounding mode,
// clamped to +-127), so both give the same bytes.
void quantize_group_scalar(const float* x, int64_t n, int8_t* xq, float* xs, int32_t* xc,
                           float* xsum) {
  float amax = 0.f;
  for (int64_t k = 0; k < n; ++k) amax = std::max(amax, std::abs(x[k]));
  *xs = amax / 127.f;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int64_t k = 0; k < kGroup; ++k) {
    const float v = k < n ? std::nearbyint(x[k] * inv) : 0.f;
    const int iv = static_cast<int>(std::min(127.f, std::max(-127.f, v)));
    xq[k] = static_cast<int8_t>(iv);
    sum += iv;
  }
  *xc = kWeightOffset * sum;
  if (xsum != nullptr) *xsum = *xs * static_cast<float>(sum);
}

void quantize_group_avx2(const float* x, int8_t* xq, float* xs, int32_t* xc, float* xsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    mx = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), mx);  // a NaN input is skipped, as std::max
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  *xs = amax / 127.f;
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) {
    // cvtps rounds to nearest even (MXCSR default), as nearbyint does; |x * inv| <= 127 up to
    // rounding, and the clamp keeps the scalar path's bound exactly.
    const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    q[i] = _mm256_min_epi32(hi, _mm256_max_epi32(lo, r));
  }
  const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  *xc = kWeightOffset * _mm_cvtsi128_si32(s4);
  if (xsum != nullptr) *xsum = *xs * static_cast<float>(_mm_cvtsi128_si32(s4));
  // 32 int32 -> 32 bytes; packs work per 128-bit lane, the permute puts them back in order.
  const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
  const __m256i b = _mm256_packs_epi16(w01, w23);
  const __m256i ordered = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq), ordered);
}

// xsum (or nullptr): each group's quantized sum, scale x the sum of its codes (gguf-a8's
// minimum term).
void quantize_row(const float* x, int64_t K, int64_t G, int8_t* xq, float* xs, int32_t* xc,
                  float* xsum) {
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k0 = g * kGroup, n = std::min(K, k0 + kGroup) - k0;
    float* sum = xsum != nullptr ? xsum + g : nullptr;
    if (n == kGroup)
      quantize_group_avx2(x + k0, xq + k0, xs + g, xc + g, sum);
    else
      quantize_group_scalar(x + k0, n, xq + k0, xs + g, xc + g, sum);
  }
}

// The rows of x as the matmuls take them: codes (row stride ldx bytes), scales, the VNNI
// offset's corrections and (if asked) float block sums, in this thread's scratch: three tensor
// allocations a call cost ~3 us, ~0.3 ms of a decode step at 90 calls.
struct Rows {
  const int8_t* xq;
  const float* xs;
  const int32_t* xc;
  const float* xsum;
  int64_t ldx;
};

Rows quantize_rows(const float* xp, int64_t M, int64_t K, int64_t G, bool sums) {
  const int64_t ldx = G * kGroup;
  static thread_local std::vector<int32_t> scratch;
  scratch.resize(static_cast<size_t>(M * (ldx / 4 + 3 * G)));
  int8_t* xq = reinterpret_cast<int8_t*>(scratch.data());
  float* xs = reinterpret_cast<float*>(scratch.data() + M * ldx / 4);
  int32_t* xc = scratch.data() + M * (ldx / 4 + G);
  float* xsum = sums ? reinterpret_cast<float*>(scratch.data() + M * (ldx / 4 + 2 * G)) : nullptr;
  at::parallel_for(0, M, 16, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r)
      quantize_row(xp + r * K, K, G, xq + r * ldx, xs + r * G, xc + r * G,
                   sums ? xsum + r * G : nullptr);
  });
  return {xq, xs, xc, xsum, ldx};
}

// gguf-a16's rows: each group of 32 inputs rounded to int16 (x * (32767 / amax), to nearest even
// as nearbyint), stored in the pair order the tiles read (see the top: input kPairOrder[j] at
// j), with its scale and scale x the sum of its codes. AVX2 in both builds (a Q4_1 input size
// is a multiple of 32: whole groups only).
constexpr int kPairOrder[kGroup] = {0,  2,  16, 18, 1,  3,  17, 19, 4,  6,  20, 22, 5,  7,  21, 23,
                                    8,  10, 24, 26, 9,  11, 25, 27, 12, 14, 28, 30, 13, 15, 29, 31};
// The pair order of w8a8's quads (matmul_a16): (4j, 4j+2), (4j+1, 4j+3) per quad j.
constexpr int kQuadPairOrder[kGroup] = {0,  2,  1,  3,  4,  6,  5,  7,  8,  10, 9,  11, 12, 14, 13, 15,
                                        16, 18, 17, 19, 20, 22, 21, 23, 24, 26, 25, 27, 28, 30, 29, 31};

void quantize_group16(const float* x, const int* order, int16_t* xq, float* xs, float* xsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    mx = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), mx);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  *xs = amax / 32767.f;
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
  const __m256i hi = _mm256_set1_epi32(32767), lo = _mm256_set1_epi32(-32767);
  alignas(32) int32_t codes[kGroup];
  __m256i sum8 = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    const __m256i c = _mm256_min_epi32(hi, _mm256_max_epi32(lo, r));
    sum8 = _mm256_add_epi32(sum8, c);
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes + 8 * i), c);
  }
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  *xsum = *xs * static_cast<float>(_mm_cvtsi128_si32(s4));
  for (int j = 0; j < kGroup; ++j) xq[j] = static_cast<int16_t>(codes[order[j]]);
}

struct Rows16 {
  const int16_t* xq;
  const float* xs;
  const float* xsum;
  int64_t ldx;
};

// As quantize_rows, in int16 (this thread's scratch, its own buffer), each group's codes in
// `order` (kPairOrder or kQuadPairOrder).
Rows16 quantize_rows16(const float* xp, int64_t M, int64_t K, int64_t G, const int* order) {
  const int64_t ldx = G * kGroup;
  static thread_local std::vector<int32_t> scratch;
  scratch.resize(static_cast<size_t>(M * (ldx / 2 + 2 * G)));
  int16_t* xq = reinterpret_cast<int16_t*>(scratch.data());
  float* xs = reinterpret_cast<float*>(scratch.data() + M * ldx / 2);
  float* xsum = reinterpret_cast<float*>(scratch.data() + M * (ldx / 2 + G));
  at::parallel_for(0, M, 16, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r)
      for (int64_t g = 0; g < G; ++g)
        quantize_group16(xp + r * K + g * kGroup, order, xq + r * ldx + g * kGroup,
                         xs + r * G + g, xsum + r * G + g);
  });
  return {xq, xs, xsum, ldx};
}

// f(std::integral_constant<int, NR>) for a block of nr rows (nr <= kRows).
template <class F>
void by_rows(int64_t nr, F f) {
  switch (nr) {
#if defined(__AVX512VNNI__)
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
#endif
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// y float32 [M, N] (+ bias) (+ residual): work items (tile, block of kRows rows) in tile-major
// order over torch's threads; tile(t, r0, nr, out) writes rows r0.. of tile t to out[r * 16].
template <class Tile>
torch::Tensor run_tiles(int64_t M, int64_t N, const float* bp, const float* rp, int64_t ldr,
                        Tile tile) {
  auto y = torch::empty({M, N}, torch::kFloat);
  float* yp = y.data_ptr<float>();
  const int64_t T = ceil_div(N, kTile), row_blocks = ceil_div(M, kRows);
  at::parallel_for(0, T * row_blocks, 1, [&](int64_t a, int64_t b) {
    float out[kRows * kTile];
    for (int64_t item = a; item < b; ++item) {
      const int64_t t = item / row_blocks, r0 = (item % row_blocks) * kRows;
      const int64_t nr = std::min(kRows, M - r0);
      tile(t, r0, nr, out);
      const int64_t n0 = t * kTile, nc = std::min(kTile, N - n0);
      for (int64_t r = 0; r < nr; ++r)
        add_store(out + r * kTile, bp ? bp + n0 : nullptr,
                  rp ? rp + (r0 + r) * ldr + n0 : nullptr, nc, yp + (r0 + r) * N + n0);
    }
  });
  return y;
}

void check_packed(const torch::Tensor& q, const torch::Tensor& s, int64_t K, int64_t N) {
  const int64_t T = ceil_div(N, kTile), G = ceil_div(K, kGroup);
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.is_contiguous() && q.dim() == 4 && q.size(0) == T &&
                  q.size(1) == G * kQuads && q.size(2) == kTile && q.size(3) == 4,
              "q: int8 [T, K/4, 16, 4] matching K, N");
  TORCH_CHECK(s.dtype() == torch::kHalf && s.is_contiguous() && s.dim() == 3 && s.size(0) == T &&
                  s.size(1) == G && s.size(2) == kTile,
              "s: fp16 [T, G, 16] matching K, N");
}

}  // namespace

// x float32 [M, K] -> (xq int8 [M, G*32], xs float32 [M, G]): the activations exactly as the
// matmul quantizes them (without the vnni build's +128), for tests and quality checks.
std::vector<torch::Tensor> quantize_activations(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat, "x: float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = ceil_div(K, kGroup);
  auto xq = torch::empty({M, G * kGroup}, torch::kInt8);
  auto xs = torch::empty({M, G}, torch::kFloat);
  std::vector<int32_t> xc(G);
  for (int64_t r = 0; r < M; ++r)
    quantize_row(x.data_ptr<float>() + r * K, K, G, xq.data_ptr<int8_t>() + r * G * kGroup,
                 xs.data_ptr<float>() + r * G, xc.data(), nullptr);
  return {xq, xs};
}

// x float32 [M, K] -> y float32 [M, N] (+ bias [N]) (+ residual [M, N]). The rows are quantized
// first (spread over torch's threads), then work items (tile, block of kRows rows) in tile-major
// order.
torch::Tensor matmul(torch::Tensor x, torch::Tensor q, torch::Tensor s, int64_t N,
                     c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat, "x: float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = ceil_div(K, kGroup);
  check_packed(q, s, K, N);
  const float* bp = bias_ptr(bias, N);
  int64_t ldr;  // the optional residual added to the output (a layer's `x + proj(h)`)
  const float* rp = residual_ptr(residual, M, N, &ldr);
  const Rows rows = quantize_rows(x.data_ptr<float>(), M, K, G, false);
  const int8_t* qp = q.data_ptr<int8_t>();
  const at::Half* sp = s.data_ptr<at::Half>();
  return run_tiles(M, N, bp, rp, ldr, [&](int64_t t, int64_t r0, int64_t nr, float* out) {
    const int8_t* qt = qp + t * G * kQuads * 64;
    const at::Half* st = sp + t * G * kTile;
    by_rows(nr, [&](auto c) {
      constexpr int NR = decltype(c)::value;
      tile_rows<NR, (NR <= 3 ? 2 : 1)>(rows.xq + r0 * rows.ldx, rows.ldx, rows.xs + r0 * G,
                                        rows.xc + r0 * G, G, qt, st, out);
    });
  });
}

void check_q4_1(const torch::Tensor& q, const torch::Tensor& d, const torch::Tensor& m,
                int64_t K, int64_t N) {
  const int64_t T = ceil_div(N, kTile), G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0, "Q4_1: the input size must be a multiple of 32, got ", K);
  TORCH_CHECK(q.dtype() == torch::kUInt8 && q.is_contiguous() && q.dim() == 5 &&
                  q.size(0) == T && q.size(1) == G && q.size(2) == 4 && q.size(3) == kTile &&
                  q.size(4) == 4,
              "q: uint8 [T, K/32, 4, 16, 4] matching K, N");
  TORCH_CHECK(d.dtype() == m.dtype() && (d.dtype() == torch::kHalf || d.dtype() == torch::kFloat),
              "d, m: both fp16 (Q4_1) or both float32 (Q4_K)");
  for (const auto* t : {&d, &m})
    TORCH_CHECK(t->is_contiguous() && t->dim() == 3 && t->size(0) == T && t->size(1) == G &&
                    t->size(2) == kTile,
                "d, m: [T, K/32, 16] matching K, N");
}

namespace {

// matmul_q4_1 and matmul_q4_1_a16: the checks, then the rows quantized to int8 or (int16) to
// int16, then the tiles.
torch::Tensor q4_1_tiles(torch::Tensor x, const torch::Tensor& q, const torch::Tensor& d,
                         const torch::Tensor& m, int64_t N,
                         const c10::optional<torch::Tensor>& bias,
                         const c10::optional<torch::Tensor>& residual, bool int16) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat, "x: float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  check_q4_1(q, d, m, K, N);
  const float* bp = bias_ptr(bias, N);
  int64_t ldr;
  const float* rp = residual_ptr(residual, M, N, &ldr);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  if (int16) {
    const Rows16 rows = quantize_rows16(x.data_ptr<float>(), M, K, G, kPairOrder);
    auto tiles = [&](auto* dp, auto* mp) {
      return run_tiles(M, N, bp, rp, ldr, [&](int64_t t, int64_t r0, int64_t nr, float* out) {
        by_rows(nr, [&](auto c) {
          constexpr int NR = decltype(c)::value;
          tile_rows_q4_a16<NR, (NR == 1 ? 4 : NR == 2 ? 2 : 1)>(
              rows.xq + r0 * rows.ldx, rows.ldx, rows.xs + r0 * G, rows.xsum + r0 * G, G,
              qp + t * G * kQ4Block, dp + t * G * kTile, mp + t * G * kTile, out);
        });
      });
    };
    if (d.dtype() == torch::kFloat) return tiles(d.data_ptr<float>(), m.data_ptr<float>());
    return tiles(d.data_ptr<at::Half>(), m.data_ptr<at::Half>());
  }
  TORCH_CHECK(d.dtype() == torch::kHalf, "matmul_q4_1 (int8 activations): fp16 d, m only");
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = m.data_ptr<at::Half>();
  const Rows rows = quantize_rows(x.data_ptr<float>(), M, K, G, true);
  return run_tiles(M, N, bp, rp, ldr, [&](int64_t t, int64_t r0, int64_t nr, float* out) {
    by_rows(nr, [&](auto c) {
      tile_rows_q4<decltype(c)::value>(rows.xq + r0 * rows.ldx, rows.ldx, rows.xs + r0 * G,
                                       rows.xsum + r0 * G, G, qp + t * G * kQ4Block,
                                       dp + t * G * kTile, mp + t * G * kTile, out);
    });
  });
}

}  // namespace

// x float32 [M, K] -> y float32 [M, N] (+ bias [N]) (+ residual [M, N]) with GGUF Q4_1 weights
// (layout at the top; K = in_features, a multiple of 32).
torch::Tensor matmul_q4_1(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m,
                          int64_t N, c10::optional<torch::Tensor> bias,
                          c10::optional<torch::Tensor> residual) {
  return q4_1_tiles(x, q, d, m, N, bias, residual, false);
}

// As matmul_q4_1, against int16 activations (gguf-a16, see the top).
torch::Tensor matmul_q4_1_a16(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m,
                              int64_t N, c10::optional<torch::Tensor> bias,
                              c10::optional<torch::Tensor> residual) {
  return q4_1_tiles(x, q, d, m, N, bias, residual, true);
}

// x float32 [M, K] (K a multiple of 32) -> y float32 [M, N] (+ bias) (+ residual) with w8a8's
// packed int8 weights stored without the offset (both builds): int16 activations (see the top).
torch::Tensor matmul_a16(torch::Tensor x, torch::Tensor q, torch::Tensor s, int64_t N,
                         c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat, "x: float32 [M, K]");
  TORCH_CHECK(x.size(1) % kGroup == 0, "matmul_a16: the input size must be a multiple of 32, got ",
              x.size(1));
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  check_packed(q, s, K, N);
  const float* bp = bias_ptr(bias, N);
  int64_t ldr;
  const float* rp = residual_ptr(residual, M, N, &ldr);
  const Rows16 rows = quantize_rows16(x.data_ptr<float>(), M, K, G, kQuadPairOrder);
  const int8_t* qp = q.data_ptr<int8_t>();
  const at::Half* sp = s.data_ptr<at::Half>();
  return run_tiles(M, N, bp, rp, ldr, [&](int64_t t, int64_t r0, int64_t nr, float* out) {
    by_rows(nr, [&](auto c) {
      constexpr int NR = decltype(c)::value;
      tile_rows_a16<NR, (NR <= 2 ? 2 : 1)>(rows.xq + r0 * rows.ldx, rows.ldx, rows.xs + r0 * G,
                                           G, qp + t * G * kQuads * 64, sp + t * G * kTile, out);
    });
  });
}

// x float32 [M, K] (K a multiple of 32) -> y float32 [M, N] (+ bias) (+ residual) with int8
// codes in w8a8's quads (no offset), float32 scales per 16 inputs s [T, K/32, 2, 16] and,
// optionally, float32 minimums per 32 inputs mn [T, K/32, 16]: w = s * code (+ mn). Q6_K,
// Q5_K, Q5_0, Q5_1 and Q4_K exactly as their files hold them (one byte a code), and fused
// projections whose parts mix block formats (a Q4_K_M file's Q4_K q|k with a Q6_K v).
torch::Tensor matmul_k_a16(torch::Tensor x, torch::Tensor q, torch::Tensor s,
                           c10::optional<torch::Tensor> mn, int64_t N,
                           c10::optional<torch::Tensor> bias,
                           c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat, "x: float32 [M, K]");
  TORCH_CHECK(x.size(1) % kGroup == 0,
              "matmul_k_a16: the input size must be a multiple of 32, got ", x.size(1));
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup, T = ceil_div(N, kTile);
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.is_contiguous() && q.dim() == 4 && q.size(0) == T &&
                  q.size(1) == G * kQuads && q.size(2) == kTile && q.size(3) == 4,
              "q: int8 [T, K/4, 16, 4] matching K, N");
  TORCH_CHECK(s.dtype() == torch::kFloat && s.is_contiguous() && s.dim() == 4 &&
                  s.size(0) == T && s.size(1) == G && s.size(2) == 2 && s.size(3) == kTile,
              "s: float32 [T, K/32, 2, 16] matching K, N");
  if (mn.has_value())
    TORCH_CHECK(mn->dtype() == torch::kFloat && mn->is_contiguous() && mn->dim() == 3 &&
                    mn->size(0) == T && mn->size(1) == G && mn->size(2) == kTile,
                "mn: float32 [T, K/32, 16] matching K, N");
  const float* bp = bias_ptr(bias, N);
  int64_t ldr;
  const float* rp = residual_ptr(residual, M, N, &ldr);
  const Rows16 rows = quantize_rows16(x.data_ptr<float>(), M, K, G, kQuadPairOrder);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  const float* mp = mn.has_value() ? mn->data_ptr<float>() : nullptr;
  return run_tiles(M, N, bp, rp, ldr, [&](int64_t t, int64_t r0, int64_t nr, float* out) {
    by_rows(nr, [&](auto c) {
      constexpr int NR = decltype(c)::value;
      const int16_t* xr = rows.xq + r0 * rows.ldx;
      const int8_t* qt = qp + t * G * kQuads * 64;
      const float* st = sp + t * G * 2 * kTile;
      if (mp)
        tile_rows_k_a16<NR, true>(xr, rows.ldx, rows.xs + r0 * G, rows.xsum + r0 * G, G, qt, st,
                                  mp + t * G * kTile, out);
      else
        tile_rows_k_a16<NR, false>(xr, rows.ldx, rows.xs + r0 * G, rows.xsum + r0 * G, G, qt, st,
                                   nullptr, out);
    });
  });
}

// x float32 [M, K] (K a multiple of 32) -> (xq int16 [M, K] in natural input order, xs float32
// [M, G]): gguf-a16's activations, for tests.
std::vector<torch::Tensor> quantize_activations16(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat && x.size(1) % kGroup == 0,
              "x: float32 [M, K], K a multiple of 32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  const Rows16 rows = quantize_rows16(x.data_ptr<float>(), M, K, G, kPairOrder);
  auto xq = torch::empty({M, K}, torch::kShort);
  auto xs = torch::empty({M, G}, torch::kFloat);
  int16_t* qp = xq.data_ptr<int16_t>();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      xs.data_ptr<float>()[r * G + g] = rows.xs[r * G + g];
      for (int j = 0; j < kGroup; ++j)
        qp[r * K + g * kGroup + kPairOrder[j]] = rows.xq[r * rows.ldx + g * kGroup + j];
    }
  return {xq, xs};
}

// Every call lets go of the GIL (call_guard): a worker's heartbeat thread must answer while
// a long prompt step runs these, or the router takes a busy worker for dead (no_heartbeat).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("matmul", &matmul, py::call_guard<py::gil_scoped_release>(),
        "x [M, K] (quantized per 32 inputs) @ packed W [K, N] (+ bias) (+ residual [M, N])",
        py::arg("x"), py::arg("q"), py::arg("s"), py::arg("n"), py::arg("bias") = py::none(),
        py::arg("residual") = py::none());
  m.def("matmul_q4_1", &matmul_q4_1, py::call_guard<py::gil_scoped_release>(),
        "x [M, K] (quantized per 32 inputs) @ GGUF Q4_1 tiles (+ bias) (+ residual [M, N])",
        py::arg("x"), py::arg("q"), py::arg("d"), py::arg("m"), py::arg("n"),
        py::arg("bias") = py::none(), py::arg("residual") = py::none());
  m.def("matmul_q4_1_a16", &matmul_q4_1_a16, py::call_guard<py::gil_scoped_release>(),
        "x [M, K] (int16 per 32 inputs) @ GGUF Q4_1 tiles (+ bias) (+ residual [M, N])",
        py::arg("x"), py::arg("q"), py::arg("d"), py::arg("m"), py::arg("n"),
        py::arg("bias") = py::none(), py::arg("residual") = py::none());
  m.def("matmul_a16", &matmul_a16, py::call_guard<py::gil_scoped_release>(),
        "x [M, K] (int16 per 32 inputs) @ packed int8 W [K, N], no offset (+ bias) (+ residual)",
        py::arg("x"), py::arg("q"), py::arg("s"), py::arg("n"), py::arg("bias") = py::none(),
        py::arg("residual") = py::none());
  m.def("matmul_k_a16", &matmul_k_a16, py::call_guard<py::gil_scoped_release>(),
        "x [M, K] (int16 per 32 inputs) @ int8 codes, float32 scales per 16 (+ minimums per 32)",
        py::arg("x"), py::arg("q"), py::arg("s"), py::arg("mn"), py::arg("n"),
        py::arg("bias") = py::none(), py::arg("residual") = py::none());
  m.def("quantize_activations", &quantize_activations, py::call_guard<py::gil_scoped_release>(), "x [M, K] -> (int8 [M, G*32], scales)");
  m.def("quantize_activations16", &quantize_activations16, py::call_guard<py::gil_scoped_release>(), "x [M, K] -> (int16 [M, K], scales)");
  m.attr("isa") = kIsa;  // which build: "avx2" or "vnni"
  m.attr("rows") = kRows;
  m.attr("weight_offset") = kWeightOffset;  // added to each stored weight code (vnni: 128)
}
