// Paged attention for CPU that reads K and V in place from the block cache (no gather copy).
//
// Every query row r attends to the first limit[r] keys of sequence seq[r], whose token t lives
// at k_cache[table[seq[r], t / BS], t % BS]; with a sliding window W (> 0) only to the last W
// of them, keys [limit[r] - W, limit[r]). A soft-cap c (> 0) maps each scaled score s to
// c * tanh(s / c) before the softmax (Gemma 2). Rows are grouped into tiles: up to kMaxTile
// consecutive rows of one sequence (a decode is a tile of one row; a prompt chunk is split into
// tiles), so each key/value row is read once per tile and used by every query of the tile and
// every query head of its KV group (GQA).
// Work items are (tile, split of the key range), every KV head in one item on the fast path
// (one per KV head on the generic one): long contexts split into equal ranges of about
// `split_tokens` (flash-decoding; not with one thread), so batch 1 still spreads over all
// threads; each item runs an online softmax over its range, then a merge combines the splits
// by log-sum-exp.
// float32 queries with head_dim in {8,16,32,64,96,128} over a float32 or float16 cache run
// run_item_f32 (AVX2 intrinsics, or AVX-512 ones in that build; see there); other dtypes /
// head sizes the generic run_item.
// The cache may hold a narrower dtype than q (`--kv-cache-dtype float16|bfloat16`): keys and
// values are widened to float32 as they are loaded, so the arithmetic is float32 either way.
// Two builds, never -march=native: -mavx2 -mfma -mf16c (every AVX2 CPU has F16C) and the same
// plus -mavx512f -mavx512bw -mavx512vl, which kernels/__init__.py loads where torch reports
// AVX512.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

constexpr int kMaxTile = 16;

struct Item {
  int tile, kvh, split, begin, end;  // key range [begin, end)
};

// A block an item reads, in the order a thread reads them: where its first row starts (cache
// elements, head 0) and how many rows. An item prefetches kAhead entries on in this list, so
// the first blocks of the thread's next item are on their way while this one ends.
struct Span {
  int64_t base, rows;
};

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// The first key a row with `limit` visible keys sees under a sliding window (<= 0: none).
inline int32_t first_key(int32_t limit, int64_t window) {
  return window > 0 ? static_cast<int32_t>(std::max<int64_t>(0, limit - window)) : 0;
}

// One item: online softmax of the tile's queries over keys [begin, end) of its sequence.
// acc: [nq, D] unnormalised output, m/l: [nq] running max and sum of exp.
template <typename T, typename C>
void run_item(const Item& it, const T* q, const C* kc, const C* vc, const int32_t* table,
              int64_t table_w, const int32_t* tiles, const int32_t* limit, int64_t q_row,
              int64_t q_head, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale,
              int64_t window, float softcap, float* acc, float* m, float* l) {
  const int32_t seq = tiles[it.tile * 3], row0 = tiles[it.tile * 3 + 1],
                nrows = tiles[it.tile * 3 + 2];
  const int64_t G = H / KVH, nq = nrows * G;
  std::vector<float> qf(nq * D), s(nq * BS);
  std::vector<int32_t> lim(nq), lo(nq);
  for (int r = 0; r < nrows; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const T* src = q + (row0 + r) * q_row + (it.kvh * G + g) * q_head;
      float* dst = qf.data() + (r * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = to_f(src[d]) * scale;
      lim[r * G + g] = limit[row0 + r];
      lo[r * G + g] = first_key(limit[row0 + r], window);
    }
  }
  for (int64_t j = 0; j < nq; ++j) {
    m[j] = -std::numeric_limits<float>::infinity();
    l[j] = 0.f;
  }
  std::fill(acc, acc + nq * D, 0.f);
  const int32_t* blocks = table + seq * table_w;
  const int64_t row_stride = KVH * D;  // between consecutive tokens of a block
  for (int64_t t0 = it.begin; t0 < it.end; t0 += BS - (t0 % BS)) {
    const int64_t t1 = std::min<int64_t>(it.end, t0 - t0 % BS + BS), n = t1 - t0;
    const int64_t base = (static_cast<int64_t>(blocks[t0 / BS]) * BS + t0 % BS) * row_stride +
                         it.kvh * D;
    const C* kb = kc + base;
    const C* vb = vc + base;
    for (int64_t j = 0; j < nq; ++j) {
      const float* qj = qf.data() + j * D;
      float* sj = s.data() + j * BS;
      for (int64_t t = 0; t < n; ++t) {
        const C* kr = kb + t * row_stride;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qj[d] * to_f(kr[d]);
        if (softcap > 0.f) dot = softcap * std::tanh(dot / softcap);
        const bool seen = t0 + t < lim[j] && t0 + t >= lo[j];
        sj[t] = seen ? dot : -std::numeric_limits<float>::infinity();
      }
      float mx = m[j];
      for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sj[t]);
      if (mx == -std::numeric_limits<float>::infinity()) continue;  // nothing visible yet
      const float corr = std::exp(m[j] - mx);
      float* aj = acc + j * D;
      float lsum = l[j] * corr;
      for (int64_t d = 0; d < D; ++d) aj[d] *= corr;
      for (int64_t t = 0; t < n; ++t) {
        const float p = std::exp(sj[t] - mx);
        if (p == 0.f) continue;
        lsum += p;
        const C* vr = vb + t * row_stride;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) aj[d] += p * to_f(vr[d]);
      }
      m[j] = mx;
      l[j] = lsum;
    }
  }
}


// ---------------------------------------------------------------- float32 fast path (AVX2 / AVX-512)
//
// The generic run_item() below does one dot product per (query, key) with a horizontal sum at
// the end of each (a 4-cycle FMA chain of D/8 links, then a reduction), a scalar exp per key and
// the output accumulator in memory: compute-bound at ~4x the time it takes to read the keys and
// values. For float32 with head_dim a multiple of 8 (every model here) run_item_f32 instead
// works a span of blocks at a time on groups of up to 3 queries, 6 in the AVX-512 build
// (group_scores, span_softmax, group_values; Vec8 / Vec16 below): each K and V row loaded once
// per group, 4 keys' scores per reduction tree, masking
// / max / exp (exp8 from common.h: a Cephes-style polynomial, within ~2 ulp of std::exp) as
// vector ops, a branch-free value loop with the outputs in registers. Each key/value block is
// read from memory once per item and reused from L1 by the G query heads of its KV group (and
// the rows of the tile).

// 8 cache elements widened to float32: the fast path's only dependence on the cache dtype.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

inline float hmax(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// Four horizontal sums at once: out[i] = sum of the 8 lanes of a_i.
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Why this shape (it replaced a loop over one query at a time that ran at ~1/3 of the read
// bandwidth, bound by instructions rather than memory): every K and V row of a block is loaded
// once for all QB queries of a group (the G query heads of a GQA group, the rows of a tile),
// each load feeding QB FMAs; scores come 4 keys at a time out of one reduction tree; masking,
// max and exp are vector ops over a span's score rows; the value loop has no branch (a masked
// key's weight is an exact 0). Each query's sums run in the same order whatever its group, so a
// row's output does not depend on the rows beside it.
constexpr int64_t kAhead = 3;  // prefetch distance in blocks (run_item_f32)

// The registers group_scores / group_values run on: 8 floats in every build; 16 in the AVX-512
// one, whose 32 registers hold 6 queries' x 4 keys' score accumulators (a 64-float head in 4
// registers), so a group there is up to 6 queries: the 3 query heads of two rows of a tile
// share each K and V row loaded and widened. Why: a decode row is bound by reading the cache,
// but each further row of a tile (the drafts a speculative verify step checks, a short chunk
// over a cached prefix) is arithmetic on rows already in L1: in the AVX2 build an extra row
// cost 0.8-1.2 ms a step at batch 1, 1k context (30 layers, two threads), 13-42% less in the
// AVX-512 one (`pdserve bench spec-crossover --parts --attention-builds avx2,avx512`).
struct Vec8 {
  using T = __m256;
  static constexpr int kWidth = 8, kRegisters = 16, kGroup = 3;
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load(const at::Half* p) { return load8(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static __m128 sum4(T a0, T a1, T a2, T a3) { return hsum4(a0, a1, a2, a3); }
};

#if defined(__AVX512F__)
// The two 8-float halves of v added (AVX512F only: no DQ extract).
inline __m256 fold16(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// Four horizontal sums at once, out[u] = sum of the 16 lanes of a_u: an unpack tree (13
// single-uop ops) rather than four folds into hsum4 (~23 uops, its hadds 3 each), which took
// as many uops as the scores' FMAs.
inline __m128 hsum4_16(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  // Per 128-bit lane: [a0, a1, a0, a1] partial sums, then [a2, a3, a2, a3].
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  // Per 128-bit lane: [a0, a1, a2, a3] partial sums.
  const __m512d p01 = _mm512_castps_pd(s01), p23 = _mm512_castps_pd(s23);
  const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p01, p23)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(p01, p23)));
  const __m256 h = fold16(s);
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

struct Vec16 {
  using T = __m512;
  static constexpr int kWidth = 16, kRegisters = 32, kGroup = 6;
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load(const at::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static __m128 sum4(T a0, T a1, T a2, T a3) { return hsum4_16(a0, a1, a2, a3); }
};

// A head of D = NC * 8 floats runs on 16-float registers where it is a whole number of them.
template <int NC>
using VecFor = std::conditional_t<NC % 2 == 0, Vec16, Vec8>;
#else
template <int NC>
using VecFor = Vec8;
#endif

// Scores of up to V::kGroup queries q (scaled, D = NV * V::kWidth floats each) against keys
// [0, n) of one block at kb (rows rs elements apart) into s (row i of query i at s + i * sbw).
// pk (or nullptr): the same head's first pn rows of a later block, prefetched into L2 a row per
// row used here.
template <typename V, int NV, int QB, typename KT>
inline void group_scores(const float* q, int64_t n, const KT* kb, int64_t rs, float* s,
                         int64_t sbw, const KT* pk, int64_t pn) {
  constexpr int64_t W = V::kWidth, D = NV * W;
  constexpr int64_t kLine = 64 / sizeof(KT);  // cache elements per 64-byte line
  // Keys 4 at a time; the last group repeats key n - 1 in its missing places (their scores
  // are not stored), so every key's sum comes out of the same tree wherever the block's
  // visible keys end: a row scores the same alone as in a tile (the tile reads to its longest
  // row's limit).
  for (int64_t t = 0; t < n; t += 4) {
    if (pk != nullptr) {
      for (int64_t u = t; u < std::min<int64_t>(t + 4, pn); ++u)
        for (int64_t d = 0; d < D; d += kLine)
          _mm_prefetch(reinterpret_cast<const char*>(pk + u * rs + d), _MM_HINT_T1);
    }
    const KT* kr[4];
    for (int u = 0; u < 4; ++u) kr[u] = kb + std::min<int64_t>(t + u, n - 1) * rs;
    // The queries' loads are the same each pass, and the compiler hoists them into registers
    // (QB x NV of them), spilling the accumulators around every FMA: hidden from it here, they
    // stay memory operands of the FMAs (L1 hits).
    const float* qq = q;
    asm("" : "+r"(qq));
    typename V::T a[4][QB];
    for (int u = 0; u < 4; ++u)
      for (int i = 0; i < QB; ++i) a[u][i] = V::zero();
    for (int c = 0; c < NV; ++c) {
      for (int u = 0; u < 4; ++u) {
        const typename V::T kv = V::load(kr[u] + c * W);
        for (int i = 0; i < QB; ++i) a[u][i] = V::fma(kv, V::load(qq + i * D + c * W), a[u][i]);
      }
    }
    for (int i = 0; i < QB; ++i) {
      const __m128 r = V::sum4(a[0][i], a[1][i], a[2][i], a[3][i]);
      if (t + 4 <= n) {
        _mm_storeu_ps(s + i * sbw + t, r);
      } else {
        float tmp[4];
        _mm_storeu_ps(tmp, r);
        std::memcpy(s + i * sbw + t, tmp, (n - t) * sizeof(float));
      }
    }
  }
}

// Online softmax of nq queries over a span's scores (query j's row at s + j * sbw, n keys
// from token s0): keys at or past lim[j] (and the padding to a multiple of 8) score -inf, so
// exp8 makes their weight exactly 0. corr[j]: the factor query j's accumulated output is
// rescaled by. The rescale factors of all queries come out of one vector exp (nq scalar exps
// cost ~10% of the kernel at B=1 C=1024).
inline void span_softmax(float* s, int64_t sbw, const int32_t* lim, const int32_t* lo,
                         float softcap, int64_t s0, int64_t nq, int64_t n, float* m, float* l,
                         float* corr) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t padded = (n + 7) / 8 * 8;
  // Query j sees the span's keys [first(j), last(j)): its window's start to its limit.
  const auto first = [&](int64_t j) {
    return std::clamp<int64_t>(static_cast<int64_t>(lo[j]) - s0, 0, n);
  };
  const auto last = [&](int64_t j) {
    return std::clamp<int64_t>(static_cast<int64_t>(lim[j]) - s0, 0, n);
  };
  const auto visible = [&](int64_t j) { return std::max<int64_t>(0, last(j) - first(j)); };
  // Each query's new running max, held in corr until the rescale factors replace it.
  for (int64_t j = 0; j < nq; ++j) {
    float* sj = s + j * sbw;
    const int64_t nv = visible(j);
    corr[j] = m[j];
    if (nv == 0) continue;  // nothing visible to this query here: weights 0 (below)
    for (int64_t x = 0; x < first(j); ++x) sj[x] = ninf;
    for (int64_t x = last(j); x < padded; ++x) sj[x] = ninf;
    if (softcap > 0.f)  // scalar tanh: soft-capped layers are rare, the cost is in the exps
      for (int64_t x = first(j); x < last(j); ++x) sj[x] = softcap * std::tanh(sj[x] / softcap);
    __m256 mxv = _mm256_set1_ps(ninf);
    for (int64_t x = 0; x < padded; x += 8) mxv = _mm256_max_ps(mxv, _mm256_loadu_ps(sj + x));
    corr[j] = std::max(m[j], hmax(mxv));
  }
  // corr = exp(m - max), then m = max: m = -inf on a query's first visible span gives 0 (acc
  // is 0 anyway); one with nothing visible yet keeps m = -inf, corr 1 (not -inf - -inf, nan).
  for (int64_t j = 0; j < nq; j += 8) {
    float d[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t x = j; x < std::min<int64_t>(nq, j + 8); ++x) {
      d[x - j] = corr[x] == ninf ? 0.f : m[x] - corr[x];
      m[x] = corr[x];
    }
    float e[8];
    _mm256_storeu_ps(e, exp8(_mm256_loadu_ps(d)));
    for (int64_t x = j; x < std::min<int64_t>(nq, j + 8); ++x) corr[x] = e[x - j];
  }
  for (int64_t j = 0; j < nq; ++j) {
    float* sj = s + j * sbw;
    if (visible(j) == 0) {
      std::fill(sj, sj + padded, 0.f);
      corr[j] = 1.f;
      continue;
    }
    const __m256 mv = _mm256_set1_ps(m[j]);
    __m256 lsum = _mm256_setzero_ps();
    for (int64_t x = 0; x < padded; x += 8) {
      const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sj + x), mv));
      _mm256_storeu_ps(sj + x, p);
      lsum = _mm256_add_ps(lsum, p);
    }
    l[j] = l[j] * corr[j] + hsum(lsum);
  }
}

// acc[i] = acc[i] * corr[i] (only when rescale) + sum over keys x < n of w[i * sbw + x] * V
// row x (at vb, rows rs apart), for up to V::kGroup queries; pv / pn: as group_scores' pk / pn.
template <typename V, int NV, int QB, typename KT>
inline void group_values(const float* w, int64_t sbw, const float* corr, bool rescale,
                         int64_t n, const KT* vb, int64_t rs, float* acc, const KT* pv,
                         int64_t pn) {
  constexpr int64_t W = V::kWidth, D = NV * W;
  constexpr int64_t kLine = 64 / sizeof(KT);
  // In chunks of CH registers of the head: QB * CH accumulators, and either the chunk's CH
  // value registers loaded first (where they fit beside them) or QB broadcast weights.
  constexpr int CH = NV <= 4 ? NV : NV % 4 == 0 ? 4 : NV % 3 == 0 ? 3 : 2;
  static_assert(NV % CH == 0, "head_dim / width must be a multiple of the chunk");
  constexpr bool kValuesFirst = QB * CH + CH + 1 <= V::kRegisters;
  for (int c0 = 0; c0 < NV; c0 += CH) {
    typename V::T o[QB][CH];
    for (int i = 0; i < QB; ++i) {
      const typename V::T cv = V::set1(rescale ? corr[i] : 1.f);
      for (int c = 0; c < CH; ++c) o[i][c] = V::mul(V::load(acc + i * D + (c0 + c) * W), cv);
    }
    for (int64_t x = 0; x < n; ++x) {
      if (pv != nullptr && c0 == 0 && x < pn) {  // a later block's values, a row per key
        for (int64_t d = 0; d < D; d += kLine)
          _mm_prefetch(reinterpret_cast<const char*>(pv + x * rs + d), _MM_HINT_T1);
      }
      const KT* vr = vb + x * rs + c0 * W;
      if constexpr (kValuesFirst) {
        typename V::T v[CH];
        for (int c = 0; c < CH; ++c) v[c] = V::load(vr + c * W);
        for (int i = 0; i < QB; ++i) {
          const typename V::T wv = V::set1(w[i * sbw + x]);
          for (int c = 0; c < CH; ++c) o[i][c] = V::fma(wv, v[c], o[i][c]);
        }
      } else {
        typename V::T wv[QB];
        for (int i = 0; i < QB; ++i) wv[i] = V::set1(w[i * sbw + x]);
        for (int c = 0; c < CH; ++c) {
          const typename V::T v = V::load(vr + c * W);
          for (int i = 0; i < QB; ++i) o[i][c] = V::fma(wv[i], v, o[i][c]);
        }
      }
    }
    for (int i = 0; i < QB; ++i)
      for (int c = 0; c < CH; ++c) V::store(acc + i * D + (c0 + c) * W, o[i][c]);
  }
}

// f(std::integral_constant<int, QB>) for a group of qb queries, 1 <= qb <= VecFor<NC>::kGroup.
template <int NC, typename F>
inline void with_width(int64_t qb, F&& f) {
  constexpr int kMax = VecFor<NC>::kGroup;
  switch (qb) {
    case 6: if constexpr (kMax >= 6) { f(std::integral_constant<int, 6>{}); return; } break;
    case 5: if constexpr (kMax >= 5) { f(std::integral_constant<int, 5>{}); return; } break;
    case 4: if constexpr (kMax >= 4) { f(std::integral_constant<int, 4>{}); return; } break;
    case 3: f(std::integral_constant<int, 3>{}); return;
    case 2: f(std::integral_constant<int, 2>{}); return;
    default: break;
  }
  f(std::integral_constant<int, 1>{});
}

// A span: the blocks one softmax pass covers. Scores for all of its keys, one max / rescale /
// sum per query, then the values. A pass per block cost ~9 dependent steps per query each 16
// keys (max, hmax, exp, sum), a quarter of the kernel's time at B=1 C=1024 with the caches
// warm. Kernel alone, 30 layers of the default model's float16 KV, scattered blocks, caches
// cold, one thread, AMD EPYC Zen 4, best of 41 (with the vector rescale in span_softmax):
// B=1 C=1024 1.69 -> 1.62 ms, C=2048 3.16 -> 3.01 ms, B=8 C=128 2.38 -> 2.25 ms, B=32 C=128
// 9.68 -> 9.10 ms; 8 blocks measured the same as 4, 2 between.
constexpr int64_t kSpanBlocks = 4;
constexpr int64_t kSpanScores = 4096;  // cap on a span's score buffer (floats): long tiles

// Every group of up to gq queries (j0 = 0, gq, ... of nqh per head, nh heads) through f.
template <typename F>
inline void for_groups(int64_t nh, int64_t nqh, int64_t gq, F&& f) {
  for (int64_t hh = 0; hh < nh; ++hh)
    for (int64_t j0 = 0; j0 < nqh; j0 += gq)
      f(hh, j0, hh * nqh + j0, std::min<int64_t>(gq, nqh - j0));
}

// NC = head_dim / 8 (registers per head vector), KT the cache's element (float or Half).
// run_item()'s contract, for nh KV heads from it.kvh (acc / m / l hold nh x run_item's, head
// major); ahead[0, nahead): this thread's blocks from this item's first on (Span).
template <int NC, typename KT>
void run_item_f32(const Item& it, const float* q, const KT* kc, const KT* vc,
                  const int32_t* table, int64_t table_w, const int32_t* tiles,
                  const int32_t* limit, int64_t q_row, int64_t q_head, int64_t H, int64_t KVH,
                  int64_t BS, float scale, int64_t window, float softcap, float* acc, float* m,
                  float* l, int64_t nh, const Span* ahead, int64_t nahead) {
  constexpr int64_t D = NC * 8;
  using V = VecFor<NC>;  // the registers this head runs on in this build
  constexpr int NV = D / V::kWidth;
  const int32_t seq = tiles[it.tile * 3], row0 = tiles[it.tile * 3 + 1],
                nrows = tiles[it.tile * 3 + 2];
  const int64_t G = H / KVH, nqh = nrows * G, nq = nh * nqh;
  // Scratch: the scaled queries, their limits, a span's scores (a row per query, padded to a
  // multiple of 8) and each query's rescale factor.
  std::vector<float> qf(nq * D), corr(nq);
  std::vector<int32_t> lim(nq), lo(nq);
  const int64_t span_blocks =
      std::clamp<int64_t>(kSpanScores / (nq * BS), 1, kSpanBlocks);
  const int64_t sbw = (span_blocks * BS + 7) / 8 * 8;
  std::vector<float> sbuf(nq * sbw);
  for (int64_t hh = 0; hh < nh; ++hh) {
    for (int r = 0; r < nrows; ++r) {
      for (int64_t g = 0; g < G; ++g) {
        const float* src = q + (row0 + r) * q_row + ((it.kvh + hh) * G + g) * q_head;
        float* dst = qf.data() + (hh * nqh + r * G + g) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
        lim[hh * nqh + r * G + g] = limit[row0 + r];
        lo[hh * nqh + r * G + g] = first_key(limit[row0 + r], window);
      }
    }
  }
  std::fill(m, m + nq, -std::numeric_limits<float>::infinity());
  std::fill(l, l + nq, 0.f);
  std::fill(acc, acc + nq * D, 0.f);
  const int32_t* blocks = table + seq * table_w;
  const int64_t rs = KVH * D;  // between consecutive tokens of a block
  int64_t bi = 0;
  for (int64_t s0 = it.begin; s0 < it.end;) {
    // The span: up to span_blocks blocks from token s0; keys past every query's limit are
    // not read.
    int64_t base[kSpanBlocks], off[kSpanBlocks + 1], nb = 0, hi = 0;
    off[0] = 0;
    for (int64_t t0 = s0; t0 < it.end && nb < span_blocks; t0 += BS - (t0 % BS), ++nb) {
      const int64_t t1 = std::min<int64_t>(it.end, t0 - t0 % BS + BS);
      base[nb] = (static_cast<int64_t>(blocks[t0 / BS]) * BS + t0 % BS) * rs;
      off[nb + 1] = off[nb] + (t1 - t0);
    }
    for (int64_t j = 0; j < nq; ++j)
      hi = std::max(hi, std::clamp<int64_t>(static_cast<int64_t>(lim[j]) - s0, 0, off[nb]));
    // f(b, n, pf) for each block b of the span with a visible key: n its keys, pf the block
    // kAhead on in this thread's order (or nullptr). Blocks sit anywhere in the cache and a
    // head's rows are strided (KVH * D apart), which the hardware prefetcher does not follow
    // across blocks: each head's rows of pf are fetched into L2 as block b's are used.
    const auto each_block = [&](auto&& f) {
      for (int64_t b = 0; b < nb && off[b] < hi; ++b)
        f(b, std::min(off[b + 1], hi) - off[b],
          bi + b + kAhead < nahead ? &ahead[bi + b + kAhead] : nullptr);
    };
    each_block([&](int64_t b, int64_t n, const Span* pf) {
      for_groups(nh, nqh, V::kGroup, [&](int64_t hh, int64_t j0, int64_t j, int64_t qb) {
        const int64_t ho = (it.kvh + hh) * D;
        const KT* pk = pf && j0 == 0 ? kc + pf->base + ho : nullptr;
        const float* qj = qf.data() + j * D;
        float* sj = sbuf.data() + j * sbw + off[b];
        const KT* kb = kc + base[b] + ho;
        const int64_t pn = pf ? pf->rows : 0;
        with_width<NC>(qb, [&](auto w) {
          group_scores<V, NV, decltype(w)::value, KT>(qj, n, kb, rs, sj, sbw, pk, pn);
        });
      });
    });
    span_softmax(sbuf.data(), sbw, lim.data(), lo.data(), softcap, s0, nq, hi, m, l,
                 corr.data());
    each_block([&](int64_t b, int64_t n, const Span* pf) {
      for_groups(nh, nqh, V::kGroup, [&](int64_t hh, int64_t j0, int64_t j, int64_t qb) {
        const int64_t ho = (it.kvh + hh) * D;
        const KT* pv = pf && j0 == 0 ? vc + pf->base + ho : nullptr;
        const float* wj = sbuf.data() + j * sbw + off[b];
        const float* cj = corr.data() + j;  // applied once a span, on its first block
        float* aj = acc + j * D;
        const KT* vb = vc + base[b] + ho;
        const int64_t pn = pf ? pf->rows : 0;
        with_width<NC>(qb, [&](auto w) {
          group_values<V, NV, decltype(w)::value, KT>(wj, sbw, cj, b == 0, n, vb, rs, aj, pv, pn);
        });
      });
    });
    bi += nb;
    s0 += off[nb];
  }
}

// run_item_f32 for this head_dim, or nullptr (then the generic path runs).
template <typename KT>
using F32Item = void (*)(const Item&, const float*, const KT*, const KT*, const int32_t*,
                         int64_t, const int32_t*, const int32_t*, int64_t, int64_t, int64_t,
                         int64_t, int64_t, float, int64_t, float, float*, float*, float*,
                         int64_t, const Span*, int64_t);

template <typename KT>
F32Item<KT> f32_item_for(int64_t D) {
  switch (D) {
    case 8: return &run_item_f32<1, KT>;
    case 16: return &run_item_f32<2, KT>;
    case 32: return &run_item_f32<4, KT>;
    case 64: return &run_item_f32<8, KT>;
    case 96: return &run_item_f32<12, KT>;
    case 128: return &run_item_f32<16, KT>;
    default: return nullptr;
  }
}

template <typename T, typename C>
void paged_attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache,
                          const torch::Tensor& v_cache, const torch::Tensor& table,
                          const torch::Tensor& tiles, const torch::Tensor& limit,
                          int64_t split_tokens, double scale, int64_t window, double softcap,
                          torch::Tensor& out) {
  const int64_t H = q.size(1), D = q.size(2), BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = H / KVH, ntiles = tiles.size(0);
  const int32_t* tl = tiles.data_ptr<int32_t>();
  const int32_t* lm = limit.data_ptr<int32_t>();
  // float32 queries over a float32 or float16 cache: the fast path.
  constexpr bool kFast =
      std::is_same_v<T, float> && (std::is_same_v<C, float> || std::is_same_v<C, at::Half>);
  F32Item<std::conditional_t<kFast, C, float>> fast = nullptr;
  if constexpr (kFast) fast = f32_item_for<C>(D);
  // KV heads per item: all of them on the fast path, so an item reads each token's K and V rows
  // whole (KVH * D contiguous elements) instead of every KVH-th slice of them, and a step has
  // a third of the items (each with its setup and its cold first blocks). Kernel alone, 30
  // layers of the default model's float16 KV, caches cold, one thread, AMD EPYC Zen 4: with
  // the cross-item prefetch below, B=1 C=2048 4.49 -> 3.50 ms, B=8 C=128 3.99 -> 2.63 ms,
  // B=8 C=1024 19.3 -> 14.3 ms (float32 KV: 7.96 -> 6.23, 5.31 -> 4.28, 32.4 -> 27.1 ms).
  const int64_t NH = fast != nullptr ? KVH : 1;
  // Items: the key range of a tile is [0, max limit of its rows), split in ranges; under a
  // window it starts at the block holding the first key any of its rows sees.
  std::vector<Item> items;
  std::vector<int64_t> first_item(ntiles + 1);
  for (int64_t ti = 0; ti < ntiles; ++ti) {
    int32_t hi = 0, lo = std::numeric_limits<int32_t>::max();
    for (int r = 0; r < tl[ti * 3 + 2]; ++r) {
      hi = std::max(hi, lm[tl[ti * 3 + 1] + r]);
      lo = std::min(lo, first_key(lm[tl[ti * 3 + 1] + r], window));
    }
    lo = lo / BS * BS;
    first_item[ti] = static_cast<int64_t>(items.size());
    // Equal ranges of whole blocks, as many as split_tokens asks, and with a single tile (batch
    // 1) a multiple of the threads: 1025 keys in 512-token ranges (512, 512, 1) left one of two
    // threads idle.
    int64_t nsplit = std::max<int64_t>(1, (hi - lo + split_tokens - 1) / split_tokens);
    const int64_t threads = at::get_num_threads();
    if (ntiles * (KVH / NH) < threads) nsplit = (nsplit + threads - 1) / threads * threads;
    // One thread: one range. Splitting is for spreading a tile over threads; alone it only
    // adds items (setup, a merge). 30 layers of the default model's float16 KV, cold, one
    // thread, AMD EPYC Zen 4: B=1 C=1024 1.85 -> 1.71 ms, C=2048 3.22 -> 3.03 ms (with the
    // first-blocks prefetch below).
    if (threads == 1) nsplit = 1;
    const int64_t len =
        std::max<int64_t>(BS, ((hi - lo + nsplit - 1) / nsplit + BS - 1) / BS * BS);
    for (int64_t kvh = 0; kvh < KVH; kvh += NH) {
      int split = 0;
      for (int64_t b = lo; b < hi || b == lo; b += len, ++split) {
        items.push_back({static_cast<int>(ti), static_cast<int>(kvh), split, static_cast<int>(b),
                         static_cast<int>(std::min<int64_t>(hi, b + len))});
      }
    }
  }
  first_item[ntiles] = static_cast<int64_t>(items.size());
  // Query slots per item: the widest tile's rows x G. Sized to this step's tiles, not to
  // kMaxTile: a decode-only step at 2k context would otherwise allocate (and zero) ~150 KB per
  // call, past malloc's mmap threshold, so page faults on every layer.
  int32_t widest = 1;
  for (int64_t ti = 0; ti < ntiles; ++ti) widest = std::max(widest, tl[ti * 3 + 2]);
  const int64_t per_item = widest * G * NH;
  std::vector<float> acc(items.size() * per_item * D), m(items.size() * per_item),
      l(items.size() * per_item);
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const int32_t* tb = table.data_ptr<int32_t>();
  const int64_t tw = table.size(1);
  const int64_t rs = KVH * D;
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t a, int64_t b) {
    std::vector<Span> spans;  // this thread's blocks, in order (see Span)
    std::vector<int64_t> first_span(b - a);
    for (int64_t i = a; i < b; ++i) {
      first_span[i - a] = static_cast<int64_t>(spans.size());
      const Item& it = items[i];
      const int32_t* blocks = tb + tl[it.tile * 3] * tw;
      for (int64_t t0 = it.begin; t0 < it.end; t0 += BS - (t0 % BS)) {
        const int64_t t1 = std::min<int64_t>(it.end, t0 - t0 % BS + BS);
        spans.push_back({(static_cast<int64_t>(blocks[t0 / BS]) * BS + t0 % BS) * rs, t1 - t0});
      }
    }
    // This thread's first kAhead blocks: nothing prefetched them (the block loop prefetches
    // kAhead blocks on), so they came one demand miss at a time, and every layer's call starts
    // cold (the layer's weights went through the caches since): B=1 C=128 0.52 -> 0.47 ms for
    // 30 layers, B=8 C=128 2.70 -> 2.57 ms (same setting as above).
    const int64_t first = std::min<int64_t>(kAhead, static_cast<int64_t>(spans.size()));
    for (int64_t f = 0; f < first; ++f) {
      for (int64_t e = 0; e < spans[f].rows * rs; e += 64 / static_cast<int64_t>(sizeof(C))) {
        _mm_prefetch(reinterpret_cast<const char*>(kp + spans[f].base + e), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(vp + spans[f].base + e), _MM_HINT_T1);
      }
    }
    for (int64_t i = a; i < b; ++i) {
      if constexpr (kFast) {
        if (fast != nullptr) {
          const int64_t f = first_span[i - a];
          fast(items[i], qp, kp, vp, tb, tw, tl, lm, q.stride(0), q.stride(1), H, KVH, BS,
               static_cast<float>(scale), window, static_cast<float>(softcap),
               acc.data() + i * per_item * D,
               m.data() + i * per_item, l.data() + i * per_item, NH, spans.data() + f,
               static_cast<int64_t>(spans.size()) - f);
          continue;
        }
      }
      run_item<T, C>(items[i], qp, kp, vp, tb, tw, tl, lm, q.stride(0), q.stride(1), H, KVH, D, BS,
                  static_cast<float>(scale), window, static_cast<float>(softcap),
                  acc.data() + i * per_item * D, m.data() + i * per_item,
                  l.data() + i * per_item);
    }
  });
  // Merge the splits of each (tile, kv head) by log-sum-exp and write the rows.
  T* op = out.data_ptr<T>();
  at::parallel_for(0, ntiles, 1, [&](int64_t a, int64_t b) {
    std::vector<float> o(D);
    for (int64_t ti = a; ti < b; ++ti) {
      const int32_t row0 = tl[ti * 3 + 1], nrows = tl[ti * 3 + 2];
      for (int64_t i = first_item[ti]; i < first_item[ti + 1]; ++i) {
        if (items[i].split != 0) continue;
        int64_t last = i + 1;
        while (last < first_item[ti + 1] && items[last].split != 0) ++last;
        for (int64_t j = 0; j < NH * nrows * G; ++j) {
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t x = i; x < last; ++x) mx = std::max(mx, m[x * per_item + j]);
          std::fill(o.begin(), o.end(), 0.f);
          float denom = 0.f;
          for (int64_t x = i; x < last; ++x) {
            const float w = l[x * per_item + j] == 0.f ? 0.f : std::exp(m[x * per_item + j] - mx);
            denom += w * l[x * per_item + j];
            const float* ax = acc.data() + (x * per_item + j) * D;
            for (int64_t d = 0; d < D; ++d) o[d] += w * ax[d];
          }
          const int64_t hh = j / (nrows * G), jj = j % (nrows * G);
          const int64_t r = jj / G, g = jj % G;
          T* dst = op + ((row0 + r) * H + (items[i].kvh + hh) * G + g) * D;
          const float inv = denom > 0.f ? 1.f / denom : 0.f;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d] * inv);
        }
      }
    }
  });
}

}  // namespace

void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor k,
              torch::Tensor v);

// q: [N, H, D]; k_cache, v_cache: [num_blocks, BS, KVH, D] (q's dtype, or float16 / bfloat16
// under float32 queries);
// table: [S, W] int32 block tables; tiles: [M, 3] int32 (seq, first row, rows <= 16);
// limit: [N] int32 keys visible to each row; window: a sliding window (-1: none); softcap: the
// scores' soft-cap (0: none). Returns [N, H, D]; rows in no tile are left
// uninitialised (the caller fills them). With slots, k and v: write_kv(k_cache, v_cache, slots,
// k, v) first (this step's K/V, which the rows attend to), in the same call: one call a layer
// instead of two (~3 us each at decode sizes, ~4% of the attention time at B=1 C=1024).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor table, torch::Tensor tiles, torch::Tensor limit,
                              int64_t split_tokens, double scale,
                              std::optional<torch::Tensor> slots, std::optional<torch::Tensor> k,
                              std::optional<torch::Tensor> v, int64_t window, double softcap) {
  TORCH_CHECK(slots.has_value() == k.has_value() && k.has_value() == v.has_value(),
              "paged_attention: slots, k and v come together");
  if (slots.has_value()) write_kv(k_cache, v_cache, *slots, *k, *v);
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_attention: bad shapes");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: the caches must be contiguous and q's last axis dense");
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  TORCH_CHECK(ct == v_cache.scalar_type(), "paged_attention: K and V caches must share a dtype");
  TORCH_CHECK(qt == ct || (qt == torch::kFloat && (ct == torch::kHalf || ct == torch::kBFloat16)),
              "paged_attention: the caches hold q's dtype, or float16 / bfloat16 under float32 q");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "paged_attention: head_dim / GQA mismatch");
  TORCH_CHECK(table.scalar_type() == torch::kInt32 && tiles.scalar_type() == torch::kInt32 &&
                  limit.scalar_type() == torch::kInt32,
              "paged_attention: table, tiles and limit must be int32");
  TORCH_CHECK(table.is_contiguous() && tiles.is_contiguous() && limit.is_contiguous(),
              "paged_attention: index tensors must be contiguous");
  TORCH_CHECK(tiles.dim() == 2 && tiles.size(1) == 3 && limit.size(0) == q.size(0),
              "paged_attention: tiles must be [M, 3] and limit [N]");
  TORCH_CHECK(split_tokens > 0, "paged_attention: split_tokens must be > 0");
  TORCH_CHECK(window == -1 || window > 0, "paged_attention: window must be -1 (none) or > 0");
  TORCH_CHECK(softcap >= 0.0, "paged_attention: softcap must be 0 (none) or > 0");
  // Bounds, checked once here so the kernel never reads outside the tensors.
  const int64_t cap = table.size(1) * k_cache.size(1);
  const int32_t* tl = tiles.data_ptr<int32_t>();
  const int32_t* lm = limit.data_ptr<int32_t>();
  for (int64_t i = 0; i < q.size(0); ++i)
    TORCH_CHECK(lm[i] >= 0 && lm[i] <= cap, "paged_attention: limit beyond the block table");
  for (int64_t i = 0; i < tiles.size(0); ++i) {
    TORCH_CHECK(tl[i * 3] >= 0 && tl[i * 3] < table.size(0), "paged_attention: bad tile seq");
    TORCH_CHECK(tl[i * 3 + 2] >= 1 && tl[i * 3 + 2] <= kMaxTile && tl[i * 3 + 1] >= 0 &&
                    tl[i * 3 + 1] + tl[i * 3 + 2] <= q.size(0),
                "paged_attention: bad tile rows");
  }
  const int32_t* tb = table.data_ptr<int32_t>();
  for (int64_t i = 0; i < table.numel(); ++i)
    TORCH_CHECK(tb[i] >= 0 && tb[i] < k_cache.size(0), "paged_attention: block id out of range");
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (qt == ct) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qt, "paged_attention", [&] {
      paged_attention_impl<scalar_t, scalar_t>(q, k_cache, v_cache, table, tiles, limit,
                                               split_tokens, scale, window, softcap, out);
    });
  } else if (ct == torch::kHalf) {
    paged_attention_impl<float, at::Half>(q, k_cache, v_cache, table, tiles, limit, split_tokens,
                                          scale, window, softcap, out);
  } else {
    paged_attention_impl<float, at::BFloat16>(q, k_cache, v_cache, table, tiles, limit,
                                              split_tokens, scale, window, softcap, out);
  }
  return out;
}

namespace {

// n floats -> n cache elements (float: a copy; float16: round to nearest even, as torch's
// .to(float16)).
inline void store_row(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
inline void store_row(const float* src, at::Half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = static_cast<at::Half>(src[i]);
}

template <typename C>
void write_kv_impl(torch::Tensor& k_cache, torch::Tensor& v_cache, const int64_t* slots,
                   const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t T = k.size(0), row = k.size(1) * k.size(2), ks = k.stride(0), vs = v.stride(0);
  C* kc = k_cache.data_ptr<C>();
  C* vc = v_cache.data_ptr<C>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    store_row(kp + t * ks, kc + slots[t] * row, row);
    store_row(vp + t * vs, vc + slots[t] * row, row);
  }
}

}  // namespace

// This step's keys and values into the cache: token t's rows k[t], v[t] ([KVH, D] float32,
// rows of k and v may be strided, each row dense) to flat slot slots[t] of k_cache / v_cache
// ([num_blocks, BS, KVH, D], float32 or float16). One call for what torch does in four ops
// (two dtype conversions, two index_copy_), ~10 us a layer at decode sizes.
void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor k,
              torch::Tensor v) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.scalar_type() == torch::kFloat &&
                  v.scalar_type() == torch::kFloat,
              "write_kv: k and v must be float32 [T, KVH, D] of one shape");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 &&
                  v.stride(1) == v.size(2),
              "write_kv: each token's [KVH, D] rows must be dense");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == v_cache.scalar_type() &&
                  k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2),
              "write_kv: the caches must be contiguous [num_blocks, BS, KVH, D] matching k");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.dim() == 1 &&
                  slots.is_contiguous() && slots.size(0) == k.size(0),
              "write_kv: slots must be int64 [T]");
  const int64_t cap = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.size(0); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < cap, "write_kv: slot out of range");
  if (k_cache.scalar_type() == torch::kFloat)
    write_kv_impl<float>(k_cache, v_cache, sp, k, v);
  else if (k_cache.scalar_type() == torch::kHalf)
    write_kv_impl<at::Half>(k_cache, v_cache, sp, k, v);
  else
    TORCH_CHECK(false, "write_kv: the cache must be float32 or float16");
}

// Every call lets go of the GIL (call_guard): a worker's heartbeat thread must answer while
// a long prompt step runs these, or the router takes a busy worker for dead (no_heartbeat).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, py::call_guard<py::gil_scoped_release>(), "paged attention reading the block cache in place",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("table"), py::arg("tiles"),
        py::arg("limit"), py::arg("split_tokens"), py::arg("scale"), py::arg("slots") = py::none(),
        py::arg("k") = py::none(), py::arg("v") = py::none(), py::arg("window") = -1,
        py::arg("softcap") = 0.0);
  m.def("write_kv", &write_kv, py::call_guard<py::gil_scoped_release>(), "this step's float32 K and V rows into the cache at their slots");
}
