// A pure-decode step of a Llama-family decoder stack in one call from Python.
//
// Why: at batch 1 a decode step of a small model spends about a third of its time in the Python around its layers
// (module calls, views, argument adaptation: a dozen calls a layer, 30 layers). Here the same kernels run in the same
// order on the same tensors as the layer-by-layer path (models/llama.py with kernels/layer_ops.py CPU_OPS), so the
// outputs are bit for bit the same and only the dispatch goes. Float K/V caches and compact weights only; the Python
// side (decode_stack.py) says when a step qualifies.
#include "kernels.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>

at::Tensor CompactWeight::operator()(const at::Tensor& x) const {
  auto out = linear(x, weight, scales, mins, format, in_features);
  return bias.has_value() ? out + *bias : out;
}

// x: the tokens' embeddings [B, hidden] fp32; cos / sin [B, head_dim]; one K and one V cache view per layer;
// slot_mapping [B] int64; block_tables [B, W] and context_lens [B] int32. Returns the final norm's output [B, hidden].
at::Tensor DecodeStack::forward(at::Tensor x, at::Tensor cos, at::Tensor sin, const std::vector<at::Tensor>& k_caches,
                                const std::vector<at::Tensor>& v_caches, at::Tensor slot_mapping,
                                at::Tensor block_tables, at::Tensor context_lens, double scale) const {
  const int64_t n = static_cast<int64_t>(layers_.size());
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == n && static_cast<int64_t>(v_caches.size()) == n,
              "one K and one V cache per layer (", n, " layers)");
  const int64_t rows = x.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  const auto no_scales = at::empty({0}, x.options().dtype(at::kHalf));
  at::Tensor residual;
  for (int64_t i = 0; i < n; ++i) {
    const Layer& layer = layers_[i];
    at::Tensor h;
    if (i == 0) {
      h = rms_norm(x, layer.input_norm, eps_);
      residual = x;
    } else {
      h = add_rms_norm(x, residual, layer.input_norm, eps_);
    }
    const auto qkv = layer.qkv(h);
    auto q = qkv.narrow(1, 0, q_size).view({rows, num_heads_, head_dim_});
    auto k = qkv.narrow(1, q_size, kv_size).view({rows, num_kv_heads_, head_dim_});
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, num_kv_heads_, head_dim_});
    rope_(q, cos, sin);
    rope_(k, cos, sin);
    write_kv_(k, v, k_caches[i], v_caches[i], slot_mapping);
    const auto attended = paged_decode((q * scale).contiguous(), k_caches[i], v_caches[i], no_scales, no_scales,
                                       block_tables, context_lens);
    h = add_rms_norm(layer.o(attended.reshape({rows, q_size})), residual, layer.post_norm, eps_);
    x = layer.down(silu_mul(layer.gate_up(h)));
  }
  return add_rms_norm(x, residual, final_norm_, eps_);
}

