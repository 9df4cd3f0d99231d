// Paged attention on the CPU for every kind of row a step holds: decode (one new token),
// prefill, a chunk of a prompt over its cached prefix, jump-forward tokens. The queries are
// the step's flattened batch (layers/attention/base.py); K and V are read from the paged
// cache in place, in whatever dtype it holds, and the math is float32.
//
// Batch invariance: a query row's output depends only on its q, its position p and the keys
// it sees, never on how many rows share the call, where its chunk began, or whether a key
// was written this step or long ago. Every row, decode or prefill, goes through the same
// arithmetic in the same order:
//   s_j  = sum over d of (scale * q[d]) * k_j[d]    16 partial sums, partial l over the dims
//                                                   d = l, l + 16, ... in order (one fma
//                                                   each), then one fixed tree across them
//   m    = max of s_j over the keys it sees         (max is exact in any order)
//   e_j  = exp(s_j - m)                             expv: one polynomial, lane by lane
//   sum  = e_j summed in 16 lanes by j % 16, from key 0's group up, then the fixed tree
//   o[d] = (sum over j, in key order, of e_j * v_j[d]) / sum
// The loops around that (tiles of rows, chunks of keys, threads) only choose what runs when.
// The scores have two implementations, with the same operations on each value: a few query
// vectors (decode) take key rows as they are stored and sum across lanes (sums16); many (a
// prefill tile) take 16 keys transposed, one key a lane, and add the partials as vectors in
// sums16's order (scores_by_keys). The file is compiled without -ffast-math and with
// -ffp-contract=off: every fused multiply-add is an explicit fma16, the rest rounds as written.
//
// A layer's options: with a sliding window W > 0 a query at p sees keys p - W < j <= p, and
// only those are read (with an attention chunk C > 0, Llama 4's, keys p / C * C <= j <= p); with a soft cap c > 0 each score s becomes c * tanh(s / c). An fp8
// cache holds K / k_scale and V / v_scale (float8_e4m3fn): read back times the scale. With
// attention sinks (gpt-oss: a learned logit a head) the softmax's denominator has one more
// term, as if a key of score sink[h] and value 0 were seen: m = max(m, sink), sum += exp(sink - m).
// With key_ends (Gemma 3's images, a step's: int32 a query row) the row sees keys up to
// key_ends[row] - 1 in place of p (an image token its whole image; a window still bounds it below).
//
// Work item = (sequence, KV head, tile of up to kTileRows query rows): the query heads that
// share the KV head read each key row once per tile. Rows of the cache:
//     slot(t) = block_tables[b, t / block_size] * block_size + t % block_size
//     k_cache[slot(t) / block_size][slot(t) % block_size][kv_head][:]
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__F16C__) || defined(__FMA__)
#include <immintrin.h>
#endif
// AVX2 without AVX-512: 16 ymm registers of 8 floats, where 16-lane vectors go through the stack
#if !defined(__AVX512F__) && defined(__FMA__)
#define EMBER_YMM_ONLY 1
#endif

#include "convert.h"
#include "pool.h"

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

constexpr int64_t kLanes = 16;
constexpr int64_t kTileRows = 16;   // query rows an item (decode: 1)
constexpr int64_t kKeyChunk = 128;  // keys a pass converts and walks (256, 64 KB of rows, ran ~10 % slower)
constexpr int64_t kAhead = 8;         // cache rows prefetched ahead of use
constexpr int64_t kThreadWork = 4096;  // (key, query head) pairs below which one thread does it all

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }
inline v16 splat(float x) { return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

inline v16 fma16(v16 a, v16 b, v16 c) {  // a * b + c, rounded once
#if defined(__AVX512F__)
  return reinterpret_cast<v16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                reinterpret_cast<__m512>(c)));
#elif defined(__FMA__)
  // AVX2: the halves through memcpy, which GCC keeps in ymm registers; halves taken by
  // __builtin_shufflevector were put together lane by lane through the stack (a prefill's
  // attention ran at 4 GFLOP/s on an AVX2 EPYC, 10 this way; the same fma on each lane)
  __m256 h[6];
  std::memcpy(h, &a, 64);
  std::memcpy(h + 2, &b, 64);
  std::memcpy(h + 4, &c, 64);
  const __m256 r[2] = {_mm256_fmadd_ps(h[0], h[2], h[4]), _mm256_fmadd_ps(h[1], h[3], h[5])};
  v16 out;
  std::memcpy(&out, r, 64);
  return out;
#else
  v16 r;
  for (int i = 0; i < 16; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

// rows[l][col + d], 16 rows of 16 values -> out[d][l], by swapping blocks of 8, 4, 2, 1
inline void transpose16(const float* const* rows, int64_t col, v16 out[16]) {
  v16 x[16];
  for (int i = 0; i < 16; ++i) x[i] = load16(rows[i] + col);
  for (int i = 0; i < 8; ++i) {
    const v16 a = x[i], b = x[i + 8];
    x[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    x[i + 8] = __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 16; i += (i % 8 == 3) ? 5 : 1) {
    const v16 a = x[i], b = x[i + 4];
    x[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    x[i + 4] = __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  for (int i = 0; i < 16; i += (i % 4 == 1) ? 3 : 1) {
    const v16 a = x[i], b = x[i + 2];
    x[i] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    x[i + 2] = __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  for (int i = 0; i < 16; i += 2) {
    const v16 a = x[i], b = x[i + 1];
    x[i] = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    x[i + 1] = __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  }
  for (int i = 0; i < 16; ++i) out[i] = x[i];
}

// lane j: the sum of a[j]'s 16 lanes, each by the same tree (halves, then quarters, ...)
inline v16 sums16(const v16 a[16]) {
  v16 z[8], y[4], x[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: a[i]'s halves added; 8-15: a[i + 8]'s
    z[i] = __builtin_shufflevector(a[i], a[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[i], a[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // 4 lanes each of a[i], a[i + 4], a[i + 8], a[i + 12]
    y[i] = __builtin_shufflevector(z[i], z[i + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(z[i], z[i + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // 2 lanes each of a[i + 2c], a[i + 2 + 2c]... in key order by pairs
    x[i] = __builtin_shufflevector(y[i], y[i + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(y[i], y[i + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return __builtin_shufflevector(x[0], x[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(x[0], x[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// the 16 lanes summed by sums16's tree (its lane 0 for a lone vector)
inline float sum_lanes(v16 a) {
  const v8 h = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  const float p0 = q[0] + q[2], p1 = q[1] + q[3];
  return p0 + p1;
}

// The softmax's vectors: 16 lanes, or on AVX2 8 (a ymm register: 16-lane vectors went lane by
// lane through the stack there, ~19 % of a long prefill); each lane's arithmetic is the same.
#if defined(EMBER_YMM_ONLY)
typedef v8 VS;
typedef int32_t IS __attribute__((vector_size(32)));
inline VS fmav(VS a, VS b, VS c) {
  return reinterpret_cast<VS>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                              reinterpret_cast<__m256>(c)));
}
#else
typedef v16 VS;
typedef i16 IS;
inline VS fmav(VS a, VS b, VS c) { return fma16(a, b, c); }
#endif
constexpr int64_t kSoftmaxLanes = sizeof(VS) / sizeof(float);
inline VS splatv(float x) {
  VS v;
  for (int64_t i = 0; i < kSoftmaxLanes; ++i) v[i] = x;
  return v;
}
inline VS loadv(const float* p) {
  VS v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void storev(float* p, VS v) { std::memcpy(p, &v, sizeof(v)); }
const VS kSoftmaxIota = [] {
  VS v;
  for (int64_t i = 0; i < kSoftmaxLanes; ++i) v[i] = static_cast<float>(i);
  return v;
}();

// e^x lane by lane for x <= 0 (Cephes' expf: x = n ln 2 + r, a degree-6 polynomial in r,
// times 2^n); below -87 (e^x < 2^-125) it is 0
inline VS expv(VS x) {
  const VS xc = x < splatv(-87.f) ? splatv(-87.f) : x;
  const VS t = xc * 1.44269504088896341f + 12582912.f;  // round to nearest: 1.5 * 2^23
  const VS n = t - 12582912.f;
  VS r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  VS p = splatv(1.9875691500e-4f);
  p = fmav(p, r, splatv(1.3981999507e-3f));
  p = fmav(p, r, splatv(8.3334519073e-3f));
  p = fmav(p, r, splatv(4.1665795894e-2f));
  p = fmav(p, r, splatv(1.6666665459e-1f));
  p = fmav(p, r, splatv(5.0000001201e-1f));
  const VS y = fmav(p, r * r, r) + 1.f;
  const IS bits = (__builtin_convertvector(n, IS) + 127) << 23;
  const VS out = y * __builtin_bit_cast(VS, bits);
  return x < splatv(-87.f) ? splatv(0.f) : out;
}

// c * tanh(s / c), from e^(-2|s / c|)
inline VS softcapv(VS s, float cap, float inv_cap) {
  const VS y = s * inv_cap;
  const VS a = y < splatv(0.f) ? -y : y;
  const VS e = expv(a * -2.f);
  const VS th = (1.f - e) / (1.f + e);
  return (y < splatv(0.f) ? -th : th) * cap;
}

// `count` cache rows, `stride` bytes apart, as float32 rows of `padded` values into dst
// (zeros past dim; exact: every conversion is), the next rows prefetched as these convert
template <typename TKV>
void cache_rows(const char* rows, int64_t stride, int64_t count, int64_t dim, int64_t padded, float scale, float* dst) {
  for (int64_t r = 0; r < count; ++r, rows += stride, dst += padded) {
    // rows come from DRAM (the weights stream evicts them): ask for those kAhead on early
    if (r + kAhead < count)
      for (int64_t line = 0; line < dim * static_cast<int64_t>(sizeof(TKV)); line += 64)
        __builtin_prefetch(rows + kAhead * stride + line);
    const TKV* src = reinterpret_cast<const TKV*>(rows);
    int64_t i = 0;
    if constexpr (std::is_same_v<TKV, float>) {
      std::memcpy(dst, src, dim * sizeof(float));
      i = dim;
    } else if constexpr (std::is_same_v<TKV, at::Float8_e4m3fn>) {
      for (; i < dim; ++i) dst[i] = static_cast<float>(src[i]) * scale;
    } else {
#if defined(__F16C__)
      if constexpr (std::is_same_v<TKV, at::Half>) {  // c10's conversion is scalar bit work
        for (; i + 8 <= dim; i += 8)
          _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
      }
#endif
      for (; i < dim; ++i) dst[i] = ember_cpu::load(src[i]);
    }
    for (; i < padded; ++i) dst[i] = 0.f;
  }
}

template <typename T>
void q_row(const void* row, int64_t dim, int64_t padded, float scale, float* dst) {
  const T* q = static_cast<const T*>(row);
  for (int64_t d = 0; d < padded; ++d) dst[d] = d < dim ? ember_cpu::load(q[d]) * scale : 0.f;
}

template <typename T>
void out_row(const float* src, int64_t dim, void* dst) {
  T* o = static_cast<T*>(dst);
  for (int64_t d = 0; d < dim; ++d) o[d] = ember_cpu::store<T>(src[d]);
}

using RowIn = void (*)(const void* row, int64_t dim, int64_t padded, float scale, float* dst);
using RowsIn = void (*)(const char* rows, int64_t stride, int64_t count, int64_t dim, int64_t padded, float scale,
                       float* dst);
using RowOut = void (*)(const float* src, int64_t dim, void* dst);

struct Args {
  const char* q;
  int64_t q_token_stride, q_head_stride;  // bytes
  const char* k;
  const char* v;
  int64_t cache_item;                      // bytes an element of the cache
  bool cache_as_is;                        // float32 rows of `padded` values: read in place
  int64_t block_size, kv_heads, heads, dim;
  const int32_t* tables;
  int64_t max_blocks;
  const int32_t* starts;
  const int32_t* lens;
  float scale, cap, inv_cap, k_scale, v_scale;
  int64_t window;
  int64_t chunk;
  const float* sinks;                      // a logit per query head, or null
  const int32_t* key_ends;                 // a query row's end of keys (exclusive), or null: p + 1
  RowIn load_q;
  RowsIn load_kv;
  RowOut store_out;
  int64_t out_item;                        // bytes an element of the output
  char* out;
};

struct Item {
  int64_t seq, kv_head, row0, row1;  // rows [row0, row1) of the sequence's new tokens
};

constexpr int64_t kByKeys = 6;  // query vectors from which the scores take keys transposed

// one query vector's scores against `count` key rows (a multiple of 16): 16 at a time, each
// key's 16 lanes of partial sums added by sums16's tree
template <int NC>
__attribute__((noinline)) void scores_by_rows(const float* q, const float* const* keys, int64_t count, float* out) {
  v16 qv[NC];
  for (int c = 0; c < NC; ++c) qv[c] = load16(q + c * kLanes);
  for (int64_t j0 = 0; j0 < count; j0 += kLanes, out += kLanes) {
    v16 part[16];
    for (int l = 0; l < 16; ++l) {
      const float* kr = keys[j0 + l];
      v16 s = qv[0] * load16(kr);
      for (int c = 1; c < NC; ++c) s = fma16(qv[c], load16(kr + c * kLanes), s);
      part[l] = s;
    }
    store16(out, sums16(part));
  }
}

// every query vector's scores against `count` key rows, 16 keys transposed at a time so that
// a lane is a key: partial l (dims l, l + 16, ...) is a vector over the keys, and the 16
// partials are added as sums16 adds a key's lanes. Vector v's scores go to out + v * stride.
template <int NC>
__attribute__((noinline)) void scores_by_keys(const float* q, int64_t vectors, const float* const* keys, int64_t count,
                                              float* out, int64_t stride) {
  constexpr int64_t padded = NC * kLanes;
  constexpr int64_t kVB = 4;  // query vectors a pass
  v16 kt[padded];             // kt[d]: dim d of the 16 keys
  for (int64_t j0 = 0; j0 < count; j0 += kLanes) {
    for (int c = 0; c < NC; ++c) transpose16(keys + j0, c * kLanes, kt + c * kLanes);
    for (int64_t v0 = 0; v0 < vectors; v0 += kVB) {
      const int64_t n = std::min(kVB, vectors - v0);
      const float* qv[kVB];
      for (int64_t b = 0; b < kVB; ++b) qv[b] = q + (v0 + std::min(b, n - 1)) * padded;
      auto partial = [&](int l, v16 out_[kVB]) __attribute__((always_inline)) {  // dims l, l + 16, ... in order
        for (int64_t b = 0; b < kVB; ++b) out_[b] = splat(qv[b][l]) * kt[l];
        for (int c = 1; c < NC; ++c)
          for (int64_t b = 0; b < kVB; ++b) out_[b] = fma16(splat(qv[b][c * kLanes + l]), kt[c * kLanes + l], out_[b]);
      };
      auto pair = [&](int m, v16 out_[kVB]) __attribute__((always_inline)) {  // partial m + partial m + 8
        v16 x[kVB], y[kVB];
        partial(m, x);
        partial(m + 8, y);
        for (int64_t b = 0; b < kVB; ++b) out_[b] = x[b] + y[b];
      };
      // sums16's tree: ((t0 + t4) + (t2 + t6)) + ((t1 + t5) + (t3 + t7)), t_m = partial m + partial m + 8
      v16 t0[kVB], t1[kVB], u0[kVB], w0[kVB];
      pair(0, t0), pair(4, t1);
      for (int64_t b = 0; b < kVB; ++b) u0[b] = t0[b] + t1[b];
      pair(2, t0), pair(6, t1);
      for (int64_t b = 0; b < kVB; ++b) w0[b] = u0[b] + (t0[b] + t1[b]);
      pair(1, t0), pair(5, t1);
      for (int64_t b = 0; b < kVB; ++b) u0[b] = t0[b] + t1[b];
      pair(3, t0), pair(7, t1);
      for (int64_t b = 0; b < n; ++b) store16(out + (v0 + b) * stride + j0, w0[b] + (u0[b] + (t0[b] + t1[b])));
    }
  }
}

// o[b] += sum over the `count` value rows j of e[b][j] * row j, in order, for b < B (a
// compiled loop of its own: inlined into attend, its sums went through the stack each key)
template <int NC, int B>
__attribute__((noinline)) void values_block(const float* const* e, const float* const* rows, int64_t count,
                                            float* const* o) {
#if defined(EMBER_YMM_ONLY)
  // AVX2: one query vector and at most 8 of its ymm halves at a time, so the sums stay in the
  // 16 registers (B vectors of v16 sums went through the stack each key: 35 % of a 1,524-token
  // prefill); each lane takes the same fmas in the same key order as below
  constexpr int kHalves = 2 * NC;
  constexpr int kHeld = [] {  // the most halves, at most 8, that divide a vector's
    int held = 8;
    while (kHalves % held) --held;
    return held;
  }();
  for (int b = 0; b < B; ++b) {
    for (int h0 = 0; h0 < kHalves; h0 += kHeld) {
      __m256 sum[kHeld];
      for (int h = 0; h < kHeld; ++h) sum[h] = _mm256_loadu_ps(o[b] + (h0 + h) * 8);
      for (int64_t j = 0; j < count; ++j) {
        const __m256 w = _mm256_broadcast_ss(e[b] + j);
        const float* x = rows[j] + h0 * 8;
        for (int h = 0; h < kHeld; ++h) sum[h] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + h * 8), sum[h]);
      }
      for (int h = 0; h < kHeld; ++h) _mm256_storeu_ps(o[b] + (h0 + h) * 8, sum[h]);
    }
  }
#else
  v16 sum[B][NC];
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < NC; ++c) sum[b][c] = load16(o[b] + c * kLanes);
  for (int64_t j = 0; j < count; ++j) {
    v16 w[B];
    for (int b = 0; b < B; ++b) w[b] = splat(e[b][j]);
    for (int c = 0; c < NC; ++c) {
      const v16 x = load16(rows[j] + c * kLanes);
      for (int b = 0; b < B; ++b) sum[b][c] = fma16(w[b], x, sum[b][c]);
    }
  }
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < NC; ++c) store16(o[b] + c * kLanes, sum[b][c]);
#endif
}

// One item. Every query vector of the tile (its rows x the KV head's query heads) runs over
// the tile's keys [lo, hi]; a key a row does not see gets e = 0 exactly, and adding 0 * v
// leaves a sum's bits as they were, so each row's result is what it would be alone.
template <int NC>
void attend(const Args& a, const Item& it) {
  constexpr int64_t padded = NC * kLanes;
  const int64_t group = a.heads / a.kv_heads, dim = a.dim;
  const int64_t nq = a.starts[it.seq + 1] - a.starts[it.seq], len = a.lens[it.seq];
  const int64_t rows = it.row1 - it.row0, vectors = rows * group;  // query vectors: (row, head) pairs
  const int32_t* table = a.tables + it.seq * a.max_blocks;
  const int64_t slot_stride = a.kv_heads * dim, block_stride = a.block_size * slot_stride;
  // row r (0-based in the tile) at position pos(r) sees keys [first(r), last(r)]
  auto pos = [&](int64_t r) { return len - nq + it.row0 + r; };
  auto first = [&](int64_t r) {
    return a.window > 0 ? std::max<int64_t>(0, pos(r) + 1 - a.window) : a.chunk > 0 ? pos(r) / a.chunk * a.chunk : 0;
  };
  auto last = [&](int64_t r) -> int64_t { return a.key_ends ? a.key_ends[a.starts[it.seq] + it.row0 + r] - 1 : pos(r); };
  const int64_t lo_key = first(0);
  int64_t hi = pos(rows - 1);
  for (int64_t r = 0; a.key_ends && r < rows; ++r) hi = std::max(hi, last(r));
  const int64_t lo = lo_key / kLanes * kLanes, end = hi / kLanes * kLanes + kLanes;  // whole groups of 16
  const int64_t span = end - lo;
  thread_local std::vector<float> qf, scores, converted, acc, zeros, inv_totals;
  thread_local std::vector<const float*> key_rows;
  qf.resize(vectors * padded);
  scores.resize(vectors * span);
  converted.resize(std::min(kKeyChunk, span) * padded);
  acc.assign(vectors * padded, 0.f);
  inv_totals.resize(vectors);
  zeros.assign(padded, 0.f);
  key_rows.resize(kKeyChunk);
  for (int64_t vi = 0; vi < vectors; ++vi) {
    const int64_t token = a.starts[it.seq] + it.row0 + vi / group, head = it.kv_head * group + vi % group;
    a.load_q(a.q + token * a.q_token_stride + head * a.q_head_stride, dim, padded, a.scale, qf.data() + vi * padded);
  }
  const int64_t head_offset = it.kv_head * dim * a.cache_item;
  // key_rows[t - c0]: key or value t of [c0, c1) as a float32 row; those outside [lo_key, hi]
  // are zeros (never read: before a window they may be anything)
  auto fill = [&](const char* base, int64_t c0, int64_t c1, float scale) {
    for (int64_t t = c0; t < c1;) {
      if (t < lo_key || t > hi) {
        key_rows[t++ - c0] = zeros.data();
        continue;
      }
      // a run of the keys in one block: one division a block, not one a key
      const int64_t offset = t % a.block_size, run = std::min({a.block_size - offset, hi + 1 - t, c1 - t});
      const char* row = base + (static_cast<int64_t>(table[t / a.block_size]) * block_stride + offset * slot_stride) *
                                   a.cache_item + head_offset;
      const int64_t row_bytes = slot_stride * a.cache_item;
      if (t + run <= hi && (t + run) / a.block_size < a.max_blocks) {  // the next block's first rows, early
        const char* next = base + static_cast<int64_t>(table[(t + run) / a.block_size]) * block_stride * a.cache_item +
                           head_offset;
        for (int64_t i = 0; i < std::min(kAhead, hi - t - run + 1); ++i)
          for (int64_t line = 0; line < dim * a.cache_item; line += 64) __builtin_prefetch(next + i * row_bytes + line);
      }
      if (a.cache_as_is) {
        for (int64_t i = 0; i < run; ++i) key_rows[t - c0 + i] = reinterpret_cast<const float*>(row + i * row_bytes);
      } else {
        float* dst = converted.data() + (t - c0) * padded;
        a.load_kv(row, row_bytes, run, dim, padded, scale, dst);
        for (int64_t i = 0; i < run; ++i) key_rows[t - c0 + i] = dst + i * padded;
      }
      t += run;
    }
  };
  for (int64_t c0 = lo; c0 < end; c0 += kKeyChunk) {  // scores, 16 keys at a time
    const int64_t c1 = std::min(c0 + kKeyChunk, end);
    fill(a.k, c0, c1, a.k_scale);
    if (vectors >= kByKeys) {
      scores_by_keys<NC>(qf.data(), vectors, key_rows.data(), c1 - c0, scores.data() + (c0 - lo), span);
    } else {
      for (int64_t vi = 0; vi < vectors; ++vi)
        scores_by_rows<NC>(qf.data() + vi * padded, key_rows.data(), c1 - c0, scores.data() + vi * span + (c0 - lo));
    }
  }
  for (int64_t vi = 0; vi < vectors; ++vi) {  // softmax numerators in place, and their sums
    const int64_t r = vi / group, f = first(r), p = last(r);
    float* s = scores.data() + vi * span;
    const VS lo_v = splatv(static_cast<float>(f - lo)), hi_v = splatv(static_cast<float>(p - lo));
    VS top = splatv(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < span; j += kSoftmaxLanes) {
      VS x = loadv(s + j);
      if (a.cap > 0) x = softcapv(x, a.cap, a.inv_cap);
      const VS idx = kSoftmaxIota + static_cast<float>(j);
      x = (idx >= lo_v) & (idx <= hi_v) ? x : splatv(-std::numeric_limits<float>::infinity());
      storev(s + j, x);
      top = top > x ? top : x;
    }
    const float sink = a.sinks ? a.sinks[it.kv_head * group + vi % group] : -std::numeric_limits<float>::infinity();
    float m = sink;
    for (int64_t i = 0; i < kSoftmaxLanes; ++i) m = std::max(m, top[i]);
    VS totals[kLanes / kSoftmaxLanes];  // lane j % 16 of the 16 sums, as one 16-lane vector would hold them
    for (auto& t : totals) t = splatv(0.f);
    for (int64_t j = 0; j < span; j += kSoftmaxLanes) {
      const VS e = expv(loadv(s + j) - m);  // hidden keys: -inf - m -> 0
      storev(s + j, e);
      totals[j % kLanes / kSoftmaxLanes] += e;
    }
    v16 total;
    std::memcpy(&total, totals, sizeof(total));
    inv_totals[vi] = 1.f / (sum_lanes(total) + (a.sinks ? std::exp(sink - m) : 0.f));
  }
  for (int64_t c0 = lo; c0 < end; c0 += kKeyChunk) {  // values, key by key, up to 4 query vectors at a time
    const int64_t c1 = std::min(c0 + kKeyChunk, end);
    fill(a.v, c0, c1, a.v_scale);
    for (int64_t vi = 0; vi < vectors;) {
      const int64_t n = std::min<int64_t>(4, vectors - vi);
      const float* e[4];
      float* o[4];
      for (int64_t b = 0; b < n; ++b) {
        e[b] = scores.data() + (vi + b) * span + (c0 - lo);
        o[b] = acc.data() + (vi + b) * padded;
      }
      switch (n) {
        case 4: values_block<NC, 4>(e, key_rows.data(), c1 - c0, o); break;
        case 3: values_block<NC, 3>(e, key_rows.data(), c1 - c0, o); break;
        case 2: values_block<NC, 2>(e, key_rows.data(), c1 - c0, o); break;
        default: values_block<NC, 1>(e, key_rows.data(), c1 - c0, o); break;
      }
      vi += n;
    }
  }
  for (int64_t vi = 0; vi < vectors; ++vi) {
    const int64_t token = a.starts[it.seq] + it.row0 + vi / group, head = it.kv_head * group + vi % group;
    float* o = acc.data() + vi * padded;
    const v16 inv = splat(inv_totals[vi]);
    for (int c = 0; c < NC; ++c) store16(o + c * kLanes, load16(o + c * kLanes) * inv);
    a.store_out(o, dim, a.out + (token * a.heads + head) * dim * a.out_item);
  }
}

template <int NC>
void run(const Args& a, int64_t seqs) {
  // items, the longest first (the rows at the end of a long prompt see the most keys), so
  // that the threads taking them from the pool's counter finish together
  std::vector<Item> items;
  std::vector<int64_t> cost;
  int64_t work = 0;  // (key, query head) pairs
  for (int64_t b = 0; b < seqs; ++b) {
    const int64_t nq = a.starts[b + 1] - a.starts[b];
    for (int64_t r1 = nq; r1 > 0; r1 -= kTileRows) {
      const int64_t r0 = std::max<int64_t>(0, r1 - kTileRows), p = a.lens[b] - nq + r1 - 1;
      const int64_t keys = a.window > 0 ? std::min(p + 1, a.window + r1 - r0) : p + 1;
      for (int64_t h = 0; h < a.kv_heads; ++h) {
        items.push_back({b, h, r0, r1});
        cost.push_back(keys * (r1 - r0));
        work += cost.back() * (a.heads / a.kv_heads);
      }
    }
  }
  std::vector<int64_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return cost[x] > cost[y]; });
  if (work < kThreadWork) {
    for (int64_t i : order) attend<NC>(a, items[i]);
  } else {
    ember_cpu::Pool::get().run(static_cast<int64_t>(order.size()), [&](int64_t i) { attend<NC>(a, items[order[i]]); });
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           double scale, int64_t window, double softcap, const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& sinks,
                           int64_t chunk, const std::optional<at::Tensor>& key_ends) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(chunk >= 0 && (chunk == 0 || window == 0), "chunk must be >= 0 (0: none), and not beside a window");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [num_tokens, heads, head_dim] with unit last stride");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes(), "caches must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf, "q must be float32, bfloat16 or float16");
  TORCH_CHECK(v_cache.scalar_type() == ct && (ct == at::kFloat || ct == at::kHalf || ct == at::kBFloat16 ||
              ct == at::kFloat8_e4m3fn), "the caches must be float32, float16, bfloat16 or float8_e4m3fn, both alike");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0, "head shapes do not match");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2 &&
              seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
              query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous(),
              "block_tables, query_start_loc and seq_lens must be contiguous int32");
  const int64_t seqs = seq_lens.size(0);
  TORCH_CHECK(block_tables.size(0) == seqs && query_start_loc.size(0) == seqs + 1, "one table, start and length a sequence");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[seqs] == q.size(0), "query_start_loc must run from 0 to the number of tokens");
  for (int64_t b = 0; b < seqs; ++b)
    TORCH_CHECK(starts[b + 1] >= starts[b] && lens[b] >= starts[b + 1] - starts[b] &&
                (lens[b] + k_cache.size(1) - 1) / k_cache.size(1) <= block_tables.size(1),
                "sequence ", b, ": its new tokens must fit its length, and its length its block table");
  TORCH_CHECK(!key_ends.has_value() || (key_ends->scalar_type() == at::kInt && key_ends->is_contiguous() &&
              key_ends->dim() == 1 && key_ends->size(0) == q.size(0)), "key_ends must be contiguous int32 [num_tokens]");
  const int32_t* ends = key_ends.has_value() ? key_ends->data_ptr<int32_t>() : nullptr;
  for (int64_t b = 0; ends && b < seqs; ++b)
    for (int64_t t = starts[b]; t < starts[b + 1]; ++t)
      TORCH_CHECK(ends[t] > lens[b] - (starts[b + 1] - t) && ends[t] <= lens[b], "sequence ", b, ": key_ends[", t,
                  "] must be past its query's position and within its length");
  auto scale_of = [](const std::optional<at::Tensor>& s) {
    return s.has_value() ? s->to(at::kFloat).item<float>() : 1.f;
  };
  const bool fp8 = ct == at::kFloat8_e4m3fn;
  const float fs = static_cast<float>(softcap);
  const int64_t chunks = (q.size(2) + kLanes - 1) / kLanes;
  // the head size padded to a register count there is code for (zeros add nothing); 36: the
  // 576 of multi-head latent attention's latent (512) and RoPE key (64)
  const int nc = chunks <= 6 ? static_cast<int>(chunks) : chunks <= 8 ? 8 : chunks <= 16 ? 16 : chunks <= 32 ? 32 : 36;
  TORCH_CHECK(chunks <= 36, "head_dim ", q.size(2), " is over the kernel's 576");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
              sinks->dim() == 1 && sinks->size(0) == q.size(1)), "sinks must be contiguous float32 [heads]");
  Args a{};
  a.q = static_cast<const char*>(q.data_ptr());
  a.q_token_stride = q.stride(0) * q.element_size();
  a.q_head_stride = q.stride(1) * q.element_size();
  a.k = static_cast<const char*>(k_cache.data_ptr());
  a.v = static_cast<const char*>(v_cache.data_ptr());
  a.cache_item = k_cache.element_size();
  a.cache_as_is = ct == at::kFloat && q.size(2) == nc * kLanes;
  a.block_size = k_cache.size(1);
  a.kv_heads = k_cache.size(2);
  a.heads = q.size(1);
  a.dim = q.size(2);
  a.tables = block_tables.data_ptr<int32_t>();
  a.max_blocks = block_tables.size(1);
  a.starts = starts;
  a.lens = lens;
  a.scale = static_cast<float>(scale);
  a.cap = fs;
  a.inv_cap = fs > 0 ? 1.f / fs : 0.f;
  a.k_scale = fp8 ? scale_of(k_scale) : 1.f;
  a.v_scale = fp8 ? scale_of(v_scale) : 1.f;
  a.window = window;
  a.chunk = chunk;
  a.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  a.key_ends = ends;
  a.load_q = qt == at::kFloat ? &q_row<float> : qt == at::kBFloat16 ? &q_row<at::BFloat16> : &q_row<at::Half>;
  a.store_out = qt == at::kFloat ? &out_row<float> : qt == at::kBFloat16 ? &out_row<at::BFloat16> : &out_row<at::Half>;
  a.load_kv = ct == at::kFloat ? &cache_rows<float> : ct == at::kHalf ? &cache_rows<at::Half>
              : ct == at::kBFloat16 ? &cache_rows<at::BFloat16> : &cache_rows<at::Float8_e4m3fn>;
  a.out_item = q.element_size();
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  a.out = static_cast<char*>(out.data_ptr());
  if (q.size(0) == 0) return out;
  switch (nc) {
    case 1: run<1>(a, seqs); break;
    case 2: run<2>(a, seqs); break;
    case 3: run<3>(a, seqs); break;
    case 4: run<4>(a, seqs); break;
    case 5: run<5>(a, seqs); break;
    case 6: run<6>(a, seqs); break;
    case 8: run<8>(a, seqs); break;
    case 16: run<16>(a, seqs); break;
    case 32: run<32>(a, seqs); break;
    default: run<36>(a, seqs); break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  // window 0: the whole context; softcap 0: plain scores; k_scale / v_scale: an fp8 cache's;
  // sinks: a softmax logit a query head (gpt-oss); chunk 0: no attention chunks; key_ends: each
  // query row's end of keys (Gemma 3's image tokens see their whole image)
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start_loc, "
        "Tensor seq_lens, float scale, int window=0, float softcap=0.0, Tensor? k_scale=None, "
        "Tensor? v_scale=None, Tensor? sinks=None, int chunk=0, Tensor? key_ends=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
