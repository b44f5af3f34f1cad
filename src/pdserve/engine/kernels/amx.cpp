// The prefill format's GEMM on Intel AMX (engine/prefill_format.py): float32 rows times a
// weight packed once into bfloat16 tiles, float32 out, bias and residual added as it stores.
//
// Why not torch's bfloat16 GEMM: it rounds its output to bfloat16, and that rounding (every
// projection's output, so every residual update) cost the most agreement with float32 of the
// prefill path's roundings (docs/benchmarks/prefill.md). Here the tiles accumulate in float32
// and store float32. `hi` alone: one product, inputs and weights rounded to bfloat16. With `lo`
// (bf16x3): x = xh + xl and W = Wh + Wl, each part bfloat16, and x W ~ xh Wh + xl Wh + xh Wl
// (the xl Wl term is below float32's rounding of the sum): three tile products for about
// float32's accuracy (16 mantissa bits of each operand), still on the matrix units.
//
// Tiles: C is 16 x 16 float32; A is 16 rows x 32 bfloat16 of x; B is a weight tile, 16 rows of
// 16 (k, k+1) pairs, "VNNI" order: B[r][n] = (W[2r][n], W[2r + 1][n]). A work item is 32 rows x
// 32 columns (four C tiles, two A, two B: all eight tile registers), looping over K in steps of
// 32. Built with -mamx-tile -mamx-bf16 -mavx512f -mavx512bf16; loaded only where the CPU has
// AMX (kernels.amx_module checks the flags and asks the kernel for permission to use tiles).
#include "common.h"

#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <vector>

namespace {

constexpr int kTileRows = 16;
constexpr int kTileK = 32;  // bfloat16 per A-tile row
constexpr int kBlock = 32;  // rows and columns of a work item
constexpr int64_t kGroup = 8;  // row blocks sharing one pass over a weight block
constexpr int64_t kChunk = 8;  // K steps of a weight chunk kept in L1

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kTileRows;
  }
  _tile_loadconfig(&cfg);
}

// Linux hands a process the AMX tile state only when asked (once per process).
bool request_amx() {
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}

inline __m512 widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// rows [r0, r1) of x (float32, row stride ldx) -> xh (and xl = x - xh) bfloat16 [*, K].
void split_rows(const float* x, int64_t ldx, int64_t r0, int64_t r1, int64_t K, uint16_t* xh,
                uint16_t* xl) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * ldx;
    uint16_t* h = xh + r * K;
    uint16_t* l = xl ? xl + r * K : nullptr;
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = _mm512_loadu_ps(xr + k);
      const __m256i vh = (__m256i)_mm512_cvtneps_pbh(v);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + k), vh);
      if (l) {
        const __m256i vl = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, widen(vh)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(l + k), vl);
      }
    }
  }
}

}  // namespace

bool init() {
  static const bool ok = request_amx();
  return ok;
}

// W float32 [K, N] -> (hi, lo) bfloat16 tiles [N/16][K/32][16][16][2]: hi = W rounded, lo =
// (W - hi) rounded. K and N multiples of 32.
std::vector<torch::Tensor> pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.dtype() == torch::kFloat, "w: float32 [K, N]");
  const int64_t K = w.size(0), N = w.size(1);
  TORCH_CHECK(K % kBlock == 0 && N % kBlock == 0, "K and N must be multiples of 32");
  auto wc = w.contiguous();
  auto hi = torch::empty({N / 16, K / kTileK, kTileRows, 16, 2}, torch::kBFloat16);
  auto lo = torch::empty_like(hi);
  auto* hp = reinterpret_cast<uint16_t*>(hi.data_ptr<at::BFloat16>());
  auto* lp = reinterpret_cast<uint16_t*>(lo.data_ptr<at::BFloat16>());
  const float* src = wc.data_ptr<float>();
  for (int64_t nb = 0; nb < N / 16; ++nb)
    for (int64_t kb = 0; kb < K / kTileK; ++kb)
      for (int r = 0; r < kTileRows; ++r)
        for (int n = 0; n < 16; ++n)
          for (int p = 0; p < 2; ++p) {
            const float v = src[(kb * kTileK + 2 * r + p) * N + nb * 16 + n];
            const int64_t at = (((nb * (K / kTileK) + kb) * kTileRows + r) * 16 + n) * 2 + p;
            const __m512 hv = _mm512_set1_ps(v);
            const __m256i h = (__m256i)_mm512_cvtneps_pbh(hv);
            const uint16_t hb = static_cast<uint16_t>(_mm256_extract_epi16(h, 0));
            const __m256i l = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(hv, widen(h)));
            hp[at] = hb;
            lp[at] = static_cast<uint16_t>(_mm256_extract_epi16(l, 0));
          }
  return {hi, lo};
}

namespace {

// x's bfloat16 parts and the packed weight: what every C block is computed from.
struct Gemm {
  torch::Tensor xh_t, xl_t;  // x rounded, and the rounding of the rest (bf16x3), [Mp, K]
  const uint16_t *xh, *xl, *wh, *wl;
  int64_t M, K, KB, MB;
  bool x3;

  Gemm(const torch::Tensor& x, const torch::Tensor& hi, int64_t N,
       const c10::optional<torch::Tensor>& lo) {
    TORCH_CHECK(init(), "the kernel may not use AMX tiles in this process");
    TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat && x.stride(1) == 1,
                "x: float32 [M, K] with unit column stride");
    M = x.size(0);
    K = x.size(1);
    TORCH_CHECK(hi.dim() == 5 && hi.size(0) * 16 == N && hi.size(1) * kTileK == K,
                "hi: packed for another shape");
    x3 = lo.has_value();
    KB = K / kTileK;
    MB = (M + kBlock - 1) / kBlock;
    xh_t = torch::zeros({MB * kBlock, K}, torch::kBFloat16);
    xl_t = x3 ? torch::zeros({MB * kBlock, K}, torch::kBFloat16) : torch::Tensor();
    auto* h = reinterpret_cast<uint16_t*>(xh_t.data_ptr<at::BFloat16>());
    auto* l = x3 ? reinterpret_cast<uint16_t*>(xl_t.data_ptr<at::BFloat16>()) : nullptr;
    const float* xp = x.data_ptr<float>();
    const int64_t ldx = x.stride(0), k = K;
    at::parallel_for(0, M, 64, [&](int64_t r0, int64_t r1) { split_rows(xp, ldx, r0, r1, k, h, l); });
    xh = h;
    xl = l;
    wh = reinterpret_cast<const uint16_t*>(hi.data_ptr<at::BFloat16>());
    wl = x3 ? reinterpret_cast<const uint16_t*>(lo->data_ptr<at::BFloat16>()) : nullptr;
  }

  // C of column block nb (32 columns) for row blocks [mb0, mb1) into cbuf, K in chunks of
  // kChunk steps: a chunk of the weight block (hi and lo: 32 KB) stays in L1 while the rows of
  // x (in L2) pass under it; the C blocks wait in cbuf between chunks. Tiles configured.
  void block(int64_t nb, int64_t mb0, int64_t mb1, float (*cbuf)[kBlock][kBlock]) const {
    const int64_t lda = K * 2;  // bytes per row of x's bfloat16 copy
    // B tiles of column blocks 2nb and 2nb+1 (16 columns each), K step kb: 512 bf16 apart
    const uint16_t* b0h = wh + (2 * nb) * KB * 512;
    const uint16_t* b1h = wh + (2 * nb + 1) * KB * 512;
    const uint16_t* b0l = x3 ? wl + (2 * nb) * KB * 512 : nullptr;
    const uint16_t* b1l = x3 ? wl + (2 * nb + 1) * KB * 512 : nullptr;
    for (int64_t kc = 0; kc < KB; kc += kChunk) {
      const int64_t kend = std::min(KB, kc + kChunk);
      for (int64_t mb = mb0; mb < mb1; ++mb) {
        float* c = &cbuf[mb - mb0][0][0];
        if (kc == 0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else {
          _tile_loadd(0, c, kBlock * 4);
          _tile_loadd(1, c + 16, kBlock * 4);
          _tile_loadd(2, c + 16 * kBlock, kBlock * 4);
          _tile_loadd(3, c + 16 * kBlock + 16, kBlock * 4);
        }
        const uint16_t* a_h = xh + mb * kBlock * K;
        const uint16_t* a_l = x3 ? xl + mb * kBlock * K : nullptr;
        for (int64_t kb = kc; kb < kend; ++kb) {
          const int64_t ko = kb * kTileK;
          _tile_loadd(4, a_h + ko, lda);
          _tile_loadd(5, a_h + 16 * K + ko, lda);
          _tile_loadd(6, b0h + kb * 512, 64);
          _tile_loadd(7, b1h + kb * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
          if (x3) {
            _tile_loadd(6, b0l + kb * 512, 64);  // xh Wl
            _tile_loadd(7, b1l + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
            _tile_loadd(4, a_l + ko, lda);  // xl Wh
            _tile_loadd(5, a_l + 16 * K + ko, lda);
            _tile_loadd(6, b0h + kb * 512, 64);
            _tile_loadd(7, b1h + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, c, kBlock * 4);
        _tile_stored(1, c + 16, kBlock * 4);
        _tile_stored(2, c + 16 * kBlock, kBlock * 4);
        _tile_stored(3, c + 16 * kBlock + 16, kBlock * 4);
      }
    }
  }

  int64_t rows(int64_t mb) const { return std::min<int64_t>(kBlock, M - mb * kBlock); }
};

}  // namespace

// x [M, K] float32 (unit column stride) @ W (packed hi, and lo for bf16x3) -> float32 [M, N]
// (+ bias [N]) (+ residual [M, N]), as torch's `residual + (x @ W + bias)`.
torch::Tensor matmul(torch::Tensor x, torch::Tensor hi, int64_t N,
                     const c10::optional<torch::Tensor>& lo,
                     const c10::optional<torch::Tensor>& bias,
                     const c10::optional<torch::Tensor>& residual) {
  const Gemm gemm(x, hi, N, lo);
  const int64_t M = gemm.M, NB = N / kBlock;
  int64_t ldr = 0;
  const float* bp = bias_ptr(bias, N);
  const float* rp = residual_ptr(residual, M, N, &ldr);
  auto out = torch::empty({M, N}, torch::kFloat);
  float* op = out.data_ptr<float>();
  // An item is one 32-column block over a group of kGroup row blocks.
  const int64_t groups = (gemm.MB + kGroup - 1) / kGroup;
  at::parallel_for(0, groups * NB, 1, [&](int64_t i0, int64_t i1) {
    configure_tiles();
    alignas(64) float cbuf[kGroup][kBlock][kBlock];
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t g = item / NB, nb = item % NB;
      const int64_t mb0 = g * kGroup, mb1 = std::min(gemm.MB, mb0 + kGroup);
      gemm.block(nb, mb0, mb1, cbuf);
      for (int64_t mb = mb0; mb < mb1; ++mb)
        for (int64_t r = 0; r < gemm.rows(mb); ++r) {
          const int64_t row = mb * kBlock + r, col = nb * kBlock;
          const float* res = rp ? rp + row * ldr + col : nullptr;
          add_store(cbuf[mb - mb0][r], bp ? bp + col : nullptr, res, kBlock, op + row * N + col);
        }
    }
    _tile_release();
  });
  return out;
}

// silu(x @ W[:, :I]) * (x @ W[:, I:]) -> float32 [M, I] for the gate|up weight W [K, 2I]: the
// MLP's activation in the GEMM's store, never writing the [M, 2I] gate|up output (an item
// computes a gate block and its up block, then combines them). I a multiple of 32.
torch::Tensor matmul_silu(torch::Tensor x, torch::Tensor hi, int64_t I,
                          const c10::optional<torch::Tensor>& lo) {
  TORCH_CHECK(I % kBlock == 0, "I must be a multiple of 32");
  const Gemm gemm(x, hi, 2 * I, lo);
  const int64_t M = gemm.M, NB = I / kBlock;
  auto out = torch::empty({M, I}, torch::kFloat);
  float* op = out.data_ptr<float>();
  const int64_t groups = (gemm.MB + kGroup - 1) / kGroup;
  at::parallel_for(0, groups * NB, 1, [&](int64_t i0, int64_t i1) {
    configure_tiles();
    alignas(64) float gate[kGroup][kBlock][kBlock];
    alignas(64) float up[kGroup][kBlock][kBlock];
    const __m256 one = _mm256_set1_ps(1.f), neg = _mm256_set1_ps(-0.f);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t g = item / NB, nb = item % NB;
      const int64_t mb0 = g * kGroup, mb1 = std::min(gemm.MB, mb0 + kGroup);
      gemm.block(nb, mb0, mb1, gate);
      gemm.block(nb + NB, mb0, mb1, up);
      for (int64_t mb = mb0; mb < mb1; ++mb)
        for (int64_t r = 0; r < gemm.rows(mb); ++r) {
          const float* gr = gate[mb - mb0][r];
          const float* ur = up[mb - mb0][r];
          float* o = op + (mb * kBlock + r) * I + nb * kBlock;
          for (int c = 0; c < kBlock; c += 8) {  // as kernels/w8g32.cpp's silu_mul
            const __m256 gv = _mm256_load_ps(gr + c);
            const __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, neg))));
            _mm256_storeu_ps(o + c, _mm256_mul_ps(sv, _mm256_load_ps(ur + c)));
          }
        }
    }
    _tile_release();
  });
  return out;
}

// ---------------------------------------------------------------- causal attention
// A fresh prompt's causal attention on AMX tiles, flash-style (16 queries x 32 keys a block,
// online softmax, no T x T scores anywhere), float32 in and out, head_dim 64. Scores are
// bf16x3 (q and k split as above: three tile products), which agreement with float32 needs,
// or with `split` false one bfloat16 product (the bf16 prefill format: its GEMMs round the
// same way, and the tile work halves); probabilities and values are one bfloat16 product (measured: as float32's agreement,
// docs/benchmarks/prefill.md). Softmax in base 2: log2(e) / sqrt(D) is folded into q, and the
// running maximum is raised only when a row's new maximum exceeds it by more than 8 (2^8 in
// the unnormalised sums is harmless in float32), so the output tiles are rarely rescaled.
namespace {

constexpr int kD = 64;  // head_dim this kernel takes
constexpr int kKeys = 32;  // keys a block (two S tiles)

inline __m512 exp2_16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);  // [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline void split16(__m512 v, uint16_t* h, uint16_t* l) {
  const __m256i vh = (__m256i)_mm512_cvtneps_pbh(v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(h), vh);
  if (l) {
    const __m256i vl = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, widen(vh)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(l), vl);
  }
}

}  // namespace

// q [n, H, 64], k and v [ctx, KVH, 64] (float32, unit stride within a row's heads; the
// queries are the last n of the ctx positions: ctx - n keys of a cached prefix before them)
// -> out [n, H, 64] float32: softmax(q k^T * scale + causal mask) v, query i seeing keys
// 0..ctx - n + i.
torch::Tensor causal_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale,
                               bool split) {
  TORCH_CHECK(init(), "the kernel may not use AMX tiles in this process");
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->dim() == 3 && t->dtype() == torch::kFloat && t->size(2) == kD &&
                    t->stride(2) == 1 && t->stride(1) == kD,
                "q, k, v: float32 [T, heads, 64], heads contiguous within a row");
  const int64_t n = q.size(0), T = k.size(0), H = q.size(1), KVH = k.size(1), off = T - n;
  TORCH_CHECK(off >= 0 && v.size(0) == T && v.size(1) == KVH && H % KVH == 0, "shapes");
  const int64_t G = H / KVH, NK = (T + kKeys - 1) / kKeys;  // key blocks of 32
  // K as B tiles of S = Q K^T: per (kv head, 16-key block, 32-dim chunk) 16 rows of 16 keys'
  // (dim 2r, 2r+1) pairs; hi and lo. V as B tiles of O = P V: per (kv head, 32-key block,
  // 16-dim chunk) 16 rows of 16 dims' (key 2r, 2r+1) pairs. Keys past T are zeros.
  const int64_t ktile = 512;  // bfloat16 in a tile
  auto kh_t = torch::zeros({KVH, NK * 2, 2, ktile}, torch::kBFloat16);
  auto kl_t = split ? torch::zeros_like(kh_t) : torch::empty({0}, torch::kBFloat16);
  auto vp_t = torch::zeros({KVH, NK, 4, ktile}, torch::kBFloat16);
  auto* kh = reinterpret_cast<uint16_t*>(kh_t.data_ptr<at::BFloat16>());
  auto* kl = reinterpret_cast<uint16_t*>(kl_t.data_ptr<at::BFloat16>());
  auto* vp = reinterpret_cast<uint16_t*>(vp_t.data_ptr<at::BFloat16>());
  const float* kp = k.data_ptr<float>();
  const float* vsrc = v.data_ptr<float>();
  const int64_t ldk = k.stride(0), ldv = v.stride(0), ldq = q.stride(0);
  // One item packs a pair of keys (2j, 2j + 1) of one kv head, vectorised: a key's 32-dim
  // chunk converts to 16 bfloat16 (dim 2r, 2r + 1) pairs, one per K tile row r (a scatter
  // with the rows' stride), and a pair's 16 dims interleave into one V tile row (one store).
  // Per-element conversions here cost more than the tile products for a short chunk over a
  // long cached prefix (48 queries over 1848 keys: most of the kernel's time).
  const int64_t TP = (T + 1) / 2;
  const __m512i rows16 = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                             5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  at::parallel_for(0, KVH * TP, 128, [&](int64_t a, int64_t b) {
    for (int64_t it = a; it < b; ++it) {
      const int64_t g = it / TP, j0 = 2 * (it % TP);
      for (int64_t j = j0; j < std::min(T, j0 + 2); ++j) {
        const float* kr = kp + j * ldk + g * kD;
        const int64_t kb16 = j / 16, col = j % 16;
        for (int c = 0; c < 2; ++c) {  // K: tile (kb16, c), row r, col `col`: dims 32c + 2r, +1
          const __m512 x0 = _mm512_loadu_ps(kr + 32 * c), x1 = _mm512_loadu_ps(kr + 32 * c + 16);
          const __m256i h0 = (__m256i)_mm512_cvtneps_pbh(x0), h1 = (__m256i)_mm512_cvtneps_pbh(x1);
          const int64_t at = ((g * NK * 2 + kb16) * 2 + c) * ktile / 2 + col;  // in uint32
          _mm512_i32scatter_epi32(reinterpret_cast<uint32_t*>(kh) + at, rows16,
                                  _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1), 4);
          if (!split) continue;
          const __m256i l0 = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x0, widen(h0)));
          const __m256i l1 = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x1, widen(h1)));
          _mm512_i32scatter_epi32(reinterpret_cast<uint32_t*>(kl) + at, rows16,
                                  _mm512_inserti64x4(_mm512_castsi256_si512(l0), l1, 1), 4);
        }
      }
      const float* v0 = vsrc + j0 * ldv + g * kD;
      const bool pair = j0 + 1 < T;
      const int64_t kb32 = j0 / kKeys, r = (j0 % kKeys) / 2;
      for (int64_t t = 0; t < kD / 16; ++t) {  // V: tile (kb32, t), row r: (key j0, j0 + 1) pairs
        const __m256i e = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(v0 + 16 * t));
        const __m256i o = pair ? (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(v0 + ldv + 16 * t))
                               : _mm256_setzero_si256();
        const __m512i w = _mm512_or_si512(_mm512_cvtepu16_epi32(e),
                                          _mm512_slli_epi32(_mm512_cvtepu16_epi32(o), 16));
        _mm512_storeu_si512(vp + ((g * NK + kb32) * 4 + t) * ktile + r * 32, w);
      }
    }
  });
  auto out = torch::empty({n, H, kD}, torch::kFloat);
  float* op = out.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const float qscale = static_cast<float>(scale) * 1.4426950408889634f;  // log2(e)
  const int64_t NQ = (n + 15) / 16;
  // Items alternate cheap (early) and dear (late) query blocks, so each thread's contiguous
  // share of the list holds about as many keys as another's.
  std::vector<int64_t> order;
  for (int64_t lo = 0, hi = NQ - 1; lo <= hi; ++lo, --hi) {
    order.push_back(lo);
    if (hi != lo) order.push_back(hi);
  }
  at::parallel_for(0, NQ * H, 1, [&](int64_t i0, int64_t i1) {
    configure_tiles();
    alignas(64) uint16_t qh[16 * kD], ql[16 * kD], pb[16 * kKeys];
    alignas(64) float sb[16 * kKeys], ob[16 * kD];
    float m[16], l[16], alpha[16];
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t qb = order[item / H], h = item % H, g = h / G;
      const int64_t q0 = qb * 16, rows = std::min<int64_t>(16, n - q0), p0 = off + q0;
      for (int64_t r = 0; r < 16; ++r) {
        for (int64_t d = 0; d < kD; d += 16) {
          const __m512 x = r < rows ? _mm512_mul_ps(_mm512_loadu_ps(qp + (q0 + r) * ldq + h * kD + d),
                                                    _mm512_set1_ps(qscale))
                                    : _mm512_setzero_ps();
          split16(x, qh + r * kD + d, split ? ql + r * kD + d : nullptr);
        }
        m[r] = -INFINITY;
        l[r] = 0.f;
      }
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      const int64_t last = (p0 + rows - 1) / kKeys;
      const uint16_t* khg = kh + g * NK * 2 * 2 * ktile;
      const uint16_t* klg = split ? kl + g * NK * 2 * 2 * ktile : khg;  // unread unless split
      for (int64_t kb = 0; kb <= last; ++kb) {
        _tile_zero(0);
        _tile_zero(1);
        for (int c = 0; c < 2; ++c) {  // 32-dim chunks
          const uint16_t* k0 = khg + ((2 * kb) * 2 + c) * ktile;
          const uint16_t* k1 = khg + ((2 * kb + 1) * 2 + c) * ktile;
          const uint16_t* k0l = klg + ((2 * kb) * 2 + c) * ktile;
          const uint16_t* k1l = klg + ((2 * kb + 1) * 2 + c) * ktile;
          _tile_loadd(2, qh + c * 32, kD * 2);
          _tile_loadd(3, k0, 64);
          _tile_dpbf16ps(0, 2, 3);
          _tile_loadd(3, k1, 64);
          _tile_dpbf16ps(1, 2, 3);
          if (!split) continue;
          _tile_loadd(2, ql + c * 32, kD * 2);  // ql kh
          _tile_dpbf16ps(1, 2, 3);
          _tile_loadd(3, k0, 64);
          _tile_dpbf16ps(0, 2, 3);
          _tile_loadd(2, qh + c * 32, kD * 2);  // qh kl
          _tile_loadd(3, k0l, 64);
          _tile_dpbf16ps(0, 2, 3);
          _tile_loadd(3, k1l, 64);
          _tile_dpbf16ps(1, 2, 3);
        }
        _tile_stored(0, sb, kKeys * 4);
        _tile_stored(1, sb + 16, kKeys * 4);
        const bool diagonal = kb * kKeys + kKeys - 1 > p0;
        const __m512i kidx0 = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(kb * kKeys)),
                                               _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                                 10, 11, 12, 13, 14, 15));
        const __m512i kidx1 = _mm512_add_epi32(kidx0, _mm512_set1_epi32(16));
        bool rescale = false;
        for (int r = 0; r < 16; ++r) {
          __m512 s0 = _mm512_load_ps(sb + r * kKeys), s1 = _mm512_load_ps(sb + r * kKeys + 16);
          if (diagonal) {
            const __m512i qi = _mm512_set1_epi32(static_cast<int>(p0 + r));
            const __m512 ninf = _mm512_set1_ps(-INFINITY);
            s0 = _mm512_mask_mov_ps(s0, _mm512_cmpgt_epi32_mask(kidx0, qi), ninf);
            s1 = _mm512_mask_mov_ps(s1, _mm512_cmpgt_epi32_mask(kidx1, qi), ninf);
          }
          const float mx = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
          alpha[r] = 1.f;
          if (mx > m[r] + 8.f) {  // raise the running maximum (always on the first block)
            alpha[r] = m[r] == -INFINITY ? 0.f : std::exp2(m[r] - mx);
            l[r] *= alpha[r];
            m[r] = mx;
            rescale = rescale || kb > 0;
          }
          const __m512 mv = _mm512_set1_ps(m[r]);
          const __m512 p0 = exp2_16(_mm512_sub_ps(s0, mv)), p1 = exp2_16(_mm512_sub_ps(s1, mv));
          l[r] += _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
          split16(p0, pb + r * kKeys, nullptr);
          split16(p1, pb + r * kKeys + 16, nullptr);
        }
        if (rescale) {
          _tile_stored(4, ob, kD * 4);
          _tile_stored(5, ob + 16, kD * 4);
          _tile_stored(6, ob + 32, kD * 4);
          _tile_stored(7, ob + 48, kD * 4);
          for (int r = 0; r < 16; ++r)
            for (int d = 0; d < kD; d += 16)
              _mm512_store_ps(ob + r * kD + d,
                              _mm512_mul_ps(_mm512_load_ps(ob + r * kD + d), _mm512_set1_ps(alpha[r])));
          _tile_loadd(4, ob, kD * 4);
          _tile_loadd(5, ob + 16, kD * 4);
          _tile_loadd(6, ob + 32, kD * 4);
          _tile_loadd(7, ob + 48, kD * 4);
        }
        const uint16_t* vt = vp + (g * NK + kb) * 4 * ktile;
        _tile_loadd(2, pb, kKeys * 2);
        _tile_loadd(3, vt, 64);
        _tile_dpbf16ps(4, 2, 3);
        _tile_loadd(3, vt + ktile, 64);
        _tile_dpbf16ps(5, 2, 3);
        _tile_loadd(3, vt + 2 * ktile, 64);
        _tile_dpbf16ps(6, 2, 3);
        _tile_loadd(3, vt + 3 * ktile, 64);
        _tile_dpbf16ps(7, 2, 3);
      }
      _tile_stored(4, ob, kD * 4);
      _tile_stored(5, ob + 16, kD * 4);
      _tile_stored(6, ob + 32, kD * 4);
      _tile_stored(7, ob + 48, kD * 4);
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 inv = _mm512_set1_ps(1.f / l[r]);
        float* o = op + ((q0 + r) * H + h) * kD;
        for (int d = 0; d < kD; d += 16)
          _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_load_ps(ob + r * kD + d), inv));
      }
    }
    _tile_release();
  });
  return out;
}

// Every call lets go of the GIL (call_guard): a worker's heartbeat thread must answer while
// a long prompt step runs these, or the router takes a busy worker for dead (no_heartbeat).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("init", &init, "ask Linux for the AMX tile state; False where it says no");
  m.def("pack", &pack, py::call_guard<py::gil_scoped_release>(), "float32 W [K, N] -> (hi, lo) bfloat16 AMX tiles");
  m.def("matmul", &matmul, py::call_guard<py::gil_scoped_release>(), "float32 x [M, K] @ packed W (hi, lo for bf16x3) (+ bias) (+ residual)",
        py::arg("x"), py::arg("hi"), py::arg("n"), py::arg("lo") = py::none(),
        py::arg("bias") = py::none(), py::arg("residual") = py::none());
  m.def("matmul_silu", &matmul_silu, py::call_guard<py::gil_scoped_release>(), "silu(x @ W[:, :I]) * (x @ W[:, I:]) for gate|up W [K, 2I]",
        py::arg("x"), py::arg("hi"), py::arg("i"), py::arg("lo") = py::none());
  m.def("causal_attention", &causal_attention, py::call_guard<py::gil_scoped_release>(),
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("split") = true,
        "causal softmax(q k^T * scale) v for float32 q [n, H, 64], k, v [ctx, KVH, 64]");
}
