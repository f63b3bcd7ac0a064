// Paged decode attention for CPUs: one query token per sequence against its cached K/V, read in place.
//
// Why not gather + matmul (the torch backend): that copies every cached K/V row into a contiguous tensor and reads
// the copy again, so a decode step moves each byte of the cache three times; here each row is read once, converted
// to fp32 in registers, and folded into an online softmax. Work is split over (sequence, KV head) pairs with
// at::parallel_for, so torch.set_num_threads governs it like every other CPU op.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {  // bf16 is the top half of an fp32: a shift, which vectorizes
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// One cached row (head_dim values) as fp32, times its INT8 scale when the cache is quantized.
template <typename T>
inline void load_row(const T* src, float scale, int64_t head_dim, float* dst) {
#pragma omp simd
  for (int64_t d = 0; d < head_dim; ++d) dst[d] = to_float(src[d]) * scale;
}

// Ask for a block's rows before they are needed: blocks are scattered, so the hardware prefetcher restarts at each.
template <typename T>
inline void prefetch_rows(const T* first, int64_t row_stride, int64_t rows, int64_t head_dim) {
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t byte = 0; byte < head_dim * static_cast<int64_t>(sizeof(T)); byte += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(first + t * row_stride) + byte);
}

// HEAD_DIM > 0 fixes the row width at compile time (64 and 128 cover the Llama family): the loops over it unroll.
template <typename T, int64_t HEAD_DIM>
void decode(const float* q, const T* k, const T* v, const c10::Half* k_scale, const c10::Half* v_scale,
            const int32_t* block_tables, const int32_t* context_lens, float* out, int64_t num_seqs,
            int64_t num_heads, int64_t num_kv_heads, int64_t any_head_dim, int64_t block_size, int64_t table_width,
            const int64_t* kv_strides, const int64_t* scale_strides) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : any_head_dim;
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(group * head_dim), row(head_dim), scores(group * block_size), m(group), l(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, head = task % num_kv_heads;
      const float* qs = q + (seq * num_heads + head * group) * head_dim;  // this KV head's G query rows
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), std::numeric_limits<float>::lowest());  // finite: built with -ffast-math
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t len = context_lens[seq];
      for (int64_t first = 0, b = 0; first < len; first += block_size, ++b) {
        const int64_t block = block_tables[seq * table_width + b], tokens = std::min(block_size, len - first);
        const T* kb = k + block * kv_strides[0] + head * kv_strides[2];
        const T* vb = v + block * kv_strides[0] + head * kv_strides[2];
        const int64_t sb = block * scale_strides[0] + head * scale_strides[2];
        if (first + block_size < len) {
          const int64_t next = block_tables[seq * table_width + b + 1] * kv_strides[0] + head * kv_strides[2];
          prefetch_rows(k + next, kv_strides[1], block_size, head_dim);
          prefetch_rows(v + next, kv_strides[1], block_size, head_dim);
        }
        for (int64_t t = 0; t < tokens; ++t) {
          load_row(kb + t * kv_strides[1], k_scale ? to_float(k_scale[sb + t * scale_strides[1]]) : 1.f, head_dim,
                   row.data());
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qs + g * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * row[d];
            scores[g * block_size + t] = dot;
          }
        }
        for (int64_t g = 0; g < group; ++g) {  // online softmax: rescale what came before to the new maximum
          float* s = scores.data() + g * block_size;
          const float top = std::max(m[g], *std::max_element(s, s + tokens));
          const float alpha = std::exp(m[g] - top);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < tokens; ++t) {  // vectorized expf (glibc libmvec) under -ffast-math
            s[t] = std::exp(s[t] - top);
            sum += s[t];
          }
          l[g] = l[g] * alpha + sum;
          m[g] = top;
          float* a = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] *= alpha;
        }
        for (int64_t t = 0; t < tokens; ++t) {
          load_row(vb + t * kv_strides[1], v_scale ? to_float(v_scale[sb + t * scale_strides[1]]) : 1.f, head_dim,
                   row.data());
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * block_size + t];
            float* a = acc.data() + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // an empty context (never scheduled, but possible) gives zeros
        float* o = out + (seq * num_heads + head * group + g) * head_dim;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[g * head_dim + d] * inv;
      }
    }
  });
}

}  // namespace

// q: [B, Hq, D] fp32 contiguous, already scaled. k, v: [blocks, block_size, Hkv, D] views of the pool (any row
// strides, last dim contiguous). k_scale, v_scale: [blocks, block_size, Hkv] fp16 for an INT8 cache, else empty.
// block_tables: [B, W] int32; context_lens: [B] int32. Returns [B, Hq, D] fp32.
at::Tensor paged_decode(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_scale, at::Tensor v_scale,
                        at::Tensor block_tables, at::Tensor context_lens) {
  TORCH_CHECK(q.dtype() == at::kFloat && q.is_contiguous() && q.dim() == 3, "q must be contiguous fp32 [B, H, D]");
  TORCH_CHECK(k.dim() == 4 && k.strides() == v.strides() && k.dtype() == v.dtype(), "k and v must be alike [N, bs, H, D]");
  TORCH_CHECK(k.stride(3) == 1, "the last dim of the cache must be contiguous");
  TORCH_CHECK(block_tables.dtype() == at::kInt && block_tables.is_contiguous(), "block_tables must be int32");
  TORCH_CHECK(context_lens.dtype() == at::kInt && context_lens.is_contiguous(), "context_lens must be int32");
  const bool quantized = k.dtype() == at::kChar;
  TORCH_CHECK(!quantized || (k_scale.dtype() == at::kHalf && k_scale.strides() == v_scale.strides()),
              "an int8 cache needs fp16 scales");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k.size(1), num_kv_heads = k.size(2);
  TORCH_CHECK(k.size(3) == head_dim && num_heads % num_kv_heads == 0, "q and the cache disagree on heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs && context_lens.numel() == num_seqs,
              "block_tables [B, W] and context_lens [B] must match q's batch");
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  for (int64_t seq = 0; seq < num_seqs; ++seq) {  // bad metadata fails here instead of reading outside the pool
    const int64_t used = (static_cast<int64_t>(lens[seq]) + block_size - 1) / block_size;
    TORCH_CHECK(lens[seq] >= 0 && used <= block_tables.size(1), "sequence ", seq, " has context length ", lens[seq],
                ", more than its block table holds");
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK(tables[seq * block_tables.size(1) + b] >= 0 && tables[seq * block_tables.size(1) + b] < k.size(0),
                  "sequence ", seq, " names block ", tables[seq * block_tables.size(1) + b], " outside the pool");
  }
  auto out = at::empty_like(q);
  const int64_t kv_strides[3] = {k.stride(0), k.stride(1), k.stride(2)};
  const int64_t scale_strides[3] = {quantized ? k_scale.stride(0) : 0, quantized ? k_scale.stride(1) : 0,
                                    quantized ? k_scale.stride(2) : 0};
  const c10::Half* ks = quantized ? k_scale.data_ptr<c10::Half>() : nullptr;
  const c10::Half* vs = quantized ? v_scale.data_ptr<c10::Half>() : nullptr;
  const auto run = [&](auto* kp, auto* vp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    const auto kernel = head_dim == 64 ? decode<T, 64> : head_dim == 128 ? decode<T, 128> : decode<T, 0>;
    kernel(q.data_ptr<float>(), kp, vp, ks, vs, tables, lens, out.data_ptr<float>(), num_seqs, num_heads,
           num_kv_heads, head_dim, block_size, block_tables.size(1), kv_strides, scale_strides);
  };
  if (quantized) run(k.data_ptr<int8_t>(), v.data_ptr<int8_t>());
  else if (k.dtype() == at::kBFloat16) run(k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>());
  else if (k.dtype() == at::kHalf) run(k.data_ptr<c10::Half>(), v.data_ptr<c10::Half>());
  else if (k.dtype() == at::kFloat) run(k.data_ptr<float>(), v.data_ptr<float>());
  else TORCH_CHECK(false, "unsupported KV cache dtype ", k.dtype());
  return out;
}

// The new tokens' K and V ([T, H, D], fp32) into their cache slots (slot = block * block_size + offset) of a float
// cache in any layout: one call per layer instead of torch's chain (slot -> block and offset, two index_put with a
// dtype conversion each), which at batch 1 cost about as long as the layer's attention.
template <typename T>
void write_rows(const float* src, int64_t T_, int64_t H, int64_t D, T* dst, const int64_t* slots, int64_t block_size,
                const int64_t strides[3]) {
  for (int64_t t = 0; t < T_; ++t) {
    const int64_t slot = slots[t];
    T* base = dst + (slot / block_size) * strides[0] + (slot % block_size) * strides[1];
    for (int64_t h = 0; h < H; ++h) {
      const float* row = src + (t * H + h) * D;
      T* out = base + h * strides[2];
      for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(row[d]);
    }
  }
}

void write_kv_(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping) {
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat, "K/V must be fp32");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "K and V must be [tokens, heads, head_dim] alike");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.stride(3) == 1 &&
              v_cache.stride(3) == 1 && k_cache.strides() == v_cache.strides(),
              "caches must be [blocks, block_size, heads, head_dim] views alike with contiguous head_dim");
  TORCH_CHECK(k_cache.size(2) == key.size(1) && k_cache.size(3) == key.size(2), "K/V heads do not match the cache");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == key.size(0),
              "slot_mapping must be int64 [tokens]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must have one dtype");
  const auto k = key.contiguous(), v = value.contiguous();
  const auto slots = slot_mapping.contiguous();
  const int64_t T_ = k.size(0), H = k.size(1), D = k.size(2), block_size = k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(0) * block_size;
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "slot ", sp[t], " is outside the cache");
  const int64_t strides[3] = {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
  const auto run = [&](auto* kp, auto* vp) {
    write_rows(k.data_ptr<float>(), T_, H, D, kp, sp, block_size, strides);
    write_rows(v.data_ptr<float>(), T_, H, D, vp, sp, block_size, strides);
  };
  if (k_cache.scalar_type() == at::kFloat) run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  else if (k_cache.scalar_type() == at::kBFloat16)
    run(k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>());
  else if (k_cache.scalar_type() == at::kHalf) run(k_cache.data_ptr<c10::Half>(), v_cache.data_ptr<c10::Half>());
  else TORCH_CHECK(false, "write_kv_ takes float caches; INT8 quantizes in torch");
}
