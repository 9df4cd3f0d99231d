// Linear layers on GGUF block-quantized weights (quant.h says the layout and the arithmetic):
// the file's rows are repacked once into tiles of 16 (`quant_repack`), activations are
// quantized to int8 per block of 32 (`quantize_rows`, or fused with the op before the layer:
// `quant_linear`), then `quant_matmul` takes the integer dot products. One path for decode
// rows and prefill alike: the tiles go to the threads a few at a time (from a shared counter:
// pool.h), and each tile meets the activation rows a few at a time while its bytes are in L1.
// The SIMD rows (quant_simd.cpp) are chosen at run time by what the CPU has; `quant_isa`
// forces one (tests) and says which runs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "pool.h"
#include "quant.h"

namespace ember_quant {

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

void run_tiles(const Job& job) {
#if defined(EMBER_QUANT_X86)
  if (g_isa == Isa::kAvx512) return avx512::tiles(job);
  if (g_isa == Isa::kAvx2) return avx2::tiles(job);
#endif
  tiles_scalar(job);
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
void quantize_block(const float* x, int8_t* q, float* d, float* s, float* h) {
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / 127.f;
  const float inv = scale != 0.f ? 1.f / scale : 0.f;
  int sums[2] = {0, 0};
  for (int i = 0; i < kBlock; ++i) {
    const int v = static_cast<int>(std::nearbyint(x[i] * inv));
    q[i] = static_cast<int8_t>(v);
    sums[i / 16] += v;
  }
  *d = scale;
  *s = scale * static_cast<float>(sums[0] + sums[1]);
  h[0] = scale * static_cast<float>(sums[0]);
  h[1] = scale * static_cast<float>(sums[1]);
}

Prologue prologue_of(const std::string& name) {
  if (name == "none") return Prologue::kNone;
  if (name == "norm") return Prologue::kNorm;
  if (name == "silu") return Prologue::kSilu;
  if (name == "gelu_tanh") return Prologue::kGeluTanh;
  TORCH_CHECK(false, "unknown prologue '", name, "': use none, norm, silu or gelu_tanh");
}

struct Quantized {
  at::Tensor q, d, s, h;
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
  const auto f32 = x.options().dtype(at::kFloat);
  Quantized out{at::empty({m, k}, x.options().dtype(at::kChar)), at::empty({m, k / kBlock}, f32),
                at::empty({m, k / kBlock}, f32), at::empty({m, k / kBlock, 2}, f32)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = kind == Prologue::kNorm ? norm_weight->data_ptr<scalar_t>() : nullptr;
    scalar_t* rp = kind == Prologue::kNorm && residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr;
    int8_t* qp = out.q.data_ptr<int8_t>();
    float* dp = out.d.data_ptr<float>();
    float* sp = out.s.data_ptr<float>();
    float* hp = out.h.data_ptr<float>();
    const int64_t nb = k / kBlock, stride = x.stride(0);
    const int64_t per_item = std::max<int64_t>(1, 8192 / k);  // rows an item: one row is ~1 us
    ember_cpu::Pool::get().run((m + per_item - 1) / per_item, [&](int64_t item) {
      const int64_t r0 = item * per_item, count = std::min(m, (item + 1) * per_item) - r0;
      std::vector<float> rows(count * k);
      prologue_rows(kind, xp + r0 * stride, x.scalar_type(), stride, count, k, wp, static_cast<float>(eps),
                    rp ? rp + r0 * k : nullptr, rows.data());
      for (int64_t r = r0; r < r0 + count; ++r)
        for (int64_t b = 0; b < nb; ++b)
          quantize_block(rows.data() + (r - r0) * k + b * kBlock, qp + r * k + b * kBlock, dp + r * nb + b,
                         sp + r * nb + b, hp + (r * nb + b) * 2);
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  Quantized q = quantize(x, Prologue::kNone, std::nullopt, 0.0, std::nullopt);
  return {q.q, q.d, q.s, q.h};
}

// y[M, N] = dequant(w) @ dequant(xq)^T (+ bias), in `dtype`; w: tiles (quant_repack)
at::Tensor quant_matmul(const at::Tensor& xq, const at::Tensor& xd, const at::Tensor& xs, const at::Tensor& xh,
                        const at::Tensor& w, int64_t qtype, int64_t n, const std::optional<at::Tensor>& bias,
                        at::ScalarType dtype) {
  const int q = static_cast<int>(qtype);
  TORCH_CHECK(block_values(q) > 0, "no kernel for GGML type ", qtype);
  TORCH_CHECK(xq.dim() == 2 && xq.is_contiguous() && xq.scalar_type() == at::kChar, "xq must be contiguous int8 [m, k]");
  const int64_t m = xq.size(0), k = xq.size(1), nb = k / kBlock;
  TORCH_CHECK(k % block_values(q) == 0, "k (", k, ") must be a multiple of the type's block (", block_values(q), ")");
  TORCH_CHECK(xd.is_contiguous() && xs.is_contiguous() && xh.is_contiguous() && xd.numel() == m * nb &&
              xs.numel() == m * nb && xh.numel() == 2 * m * nb, "xd, xs must be contiguous [m, k / 32], xh [m, k / 32, 2]");
  const int64_t tiles = (n + kRows - 1) / kRows;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == tiles * packed_tile_bytes(q, k),
              "w must be the repacked tiles of ", n, " rows of ", k, " values (", tiles * packed_tile_bytes(q, k),
              " bytes; quant_repack makes them)");
  auto out = at::empty({m, n}, xq.options().dtype(at::kFloat));
  Job job{w.data_ptr<uint8_t>(), q, k, n, xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<float>(),
          xh.data_ptr<float>(), m, out.data_ptr<float>(), n, 0, 0};
  // a few items a thread: enough for a late or slow thread to leave its share to the others,
  // few enough that taking them (an atomic each, the counter's line moving between cores) is cheap
  const int64_t per_item = std::max<int64_t>(1, tiles / (4 * at::get_num_threads()));
  ember_cpu::Pool::get().run((tiles + per_item - 1) / per_item, [&](int64_t item) {
    Job part = job;
    part.t0 = item * per_item;
    part.t1 = std::min(tiles, (item + 1) * per_item);
    run_tiles(part);
  });
  if (bias.has_value()) out.add_(*bias);
  return dtype == at::kFloat ? out : out.to(dtype);
}

// GGUF rows [n, row bytes] -> the tiles the matmul takes (quant.h)
at::Tensor quant_repack(const at::Tensor& w, int64_t qtype) {
  const int q = static_cast<int>(qtype);
  TORCH_CHECK(block_values(q) > 0, "no kernel for GGML type ", qtype);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) % block_bytes(q) == 0,
              "w must be contiguous uint8 [rows, whole blocks of the type]");
  const int64_t n = w.size(0), k = w.size(1) / block_bytes(q) * block_values(q);
  const int64_t tiles = (n + kRows - 1) / kRows;
  auto out = at::empty({tiles * packed_tile_bytes(q, k)}, w.options());
  ember_cpu::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    repack_tiles(w.data_ptr<uint8_t>(), q, n, k, out.data_ptr<uint8_t>(), t0, t1);
  });
  return out;
}

// rows `ids` of repacked tiles, dequantized to float32 (an embedding lookup)
at::Tensor quant_rows(const at::Tensor& w, int64_t qtype, int64_t n, int64_t k, const at::Tensor& ids) {
  const int q = static_cast<int>(qtype);
  TORCH_CHECK(block_values(q) > 0 && k % block_values(q) == 0, "k must hold whole blocks of GGML type ", qtype);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() &&
              w.numel() == (n + kRows - 1) / kRows * packed_tile_bytes(q, k), "w must be the repacked tiles");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), "ids must be a contiguous int64 vector");
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "row id ", ip[i], " is not in [0, ", n, ")");
  auto out = at::empty({ids.numel(), k}, w.options().dtype(at::kFloat));
  dequantize_rows(w.data_ptr<uint8_t>(), q, k, ip, ids.numel(), out.data_ptr<float>());
  return out;
}

// y = quant_matmul(quantize(prologue(x))): one call a layer. prologue "norm" also adds x into
// `residual` in place first, where given (the decoder's residual stream)
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t n,
                        const std::optional<at::Tensor>& bias, const std::string& prologue,
                        const std::optional<at::Tensor>& norm_weight, double eps,
                        const std::optional<at::Tensor>& residual) {
  Quantized q = quantize(x, prologue_of(prologue), norm_weight, eps, residual);
  return quant_matmul(q.q, q.d, q.s, q.h, w, qtype, n, bias, x.scalar_type());
}

}  // namespace
}  // namespace ember_quant

TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("quant_matmul(Tensor xq, Tensor xd, Tensor xs, Tensor xh, Tensor w, int qtype, int n, Tensor? bias, "
        "ScalarType dtype) -> Tensor");
  m.def("quant_repack(Tensor w, int qtype) -> Tensor");
  m.def("quant_rows(Tensor w, int qtype, int n, int k, Tensor ids) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor w, int qtype, int n, Tensor? bias, str prologue, Tensor? norm_weight, "
        "float eps, Tensor(a!)? residual) -> Tensor");
  m.def("quant_isa(str want) -> str", &ember_quant::quant_isa);
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) {
  m.impl("quantize_rows", &ember_quant::quantize_rows);
  m.impl("quant_matmul", &ember_quant::quant_matmul);
  m.impl("quant_linear", &ember_quant::quant_linear);
  m.impl("quant_repack", &ember_quant::quant_repack);
  m.impl("quant_rows", &ember_quant::quant_rows);
}
