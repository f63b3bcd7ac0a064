// The Python module: every kernel of this folder in one build, its sources compiled in parallel. The only source
// that includes torch/extension.h (see kernels.h for why).
#include <torch/extension.h>

#include "kernels.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
  m.def("write_kv_", &write_kv_, "new tokens' K/V into their slots of a float paged cache");
  m.def("linear", &linear, "x [M, K] fp32 @ compact weight [N, K].T -> [M, N] fp32");
  m.def("dequantize", &dequantize, "compact weight -> fp32 [N, K]");
  m.def("native_bf16", &native_bf16, "whether bf16 weights run on AVX512_BF16 dot products");
  m.def("quantized_dot", &quantized_dot, "whether Q8_0 / Q4 weights multiply Q8_0-quantized activations (int8 dots)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (fp32)");
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place, then RMSNorm of it (fp32)");
  m.def("rope_", &rope_, "rotary embedding in place, rotate-half convention (fp32)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate_up row (fp32)");
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
