// Paged attention for CPU that reads K and V in place from the block cache (no gather copy).
//
// Every query row r attends to the first limit[r] keys of sequence seq[r], whose token t lives
// at k_cache[table[seq[r], t / BS], t % BS]. Rows are grouped into tiles: up to kMaxTile
// consecutive rows of one sequence (a decode is a tile of one row; a prompt chunk is split into
// tiles), so each key/value row is read once per tile and used by every query of the tile and
// every query head of its KV group (GQA).
// Work items are (tile, kv head, split of the key range): long contexts split into
// `split_tokens` ranges (flash-decoding), so batch 1 still spreads over all threads; each item
// runs an online softmax over its range, then a merge combines the splits by log-sum-exp.
// float32 with head_dim in {8,16,32,64,96,128} runs run_item_f32 (AVX2 intrinsics, see there);
// other dtypes / head sizes the generic run_item.
// Built with -mavx2 -mfma only (never -march=native): the same code on AVX2-only and AVX-512 CPUs.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int kMaxTile = 16;

struct Item {
  int tile, kvh, split, begin, end;  // key range [begin, end)
};

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// One item: online softmax of the tile's queries over keys [begin, end) of its sequence.
// acc: [nq, D] unnormalised output, m/l: [nq] running max and sum of exp.
template <typename T>
void run_item(const Item& it, const T* q, const T* kc, const T* vc, const int32_t* table,
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
    const T* kb = kc + base;
    const T* vb = vc + base;
    for (int64_t j = 0; j < nq; ++j) {
      const float* qj = qf.data() + j * D;
      float* sj = s.data() + j * BS;
      for (int64_t t = 0; t < n; ++t) {
        const T* kr = kb + t * row_stride;
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
        const T* vr = vb + t * row_stride;
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
// values. For float32 with head_dim a multiple of 8 (every model here) run_item_f32 instead:
//   * scores 8 keys at a time: 8 independent accumulators, one per key, reduced together by one
//     transposing hadd tree into a register of 8 scores;
//   * exp vectorised (exp8 below: a Cephes-style polynomial, within ~2 ulp of std::exp);
//   * per query, the D/8 output registers stay in registers over a block's keys.
// Each key/value block is read from memory once per item and reused from L1 by the G query
// heads of its KV group (and the rows of the tile).

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

// Eight horizontal sums at once: out[i] = sum of the 8 lanes of r[i].
inline __m256 hsum8x8(const __m256* r) {
  const __m256 t0 = _mm256_hadd_ps(r[0], r[1]), t1 = _mm256_hadd_ps(r[2], r[3]);
  const __m256 t2 = _mm256_hadd_ps(r[4], r[5]), t3 = _mm256_hadd_ps(r[6], r[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// NC = head_dim / 8 (registers per head vector). Same contract as run_item().
template <int NC>
void run_item_f32(const Item& it, const float* q, const float* kc, const float* vc,
                  const int32_t* table, int64_t table_w, const int32_t* tiles,
                  const int32_t* limit, int64_t q_row, int64_t q_head, int64_t H, int64_t KVH,
                  int64_t BS, float scale, float* acc, float* m, float* l) {
  constexpr int64_t D = NC * 8;
  const float ninf = -std::numeric_limits<float>::infinity();
  const int32_t seq = tiles[it.tile * 3], row0 = tiles[it.tile * 3 + 1],
                nrows = tiles[it.tile * 3 + 2];
  const int64_t G = H / KVH, nq = nrows * G;
  // Scratch: the scaled queries, their limits, one block's scores padded to a multiple of 8.
  std::vector<float> qf(nq * D);
  std::vector<int32_t> lim(nq);
  std::vector<float> sbuf(((BS + 7) / 8) * 8);
  for (int r = 0; r < nrows; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const float* src = q + (row0 + r) * q_row + (it.kvh * G + g) * q_head;
      float* dst = qf.data() + (r * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
      lim[r * G + g] = limit[row0 + r];
    }
  }
  for (int64_t j = 0; j < nq; ++j) {
    m[j] = ninf;
    l[j] = 0.f;
  }
  std::fill(acc, acc + nq * D, 0.f);
  const int32_t* blocks = table + seq * table_w;
  const int64_t rs = KVH * D;  // between consecutive tokens of a block
  float* sj = sbuf.data();
  for (int64_t t0 = it.begin; t0 < it.end; t0 += BS - (t0 % BS)) {
    const int64_t t1 = std::min<int64_t>(it.end, t0 - t0 % BS + BS), n = t1 - t0;
    const int64_t base = (static_cast<int64_t>(blocks[t0 / BS]) * BS + t0 % BS) * rs +
                         it.kvh * D;
    const float* kb = kc + base;
    const float* vb = vc + base;
    // Blocks sit anywhere in the cache and a head's rows are strided (KVH * D apart), which
    // the hardware prefetcher does not follow across blocks: one thread then waited on memory
    // at ~1/3 of the read bandwidth. Fetch the next block's rows of this head while this one
    // is computed.
    const int64_t next = t1;
    if (next < it.end) {
      const int64_t nb = (static_cast<int64_t>(blocks[next / BS]) * BS + next % BS) * rs +
                         it.kvh * D;
      const int64_t nn = std::min<int64_t>(it.end, next - next % BS + BS) - next;
      for (int64_t t = 0; t < nn; ++t) {
        for (int64_t d = 0; d < D; d += 16) {
          _mm_prefetch(reinterpret_cast<const char*>(kc + nb + t * rs + d), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(vc + nb + t * rs + d), _MM_HINT_T0);
        }
      }
    }
    for (int64_t j = 0; j < nq; ++j) {
      __m256 qv[NC];
      for (int c = 0; c < NC; ++c) qv[c] = _mm256_loadu_ps(qf.data() + j * D + c * 8);
      int64_t t = 0;
      for (; t + 8 <= n; t += 8) {
        __m256 r[8];
        for (int u = 0; u < 8; ++u) {
          const float* kr = kb + (t + u) * rs;
          r[u] = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kr));
          for (int c = 1; c < NC; ++c) r[u] = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(kr + c * 8), r[u]);
        }
        _mm256_storeu_ps(sj + t, hsum8x8(r));
      }
      for (; t < n; ++t) {
        const float* kr = kb + t * rs;
        __m256 r = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kr));
        for (int c = 1; c < NC; ++c) r = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(kr + c * 8), r);
        sj[t] = hsum(r);
      }
      float mx = m[j];
      for (t = 0; t < n; ++t) {
        if (t0 + t >= lim[j]) sj[t] = ninf;
        mx = std::max(mx, sj[t]);
      }
      if (mx == ninf) continue;  // nothing visible yet
      for (t = n; t < static_cast<int64_t>(sbuf.size()); ++t) sj[t] = ninf;
      const float corr = std::exp(m[j] - mx);
      const __m256 mxv = _mm256_set1_ps(mx);
      __m256 lsum = _mm256_setzero_ps();
      for (t = 0; t < n; t += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sj + t), mxv));
        _mm256_storeu_ps(sj + t, p);
        lsum = _mm256_add_ps(lsum, p);
      }
      float* aj = acc + j * D;
      const __m256 cv = _mm256_set1_ps(corr);
      __m256 a[NC];
      for (int c = 0; c < NC; ++c) a[c] = _mm256_mul_ps(_mm256_loadu_ps(aj + c * 8), cv);
      for (t = 0; t < n; ++t) {
        if (sj[t] == 0.f) continue;  // masked (or underflowed) key
        const __m256 p = _mm256_set1_ps(sj[t]);
        const float* vr = vb + t * rs;
        for (int c = 0; c < NC; ++c) a[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + c * 8), a[c]);
      }
      for (int c = 0; c < NC; ++c) _mm256_storeu_ps(aj + c * 8, a[c]);
      m[j] = mx;
      l[j] = l[j] * corr + hsum(lsum);
    }
  }
}

// run_item_f32 for this head_dim, or nullptr (then the generic path runs).
using F32Item = void (*)(const Item&, const float*, const float*, const float*, const int32_t*,
                         int64_t, const int32_t*, const int32_t*, int64_t, int64_t, int64_t,
                         int64_t, int64_t, float, float*, float*, float*);

inline F32Item f32_item_for(int64_t D) {
  switch (D) {
    case 8: return &run_item_f32<1>;
    case 16: return &run_item_f32<2>;
    case 32: return &run_item_f32<4>;
    case 64: return &run_item_f32<8>;
    case 96: return &run_item_f32<12>;
    case 128: return &run_item_f32<16>;
    default: return nullptr;
  }
}

template <typename T>
void paged_attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache,
                          const torch::Tensor& v_cache, const torch::Tensor& table,
                          const torch::Tensor& tiles, const torch::Tensor& limit,
                          int64_t split_tokens, double scale, torch::Tensor& out) {
  const int64_t H = q.size(1), D = q.size(2), BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = H / KVH, ntiles = tiles.size(0);
  const int32_t* tl = tiles.data_ptr<int32_t>();
  const int32_t* lm = limit.data_ptr<int32_t>();
  // Items: the key range of a tile is [0, max limit of its rows), split every split_tokens.
  std::vector<Item> items;
  std::vector<int64_t> first_item(ntiles + 1);
  for (int64_t ti = 0; ti < ntiles; ++ti) {
    int32_t hi = 0;
    for (int r = 0; r < tl[ti * 3 + 2]; ++r) hi = std::max(hi, lm[tl[ti * 3 + 1] + r]);
    first_item[ti] = static_cast<int64_t>(items.size());
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      int split = 0;
      for (int64_t b = 0; b < hi || b == 0; b += split_tokens, ++split) {
        items.push_back({static_cast<int>(ti), static_cast<int>(kvh), split, static_cast<int>(b),
                         static_cast<int>(std::min<int64_t>(hi, b + split_tokens))});
      }
    }
  }
  first_item[ntiles] = static_cast<int64_t>(items.size());
  // Query slots per item: the widest tile's rows x G. Sized to this step's tiles, not to
  // kMaxTile: a decode-only step at 2k context would otherwise allocate (and zero) ~150 KB per
  // call, past malloc's mmap threshold, so page faults on every layer.
  int32_t widest = 1;
  for (int64_t ti = 0; ti < ntiles; ++ti) widest = std::max(widest, tl[ti * 3 + 2]);
  const int64_t per_item = widest * G;
  std::vector<float> acc(items.size() * per_item * D), m(items.size() * per_item),
      l(items.size() * per_item);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tb = table.data_ptr<int32_t>();
  const int64_t tw = table.size(1);
  F32Item fast = nullptr;
  if constexpr (std::is_same_v<T, float>) fast = f32_item_for(D);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      if constexpr (std::is_same_v<T, float>) {
        if (fast != nullptr) {
          fast(items[i], qp, kp, vp, tb, tw, tl, lm, q.stride(0), q.stride(1), H, KVH, BS,
               static_cast<float>(scale), acc.data() + i * per_item * D,
               m.data() + i * per_item, l.data() + i * per_item);
          continue;
        }
      }
      run_item<T>(items[i], qp, kp, vp, tb, tw, tl, lm, q.stride(0), q.stride(1), H, KVH, D, BS,
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
        for (int64_t j = 0; j < nrows * G; ++j) {
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
          const int64_t r = j / G, g = j % G;
          T* dst = op + ((row0 + r) * H + items[i].kvh * G + g) * D;
          const float inv = denom > 0.f ? 1.f / denom : 0.f;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d] * inv);
        }
      }
    }
  });
}

}  // namespace

// q: [N, H, D]; k_cache, v_cache: [num_blocks, BS, KVH, D] (same dtype as q);
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
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_attention: q and the caches must share a dtype");
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    paged_attention_impl<scalar_t>(q, k_cache, v_cache, table, tiles, limit, split_tokens, scale,
                                   out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention reading the block cache in place");
}
