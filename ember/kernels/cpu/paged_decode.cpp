// Paged decode attention on the CPU: one query token per sequence, read straight from the
// paged K/V cache (no gather, no upcast of the whole context), float32 math.
//
// Work item = (sequence, KV head): the group of query heads that share the KV head read
// each cached K and V row once. Rows of the cache:
//     slot(t) = block_tables[b, t / block_size] * block_size + t % block_size
//     k_cache[slot(t) / block_size][slot(t) % block_size][kv_head][:]
//
// A layer's options (ember/layers/attention/base.py): with a sliding window W > 0 the query
// (position len - 1) sees only the keys t in [max(0, len - W), len), and only those are
// read; with a soft cap c > 0 each score s becomes c * tanh(s / c) before the softmax.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "pool.h"

namespace {

constexpr int64_t kThreadRows = 256;  // context rows a thread: KV rows come from DRAM (the weights stream evicts them)

// a cache row as float32: itself in a float32 cache, else converted into `buf`
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
#if defined(__F16C__)
    if constexpr (std::is_same_v<T, at::Half>) {  // c10's conversion is scalar bit work: 8 at a time here
      int64_t i = 0;
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
      for (; i < n; ++i) buf[i] = ember_cpu::load(src[i]);
      return buf;
    }
#endif
    for (int64_t i = 0; i < n; ++i) buf[i] = ember_cpu::load(src[i]);
    return buf;
  }
}

// kDim > 0: the head size as a compile-time constant, so the inner loops unroll (2x faster
// at 64); 0: read from q
template <typename T, typename TKV, int64_t kDim>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
            double softcap, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = kDim > 0 ? kDim : q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, max_blocks = block_tables.size(1);
  const int64_t q_seq_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t slot_stride = kv_heads * dim, block_stride = block_size * slot_stride;
  const T* qp = q.data_ptr<T>();
  const TKV* kp = k_cache.data_ptr<TKV>();
  const TKV* vp = v_cache.data_ptr<TKV>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const float cap = static_cast<float>(softcap), inv_cap = softcap > 0 ? static_cast<float>(1.0 / softcap) : 0.f;
  // the first key a query sees:  keys  0 ... first ... len - 1   (first = 0 without a window)
  auto first_key = [window](int64_t len) { return window > 0 ? std::max<int64_t>(0, len - window) : int64_t{0}; };

  // f(i, row) for keys first + i, i in [0, len): a block's rows one after another (one division a
  // block, not two a key; the next row prefetched)
  auto each_key = [&](const int32_t* table, int64_t first, int64_t len, const TKV* base, auto&& f) {
    for (int64_t i = 0; i < len;) {
      const int64_t t = first + i, offset = t % block_size, run = std::min(block_size - offset, len - i);
      const TKV* row = base + table[t / block_size] * block_stride + offset * slot_stride;
      for (int64_t j = 0; j < run; ++j, ++i, row += slot_stride) {
        __builtin_prefetch(row + 4 * slot_stride);
        f(i, row);
      }
    }
  };

  // threads pay past ~256 context rows in all (batch 1 at a short context runs on one)
  int64_t rows = 0;
  for (int64_t b = 0; b < batch; ++b) rows += (lens[b] - first_key(lens[b])) * kv_heads;
  const int64_t grain = std::max<int64_t>(1, kThreadRows * batch * kv_heads / std::max<int64_t>(1, rows));
  ember_cpu::parallel_for(0, batch * kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), row(dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, kv_head = item % kv_heads, first = first_key(lens[b]);
      const int64_t len = lens[b] - first;  // keys first .. lens[b] - 1; scores[g * len + i] is key first + i
      const int32_t* table = tables + b * max_blocks;
      for (int64_t g = 0; g < group; ++g) {
        const T* src = qp + b * q_seq_stride + (kv_head * group + g) * q_head_stride;
        for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = ember_cpu::load(src[d]) * fscale;
      }
      scores.resize(group * len);
      each_key(table, first, len, kp + kv_head * dim, [&](int64_t i, const TKV* k) {
        const float* kf = as_float(k, row.data(), dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qg[d] * kf[d];
          scores[g * len + i] = s;
        }
      });
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        if (cap > 0) {
          for (int64_t i = 0; i < len; ++i) s[i] = cap * std::tanh(s[i] * inv_cap);
        }
        const float top = *std::max_element(s, s + len);
        float total = 0.f;
        for (int64_t i = 0; i < len; ++i) total += (s[i] = std::exp(s[i] - top));
        const float inv = 1.f / total;
        for (int64_t i = 0; i < len; ++i) s[i] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      each_key(table, first, len, vp + kv_head * dim, [&](int64_t i, const TKV* v) {
        const float* vf = as_float(v, row.data(), dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + i];
          float* a = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += p * vf[d];
        }
      });
      for (int64_t g = 0; g < group; ++g) {
        T* dst = op + (b * heads + kv_head * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = ember_cpu::store<T>(acc[g * dim + d]);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window, double softcap) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none), got ", softcap);  // (-ffast-math: no NaN checks)
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [num_seqs, heads, head_dim] with unit last stride");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  const auto cache_type = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == cache_type && (cache_type == q.scalar_type() ||
              (q.scalar_type() == at::kFloat && (cache_type == at::kHalf || cache_type == at::kBFloat16))),
              "the caches must be in q's dtype, or float16 / bfloat16 with a float32 q");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0, "head shapes do not match");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
              seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "block_tables and seq_lens must be contiguous int32");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && seq_lens.size(0) == q.size(0), "one table and length per query");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  auto run = [&](auto q_type, auto cache_type_) {
    using T = decltype(q_type);
    using TKV = decltype(cache_type_);
    if (q.size(2) == 64) {
      attend<T, TKV, 64>(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, out);
    } else if (q.size(2) == 128) {
      attend<T, TKV, 128>(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, out);
    } else {
      attend<T, TKV, 0>(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, out);
    }
  };
  if (cache_type == at::kHalf && q.scalar_type() == at::kFloat) {
    run(float{}, at::Half{});
  } else if (cache_type == at::kBFloat16 && q.scalar_type() == at::kFloat) {
    run(float{}, at::BFloat16{});
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention",
                                    [&] { run(scalar_t{}, scalar_t{}); });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  // window 0: the whole context; softcap 0: plain scores
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window=0, float softcap=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
