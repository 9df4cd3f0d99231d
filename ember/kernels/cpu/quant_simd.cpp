// The SIMD rows of quant_gemm.cpp, compiled twice: for AVX2 (x86-64-v3: AVX2, FMA, F16C)
// into ember_quant::avx2, and for AVX-512 with VNNI (x86-64-v4 + avx512vnni) into
// ember_quant::avx512; quant_gemm.cpp picks one at run time by what the CPU has.
//
// Each weight sub-block of 32 values becomes one 256-bit register of unsigned bytes (its
// q_w) and is multiplied with up to kTile activation rows while it is in a register:
//   VNNI:  vpdpbusd (u8 x s8, four products summed into each of 8 int32 lanes)
//   AVX2:  vpmaddubsw (pairs into int16, no overflow: q_w <= 63) then vpmaddwd with ones
// The int32 lanes are converted and scaled by a * d per block into 8 float lanes, summed
// across lanes once per output.
#include <immintrin.h>

#include "quant.h"

#if defined(EMBER_QUANT_AVX512)
#define EMBER_QUANT_NS avx512
#else
#define EMBER_QUANT_NS avx2
#endif

namespace ember_quant::EMBER_QUANT_NS {
namespace {

constexpr int kTile = 4;  // activation rows per pass over a weight row

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(EMBER_QUANT_AVX512)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 16 bytes of nibbles -> 32 values: value j is byte j's low nibble, value 16 + j its high one
inline __m256i nibbles16(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}

// 32 bits -> 32 bytes: byte j is 0x10 where bit j is set (Q5_0/Q5_1's fifth bit)
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
#if defined(EMBER_QUANT_AVX512)
  return _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(0x10));
#else
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
#endif
}

inline __m256i shift_right16(__m256i v, int count) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(count)); }

inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

// up to kTile activation rows against one weight row. AVX2 takes a sub-block at a time;
// AVX-512 holds the first of two adjacent sub-blocks back and takes them as a pair in 512-bit
// registers (a row has an even number of sub-blocks but for rows of 32 * odd values; the last
// held one then goes alone, in store()). The activation scales come 8 copies a block (quant.h),
// so a block's (or a pair's) scale vector is one load.
template <int T>
struct Tile {
  const int8_t* xq[T];
  const float* xd[T];
  const float* xs[T];
#if defined(EMBER_QUANT_AVX512)
  __m512 acc[T], off[T];
  bool held = false;
  int64_t hj = 0;
  __m256i hq, hs;  // the held sub-block's values (and Q6_K's scales)
  float ha = 0.f, hb = 0.f;
#else
  __m256 acc[T], off[T];
#endif

  Tile(const Job& job, int64_t m0) {
    const int64_t nb = job.k / kBlock;
    for (int t = 0; t < T; ++t) {
      xq[t] = job.xq + (m0 + t) * job.k;
      xd[t] = job.xd + (m0 + t) * nb * 8;
      xs[t] = job.xs + (m0 + t) * nb * 8;
#if defined(EMBER_QUANT_AVX512)
      acc[t] = off[t] = _mm512_setzero_ps();
#else
      acc[t] = off[t] = _mm256_setzero_ps();
#endif
    }
  }

  // one sub-block at 256 bits: acc += a * d * int_dot(q, x) (+ b * s), p computed by `dot`
  template <typename Dot>
  inline void single(int64_t j, float a, float b, bool offset, Dot dot) {
    const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
    for (int t = 0; t < T; ++t) {
      const __m256 p = _mm256_cvtepi32_ps(dot(load32(xq[t] + kBlock * j)));
      const __m256 scale = _mm256_mul_ps(va, _mm256_loadu_ps(xd[t] + 8 * j));
#if defined(EMBER_QUANT_AVX512)
      acc[t] = _mm512_add_ps(acc[t], _mm512_zextps256_ps512(_mm256_mul_ps(p, scale)));
      if (offset) off[t] = _mm512_add_ps(off[t], _mm512_zextps256_ps512(_mm256_mul_ps(vb, _mm256_loadu_ps(xs[t] + 8 * j))));
#else
      acc[t] = _mm256_fmadd_ps(p, scale, acc[t]);
      if (offset) off[t] = _mm256_fmadd_ps(vb, _mm256_loadu_ps(xs[t] + 8 * j), off[t]);
#endif
    }
  }

#if defined(EMBER_QUANT_AVX512)
  static inline __m512i pair(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
  static inline __m512 pair(float lo, float hi) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(lo)), _mm256_set1_ps(hi), 1);
  }

  // the held sub-block hj and hj + 1 at 512 bits
  template <typename Dot>
  inline void both(float a, float b, bool offset, Dot dot) {
    const __m512 va = pair(ha, a), vb = pair(hb, b);
    for (int t = 0; t < T; ++t) {
      const __m512 p = _mm512_cvtepi32_ps(dot(_mm512_loadu_si512(xq[t] + kBlock * hj)));
      acc[t] = _mm512_fmadd_ps(p, _mm512_mul_ps(va, _mm512_loadu_ps(xd[t] + 8 * hj)), acc[t]);
      if (offset) off[t] = _mm512_fmadd_ps(vb, _mm512_loadu_ps(xs[t] + 8 * hj), off[t]);
    }
    held = false;
  }

  inline bool hold(int64_t j, __m256i q, __m256i s, float a, float b) {
    if (held) return false;
    held = true, hj = j, hq = q, hs = s, ha = a, hb = b;
    return true;
  }
#endif

  // sub-block j holds a * q + b, q unsigned
  inline void add(int64_t j, __m256i q, float a, float b) {
#if defined(EMBER_QUANT_AVX512)
    if (hold(j, q, q, a, b)) return;
    const __m512i both_q = pair(hq, q);
    both(a, b, true, [&](__m512i x) { return _mm512_dpbusd_epi32(_mm512_setzero_si512(), both_q, x); });
#else
    single(j, a, b, true, [&](__m256i x) { return dot_u8s8(q, x); });
#endif
  }

  // sub-block j holds a * w, w signed (Q8_0): |w| times x carrying w's sign
  inline void add_signed(int64_t j, __m256i w, float a) {
#if defined(EMBER_QUANT_AVX512)
    if (hold(j, w, w, a, 0.f)) return;
    const __m512i both_w = pair(hq, w), u = _mm512_abs_epi8(both_w);
    const __mmask64 negative = _mm512_movepi8_mask(both_w);
    both(a, 0.f, false, [&](__m512i x) {
      return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x));
    });
#else
    const __m256i u = _mm256_sign_epi8(w, w);
    single(j, a, 0.f, false, [&](__m256i x) { return dot_u8s8(u, _mm256_sign_epi8(x, w)); });
#endif
  }

  // sub-block j holds a * s_i * (q - 32), s_i an int8 scale per 16 values in int16 lanes (Q6_K)
  inline void add_scaled(int64_t j, __m256i q, __m256i scales, float a) {
#if defined(EMBER_QUANT_AVX512)
    if (hold(j, q, scales, a, 0.f)) return;
    const __m512i both_q = pair(hq, q), both_s = pair(hs, scales), c32 = _mm512_set1_epi8(32);
    both(a, 0.f, false, [&](__m512i x) {
      return _mm512_madd_epi16(_mm512_sub_epi16(_mm512_maddubs_epi16(both_q, x), _mm512_maddubs_epi16(c32, x)), both_s);
    });
#else
    const __m256i c32 = _mm256_set1_epi8(32);
    single(j, a, 0.f, false, [&](__m256i x) {
      return _mm256_madd_epi16(_mm256_sub_epi16(_mm256_maddubs_epi16(q, x), _mm256_maddubs_epi16(c32, x)), scales);
    });
#endif
  }

  // the last held sub-block, if any, then out[t * ldo] for each row
  template <int kKind>
  inline void finish(float* out, int64_t ldo) {
#if defined(EMBER_QUANT_AVX512)
    if (held) {  // an odd count of sub-blocks: the last alone
      held = false;
      const __m256i q = hq, s = hs;
      if (kKind == 0) {
        single(hj, ha, hb, true, [&](__m256i x) { return dot_u8s8(q, x); });
      } else if (kKind == 1) {
        const __m256i u = _mm256_sign_epi8(q, q);
        single(hj, ha, 0.f, false, [&](__m256i x) { return dot_u8s8(u, _mm256_sign_epi8(x, q)); });
      } else {
        const __m256i c32 = _mm256_set1_epi8(32);
        single(hj, ha, 0.f, false, [&](__m256i x) {
          return _mm256_madd_epi16(_mm256_sub_epi16(_mm256_maddubs_epi16(q, x), _mm256_maddubs_epi16(c32, x)), s);
        });
      }
    }
#endif
    for (int t = 0; t < T; ++t) out[t * ldo] = hsum(acc[t]) + hsum(off[t]);
  }
};

template <int T>
void row_q4_0(const uint8_t* r, int64_t nb, Tile<T>& tile) {
  for (int64_t j = 0; j < nb; ++j, r += 18) {
    const float d = half(r);
    tile.add(j, nibbles16(r + 2), d, -8.f * d);
  }
}

template <int T>
void row_q4_1(const uint8_t* r, int64_t nb, Tile<T>& tile) {
  for (int64_t j = 0; j < nb; ++j, r += 20) tile.add(j, nibbles16(r + 4), half(r), half(r + 2));
}

template <int T>
void row_q5_0(const uint8_t* r, int64_t nb, Tile<T>& tile) {
  for (int64_t j = 0; j < nb; ++j, r += 22) {
    const float d = half(r);
    tile.add(j, _mm256_or_si256(nibbles16(r + 6), fifth_bits(r + 2)), d, -16.f * d);
  }
}

template <int T>
void row_q5_1(const uint8_t* r, int64_t nb, Tile<T>& tile) {
  for (int64_t j = 0; j < nb; ++j, r += 24)
    tile.add(j, _mm256_or_si256(nibbles16(r + 8), fifth_bits(r + 4)), half(r), half(r + 2));
}

template <int T>
void row_q8_0(const uint8_t* r, int64_t nb, Tile<T>& tile) {
  for (int64_t j = 0; j < nb; ++j, r += 34) tile.add_signed(j, load32(r + 2), half(r));
}

// Q4_K / Q5_K super-block of 256: | d | dmin | 12 bytes of 6-bit scales and mins | (Q5_K: qh[32]) | qs[128] |
// qs byte l of chunk c (32 bytes) holds value l of sub-block 2c (low nibble) and of 2c + 1 (high);
// Q5_K's fifth bit of value l of sub-block i is bit i of qh[l].
template <int T, bool kFive>
void row_k(const uint8_t* r, int64_t nb, Tile<T>& tile) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  for (int64_t s = 0; s < nb / 8; ++s, r += kFive ? 176 : 144) {
    const float d = half(r), dmin = half(r + 2);
    const uint8_t* qs = r + (kFive ? 48 : 16);
    const __m256i qh = kFive ? load32(r + 16) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load32(qs + 32 * c);
      __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      if (kFive) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(shift_right16(qh, 2 * c), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(shift_right16(qh, 2 * c + 1), one), 4));
      }
      int sc, mn;
      k_scale_min(r + 4, 2 * c, sc, mn);
      tile.add(8 * s + 2 * c, lo, d * sc, -dmin * mn);
      k_scale_min(r + 4, 2 * c + 1, sc, mn);
      tile.add(8 * s + 2 * c + 1, hi, d * sc, -dmin * mn);
    }
  }
}

// Q6_K super-block of 256: | ql[128] | qh[64] | int8 scales[16] | d |, two halves of 128 values;
// in half h, value l of sub-block 4h + i is (low 4 bits, 2 high bits) - 32:
//   i = 0: ql[l] & 15, qh[l] bits 0-1;   i = 1: ql[l + 32] & 15, qh[l] bits 2-3
//   i = 2: ql[l] >> 4, qh[l] bits 4-5;   i = 3: ql[l + 32] >> 4, qh[l] bits 6-7
// (ql, qh of half h start at 64h and 32h), scaled by scales[8h + 2i + l / 16].
template <int T>
void row_q6_k(const uint8_t* r, int64_t nb, Tile<T>& tile) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3);
  for (int64_t s = 0; s < nb / 8; ++s, r += 210) {
    const float d = half(r + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(r + 192);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load32(r + 64 * h), l1 = load32(r + 64 * h + 32), qh = load32(r + 128 + 32 * h);
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, two), 4)),
          _mm256_or_si256(_mm256_and_si256(l1, low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), two), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), two), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), two), 4)),
      };
      for (int i = 0; i < 4; ++i) {
        const int8_t* sc = scales + 8 * h + 2 * i;
        const __m256i s16 = _mm256_set_m128i(_mm_set1_epi16(sc[1]), _mm_set1_epi16(sc[0]));
        tile.add_scaled(8 * s + 4 * h + i, q[i], s16, d);
      }
    }
  }
}

template <int T>
void row(const Job& job, int64_t n, int64_t m0) {
  Tile<T> tile(job, m0);
  const uint8_t* r = job.w + n * job.row_bytes;
  const int64_t nb = job.k / kBlock;
  float* out = job.out + m0 * job.ldo + n;
  switch (job.qtype) {
    case kQ4_0: row_q4_0(r, nb, tile); return tile.template finish<0>(out, job.ldo);
    case kQ4_1: row_q4_1(r, nb, tile); return tile.template finish<0>(out, job.ldo);
    case kQ5_0: row_q5_0(r, nb, tile); return tile.template finish<0>(out, job.ldo);
    case kQ5_1: row_q5_1(r, nb, tile); return tile.template finish<0>(out, job.ldo);
    case kQ8_0: row_q8_0(r, nb, tile); return tile.template finish<1>(out, job.ldo);
    case kQ4_K: row_k<T, false>(r, nb, tile); return tile.template finish<0>(out, job.ldo);
    case kQ5_K: row_k<T, true>(r, nb, tile); return tile.template finish<0>(out, job.ldo);
    case kQ6_K: row_q6_k(r, nb, tile); return tile.template finish<2>(out, job.ldo);
    default: return;
  }
}

}  // namespace

void rows(const Job& job) {
  int64_t m0 = 0;
  for (; m0 + kTile <= job.m; m0 += kTile)
    for (int64_t n = job.n0; n < job.n1; ++n) row<kTile>(job, n, m0);
  const int64_t rest = job.m - m0;
  for (int64_t n = job.n0; n < job.n1 && rest > 0; ++n) {
    if (rest == 3) row<3>(job, n, m0);
    else if (rest == 2) row<2>(job, n, m0);
    else row<1>(job, n, m0);
  }
}

}  // namespace ember_quant::EMBER_QUANT_NS
