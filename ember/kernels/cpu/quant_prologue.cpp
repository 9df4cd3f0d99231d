// The op before a quantized layer, on one row, fused into the layer's call (quant_gemm.cpp
// `quant_linear`): compiled apart, with -ffast-math as fused.cpp's unfused ops are (their exp
// and tanh vectorized), while quant_gemm.cpp keeps IEEE arithmetic for the activations' int8
// rounding. The values are the plain ops' own (layers/norm.py, layers/activation.py), rounded
// to the model dtype T where those round.
#include <ATen/ATen.h>

#include <cmath>

#include "convert.h"
#include "quant.h"

namespace ember_quant {
namespace {

template <typename T>
inline float rounded(float v) { return ember_cpu::round_to<T>(v); }

template <typename T>
void rows(Prologue kind, const T* src, int64_t stride, int64_t count, int64_t k, const T* norm_weight, float eps,
          T* residual, float* out) {
  using ember_cpu::load;
  using ember_cpu::store;
  for (int64_t r = 0; r < count; ++r, src += stride, out += k) {
    T* res = residual == nullptr ? nullptr : residual + r * k;
    switch (kind) {
      case Prologue::kNone:
        for (int64_t i = 0; i < k; ++i) out[i] = load(src[i]);
        break;
      case Prologue::kNorm: {  // y = w * T(r / rms(r)), r = T(x + residual) (residual <- r) or x
        for (int64_t i = 0; i < k; ++i) out[i] = load(src[i]);
        if (res != nullptr) {
          for (int64_t i = 0; i < k; ++i) {
            res[i] = store<T>(out[i] + load(res[i]));
            out[i] = load(res[i]);
          }
        }
        float squares = 0.f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < k; ++i) squares += out[i] * out[i];
        const float inv = 1.f / std::sqrt(squares / static_cast<float>(k) + eps);
        for (int64_t i = 0; i < k; ++i) out[i] = rounded<T>(load(norm_weight[i]) * rounded<T>(out[i] * inv));
        break;
      }
      case Prologue::kSilu:  // src = [gate | up] of 2k values: T(T(silu(gate)) * up)
#pragma omp simd
        for (int64_t i = 0; i < k; ++i) {
          const float g = load(src[i]);
          out[i] = rounded<T>(rounded<T>(g / (1.f + std::exp(-g))) * load(src[k + i]));
        }
        break;
      case Prologue::kGeluTanh:  // T(T(gelu_tanh(gate)) * up)
#pragma omp simd
        for (int64_t i = 0; i < k; ++i) {
          const float g = load(src[i]);
          const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
          out[i] = rounded<T>(rounded<T>(0.5f * g * (1.f + std::tanh(inner))) * load(src[k + i]));
        }
        break;
    }
  }
}

}  // namespace

void prologue_rows(Prologue kind, const void* src, at::ScalarType dtype, int64_t stride, int64_t count, int64_t k,
                   const void* norm_weight, float eps, void* residual, float* out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "prologue_rows", [&] {
    rows<scalar_t>(kind, static_cast<const scalar_t*>(src), stride, count, k, static_cast<const scalar_t*>(norm_weight),
                   eps, static_cast<scalar_t*>(residual), out);
  });
}

}  // namespace ember_quant
