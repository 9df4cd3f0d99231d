// Linear layers on GGUF block-quantized weights, kept in the file's own block layout
// (quant.h says the arithmetic): activations are quantized to int8 per block of 32
// (`quantize_rows`), then `quant_matmul` takes the integer dot products block by block.
// One path for decode rows and prefill alike: the output rows are split between threads in
// runs of kRunRows weight rows (taken from a shared counter: pool.h), and each weight row
// meets the activation rows a few at a time while its bytes are in L1. The SIMD rows (quant_simd.cpp) are chosen at run time by
// what the CPU has; `quant_isa` forces one (tests) and says which runs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "convert.h"
#include "pool.h"
#include "quant.h"

namespace ember_quant {

// ---- the plain rows: any CPU, and the reference the SIMD rows are tested against
namespace {

// sub-block j of a weight row as integers: w_i = a * scale_i * (q_i - offset) + b
struct SubBlock {
  int q[kBlock];
  int scale[2] = {1, 1};  // per 16 values (Q6_K); 1 elsewhere
  int offset = 0;
  float a = 0.f, b = 0.f;
};

void decode(const uint8_t* row, int qtype, int64_t j, SubBlock& sb) {
  switch (qtype) {
    case kQ4_0: case kQ4_1: {
      const uint8_t* r = row + j * (qtype == kQ4_0 ? 18 : 20);
      const uint8_t* qs = r + (qtype == kQ4_0 ? 2 : 4);
      for (int i = 0; i < 16; ++i) sb.q[i] = qs[i] & 0xF, sb.q[i + 16] = qs[i] >> 4;
      sb.a = fp16_to_fp32(r);
      if (qtype == kQ4_0) sb.offset = 8; else sb.b = fp16_to_fp32(r + 2);
      return;
    }
    case kQ5_0: case kQ5_1: {
      const bool one = qtype == kQ5_1;
      const uint8_t* r = row + j * (one ? 24 : 22);
      uint32_t qh;
      std::memcpy(&qh, r + (one ? 4 : 2), 4);
      const uint8_t* qs = r + (one ? 8 : 6);
      for (int i = 0; i < 16; ++i) {
        sb.q[i] = (qs[i] & 0xF) | (((qh >> i) & 1) << 4);
        sb.q[i + 16] = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
      }
      sb.a = fp16_to_fp32(r);
      if (one) sb.b = fp16_to_fp32(r + 2); else sb.offset = 16;
      return;
    }
    case kQ8_0: {
      const uint8_t* r = row + j * 34;
      for (int i = 0; i < 32; ++i) sb.q[i] = static_cast<int8_t>(r[2 + i]);
      sb.a = fp16_to_fp32(r);
      return;
    }
    case kQ4_K: case kQ5_K: {
      const bool five = qtype == kQ5_K;
      const uint8_t* r = row + (j / 8) * (five ? 176 : 144);
      const int sub = static_cast<int>(j % 8), c = sub / 2;
      const uint8_t* qs = r + (five ? 48 : 16) + 32 * c;
      for (int l = 0; l < 32; ++l) {
        int v = sub % 2 ? qs[l] >> 4 : qs[l] & 0xF;
        if (five) v |= ((r[16 + l] >> sub) & 1) << 4;
        sb.q[l] = v;
      }
      int sc, mn;
      k_scale_min(r + 4, sub, sc, mn);
      sb.a = fp16_to_fp32(r) * sc;
      sb.b = -fp16_to_fp32(r + 2) * mn;
      return;
    }
    case kQ6_K: {
      const uint8_t* r = row + (j / 8) * 210;
      const int sub = static_cast<int>(j % 8), h = sub / 4, i = sub % 4;
      const uint8_t* ql = r + 64 * h + (i % 2 ? 32 : 0);
      const uint8_t* qh = r + 128 + 32 * h;
      for (int l = 0; l < 32; ++l)
        sb.q[l] = (i < 2 ? ql[l] & 0xF : ql[l] >> 4) | (((qh[l] >> (2 * i)) & 3) << 4);
      const int8_t* scales = reinterpret_cast<const int8_t*>(r + 192) + 8 * h + 2 * i;
      sb.scale[0] = scales[0], sb.scale[1] = scales[1];
      sb.offset = 32;
      sb.a = fp16_to_fp32(r + 208);
      return;
    }
    default: return;
  }
}

}  // namespace

void rows_scalar(const Job& job) {
  const int64_t nb = job.k / kBlock;
  SubBlock sb;
  for (int64_t n = job.n0; n < job.n1; ++n) {
    const uint8_t* row = job.w + n * job.row_bytes;
    for (int64_t m = 0; m < job.m; ++m) {
      const int8_t* xq = job.xq + m * job.k;
      float acc = 0.f;
      for (int64_t j = 0; j < nb; ++j) {
        decode(row, job.qtype, j, sb);
        int isum = 0;
        for (int i = 0; i < kBlock; ++i) isum += sb.scale[i / 16] * (sb.q[i] - sb.offset) * xq[kBlock * j + i];
        acc += sb.a * job.xd[(m * nb + j) * 8] * static_cast<float>(isum) + sb.b * job.xs[(m * nb + j) * 8];
      }
      job.out[m * job.ldo + n] = acc;
    }
  }
}

namespace {

// ---- which rows run
enum class Isa { kScalar, kAvx2, kAvx512 };

bool cpu_has(Isa isa) {
#if defined(EMBER_QUANT_X86)
  __builtin_cpu_init();
  if (isa == Isa::kAvx2)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == Isa::kAvx512)
    return cpu_has(Isa::kAvx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
  return isa == Isa::kScalar;
}

Isa best() { return cpu_has(Isa::kAvx512) ? Isa::kAvx512 : cpu_has(Isa::kAvx2) ? Isa::kAvx2 : Isa::kScalar; }

Isa g_isa = best();

const char* isa_name(Isa isa) { return isa == Isa::kAvx512 ? "avx512_vnni" : isa == Isa::kAvx2 ? "avx2" : "scalar"; }

void run_rows(const Job& job) {
#if defined(EMBER_QUANT_X86)
  if (g_isa == Isa::kAvx512) return avx512::rows(job);
  if (g_isa == Isa::kAvx2) return avx2::rows(job);
#endif
  rows_scalar(job);
}

// "" reads the choice; "best", "avx512_vnni", "avx2" or "scalar" sets it (an instruction
// set the CPU lacks is an error). Returns the choice in force.
std::string quant_isa(const std::string& want) {
  if (!want.empty()) {
    Isa isa = want == "best" ? best() : want == "avx512_vnni" ? Isa::kAvx512 : want == "avx2" ? Isa::kAvx2
            : want == "scalar" ? Isa::kScalar : static_cast<Isa>(-1);
    TORCH_CHECK(isa == Isa::kScalar || isa == Isa::kAvx2 || isa == Isa::kAvx512,
                "unknown instruction set '", want, "': use best, avx512_vnni, avx2 or scalar");
    TORCH_CHECK(cpu_has(isa), "this CPU cannot run the ", isa_name(isa), " kernels");
    g_isa = isa;
  }
  return isa_name(g_isa);
}

// ---- activations: [M, K] float -> int8 per block of 32, scale d, and s = d * sum(q)
void quantize_block(const float* x, int8_t* q, float* d8, float* s8) {
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / 127.f;
  const float inv = scale != 0.f ? 1.f / scale : 0.f;
  int sum = 0;
  for (int i = 0; i < kBlock; ++i) {
    const int v = static_cast<int>(std::nearbyint(x[i] * inv));
    q[i] = static_cast<int8_t>(v);
    sum += v;
  }
  for (int i = 0; i < 8; ++i) d8[i] = scale, s8[i] = i == 0 ? scale * static_cast<float>(sum) : 0.f;
}

// What runs on a row before it is quantized (the op the layer before would run, fused in):
// the values each produces are the plain ops' own (layers/norm.py, layers/activation.py),
// rounded to the model dtype T where those round.
enum class Prologue { kNone, kNorm, kSilu, kGeluTanh };

Prologue prologue_of(const std::string& name) {
  if (name == "none") return Prologue::kNone;
  if (name == "norm") return Prologue::kNorm;
  if (name == "silu") return Prologue::kSilu;
  if (name == "gelu_tanh") return Prologue::kGeluTanh;
  TORCH_CHECK(false, "unknown prologue '", name, "': use none, norm, silu or gelu_tanh");
}

template <typename T>
inline float rounded(float v) { return ember_cpu::round_to<T>(v); }

// row -> k float values in out; src is the row as the layer receives it
template <typename T>
void prologue_row(Prologue kind, const T* src, int64_t k, const T* norm_weight, float eps, T* residual, float* out) {
  using ember_cpu::load;
  using ember_cpu::store;
  switch (kind) {
    case Prologue::kNone:
      for (int64_t i = 0; i < k; ++i) out[i] = load(src[i]);
      return;
    case Prologue::kNorm: {  // y = w * T(r / rms(r)), r = T(x + residual) (residual <- r) or x
      for (int64_t i = 0; i < k; ++i) out[i] = load(src[i]);
      if (residual != nullptr) {
        for (int64_t i = 0; i < k; ++i) {
          residual[i] = store<T>(out[i] + load(residual[i]));
          out[i] = load(residual[i]);
        }
      }
      float squares = 0.f;
      for (int64_t i = 0; i < k; ++i) squares += out[i] * out[i];
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(k) + eps);
      for (int64_t i = 0; i < k; ++i) out[i] = rounded<T>(load(norm_weight[i]) * rounded<T>(out[i] * inv));
      return;
    }
    case Prologue::kSilu:  // src = [gate | up] of 2k values: T(T(silu(gate)) * up)
      for (int64_t i = 0; i < k; ++i) {
        const float g = load(src[i]);
        out[i] = rounded<T>(rounded<T>(g / (1.f + std::exp(-g))) * load(src[k + i]));
      }
      return;
    case Prologue::kGeluTanh:  // T(T(gelu_tanh(gate)) * up)
      for (int64_t i = 0; i < k; ++i) {
        const float g = load(src[i]);
        const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
        out[i] = rounded<T>(rounded<T>(0.5f * g * (1.f + std::tanh(inner))) * load(src[k + i]));
      }
      return;
  }
}

struct Quantized {
  at::Tensor q, d, s;
};

// x [M, K] (the prologue's input: [M, 2K] for the activations) -> its quantized rows
Quantized quantize(const at::Tensor& x, Prologue kind, const std::optional<at::Tensor>& norm_weight, double eps,
                   const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, k] with contiguous rows");
  const bool gated = kind == Prologue::kSilu || kind == Prologue::kGeluTanh;
  const int64_t m = x.size(0), k = gated ? x.size(1) / 2 : x.size(1);
  TORCH_CHECK(!gated || x.size(1) % 2 == 0, "a gated activation takes [rows, 2 * k]");
  TORCH_CHECK(k % kBlock == 0, "k (", k, ") must be a multiple of ", kBlock);
  if (kind == Prologue::kNorm) {
    TORCH_CHECK(norm_weight.has_value() && norm_weight->dim() == 1 && norm_weight->size(0) == k &&
                norm_weight->is_contiguous() && norm_weight->scalar_type() == x.scalar_type(),
                "the norm takes a contiguous weight [k] of x's dtype");
    if (residual.has_value())
      TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                  residual->scalar_type() == x.scalar_type(), "residual must be a contiguous tensor like x");
  }
  Quantized out{at::empty({m, k}, x.options().dtype(at::kChar)),
                at::empty({m, k / kBlock, 8}, x.options().dtype(at::kFloat)),
                at::empty({m, k / kBlock, 8}, x.options().dtype(at::kFloat))};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = kind == Prologue::kNorm ? norm_weight->data_ptr<scalar_t>() : nullptr;
    scalar_t* rp = kind == Prologue::kNorm && residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr;
    int8_t* qp = out.q.data_ptr<int8_t>();
    float* dp = out.d.data_ptr<float>();
    float* sp = out.s.data_ptr<float>();
    const int64_t nb = k / kBlock, stride = x.stride(0);
    const int64_t per_item = std::max<int64_t>(1, 8192 / k);  // rows an item: one row is ~1 us
    ember_cpu::Pool::get().run((m + per_item - 1) / per_item, [&](int64_t item) {
      std::vector<float> row(k);
      for (int64_t r = item * per_item; r < std::min(m, (item + 1) * per_item); ++r) {
        prologue_row<scalar_t>(kind, xp + r * stride, k, wp, static_cast<float>(eps), rp ? rp + r * k : nullptr,
                               row.data());
        for (int64_t b = 0; b < nb; ++b)
          quantize_block(row.data() + b * kBlock, qp + r * k + b * kBlock, dp + (r * nb + b) * 8, sp + (r * nb + b) * 8);
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  Quantized q = quantize(x, Prologue::kNone, std::nullopt, 0.0, std::nullopt);
  return {q.q, q.d, q.s};
}

// weight rows a thread takes at a time: a decode row's work per run stays above the
// fork-join's cost, and the runs split evenly between two threads
constexpr int64_t kRunRows = 16;

// y[M, N] = dequant(w) @ dequant(xq)^T (+ bias), in `dtype`
at::Tensor quant_matmul(const at::Tensor& xq, const at::Tensor& xd, const at::Tensor& xs, const at::Tensor& w,
                        int64_t qtype, int64_t n, const std::optional<at::Tensor>& bias, at::ScalarType dtype) {
  const int per = block_values(static_cast<int>(qtype));
  TORCH_CHECK(per > 0, "no kernel for GGML type ", qtype);
  TORCH_CHECK(xq.dim() == 2 && xq.is_contiguous() && xq.scalar_type() == at::kChar, "xq must be contiguous int8 [m, k]");
  const int64_t m = xq.size(0), k = xq.size(1);
  TORCH_CHECK(k % per == 0, "k (", k, ") must be a multiple of the type's block (", per, ")");
  TORCH_CHECK(xd.is_contiguous() && xs.is_contiguous() && xd.numel() == m * k / kBlock * 8 && xs.numel() == xd.numel(),
              "xd and xs must be contiguous [m, k / 32, 8]");
  const int64_t row_bytes = k / per * block_bytes(static_cast<int>(qtype));
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == n * row_bytes,
              "w must be contiguous uint8 holding ", n, " rows of ", row_bytes, " bytes");
  auto out = at::empty({m, n}, xq.options().dtype(at::kFloat));
  Job job{w.data_ptr<uint8_t>(), row_bytes, static_cast<int>(qtype), k, xq.data_ptr<int8_t>(),
          xd.data_ptr<float>(), xs.data_ptr<float>(), m, out.data_ptr<float>(), n, 0, 0};
  ember_cpu::Pool::get().run((n + kRunRows - 1) / kRunRows, [&](int64_t run) {
    Job part = job;
    part.n0 = run * kRunRows;
    part.n1 = std::min(n, (run + 1) * kRunRows);
    run_rows(part);
  });
  if (bias.has_value()) out.add_(*bias);
  return dtype == at::kFloat ? out : out.to(dtype);
}

// y = quant_matmul(quantize(prologue(x))): one call a layer. prologue "norm" also adds x into
// `residual` in place first, where given (the decoder's residual stream)
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t n,
                        const std::optional<at::Tensor>& bias, const std::string& prologue,
                        const std::optional<at::Tensor>& norm_weight, double eps,
                        const std::optional<at::Tensor>& residual) {
  Quantized q = quantize(x, prologue_of(prologue), norm_weight, eps, residual);
  return quant_matmul(q.q, q.d, q.s, w, qtype, n, bias, x.scalar_type());
}

}  // namespace
}  // namespace ember_quant

TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("quant_matmul(Tensor xq, Tensor xd, Tensor xs, Tensor w, int qtype, int n, Tensor? bias, ScalarType dtype) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor w, int qtype, int n, Tensor? bias, str prologue, Tensor? norm_weight, "
        "float eps, Tensor(a!)? residual) -> Tensor");
  m.def("quant_isa(str want) -> str", &ember_quant::quant_isa);
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) {
  m.impl("quantize_rows", &ember_quant::quantize_rows);
  m.impl("quant_matmul", &ember_quant::quant_matmul);
  m.impl("quant_linear", &ember_quant::quant_linear);
}
