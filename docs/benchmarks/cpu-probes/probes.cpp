// Instruction-rate probes behind docs/benchmarks/engine.md's sixteenth-session section: how
// many 256-bit / 512-bit float FMAs, float16 -> float32 conversions and int16 / bf16 dot
// products one core retires per second. Not part of pdserve; compile and run by hand:
//   g++ -O2 probes.cpp -o probes && ./probes        (needs AVX-512 F/VNNI/BF16 for the zmm lines)
// Each loop runs independent accumulators (no dependency chain limits it) on register operands.
#include <chrono>
#include <cstdio>

static double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
#define LOOP(body, clobbers)                                         \
  [&] {                                                              \
    long n = kIters;                                                 \
    auto t0 = std::chrono::steady_clock::now();                      \
    __asm__ volatile("1:\n" body "dec %0\n jnz 1b\n" : "+r"(n)::clobbers); \
    return seconds_since(t0) / kIters;                               \
  }()
#define F10(op, r) op " " r "14," r "15," r "0\n " op " " r "14," r "15," r "1\n " op " " r "14," r "15," r "2\n " \
  op " " r "14," r "15," r "3\n " op " " r "14," r "15," r "4\n " op " " r "14," r "15," r "5\n "                  \
  op " " r "14," r "15," r "6\n " op " " r "14," r "15," r "7\n " op " " r "14," r "15," r "8\n "                  \
  op " " r "14," r "15," r "9\n "
#define CL "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12"

constexpr long kIters = 200000000;

int main() {
  const double ymm = LOOP(F10("vfmadd231ps", "%%ymm"), CL);
  const double zmm = LOOP(F10("vfmadd231ps", "%%zmm"), CL);
  // The attention kernel's score loop per 4 keys x 8 dims: 4 conversions, 12 FMAs (3 queries).
  const double ymm_cvt = LOOP(
      "vcvtph2ps %%xmm13,%%ymm10\n vcvtph2ps %%xmm13,%%ymm11\n vcvtph2ps %%xmm13,%%ymm12\n "
      "vcvtph2ps %%xmm13,%%ymm10\n " F10("vfmadd231ps", "%%ymm")
      "vfmadd231ps %%ymm14,%%ymm15,%%ymm0\n vfmadd231ps %%ymm14,%%ymm15,%%ymm1\n", CL);
  // The same work on 512-bit registers: 2 conversions, 6 FMAs.
  const double zmm_cvt = LOOP(
      "vcvtph2ps %%ymm13,%%zmm10\n vcvtph2ps %%ymm13,%%zmm11\n vfmadd231ps %%zmm14,%%zmm15,%%zmm0\n "
      "vfmadd231ps %%zmm14,%%zmm15,%%zmm1\n vfmadd231ps %%zmm14,%%zmm15,%%zmm2\n "
      "vfmadd231ps %%zmm14,%%zmm15,%%zmm3\n vfmadd231ps %%zmm14,%%zmm15,%%zmm4\n "
      "vfmadd231ps %%zmm14,%%zmm15,%%zmm5\n", CL);
  const double dpwssd = LOOP(F10("vpdpwssd", "%%zmm"), CL);
  const double madd = LOOP(F10("vpmaddwd", "%%ymm"), CL);
  const double bf16 = LOOP(F10("vdpbf16ps", "%%zmm"), CL);
  printf("fp32 FMA, 256-bit: %.2f G/s (%.1f GFLOP-MAC/s)\n", 10 / ymm / 1e9, 80 / ymm / 1e9);
  printf("fp32 FMA, 512-bit: %.2f G/s (%.1f GFLOP-MAC/s)\n", 10 / zmm / 1e9, 160 / zmm / 1e9);
  printf("12 FMA + 4 cvt (256-bit): %.3f ns, FMAs alone %.3f ns\n", ymm_cvt * 1e9, 1.2 * ymm * 1e9);
  printf("6 FMA + 2 cvt (512-bit): %.3f ns, FMAs alone %.3f ns\n", zmm_cvt * 1e9, 0.6 * zmm * 1e9);
  printf("vpdpwssd 512-bit: %.2f G/s (%.1f GMAC/s int16)\n", 10 / dpwssd / 1e9, 320 / dpwssd / 1e9);
  printf("vpmaddwd 256-bit: %.2f G/s (%.1f GMAC/s int16, before the vpaddd)\n", 10 / madd / 1e9, 160 / madd / 1e9);
  printf("vdpbf16ps 512-bit: %.2f G/s (%.1f GMAC/s bf16)\n", 10 / bf16 / 1e9, 320 / bf16 / 1e9);
}
