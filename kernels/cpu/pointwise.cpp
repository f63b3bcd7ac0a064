// The small per-layer operations of a decoder on CPU, one call each instead of a chain of torch ops.
//
// Why: at batch 1 a decode step of a small model spends as long dispatching torch ops as it does reading weights
// (RMSNorm is 8 ops, rotary embedding 14, each some microseconds of dispatch for a few hundred floats); fused, each
// is one pass over the row in cache. fp32 only: the CPU path computes in fp32 whatever the weights are stored in.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kRowsPerTask = 16;  // small batches stay on the calling thread: waking others costs more

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, name, " must be a CPU fp32 tensor");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [rows, hidden] with contiguous rows");
}

// out = x / rms(x) * weight, the mean of squares accumulated in double so the result does not depend on order.
inline void norm_row(const float* x, const float* weight, float* out, int64_t n, double eps) {
  double squares = 0.0;
  for (int64_t i = 0; i < n; ++i) squares += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(squares / n + eps));
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv);
}

}  // namespace

// RMSNorm of each row of x [T, H].
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(), "weight must be contiguous fp32");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows, n}, x.options());
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      norm_row(x.data_ptr<float>() + r * x.stride(0), w, out.data_ptr<float>() + r * n, n, eps);
  });
  return out;
}

// residual += x, then RMSNorm of the new residual: the two halves of a pre-norm block's seam, in one pass.
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "x and residual differ in shape");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows, n}, x.options());
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(), "weight must be contiguous fp32");
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* res = residual.data_ptr<float>() + r * residual.stride(0);
      const float* in = x.data_ptr<float>() + r * x.stride(0);
      for (int64_t i = 0; i < n; ++i) res[i] = in[i] + res[i];
      norm_row(res, w, out.data_ptr<float>() + r * n, n, eps);
    }
  });
  return out;
}

// Rotary embedding in place, rotate-half convention: x [T, H, D] (rows may be strided views of a fused qkv
// output), cos / sin [T, D].
void rope_(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1,
              "x must be a CPU fp32 [tokens, heads, head_dim] tensor with contiguous heads");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(cos.size(0) == tokens && cos.size(1) == dim && sin.sizes() == cos.sizes(), "cos/sin must be [T, D]");
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos.data_ptr<float>() + t * cos.stride(0);
      const float* s = sin.data_ptr<float>() + t * sin.stride(0);
      for (int64_t h = 0; h < heads; ++h) {
        float* row = x.data_ptr<float>() + t * x.stride(0) + h * x.stride(1);
        for (int64_t i = 0; i < half; ++i) {
          const float a = row[i], b = row[i + half];
          row[i] = a * c[i] - b * s[i];
          row[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

// SwiGLU: gate_up [T, 2I] (gate first) -> silu(gate) * up [T, I].
at::Tensor silu_mul(at::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = at::empty({rows, n}, gate_up.options());
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gate_up.data_ptr<float>() + r * gate_up.stride(0);
      float* o = out.data_ptr<float>() + r * n;
      for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * g[i + n];
    }
  });
  return out;
}
