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

namespace {

constexpr int kTileRows = 16;
constexpr int kTileK = 32;  // bfloat16 per A-tile row
constexpr int kBlock = 32;  // rows and columns of a work item
constexpr int64_t kGroup = 8;  // row blocks sharing one pass over a weight block

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

// x [M, K] float32 (unit column stride) @ W (packed hi, and lo for bf16x3) -> float32 [M, N]
// (+ bias [N]) (+ residual [M, N]), as torch's `residual + (x @ W + bias)`.
torch::Tensor matmul(torch::Tensor x, torch::Tensor hi, int64_t N,
                     const c10::optional<torch::Tensor>& lo,
                     const c10::optional<torch::Tensor>& bias,
                     const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(init(), "the kernel may not use AMX tiles in this process");
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat && x.stride(1) == 1,
              "x: float32 [M, K] with unit column stride");
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  TORCH_CHECK(hi.dim() == 5 && hi.size(0) * 16 == N && hi.size(1) * kTileK == K,
              "hi: packed for another shape");
  const bool x3 = lo.has_value();
  int64_t ldr = 0;
  const float* bp = bias_ptr(bias, N);
  const float* rp = residual_ptr(residual, M, N, &ldr);
  const int64_t Mp = (M + kBlock - 1) / kBlock * kBlock;
  auto xh_t = torch::zeros({Mp, K}, torch::kBFloat16);
  auto xl_t = x3 ? torch::zeros({Mp, K}, torch::kBFloat16) : torch::Tensor();
  auto* xh = reinterpret_cast<uint16_t*>(xh_t.data_ptr<at::BFloat16>());
  auto* xl = x3 ? reinterpret_cast<uint16_t*>(xl_t.data_ptr<at::BFloat16>()) : nullptr;
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t r0, int64_t r1) { split_rows(xp, ldx, r0, r1, K, xh, xl); });
  auto out = torch::empty({M, N}, torch::kFloat);
  float* op = out.data_ptr<float>();
  const auto* wh = reinterpret_cast<const uint16_t*>(hi.data_ptr<at::BFloat16>());
  const auto* wl = x3 ? reinterpret_cast<const uint16_t*>(lo->data_ptr<at::BFloat16>()) : nullptr;
  const int64_t KB = K / kTileK, NB = N / kBlock, MB = Mp / kBlock;
  // An item is one 32-column block over a group of kGroup row blocks: the weight block (32
  // columns x K) stays in L1 while the group's rows of x (in L2) pass under it.
  const int64_t groups = (MB + kGroup - 1) / kGroup;
  at::parallel_for(0, groups * NB, 1, [&](int64_t i0, int64_t i1) {
    configure_tiles();
    alignas(64) float c[kBlock][kBlock];
    for (int64_t item = i0; item < i1; ++item) {
     const int64_t g = item / NB, nb = item % NB;
     for (int64_t mb = g * kGroup; mb < std::min(MB, (g + 1) * kGroup); ++mb) {
      const uint16_t* a_h = xh + mb * kBlock * K;
      const uint16_t* a_l = x3 ? xl + mb * kBlock * K : nullptr;
      // B tiles of column blocks 2nb and 2nb+1 (16 columns each), K step kb: 512 bf16 apart
      const uint16_t* b0h = wh + (2 * nb) * KB * 512;
      const uint16_t* b1h = wh + (2 * nb + 1) * KB * 512;
      const uint16_t* b0l = x3 ? wl + (2 * nb) * KB * 512 : nullptr;
      const uint16_t* b1l = x3 ? wl + (2 * nb + 1) * KB * 512 : nullptr;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const int64_t lda = K * 2;  // bytes per row of x's bfloat16 copy
      for (int64_t kb = 0; kb < KB; ++kb) {
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
          _tile_loadd(4, a_l + ko, lda);  // xl Wh
          _tile_loadd(5, a_l + 16 * K + ko, lda);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
          _tile_loadd(4, a_h + ko, lda);  // xh Wl
          _tile_loadd(5, a_h + 16 * K + ko, lda);
          _tile_loadd(6, b0l + kb * 512, 64);
          _tile_loadd(7, b1l + kb * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, &c[0][0], kBlock * 4);
      _tile_stored(1, &c[0][16], kBlock * 4);
      _tile_stored(2, &c[16][0], kBlock * 4);
      _tile_stored(3, &c[16][16], kBlock * 4);
      const int64_t rows = std::min<int64_t>(kBlock, M - mb * kBlock);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = mb * kBlock + r, col = nb * kBlock;
        const float* res = rp ? rp + row * ldr + col : nullptr;
        add_store(c[r], bp ? bp + col : nullptr, res, kBlock, op + row * N + col);
      }
     }
    }
    _tile_release();
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("init", &init, "ask Linux for the AMX tile state; False where it says no");
  m.def("pack", &pack, "float32 W [K, N] -> (hi, lo) bfloat16 AMX tiles");
  m.def("matmul", &matmul, "float32 x [M, K] @ packed W (hi, lo for bf16x3) (+ bias) (+ residual)",
        py::arg("x"), py::arg("hi"), py::arg("n"), py::arg("lo") = py::none(),
        py::arg("bias") = py::none(), py::arg("residual") = py::none());
}
