// A pure-decode step of a Llama-family decoder stack in one call from Python.
//
// Why: at batch 1 a decode step of a small model spends about a third of its time in the Python around its layers
// (module calls, views, argument adaptation: a dozen calls a layer, 30 layers). Here the same kernels run in the same
// order on the same tensors as the layer-by-layer path (models/llama.py with kernels/layer_ops.py CPU_OPS), so the
// outputs are bit for bit the same and only the dispatch goes. Float K/V caches and compact weights only; the Python
// side (decode_stack.py) says when a step qualifies.
#include <torch/extension.h>

#include <optional>
#include <utility>
#include <vector>

// The kernels it runs, each defined in its own source of this folder.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_scale,
                           torch::Tensor v_scale, torch::Tensor block_tables, torch::Tensor context_lens);
void write_kv_(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
               torch::Tensor slot_mapping);
torch::Tensor linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scales, torch::Tensor mins,
                     int64_t format, int64_t K);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_mul(torch::Tensor gate_up);

namespace {

// One compact linear layer (weight_linear.cpp's formats) and its bias, if it has one.
struct CompactWeight {
  torch::Tensor weight, scales, mins;
  std::optional<torch::Tensor> bias;
  int64_t format, in_features;

  torch::Tensor operator()(const torch::Tensor& x) const {
    auto out = linear(x, weight, scales, mins, format, in_features);
    return bias.has_value() ? out + *bias : out;
  }
};

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, torch::Tensor final_norm)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
        final_norm_(std::move(final_norm)) {}

  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, CompactWeight qkv, CompactWeight o,
                 CompactWeight gate_up, CompactWeight down) {
    layers_.push_back({std::move(input_norm), std::move(post_norm), std::move(qkv), std::move(o),
                       std::move(gate_up), std::move(down)});
  }

  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                        const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                        torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor context_lens,
                        double scale) const;

 private:
  struct Layer {
    torch::Tensor input_norm, post_norm;
    CompactWeight qkv, o, gate_up, down;
  };
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_;
  torch::Tensor final_norm_;
  std::vector<Layer> layers_;
};

// x: the tokens' embeddings [B, hidden] fp32; cos / sin [B, head_dim]; one K and one V cache view per layer;
// slot_mapping [B] int64; block_tables [B, W] and context_lens [B] int32. Returns the final norm's output [B, hidden].
torch::Tensor DecodeStack::forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                   const std::vector<torch::Tensor>& k_caches,
                                   const std::vector<torch::Tensor>& v_caches, torch::Tensor slot_mapping,
                                   torch::Tensor block_tables, torch::Tensor context_lens, double scale) const {
  const int64_t n = static_cast<int64_t>(layers_.size());
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == n && static_cast<int64_t>(v_caches.size()) == n,
              "one K and one V cache per layer (", n, " layers)");
  const int64_t rows = x.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  const auto no_scales = torch::empty({0}, x.options().dtype(torch::kFloat16));
  torch::Tensor residual;
  for (int64_t i = 0; i < n; ++i) {
    const Layer& layer = layers_[i];
    torch::Tensor h;
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

}  // namespace

void bind_decode_stack(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<CompactWeight>(m, "CompactWeight")
      .def(py::init<torch::Tensor, torch::Tensor, torch::Tensor, std::optional<torch::Tensor>, int64_t, int64_t>(),
           py::arg("weight"), py::arg("scales"), py::arg("mins"), py::arg("bias"), py::arg("format"),
           py::arg("in_features"));
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, int64_t, double, torch::Tensor>(), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("final_norm"))
      .def("add_layer", &DecodeStack::add_layer)
      // the GIL is let go: a step runs for milliseconds and touches no Python object
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>());
}
