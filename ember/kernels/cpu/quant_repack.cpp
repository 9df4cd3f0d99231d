// GGUF rows -> the tiles of quant.h, and back: the repacking done once at load, the plain
// rows (any CPU, and the reference the SIMD rows are tested against) and the dequantized
// rows an embedding lookup takes. All three read the layout through `Packed`, so this file is
// also the layout's executable description.
#include <algorithm>
#include <vector>

#include "quant.h"

namespace ember_quant {
namespace {

// a native GGUF row decoded to its stored integers and raw scale fields
struct NativeRow {
  std::vector<int> q;            // k values as stored (unsigned; Q8_0 signed)
  std::vector<uint16_t> d, m;    // per block: f16 bits of d (and m, or K-quants' dmin)
  std::vector<uint8_t> sc, mn;   // K-quants: per sub-block scale and min; Q6_K: per 16 values (int8)
};

uint16_t half_bits(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

void decode_native(const uint8_t* row, int qtype, int64_t k, NativeRow& out) {
  out.q.resize(k);
  out.d.clear(), out.m.clear(), out.sc.clear(), out.mn.clear();
  const int64_t nb = k / block_values(qtype);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* r = row + b * block_bytes(qtype);
    int* q = out.q.data() + b * block_values(qtype);
    switch (qtype) {
      case kQ4_0: case kQ4_1: {
        const uint8_t* qs = r + (qtype == kQ4_0 ? 2 : 4);
        for (int i = 0; i < 16; ++i) q[i] = qs[i] & 0xF, q[i + 16] = qs[i] >> 4;
        out.d.push_back(half_bits(r));
        if (qtype == kQ4_1) out.m.push_back(half_bits(r + 2));
        break;
      }
      case kQ5_0: case kQ5_1: {
        const bool one = qtype == kQ5_1;
        uint32_t qh;
        std::memcpy(&qh, r + (one ? 4 : 2), 4);
        const uint8_t* qs = r + (one ? 8 : 6);
        for (int i = 0; i < 16; ++i) {
          q[i] = (qs[i] & 0xF) | (((qh >> i) & 1) << 4);
          q[i + 16] = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
        }
        out.d.push_back(half_bits(r));
        if (one) out.m.push_back(half_bits(r + 2));
        break;
      }
      case kQ8_0:
        for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(r[2 + i]);
        out.d.push_back(half_bits(r));
        break;
      case kQ4_K: case kQ5_K: {
        const bool five = qtype == kQ5_K;
        out.d.push_back(half_bits(r));
        out.m.push_back(half_bits(r + 2));
        for (int j = 0; j < 8; ++j) {
          int sc, mn;
          k_scale_min(r + 4, j, sc, mn);
          out.sc.push_back(static_cast<uint8_t>(sc));
          out.mn.push_back(static_cast<uint8_t>(mn));
          const uint8_t* qs = r + (five ? 48 : 16) + 32 * (j / 2);
          for (int l = 0; l < 32; ++l) {
            int v = j % 2 ? qs[l] >> 4 : qs[l] & 0xF;
            if (five) v |= ((r[16 + l] >> j) & 1) << 4;
            q[32 * j + l] = v;
          }
        }
        break;
      }
      case kQ6_K: {
        out.d.push_back(half_bits(r + 208));
        for (int i = 0; i < 16; ++i) out.sc.push_back(r[192 + i]);
        for (int v = 0; v < 256; ++v) {  // half h, quarter i, value l (ggml's dequantize_row_q6_K)
          const int h = v / 128, i = (v % 128) / 32, l = v % 32;
          const uint8_t ql = r[64 * h + 32 * (i % 2) + l];
          q[v] = (i < 2 ? ql & 0xF : ql >> 4) | (((r[128 + 32 * h + l] >> (2 * i)) & 3) << 4);
        }
        break;
      }
      default: break;
    }
  }
}

int header_bytes(int qtype) {
  switch (qtype) {
    case kQ4_1: case kQ5_1: return 64;
    case kQ4_K: case kQ5_K: return 64 + 256;
    case kQ6_K: return 32 + 256;
    default: return 32;
  }
}

// where each field of tile `t` lives (quant.h); j: sub-block index along k
struct Packed {
  uint8_t* base;
  int qtype;
  Packed(const uint8_t* w, int qtype_, int64_t k, int64_t t)
      : base(const_cast<uint8_t*>(w) + t * packed_tile_bytes(qtype_, k)), qtype(qtype_) {}

  uint8_t* unit(int64_t j) const { return base + (is_k_quant(qtype) ? j / 8 : j) * packed_block_bytes(qtype); }
  uint8_t* qs(int64_t j) const { return unit(j) + header_bytes(qtype) + (is_k_quant(qtype) ? (j % 8) * kQs : 0); }
  uint8_t* hi(int64_t j) const { return unit(j) + header_bytes(qtype) + (is_k_quant(qtype) ? 8 * kQs + (j % 8) * kHi : kQs); }
  uint8_t* hi2(int64_t j) const { return unit(j) + header_bytes(qtype) + 8 * kQs + (j % 8) * kHi2; }
  uint8_t* q8(int64_t j) const { return unit(j) + 32; }
  uint8_t* d(int64_t j, int r) const { return unit(j) + 2 * r; }
  uint8_t* m(int64_t j, int r) const { return unit(j) + 32 + 2 * r; }  // Q4_1/Q5_1's m, K's dmin
  uint8_t* sc(int64_t j, int r) const { return unit(j) + 64 + 16 * (j % 8) + r; }   // Q4_K / Q5_K
  uint8_t* mn(int64_t j, int r) const { return unit(j) + 192 + 16 * (j % 8) + r; }
  uint8_t* sc16(int64_t j, int half, int r) const { return unit(j) + 32 + 16 * (2 * (j % 8) + half) + r; }  // Q6_K

  // value o (0..31) of sub-block j of row r, as stored
  int value(int64_t j, int r, int o) const {
    const int g = o / 4, i = o % 4, byte = 4 * r + i;
    if (qtype == kQ8_0) return static_cast<int8_t>(q8(j)[64 * g + byte]);
    const uint8_t nib = qs(j)[64 * (g % 4) + byte];
    int v = g < 4 ? nib & 0xF : nib >> 4;
    if (qtype == kQ5_0 || qtype == kQ5_1 || qtype == kQ5_K) {
      uint64_t mask;
      std::memcpy(&mask, hi(j) + 8 * g, 8);
      v |= static_cast<int>((mask >> byte) & 1) << 4;
    } else if (qtype == kQ6_K) {
      v |= ((hi2(j)[64 * (g / 4) + byte] >> (2 * (g % 4))) & 3) << 4;
    }
    return v;
  }

  // w = a * value + b for values o of sub-block j of row r (Q6_K: a per 16 values, `half`)
  void affine(int64_t j, int r, int half, float& a, float& b) const {
    const float d_ = fp16_to_fp32(d(j, r));
    switch (qtype) {
      case kQ4_0: a = d_, b = -8.f * d_; return;
      case kQ5_0: a = d_, b = -16.f * d_; return;
      case kQ8_0: a = d_, b = 0.f; return;
      case kQ4_1: case kQ5_1: a = d_, b = fp16_to_fp32(m(j, r)); return;
      case kQ4_K: case kQ5_K:
        a = d_ * static_cast<float>(*sc(j, r));
        b = -(fp16_to_fp32(m(j, r)) * static_cast<float>(*mn(j, r)));
        return;
      case kQ6_K:
        a = d_ * static_cast<float>(static_cast<int8_t>(*sc16(j, half, r)));
        b = -32.f * a;
        return;
      default: a = b = 0.f;
    }
  }
};

}  // namespace

// native rows [n, row bytes] -> tiles [t0, t1); rows past n are zeros
void repack_tiles(const uint8_t* src, int qtype, int64_t n, int64_t k, uint8_t* dst, int64_t t0, int64_t t1) {
  const int64_t nb = k / kBlock, row_bytes = k / block_values(qtype) * block_bytes(qtype);
  std::memset(dst + t0 * packed_tile_bytes(qtype, k), 0, (t1 - t0) * packed_tile_bytes(qtype, k));
  NativeRow row;
  for (int64_t t = t0; t < t1; ++t) {
    Packed p(dst, qtype, k, t);
    for (int r = 0; r < kRows && t * kRows + r < n; ++r) {
      decode_native(src + (t * kRows + r) * row_bytes, qtype, k, row);
      for (int64_t j = 0; j < nb; ++j) {
        const int* q = row.q.data() + j * kBlock;
        if (qtype == kQ8_0) {
          for (int o = 0; o < kBlock; ++o) p.q8(j)[64 * (o / 4) + 4 * r + o % 4] = static_cast<uint8_t>(q[o]);
        } else {
          for (int o = 0; o < kBlock; ++o) {
            const int g = o / 4, byte = 4 * r + o % 4;
            p.qs(j)[64 * (g % 4) + byte] |= static_cast<uint8_t>((q[o] & 0xF) << (g < 4 ? 0 : 4));
            if (qtype == kQ5_0 || qtype == kQ5_1 || qtype == kQ5_K) {
              uint64_t mask;
              std::memcpy(&mask, p.hi(j) + 8 * g, 8);
              mask |= static_cast<uint64_t>((q[o] >> 4) & 1) << byte;
              std::memcpy(p.hi(j) + 8 * g, &mask, 8);
            } else if (qtype == kQ6_K) {
              p.hi2(j)[64 * (g / 4) + byte] |= static_cast<uint8_t>(((q[o] >> 4) & 3) << (2 * (g % 4)));
            }
          }
        }
        // scales: once per block of the file's (a sub-block, or a K-quant's super-block)
        if (!is_k_quant(qtype)) {
          std::memcpy(p.d(j, r), &row.d[j], 2);
          if (qtype == kQ4_1 || qtype == kQ5_1) std::memcpy(p.m(j, r), &row.m[j], 2);
        } else {
          if (j % 8 == 0) {
            std::memcpy(p.d(j, r), &row.d[j / 8], 2);
            if (qtype != kQ6_K) std::memcpy(p.m(j, r), &row.m[j / 8], 2);
          }
          if (qtype == kQ6_K) {
            for (int h = 0; h < 2; ++h) *p.sc16(j, h, r) = row.sc[2 * j + h];
          } else {
            *p.sc(j, r) = row.sc[j];
            *p.mn(j, r) = row.mn[j];
          }
        }
      }
    }
  }
}

// the plain rows: out = sum over sub-blocks of a * d_x * sum(q * x_q) + b * s_x (Q6_K by halves)
void tiles_scalar(const Job& job) {
  const int64_t nb = job.k / kBlock;
  for (int64_t t = job.t0; t < job.t1; ++t) {
    const Packed p(job.w, job.qtype, job.k, t);
    for (int r = 0; r < kRows && t * kRows + r < job.n; ++r) {
      for (int64_t m = 0; m < job.m; ++m) {
        const int8_t* x = job.xq + m * job.k;
        float acc = 0.f;
        for (int64_t j = 0; j < nb; ++j) {
          for (int half = 0; half < (job.qtype == kQ6_K ? 2 : 1); ++half) {
            const int lo = job.qtype == kQ6_K ? 16 * half : 0, hi = job.qtype == kQ6_K ? lo + 16 : kBlock;
            int isum = 0;
            for (int o = lo; o < hi; ++o) isum += p.value(j, r, o) * x[kBlock * j + o];
            float a, b;
            p.affine(j, r, half, a, b);
            const float s = job.qtype == kQ6_K ? job.xh[(m * nb + j) * 2 + half] : job.xs[m * nb + j];
            acc += a * job.xd[m * nb + j] * static_cast<float>(isum) + b * s;
          }
        }
        job.out[m * job.ldo + t * kRows + r] = acc;
      }
    }
  }
}

// rows ids of the weight, dequantized: w = a * q + b, in the order of the file's decoders
// (gguf-py's: d * (q - 8), d * q + m, (d * scale) * q - dmin * min, (d * scale) * (q - 32))
void dequantize_rows(const uint8_t* w, int qtype, int64_t k, const int64_t* ids, int64_t count, float* out) {
  const int64_t nb = k / kBlock;
  for (int64_t i = 0; i < count; ++i) {
    const Packed p(w, qtype, k, ids[i] / kRows);
    const int r = static_cast<int>(ids[i] % kRows);
    float* y = out + i * k;
    for (int64_t j = 0; j < nb; ++j) {
      for (int o = 0; o < kBlock; ++o) {
        float a, b;
        p.affine(j, r, o / 16, a, b);
        const int v = p.value(j, r, o);
        const float d_ = fp16_to_fp32(p.d(j, r));
        switch (qtype) {
          case kQ4_0: y[kBlock * j + o] = d_ * static_cast<float>(v - 8); break;
          case kQ5_0: y[kBlock * j + o] = d_ * static_cast<float>(v - 16); break;
          case kQ6_K: y[kBlock * j + o] = a * static_cast<float>(v - 32); break;
          default: y[kBlock * j + o] = a * static_cast<float>(v) + b;
        }
      }
    }
  }
}

}  // namespace ember_quant
