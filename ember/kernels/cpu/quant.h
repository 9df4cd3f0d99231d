// GGUF block-quantized weights times int8-quantized activations: the layout and types shared
// by the op (quant_gemm.cpp), the repacking and plain rows (quant_repack.cpp) and the SIMD
// rows (quant_simd.cpp, compiled once per instruction set).
//
// Activations are quantized per block of 32 values, as llama.cpp's q8 path does:
//   d = max|x| / 127,  q = round_half_even(x * (1 / d)),  s = d * sum(q)  (h: the same per 16)
//
// Weights are repacked at load, 16 rows at a time ("a tile"), so that a 512-bit register holds
// 4 consecutive values of each of the 16 rows and one int8 dot-product instruction (vpdpbusd)
// adds 4 products into each row's own lane: a tile's 16 outputs build up side by side and come
// out as one vector, with no sum across lanes. The values keep their width (4, 5, 6 or 8 bits)
// and the scales their type, so the repacked bytes are the file's, reordered (and the last
// tile padded to 16 rows with zeros):
//
//   a sub-block: 32 values of a row (j: which, along k); its 8 groups of 4 values (g)
//   qs   256 B  4 chunks of 64 B; chunk c, byte 4r + i: low nibble = q[r][4c + i] (group c),
//               high nibble = q[r][4(c + 4) + i] (group c + 4)        (the low 4 bits of q)
//   hi    64 B  (5-bit types) group g's 8 bytes: a 64-bit mask, bit 4r + i = bit 4 of q[r][4g + i]
//   hi2  128 B  (Q6_K) 2 chunks of 64 B; chunk h, byte 4r + i, bits 2k, 2k + 1 = bits 4-5 of
//               q[r][4(4h + k) + i]
//   q8   512 B  (Q8_0) group g's 64 B: byte 4r + i = q[r][4g + i], signed
//
// and per tile, in k order (f16: IEEE half as the file stores it; [16]: one per row):
//   Q4_0  per sub-block:   d f16[16] | qs                    w = d * (q - 8)
//   Q4_1  per sub-block:   d f16[16] | m f16[16] | qs        w = d * q + m
//   Q5_0  per sub-block:   d f16[16] | qs | hi               w = d * (q - 16)
//   Q5_1  per sub-block:   d f16[16] | m f16[16] | qs | hi   w = d * q + m
//   Q8_0  per sub-block:   d f16[16] | q8                    w = d * q
//   Q4_K  per super-block of 8 sub-blocks: d f16[16] | dmin f16[16] | scale u8[8][16] |
//                          min u8[8][16] | 8 x qs            w = d * scale_j * q - dmin * min_j
//   Q5_K  as Q4_K, then 8 x hi
//   Q6_K  per super-block: d f16[16] | scale i8[16][16] (per 16 values) | 8 x qs | 8 x hi2
//                          w = d * scale * (q - 32)
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <cstring>

namespace ember_quant {

// ggml's type ids (ggml.h fixes them)
enum QType : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
};

constexpr int kBlock = 32;  // values a sub-block (and an activation block)
constexpr int kRows = 16;   // rows a tile
constexpr int kQs = 256, kHi = 64, kHi2 = 128, kQ8 = 512;

constexpr bool is_k_quant(int qtype) { return qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K; }

// values per block and bytes per block of each type as GGUF stores a row; 0: no kernel
constexpr int block_values(int qtype) {
  switch (qtype) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: return 32;
    case kQ4_K: case kQ5_K: case kQ6_K: return 256;
    default: return 0;
  }
}

constexpr int block_bytes(int qtype) {
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

// bytes of one tile's block (a sub-block, or a K-quant's super-block) in the repacked layout
constexpr int64_t packed_block_bytes(int qtype) {
  switch (qtype) {
    case kQ4_0: return 32 + kQs;
    case kQ4_1: return 64 + kQs;
    case kQ5_0: return 32 + kQs + kHi;
    case kQ5_1: return 64 + kQs + kHi;
    case kQ8_0: return 32 + kQ8;
    case kQ4_K: return 64 + 256 + 8 * kQs;
    case kQ5_K: return 64 + 256 + 8 * (kQs + kHi);
    case kQ6_K: return 32 + 256 + 8 * (kQs + kHi2);
    default: return 0;
  }
}

constexpr int64_t packed_tile_bytes(int qtype, int64_t k) { return k / block_values(qtype) * packed_block_bytes(qtype); }

// one job: out[m * ldo + n] = dot(weight row n, activation row m), for the rows of tiles
// [t0, t1) and every activation row
struct Job {
  const uint8_t* w;     // repacked, packed_tile_bytes a tile
  int qtype;
  int64_t k;            // values a row
  int64_t n;            // rows (the last tile may be partly padding)
  const int8_t* xq;     // [M, k]
  const float* xd;      // [M, k / 32]
  const float* xs;      // [M, k / 32]
  const float* xh;      // [M, k / 32, 2]: s of each half (Q6_K's scales are per 16 values)
  int64_t m;
  float* out;
  int64_t ldo;
  int64_t t0, t1;
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

// the op before a layer (quant_prologue.cpp): rows of x (dtype T, `stride` apart) -> count x k floats
enum class Prologue { kNone, kNorm, kSilu, kGeluTanh };
void prologue_rows(Prologue kind, const void* src, at::ScalarType dtype, int64_t stride, int64_t count, int64_t k,
                   const void* norm_weight, float eps, void* residual, float* out);

void tiles_scalar(const Job& job);
void repack_tiles(const uint8_t* src, int qtype, int64_t n, int64_t k, uint8_t* dst, int64_t t0, int64_t t1);
void dequantize_rows(const uint8_t* w, int qtype, int64_t k, const int64_t* ids, int64_t count, float* out);
namespace avx2 {
void tiles(const Job& job);
}
namespace avx512 {
void tiles(const Job& job);
}

}  // namespace ember_quant
