// Fused elementwise ops for the CPU: one pass over the rows instead of the ~10 small torch
// ops (and their float32 round trips) each of these takes per layer. The arithmetic is
// float32 and the roundings to the model dtype are where the plain-torch versions in
// ember/layers round (y = weight * T(x / rms(x)), silu rounded before the product).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "convert.h"
#include "pool.h"

namespace {

// Threads only pay past this many elements (ATen's own GRAIN_SIZE): a decode step's
// [16, 576] norm is cheaper on one thread than a fork-join of two.
constexpr int64_t kGrainElements = 32768;

inline int64_t grain(int64_t elements_per_item) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, elements_per_item));
}

using ember_cpu::load;
using ember_cpu::round_to;
using ember_cpu::store;

// rows of a [rows, n] or [tokens, heads, n] tensor whose last dim is contiguous
struct Rows {
  int64_t count, per_token, stride_token, stride_head;
  explicit Rows(const at::Tensor& x)
      : count(x.numel() / x.size(-1)),
        per_token(x.dim() == 3 ? x.size(1) : 1),
        stride_token(x.stride(0)),
        stride_head(x.dim() == 3 ? x.stride(1) : 0) {}
  int64_t offset(int64_t row) const { return (row / per_token) * stride_token + (row % per_token) * stride_head; }
};

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, T* residual, at::Tensor& out) {
  const int64_t n = x.size(-1);
  const Rows rows(x);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  ember_cpu::parallel_for(0, rows.count, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = xp + rows.offset(r);
      T* dst = op + r * n;
      if (residual != nullptr) {  // residual <- x + residual, rounded; the norm reads it
        T* res = residual + r * n;
        for (int64_t i = 0; i < n; ++i) res[i] = store<T>(load(src[i]) + load(res[i]));
        src = res;
      }
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < n; ++i) squares += load(src[i]) * load(src[i]);
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + feps);
      for (int64_t i = 0; i < n; ++i) dst[i] = store<T>(load(wp[i]) * round_to<T>(load(src[i]) * inv));
    }
  });
}

// y = weight * norm(x); with `residual`, residual += x first (in place) and y = weight * norm(residual)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const std::optional<at::Tensor>& residual) {
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1, "x must be [rows, n] or [tokens, heads, n], last dim contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous() &&
              weight.scalar_type() == x.scalar_type(), "weight must be a contiguous [n] of x's dtype");
  if (residual.has_value()) {
    TORCH_CHECK(x.dim() == 2 && residual->sizes() == x.sizes() && residual->is_contiguous() &&
                residual->scalar_type() == x.scalar_type(), "residual must be a contiguous [rows, n] like x");
  }
  auto out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x, weight, eps, residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr, out);
  });
  return out;
}

template <typename T>
void silu_and_mul_rows(const T* src, T* dst, int64_t tokens, int64_t inter) {
  ember_cpu::parallel_for(0, tokens, grain(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = src + t * 2 * inter;
      const T* up = gate + inter;
      T* o = dst + t * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float g = load(gate[i]);
        o[i] = store<T>(round_to<T>(g / (1.f + std::exp(-g))) * load(up[i]));
      }
    }
  });
}

// [tokens, 2 * inter] = [gate | up] -> [tokens, inter]: silu(gate) * up
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [tokens, 2 * inter]");
  const int64_t tokens = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({tokens, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), tokens, inter);
  });
  return out;
}

// rotate the first `rotary` dims of each row (pairs i, i + rotary / 2), the rest left as they are
template <typename T>
void rotate_rows(const at::Tensor& x, const float* cos_sin, int64_t rotary) {
  const Rows rows(x);
  const int64_t half = rotary / 2;
  T* xp = x.data_ptr<T>();
  ember_cpu::parallel_for(0, rows.count, grain(rotary), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = xp + rows.offset(r);
      const float* cos = cos_sin + (r / rows.per_token) * rotary;
      const float* sin = cos + half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = load(row[i]), x2 = load(row[i + half]);
        row[i] = store<T>(x1 * cos[i] - x2 * sin[i]);
        row[i + half] = store<T>(x2 * cos[i] + x1 * sin[i]);
      }
    }
  });
}

// rotate-half RoPE of q [tokens, heads, dim] and k [tokens, kv_heads, dim] in place (they may
// be views of the fused qkv output); cos_sin [tokens, rotary] float32 = cos | sin, rotary <= dim:
// the first `rotary` dims of each head turn (partial RoPE where rotary < dim), the rest pass
// With the cache given (v, k_cache, v_cache, slot_mapping), token t's rotated k and its v are
// then stored in cache slot slot_mapping[t] (k_cache[slot / block_size][slot % block_size]),
// as CUDA's RoPE kernel does: one call a layer instead of RoPE and two index copies.
void rotary_inplace(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos_sin,
                    const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& k_cache,
                    const std::optional<at::Tensor>& v_cache, const std::optional<at::Tensor>& slot_mapping) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(-1) == 1 && k.stride(-1) == 1 && q.size(0) == k.size(0) &&
              q.size(2) == k.size(2) && q.scalar_type() == k.scalar_type(), "q and k must be [tokens, heads, dim] alike");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.is_contiguous() && cos_sin.scalar_type() == at::kFloat &&
              cos_sin.size(0) == q.size(0) && cos_sin.size(1) <= q.size(2) && cos_sin.size(1) % 2 == 0,
              "cos_sin must be a contiguous float32 [tokens, rotary], rotary even and at most dim");
  const bool write = k_cache.has_value();
  if (write) {
    TORCH_CHECK(v.has_value() && v_cache.has_value() && slot_mapping.has_value(), "the cache write needs v, both caches and slots");
    TORCH_CHECK(v->sizes() == k.sizes() && v->stride(-1) == 1 && v->scalar_type() == k.scalar_type(), "v must be shaped as k");
    const auto ct = k_cache->scalar_type();
    TORCH_CHECK(k_cache->dim() == 4 && k_cache->is_contiguous() && v_cache->is_contiguous() &&
                k_cache->sizes() == v_cache->sizes() && v_cache->scalar_type() == ct &&
                (ct == k.scalar_type() || ct == at::kHalf || ct == at::kBFloat16 || ct == at::kFloat) &&
                k_cache->size(2) == k.size(1) && k_cache->size(3) == k.size(2),
                "caches must be contiguous [blocks, block_size, kv_heads, dim], in k's dtype or a float one");
    TORCH_CHECK(slot_mapping->scalar_type() == at::kLong && slot_mapping->dim() == 1 && slot_mapping->is_contiguous() &&
                slot_mapping->size(0) == k.size(0), "slot_mapping must be a contiguous int64 [tokens]");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_inplace", [&] {
    rotate_rows<scalar_t>(q, cos_sin.data_ptr<float>(), cos_sin.size(1));
    rotate_rows<scalar_t>(k, cos_sin.data_ptr<float>(), cos_sin.size(1));
    if (!write) return;
    const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2), slots = k_cache->size(0) * k_cache->size(1);
    const int64_t* slot = slot_mapping->data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot ", slot[t], " is not in the cache");
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v->data_ptr<scalar_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache->scalar_type(), "cache_write", [&] {
      using C = scalar_t;  // the cache's dtype: rows converted as they go in (rounded to nearest even)
      C* kc = k_cache->data_ptr<C>();
      C* vc = v_cache->data_ptr<C>();
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
          const auto* ks = kp + t * k.stride(0) + h * k.stride(1);
          const auto* vs = vp + t * v->stride(0) + h * v->stride(1);
          C* kd = kc + (slot[t] * heads + h) * dim;
          C* vd = vc + (slot[t] * heads + h) * dim;
          for (int64_t d = 0; d < dim; ++d) kd[d] = store<C>(load(ks[d])), vd[d] = store<C>(load(vs[d]));
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual=None) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_inplace(Tensor(a!) q, Tensor(b!) k, Tensor cos_sin, Tensor? v=None, Tensor(c!)? k_cache=None, "
        "Tensor(d!)? v_cache=None, Tensor? slot_mapping=None) -> ()");
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_inplace", &rotary_inplace);
}
