// GGUF block-quantized weights times int8-quantized activations: the types shared by the
// op (quant_gemm.cpp) and its SIMD builds (quant_simd.cpp, compiled once per instruction set).
//
// Activations are quantized per block of 32 values, as llama.cpp's q8 path does:
//   d = max|x| / 127,  q = round_half_even(x / d) (x * (1 / d), exactly that way), s = d * sum(q);
// d is stored 8 times, s once and then 7 zeros, so that the SIMD rows load them as vectors
// (8 float lanes, summed at the end: d scales every lane, s counts once).
// A weight block of 32 values is  w = a * q_w + b  (a, b per block; q_w unsigned), so
//   dot(w, x) ~= a * d * sum(q_w * q) + b * s,
// with the integer sum exact. Q8_0 is signed (b = 0); Q6_K has a scale per 16 values.
#pragma once

#include <cstdint>
#include <cstring>

namespace ember_quant {

// ggml's type ids (ggml.h fixes them)
enum QType : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
};

constexpr int kBlock = 32;  // activation block; every weight type's sub-blocks are 32 values

// values per block and bytes per block of each type; 0 for a type with no kernel
inline int block_values(int qtype) {
  switch (qtype) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: return 32;
    case kQ4_K: case kQ5_K: case kQ6_K: return 256;
    default: return 0;
  }
}

inline int block_bytes(int qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

// one job: out[m * ldo + n] = dot(weight row n, activation row m) for n in [n0, n1), m in [0, m)
struct Job {
  const uint8_t* w;     // [N, row_bytes]
  int64_t row_bytes;
  int qtype;
  int64_t k;            // values per row (a multiple of the type's block)
  const int8_t* xq;     // [M, k]
  const float* xd;      // [M, k / 32, 8]: each block's d, 8 times (a 256-bit vector)
  const float* xs;      // [M, k / 32, 8]: each block's s, then 7 zeros
  int64_t m;
  float* out;
  int64_t ldo;
  int64_t n0, n1;
};

inline float fp16_to_fp32(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);  // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    do { man <<= 1; ++e; } while ((man & 0x400u) == 0);
    bits = sign | ((112u - e) << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes
inline void k_scale_min(const uint8_t* q, int j, int& scale, int& min) {
  if (j < 4) {
    scale = q[j] & 63;
    min = q[j + 4] & 63;
  } else {
    scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

void rows_scalar(const Job& job);
namespace avx2 {
void rows(const Job& job);
}
namespace avx512 {
void rows(const Job& job);
}

}  // namespace ember_quant
