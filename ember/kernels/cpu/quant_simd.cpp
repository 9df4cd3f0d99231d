// The SIMD rows of quant_gemm.cpp over the tiles of quant.h, compiled twice: for AVX-512 with
// VNNI (x86-64-v4 + avx512vnni) into ember_quant::avx512, and for AVX2 (x86-64-v3: AVX2, FMA,
// F16C) into ember_quant::avx2; quant_gemm.cpp picks one at run time by what the CPU has.
//
// A tile's sub-block (16 rows x 32 values) is unpacked once into 8 registers of unsigned
// bytes, one per group of 4 values (lane r: row r's 4 values), then meets up to kTile
// activation rows: each group's 4 activation bytes are broadcast and multiplied into every
// row's lane at once,
//   AVX-512 VNNI  vpdpbusd: 16 rows x 4 products summed into int32, 8 of them a sub-block
//   AVX2          vpmaddubsw (pairs into int16, 8 rows a register: the tile in two halves),
//                 int16 sums over as many groups as cannot overflow, then vpmaddwd into int32
// and the row's scale and offset (a, b: w = a * q + b) are applied as 16 (8) float lanes.
#include <immintrin.h>

#include <algorithm>

#include "quant.h"

#if defined(EMBER_QUANT_AVX512)
#define EMBER_QUANT_NS avx512
#else
#define EMBER_QUANT_NS avx2
#endif

namespace ember_quant::EMBER_QUANT_NS {
namespace {

constexpr int kTile = 4;  // activation rows a pass over a tile

constexpr bool five_bit(int q) { return q == kQ5_0 || q == kQ5_1 || q == kQ5_K; }
constexpr bool has_min(int q) { return q == kQ4_1 || q == kQ5_1; }
constexpr int header(int q) { return has_min(q) ? 64 : (q == kQ4_K || q == kQ5_K) ? 320 : q == kQ6_K ? 288 : 32; }
// the offset of the types that store q - c: w = d * q - c * d
constexpr float offset(int q) { return q == kQ4_0 ? 8.f : q == kQ5_0 ? 16.f : 0.f; }

inline int32_t group(const int8_t* x, int g) {
  int32_t v;
  std::memcpy(&v, x + 4 * g, 4);
  return v;
}

#if defined(EMBER_QUANT_AVX512)

using F = __m512;
constexpr int kLanes = 16;

inline __m512i load64(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline F halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline F u8s(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline F i8s(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// the 8 groups of sub-block j as unsigned bytes (Q8_0: q + 128, offset by b = -128 d)
template <int Q>
inline void unpack(const uint8_t* qs, const uint8_t* hi, __m512i w[8]) {
  if constexpr (Q == kQ8_0) {
    for (int g = 0; g < 8; ++g) w[g] = _mm512_xor_si512(load64(qs + 64 * g), _mm512_set1_epi8(-128));
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m512i v = load64(qs + 64 * c);
      w[c] = _mm512_and_si512(v, low4);
      w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    if constexpr (five_bit(Q)) {
      for (int g = 0; g < 8; ++g) {
        uint64_t mask;
        std::memcpy(&mask, hi + 8 * g, 8);
        w[g] = _mm512_or_si512(w[g], _mm512_maskz_mov_epi8(_cvtu64_mask64(mask), _mm512_set1_epi8(0x10)));
      }
    } else if constexpr (Q == kQ6_K) {
      const __m512i three = _mm512_set1_epi8(3);
      for (int h = 0; h < 2; ++h) {
        const __m512i v = load64(hi + 64 * h);
        w[4 * h] = _mm512_or_si512(w[4 * h], _mm512_slli_epi16(_mm512_and_si512(v, three), 4));
        w[4 * h + 1] = _mm512_or_si512(w[4 * h + 1], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(v, 2), three), 4));
        w[4 * h + 2] = _mm512_or_si512(w[4 * h + 2], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(v, 4), three), 4));
        w[4 * h + 3] = _mm512_or_si512(w[4 * h + 3], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(v, 6), three), 4));
      }
    }
  }
}

// int32 lanes: sum over groups [g0, g1) of w[g] . x's group g, in two chains (one row's
// sub-block is otherwise a chain of 8 dependent vpdpbusd: latency, not throughput, bound)
inline F dot(const __m512i w[8], const int8_t* x, int g0, int g1) {
  __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
  for (int g = g0; g < g1; g += 2) {
    even = _mm512_dpbusd_epi32(even, w[g], _mm512_set1_epi32(group(x, g)));
    odd = _mm512_dpbusd_epi32(odd, w[g + 1], _mm512_set1_epi32(group(x, g + 1)));
  }
  return _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
}

inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F set1(float v) { return _mm512_set1_ps(v); }
inline F zero() { return _mm512_setzero_ps(); }
inline void store(float* out, F v, int rows) {
  if (rows >= 16) _mm512_storeu_ps(out, v);
  else _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << rows) - 1), v);
}
constexpr float kQ8Offset = -128.f;  // Q8_0's q + 128

#else  // AVX2: a tile in two halves of 8 rows; `part` (0, 1) picks the half's 32 bytes of each 64

using F = __m256;
constexpr int kLanes = 8;

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline F halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline F u8s(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline F i8s(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 32 bits -> 32 bytes: byte j is 0x10 where bit j is set
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// the 8 groups of the half's rows (Q8_0: signed, as stored)
template <int Q>
inline void unpack(const uint8_t* qs, const uint8_t* hi, __m256i w[8], int part) {
  if constexpr (Q == kQ8_0) {
    for (int g = 0; g < 8; ++g) w[g] = load32(qs + 64 * g + 32 * part);
  } else {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load32(qs + 64 * c + 32 * part);
      w[c] = _mm256_and_si256(v, low4);
      w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
    if constexpr (five_bit(Q)) {
      for (int g = 0; g < 8; ++g) {
        uint32_t mask;
        std::memcpy(&mask, hi + 8 * g + 4 * part, 4);
        w[g] = _mm256_or_si256(w[g], fifth_bits(mask));
      }
    } else if constexpr (Q == kQ6_K) {
      const __m256i three = _mm256_set1_epi8(3);
      for (int h = 0; h < 2; ++h) {
        const __m256i v = load32(hi + 64 * h + 32 * part);
        w[4 * h] = _mm256_or_si256(w[4 * h], _mm256_slli_epi16(_mm256_and_si256(v, three), 4));
        w[4 * h + 1] = _mm256_or_si256(w[4 * h + 1], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 2), three), 4));
        w[4 * h + 2] = _mm256_or_si256(w[4 * h + 2], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), three), 4));
        w[4 * h + 3] = _mm256_or_si256(w[4 * h + 3], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 6), three), 4));
      }
    }
  }
}

// int32 lanes: sum over groups [g0, g1) of w[g] . x's group g. vpmaddubsw's int16 pairs are
// summed over `run` groups before widening: q <= 15 x 127 x 2 x 8 < 2^15 for 4-bit values,
// 4 groups for 5-bit, 2 for 6-bit; Q8_0's signed values take |w| x (x with w's sign), one a time
template <int Q>
inline F dot(const __m256i w[8], const int8_t* x, int g0, int g1) {
  constexpr int run = Q == kQ8_0 ? 1 : five_bit(Q) ? 4 : Q == kQ6_K ? 2 : 8;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc = _mm256_setzero_si256();
  for (int g = g0; g < g1; g += run) {
    // the run's products in two int16 chains (each half the run: no overflow either way)
    __m256i pairs[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int i = g; i < g + run && i < g1; ++i) {
      const __m256i xb = _mm256_set1_epi32(group(x, i));
      if constexpr (Q == kQ8_0) {
        pairs[0] = _mm256_maddubs_epi16(_mm256_sign_epi8(w[i], w[i]), _mm256_sign_epi8(xb, w[i]));
      } else {
        pairs[i % 2] = _mm256_add_epi16(pairs[i % 2], _mm256_maddubs_epi16(w[i], xb));
      }
    }
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(pairs[0], pairs[1]), ones));
  }
  return _mm256_cvtepi32_ps(acc);
}

inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F set1(float v) { return _mm256_set1_ps(v); }
inline F zero() { return _mm256_setzero_ps(); }
inline void store(float* out, F v, int rows) {
  if (rows >= 8) {
    _mm256_storeu_ps(out, v);
  } else if (rows > 0) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    std::memcpy(out, tmp, rows * sizeof(float));
  }
}
constexpr float kQ8Offset = 0.f;  // Q8_0 stays signed here

#endif

// T activation rows from m0 against the lanes of tile t (AVX2: one half, `part`)
template <int Q, int T>
void tile_rows(const Job& job, int64_t t, int64_t m0, int part) {
  constexpr bool kK = is_k_quant(Q);
  const int64_t nb = job.k / kBlock, unit_bytes = packed_block_bytes(Q);
  const uint8_t* base = job.w + t * packed_tile_bytes(Q, job.k);
  const int lane0 = part * kLanes;  // this half's first row in the tile (AVX-512: 0)
  const int8_t* x[T];
  const float *xd[T], *xs[T], *xh[T];
  F acc[T], off[T];  // the a * q terms and the b terms, apart: two shorter dependency chains
  for (int i = 0; i < T; ++i) {
    x[i] = job.xq + (m0 + i) * job.k;
    xd[i] = job.xd + (m0 + i) * nb;
    xs[i] = job.xs + (m0 + i) * nb;
    xh[i] = job.xh + (m0 + i) * nb * 2;
    acc[i] = off[i] = zero();
  }
  F d = zero(), dmin = zero();
  const int64_t tile_bytes = packed_tile_bytes(Q, job.k);
  for (int64_t j = 0; j < nb; ++j) {
    const uint8_t* unit = base + (kK ? j / 8 : j) * unit_bytes;
    if (m0 == 0 && part == 0 && (!kK || j % 8 == 0)) {
      // the next tile's bytes, a unit ahead of use: DRAM latency hidden behind this tile's work
      // (at 16 rows a step the kernel took twice as long on weights fresh from DRAM as on hot ones)
      for (int64_t line = 0; line < unit_bytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(unit + tile_bytes + line), _MM_HINT_T0);
    }
    const int sub = static_cast<int>(j % 8);
    const uint8_t* qs = unit + header(Q) + (kK ? sub * kQs : 0);
    const uint8_t* hi = Q == kQ6_K ? unit + header(Q) + 8 * kQs + sub * kHi2
                        : unit + header(Q) + (kK ? 8 * kQs + sub * kHi : kQs);
    if (Q == kQ8_0) qs = unit + 32;
#if defined(EMBER_QUANT_AVX512)
    __m512i w[8];
    unpack<Q>(qs, hi, w);
#else
    __m256i w[8];
    unpack<Q>(qs, hi, w, part);
#endif
    if (!kK || sub == 0) {
      d = halves(unit + 2 * lane0);
      if (kK && Q != kQ6_K) dmin = halves(unit + 32 + 2 * lane0);
    }
    if constexpr (Q == kQ6_K) {
      const F a0 = mul(d, i8s(unit + 32 + 16 * (2 * sub) + lane0));
      const F a1 = mul(d, i8s(unit + 32 + 16 * (2 * sub + 1) + lane0));
      const F b0 = mul(a0, set1(-32.f)), b1 = mul(a1, set1(-32.f));
      for (int i = 0; i < T; ++i) {
        const int8_t* xj = x[i] + kBlock * j;
        const F scale = set1(xd[i][j]);
#if defined(EMBER_QUANT_AVX512)
        const F lo = dot(w, xj, 0, 4), hi_ = dot(w, xj, 4, 8);
#else
        const F lo = dot<Q>(w, xj, 0, 4), hi_ = dot<Q>(w, xj, 4, 8);
#endif
        acc[i] = fmadd(lo, mul(a0, scale), acc[i]);
        off[i] = fmadd(hi_, mul(a1, scale), off[i]);
        acc[i] = fmadd(b0, set1(xh[i][2 * j]), acc[i]);
        off[i] = fmadd(b1, set1(xh[i][2 * j + 1]), off[i]);
      }
    } else {
      F a = d, b;
      if constexpr (kK) {
        a = mul(d, u8s(unit + 64 + 16 * sub + lane0));
        b = mul(dmin, mul(u8s(unit + 192 + 16 * sub + lane0), set1(-1.f)));
      } else if constexpr (has_min(Q)) {
        b = halves(unit + 32 + 2 * lane0);
      } else {
        b = mul(d, set1(Q == kQ8_0 ? kQ8Offset : -offset(Q)));
      }
      for (int i = 0; i < T; ++i) {
#if defined(EMBER_QUANT_AVX512)
        const F p = dot(w, x[i] + kBlock * j, 0, 8);
#else
        const F p = dot<Q>(w, x[i] + kBlock * j, 0, 8);
#endif
        acc[i] = fmadd(p, mul(a, set1(xd[i][j])), acc[i]);
        off[i] = fmadd(b, set1(xs[i][j]), off[i]);
      }
    }
  }
  const int64_t row0 = t * kRows + lane0;
  const int rows = static_cast<int>(std::min<int64_t>(kLanes, job.n - row0));
  for (int i = 0; i < T; ++i) store(job.out + (m0 + i) * job.ldo + row0, add(acc[i], off[i]), rows);
}

template <int Q>
void run(const Job& job) {
  for (int64_t t = job.t0; t < job.t1; ++t) {
    for (int part = 0; part < kRows / kLanes; ++part) {
      if (t * kRows + part * kLanes >= job.n) break;
      int64_t m0 = 0;
      for (; m0 + kTile <= job.m; m0 += kTile) tile_rows<Q, kTile>(job, t, m0, part);
      switch (job.m - m0) {
        case 3: tile_rows<Q, 3>(job, t, m0, part); break;
        case 2: tile_rows<Q, 2>(job, t, m0, part); break;
        case 1: tile_rows<Q, 1>(job, t, m0, part); break;
        default: break;
      }
    }
  }
}

}  // namespace

void tiles(const Job& job) {
  switch (job.qtype) {
    case kQ4_0: return run<kQ4_0>(job);
    case kQ4_1: return run<kQ4_1>(job);
    case kQ5_0: return run<kQ5_0>(job);
    case kQ5_1: return run<kQ5_1>(job);
    case kQ8_0: return run<kQ8_0>(job);
    case kQ4_K: return run<kQ4_K>(job);
    case kQ5_K: return run<kQ5_K>(job);
    case kQ6_K: return run<kQ6_K>(job);
    default: return;
  }
}

}  // namespace ember_quant::EMBER_QUANT_NS
