// The kernels of this folder as their sources and the Python bindings see them.
//
// Why a header of ATen's core alone: torch/extension.h costs about 36 s of compile per source on a 2-core machine
// (pybind11 and the whole C++ API), ATen/core/Tensor.h about 4 s. Only bindings.cpp includes the former, so a fresh
// build (CI, a user's first `strata serve`) compiles one heavy source instead of four.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

// paged_decode.cpp
at::Tensor paged_decode(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_scale, at::Tensor v_scale,
                        at::Tensor block_tables, at::Tensor context_lens);
void write_kv_(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping);

// weight_linear.cpp
at::Tensor linear(at::Tensor x, at::Tensor weight, at::Tensor scales, at::Tensor mins, int64_t format, int64_t K);
at::Tensor dequantize(at::Tensor weight, at::Tensor scales, at::Tensor mins, int64_t format, int64_t K);
bool native_bf16();
bool quantized_dot();

// pointwise.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rope_(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor silu_mul(at::Tensor gate_up);

// decode_stack.cpp: one compact linear layer (weight_linear.cpp's formats) and its bias, if it has one.
struct CompactWeight {
  at::Tensor weight, scales, mins;
  std::optional<at::Tensor> bias;
  int64_t format, in_features;

  at::Tensor operator()(const at::Tensor& x) const;
};

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, at::Tensor final_norm)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
        final_norm_(std::move(final_norm)) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, CompactWeight qkv, CompactWeight o,
                 CompactWeight gate_up, CompactWeight down) {
    layers_.push_back({std::move(input_norm), std::move(post_norm), std::move(qkv), std::move(o),
                       std::move(gate_up), std::move(down)});
  }

  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, const std::vector<at::Tensor>& k_caches,
                     const std::vector<at::Tensor>& v_caches, at::Tensor slot_mapping, at::Tensor block_tables,
                     at::Tensor context_lens, double scale) const;

 private:
  struct Layer {
    at::Tensor input_norm, post_norm;
    CompactWeight qkv, o, gate_up, down;
  };
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_;
  at::Tensor final_norm_;
  std::vector<Layer> layers_;
};
