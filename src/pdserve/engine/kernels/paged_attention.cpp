// Paged attention for CPU that reads K and V in place from the block cache (no gather copy).
//
// Every query row r attends to the first limit[r] keys of sequence seq[r], whose token t lives
// at k_cache[table[seq[r], t / BS], t % BS]. Rows are grouped into tiles: up to kMaxTile
// consecutive rows of one sequence (a decode is a tile of one row; a prompt chunk is split into
// tiles), so each key/value row is read once per tile and used by every query of the tile and
// every query head of its KV group (GQA).
// Work items are (tile, split of the key range), every KV head in one item on the fast path
// (one per KV head on the generic one): long contexts split into equal ranges of about
// `split_tokens` (flash-decoding; not with one thread), so batch 1 still spreads over all
// threads; each item runs an online softmax over its range, then a merge combines the splits
// by log-sum-exp.
// float32 queries with head_dim in {8,16,32,64,96,128} over a float32 or float16 cache run
// run_item_f32 (AVX2 intrinsics, see there); other dtypes / head sizes the generic run_item.
// The cache may hold a narrower dtype than q (`--kv-cache-dtype float16|bfloat16`): keys and
// values are widened to float32 as they are loaded, so the arithmetic is float32 either way.
// Built with -mavx2 -mfma -mf16c only (never -march=native): the same code on AVX2-only and
// AVX-512 CPUs (every AVX2 CPU has F16C).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
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

// One item: online softmax of the tile's queries over keys [begin, end) of its sequence.
// acc: [nq, D] unnormalised output, m/l: [nq] running max and sum of exp.
template <typename T, typename C>
void run_item(const Item& it, const T* q, const C* kc, const C* vc, const int32_t* table,
              int64_t table_w, const int32_t* tiles, const int32_t* limit, int64_t q_row,
              int64_t q_head, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale,
              float* acc, float* m, float* l) {
  const int32_t seq = tiles[it.tile * 3], row0 = tiles[it.tile * 3 + 1],
                nrows = tiles[it.tile * 3 + 2];
  const int64_t G = H / KVH, nq = nrows * G;
  std::vector<float> qf(nq * D), s(nq * BS);
  std::vector<int32_t> lim(nq);
  for (int r = 0; r < nrows; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const T* src = q + (row0 + r) * q_row + (it.kvh * G + g) * q_head;
      float* dst = qf.data() + (r * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = to_f(src[d]) * scale;
      lim[r * G + g] = limit[row0 + r];
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
        sj[t] = (t0 + t < lim[j]) ? dot : -std::numeric_limits<float>::infinity();
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


// ---------------------------------------------------------------- float32 fast path (AVX2)
//
// The generic run_item() below does one dot product per (query, key) with a horizontal sum at
// the end of each (a 4-cycle FMA chain of D/8 links, then a reduction), a scalar exp per key and
// the output accumulator in memory: compute-bound at ~4x the time it takes to read the keys and
// values. For float32 with head_dim a multiple of 8 (every model here) run_item_f32 instead
// works a block at a time on groups of up to 3 queries (block_group): each K and V row loaded
// once per group, 4 keys' scores per hadd tree, masking / max / exp (exp8 from common.h: a
// Cephes-style polynomial, within ~2 ulp of std::exp) as vector ops, a branch-free value loop
// with the outputs in registers. Each key/value block is read from memory once per item and reused from
// L1 by the G query heads of its KV group (and the rows of the tile).

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

// Up to kGroupQ queries of one KV head against one block's keys [t0, t0 + n) at kb / vb (rows
// rs floats apart). Queries q (scaled, D floats each, contiguous), their visible-key limits
// lim, running max m, sum l and unnormalised outputs acc (D floats each) are updated in place.
// pk / pv (or nullptr): the same head's first pn rows of a later block, prefetched into L2 a
// row per row used here.
//
// Why this shape (it replaced a loop over one query at a time that ran at ~1/3 of the read
// bandwidth, bound by instructions rather than memory): every K and V row of the block is loaded
// once for all QB queries of the group (the G query heads of a GQA group, the rows of a tile),
// each load feeding QB FMAs; scores come 4 keys at a time out of one hadd tree; masking, max and
// exp are vector ops over the block's score row; the value loop has no branch (a masked key's
// weight is an exact 0).
constexpr int kGroupQ = 3;
constexpr int64_t kAhead = 3;  // prefetch distance in blocks (run_item_f32)

template <int NC, int QB, typename KT>
inline void block_group(const float* q, const int32_t* lim, int64_t t0, int64_t n,
                        const KT* kb, const KT* vb, int64_t rs, float* sbuf, int64_t sbw,
                        float* acc, float* m, float* l, const KT* pk, const KT* pv,
                        int64_t pn) {
  constexpr int64_t D = NC * 8;
  constexpr int64_t kLine = 64 / sizeof(KT);  // cache elements per 64-byte line
  const float ninf = -std::numeric_limits<float>::infinity();
  int64_t nv[QB];
  int64_t nmax = 0;
  for (int i = 0; i < QB; ++i) {
    nv[i] = std::clamp<int64_t>(static_cast<int64_t>(lim[i]) - t0, 0, n);
    nmax = std::max(nmax, nv[i]);
  }
  if (nmax == 0) return;
  // Scores, 4 keys x QB queries per pass: 4 * QB accumulators + the key chunk in registers.
  int64_t t = 0;
  for (; t + 4 <= nmax; t += 4) {
    // The next block's keys, four rows at a time as this block's are used (see run_item_f32).
    if (pk != nullptr) {
      for (int64_t u = t; u < std::min<int64_t>(t + 4, pn); ++u)
        for (int64_t d = 0; d < D; d += kLine)
          _mm_prefetch(reinterpret_cast<const char*>(pk + u * rs + d), _MM_HINT_T1);
    }
    __m256 a[4][QB];
    for (int u = 0; u < 4; ++u)
      for (int i = 0; i < QB; ++i) a[u][i] = _mm256_setzero_ps();
    for (int c = 0; c < NC; ++c) {
      for (int u = 0; u < 4; ++u) {
        const __m256 kv = load8(kb + (t + u) * rs + c * 8);
        for (int i = 0; i < QB; ++i)
          a[u][i] = _mm256_fmadd_ps(kv, _mm256_loadu_ps(q + i * D + c * 8), a[u][i]);
      }
    }
    for (int i = 0; i < QB; ++i)
      _mm_storeu_ps(sbuf + i * sbw + t, hsum4(a[0][i], a[1][i], a[2][i], a[3][i]));
  }
  for (; t < nmax; ++t) {
    for (int i = 0; i < QB; ++i) {
      __m256 r = _mm256_setzero_ps();
      for (int c = 0; c < NC; ++c)
        r = _mm256_fmadd_ps(load8(kb + t * rs + c * 8),
                            _mm256_loadu_ps(q + i * D + c * 8), r);
      sbuf[i * sbw + t] = hsum(r);
    }
  }
  // Online softmax per query over this block: keys past its limit (and the padding to a multiple
  // of 8) score -inf, so exp8 makes their weight exactly 0.
  const int64_t padded = (nmax + 7) / 8 * 8;
  float corr[QB];
  for (int i = 0; i < QB; ++i) {
    float* s = sbuf + i * sbw;
    if (nv[i] == 0) {  // nothing visible to this query here: weights 0, state unchanged
      std::fill(s, s + padded, 0.f);
      corr[i] = 1.f;
      continue;
    }
    for (int64_t x = nv[i]; x < padded; ++x) s[x] = ninf;
    __m256 mxv = _mm256_set1_ps(ninf);
    for (int64_t x = 0; x < padded; x += 8) mxv = _mm256_max_ps(mxv, _mm256_loadu_ps(s + x));
    const float mx = std::max(m[i], hmax(mxv));
    corr[i] = std::exp(m[i] - mx);  // m = -inf on the first block: 0, and acc is 0 anyway
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 lsum = _mm256_setzero_ps();
    for (int64_t x = 0; x < padded; x += 8) {
      const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + x), mv));
      _mm256_storeu_ps(s + x, p);
      lsum = _mm256_add_ps(lsum, p);
    }
    l[i] = l[i] * corr[i] + hsum(lsum);
    m[i] = mx;
  }
  // Values, in chunks of CH registers of the head: QB * CH accumulators + QB weights.
  constexpr int CH = NC < 4 ? NC : 4;
  static_assert(NC % CH == 0, "head_dim / 8 must be a multiple of the chunk");
  for (int c0 = 0; c0 < NC; c0 += CH) {
    __m256 o[QB][CH];
    for (int i = 0; i < QB; ++i) {
      const __m256 cv = _mm256_set1_ps(corr[i]);
      for (int c = 0; c < CH; ++c)
        o[i][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + i * D + (c0 + c) * 8), cv);
    }
    for (int64_t x = 0; x < nmax; ++x) {
      if (pv != nullptr && c0 == 0 && x < pn) {  // the next block's values, a row per key
        for (int64_t d = 0; d < D; d += kLine)
          _mm_prefetch(reinterpret_cast<const char*>(pv + x * rs + d), _MM_HINT_T1);
      }
      const KT* vr = vb + x * rs + c0 * 8;
      __m256 w[QB];
      for (int i = 0; i < QB; ++i) w[i] = _mm256_broadcast_ss(sbuf + i * sbw + x);
      for (int c = 0; c < CH; ++c) {
        const __m256 v = load8(vr + c * 8);
        for (int i = 0; i < QB; ++i) o[i][c] = _mm256_fmadd_ps(w[i], v, o[i][c]);
      }
    }
    for (int i = 0; i < QB; ++i)
      for (int c = 0; c < CH; ++c) _mm256_storeu_ps(acc + i * D + (c0 + c) * 8, o[i][c]);
  }
}

// NC = head_dim / 8 (registers per head vector), KT the cache's element (float or Half).
// run_item()'s contract, for nh KV heads from it.kvh (acc / m / l hold nh x run_item's, head
// major); ahead[0, nahead): this thread's blocks from this item's first on (Span).
template <int NC, typename KT>
void run_item_f32(const Item& it, const float* q, const KT* kc, const KT* vc,
                  const int32_t* table, int64_t table_w, const int32_t* tiles,
                  const int32_t* limit, int64_t q_row, int64_t q_head, int64_t H, int64_t KVH,
                  int64_t BS, float scale, float* acc, float* m, float* l, int64_t nh,
                  const Span* ahead, int64_t nahead) {
  constexpr int64_t D = NC * 8;
  const int32_t seq = tiles[it.tile * 3], row0 = tiles[it.tile * 3 + 1],
                nrows = tiles[it.tile * 3 + 2];
  const int64_t G = H / KVH, nqh = nrows * G, nq = nh * nqh;
  // Scratch: the scaled queries, their limits, kGroupQ rows of one block's scores (each padded
  // to a multiple of 8).
  std::vector<float> qf(nq * D);
  std::vector<int32_t> lim(nq);
  const int64_t sbw = (BS + 7) / 8 * 8;
  std::vector<float> sbuf(kGroupQ * sbw);
  for (int64_t hh = 0; hh < nh; ++hh) {
    for (int r = 0; r < nrows; ++r) {
      for (int64_t g = 0; g < G; ++g) {
        const float* src = q + (row0 + r) * q_row + ((it.kvh + hh) * G + g) * q_head;
        float* dst = qf.data() + (hh * nqh + r * G + g) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
        lim[hh * nqh + r * G + g] = limit[row0 + r];
      }
    }
  }
  std::fill(m, m + nq, -std::numeric_limits<float>::infinity());
  std::fill(l, l + nq, 0.f);
  std::fill(acc, acc + nq * D, 0.f);
  const int32_t* blocks = table + seq * table_w;
  const int64_t rs = KVH * D;  // between consecutive tokens of a block
  int64_t bi = 0;
  for (int64_t t0 = it.begin; t0 < it.end; t0 += BS - (t0 % BS), ++bi) {
    const int64_t t1 = std::min<int64_t>(it.end, t0 - t0 % BS + BS), n = t1 - t0;
    const int64_t base = (static_cast<int64_t>(blocks[t0 / BS]) * BS + t0 % BS) * rs;
    // Blocks sit anywhere in the cache and a head's rows are strided (KVH * D apart), which
    // the hardware prefetcher does not follow across blocks: the rows of the block kAhead
    // blocks on in this thread's order (`ahead`: past this item's end, the next item's first
    // blocks) are fetched while this one is computed (3 measured best of 1-8 on the
    // AMD EPYC: 0.83x the time of 1 ahead with sequential blocks, 0.93x with scattered ones).
    // Into L2 (T1), not L1 (T0): a T0 prefetch holds one of the few L1 miss buffers until its
    // line arrives, which capped this loop at ~9 GB/s on the AMD EPYC Zen 5. And spread over
    // the block's work (block_group issues a row's lines as it uses its own row) rather than
    // all 2 x BS rows at once: a burst of 128 prefetches waits on those buffers before any
    // arithmetic runs (Xeon, one thread, w8a8 engine steps: attention 12.4 -> 10.5 ms at B=1
    // C=2048, 43.7 -> 39.9 ms at B=8 C=1024; float16 cache 8.2 -> 7.1 and 31.7 -> 28.1 ms).
    const KT* pk = nullptr;
    const KT* pv = nullptr;
    int64_t pn = 0;
    if (bi + kAhead < nahead) {
      pk = kc + ahead[bi + kAhead].base;
      pv = vc + ahead[bi + kAhead].base;
      pn = ahead[bi + kAhead].rows;
    }
    for (int64_t hh = 0; hh < nh; ++hh) {
      const int64_t ho = (it.kvh + hh) * D;
      const KT* kb = kc + base + ho;
      const KT* vb = vc + base + ho;
      for (int64_t j0 = 0; j0 < nqh; j0 += kGroupQ) {
        const int64_t j = hh * nqh + j0;
        const float* qj = qf.data() + j * D;
        float* aj = acc + j * D;
        // The head's first group prefetches for the rest.
        const KT* gk = j0 == 0 && pk ? pk + ho : nullptr;
        const KT* gv = j0 == 0 && pv ? pv + ho : nullptr;
        switch (std::min<int64_t>(kGroupQ, nqh - j0)) {
          case 3:
            block_group<NC, 3, KT>(qj, lim.data() + j, t0, n, kb, vb, rs, sbuf.data(), sbw, aj,
                                     m + j, l + j, gk, gv, pn);
            break;
          case 2:
            block_group<NC, 2, KT>(qj, lim.data() + j, t0, n, kb, vb, rs, sbuf.data(), sbw, aj,
                                     m + j, l + j, gk, gv, pn);
            break;
          default:
            block_group<NC, 1, KT>(qj, lim.data() + j, t0, n, kb, vb, rs, sbuf.data(), sbw, aj,
                                     m + j, l + j, gk, gv, pn);
            break;
        }
      }
    }
  }
}

// run_item_f32 for this head_dim, or nullptr (then the generic path runs).
template <typename KT>
using F32Item = void (*)(const Item&, const float*, const KT*, const KT*, const int32_t*,
                         int64_t, const int32_t*, const int32_t*, int64_t, int64_t, int64_t,
                         int64_t, int64_t, float, float*, float*, float*, int64_t,
                         const Span*, int64_t);

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
                          int64_t split_tokens, double scale, torch::Tensor& out) {
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
  // Items: the key range of a tile is [0, max limit of its rows), split in ranges.
  std::vector<Item> items;
  std::vector<int64_t> first_item(ntiles + 1);
  for (int64_t ti = 0; ti < ntiles; ++ti) {
    int32_t hi = 0;
    for (int r = 0; r < tl[ti * 3 + 2]; ++r) hi = std::max(hi, lm[tl[ti * 3 + 1] + r]);
    first_item[ti] = static_cast<int64_t>(items.size());
    // Equal ranges of whole blocks, as many as split_tokens asks, and with a single tile (batch
    // 1) a multiple of the threads: 1025 keys in 512-token ranges (512, 512, 1) left one of two
    // threads idle.
    int64_t nsplit = std::max<int64_t>(1, (hi + split_tokens - 1) / split_tokens);
    const int64_t threads = at::get_num_threads();
    if (ntiles * (KVH / NH) < threads) nsplit = (nsplit + threads - 1) / threads * threads;
    // One thread: one range. Splitting is for spreading a tile over threads; alone it only
    // adds items (setup, a merge). 30 layers of the default model's float16 KV, cold, one
    // thread, AMD EPYC Zen 4: B=1 C=1024 1.85 -> 1.71 ms, C=2048 3.22 -> 3.03 ms (with the
    // first-blocks prefetch below).
    if (threads == 1) nsplit = 1;
    const int64_t len = std::max<int64_t>(BS, ((hi + nsplit - 1) / nsplit + BS - 1) / BS * BS);
    for (int64_t kvh = 0; kvh < KVH; kvh += NH) {
      int split = 0;
      for (int64_t b = 0; b < hi || b == 0; b += len, ++split) {
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
               static_cast<float>(scale), acc.data() + i * per_item * D,
               m.data() + i * per_item, l.data() + i * per_item, NH, spans.data() + f,
               static_cast<int64_t>(spans.size()) - f);
          continue;
        }
      }
      run_item<T, C>(items[i], qp, kp, vp, tb, tw, tl, lm, q.stride(0), q.stride(1), H, KVH, D, BS,
                  static_cast<float>(scale),
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

// q: [N, H, D]; k_cache, v_cache: [num_blocks, BS, KVH, D] (q's dtype, or float16 / bfloat16
// under float32 queries);
// table: [S, W] int32 block tables; tiles: [M, 3] int32 (seq, first row, rows <= 16);
// limit: [N] int32 keys visible to each row. Returns [N, H, D]; rows in no tile are left
// uninitialised (the caller fills them).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor table, torch::Tensor tiles, torch::Tensor limit,
                              int64_t split_tokens, double scale) {
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
                                               split_tokens, scale, out);
    });
  } else if (ct == torch::kHalf) {
    paged_attention_impl<float, at::Half>(q, k_cache, v_cache, table, tiles, limit, split_tokens,
                                          scale, out);
  } else {
    paged_attention_impl<float, at::BFloat16>(q, k_cache, v_cache, table, tiles, limit,
                                              split_tokens, scale, out);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention reading the block cache in place");
  m.def("write_kv", &write_kv, "this step's float32 K and V rows into the cache at their slots");
}
