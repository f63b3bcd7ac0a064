// Linear layers whose weights stay in a compact format: fp16, or GGUF-style blocks of 32 (Q8_0: int8 and a scale;
// Q4_0 / Q4_1: 4-bit codes, a scale and a minimum). fp32 activations and math.
//
// Why: a decode step reads every weight once per token, so at small batches the step time is the bytes read. Here a
// weight row is widened to fp32 right before use and never written back to memory as fp32: fp16 rows in registers,
// block formats into an L1 buffer. Rows are split over threads with at::parallel_for; each task takes 4 rows and
// folds them against every activation row, so an activation chunk loaded once serves 4 outputs.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;   // values per scale (GGUF's QK8_0 / QK4_0 / QK4_1)
constexpr int64_t kRows = 4;     // weight rows widened together

enum Format : int64_t { kF16 = 0, kQ8 = 1, kQ4 = 2 };

// No fused multiply-add when widening: d * q + m rounds as GGUF's own dequantization does, so a widened row equals the
// float checkpoint converted from the same file bit for bit.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// Row n of the weight as fp32 in dst[K]. Q4 codes: byte j of a group holds value j (low nibble) and j + 16 (high).
void widen_row(int64_t format, const void* weight, const float* scales, const float* mins, int64_t n, int64_t K,
               float* dst) {
  const int64_t groups = K / kGroup;
  if (format == kF16) {
    const uint16_t* w = static_cast<const uint16_t*>(weight) + n * K;
    int64_t k = 0;
#ifdef __F16C__
    for (; k + 8 <= K; k += 8)
      _mm256_storeu_ps(dst + k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k))));
#endif
    for (; k < K; ++k) dst[k] = c10::detail::fp16_ieee_to_fp32_value(w[k]);
    return;
  }
  const float* s = scales + n * groups;
  if (format == kQ8) {
    const int8_t* w = static_cast<const int8_t*>(weight) + n * K;
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* q = w + g * kGroup;
      float* out = dst + g * kGroup;
#pragma omp simd
      for (int64_t j = 0; j < kGroup; ++j) out[j] = static_cast<float>(q[j]) * s[g];
    }
    return;
  }
  const uint8_t* w = static_cast<const uint8_t*>(weight) + n * (K / 2);
  const float* m = mins + n * groups;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* q = w + g * (kGroup / 2);
    float* out = dst + g * kGroup;
#pragma omp simd
    for (int64_t j = 0; j < kGroup / 2; ++j) {
      out[j] = static_cast<float>(q[j] & 0x0F) * s[g] + m[g];
      out[j + kGroup / 2] = static_cast<float>(q[j] >> 4) * s[g] + m[g];
    }
  }
}
#pragma GCC pop_options

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// out[m, n0..n0+3] for two activation rows at once: 8 accumulators in registers, each load feeds two or four FMAs.
template <int64_t MR>
inline void fold_tile(const float* rows, const float* x, int64_t K, float* out, int64_t N, int64_t n0) {
  __m256 a[MR][kRows];
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t r = 0; r < kRows; ++r) a[i][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 w0 = _mm256_loadu_ps(rows + k), w1 = _mm256_loadu_ps(rows + K + k);
    const __m256 w2 = _mm256_loadu_ps(rows + 2 * K + k), w3 = _mm256_loadu_ps(rows + 3 * K + k);
    for (int64_t i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * K + k);
      a[i][0] = _mm256_fmadd_ps(w0, xv, a[i][0]);
      a[i][1] = _mm256_fmadd_ps(w1, xv, a[i][1]);
      a[i][2] = _mm256_fmadd_ps(w2, xv, a[i][2]);
      a[i][3] = _mm256_fmadd_ps(w3, xv, a[i][3]);
    }
  }
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t r = 0; r < kRows; ++r) out[i * N + n0 + r] = hsum(a[i][r]);
}
#endif

// fp16 and Q8_0 weights widened in registers: each 8-value vector of a weight row is widened and used at once, never
// stored. The store and reload of a widened row (widen_row + fold_tile) cost more than widening again for every 4
// activation rows (linear time per SmolLM2 step, 2 threads: fp16 1.5-2x less at 1-32 rows; Q8_0 18.1 -> 16.4 ms at 1
// row, 28.4 -> 18.8 at 4, equal at 16; Q4 codes unpack slower than they store: 21 -> 25 ms at 1 row, so they keep
// the buffer). Each vector takes the same operations as widen_row (a product, never fused), so the same bits.
#if defined(__AVX2__) && defined(__F16C__)
struct F16Rows {
  const uint16_t* w;
  int64_t K;
  __m256 operator()(int64_t n, int64_t k) const {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * K + k)));
  }
};

struct Q8Rows {
  const int8_t* w;
  const float* scales;
  int64_t K;
  __m256 operator()(int64_t n, int64_t k) const {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + n * K + k));
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    return _mm256_mul_ps(q, _mm256_set1_ps(scales[n * (K / kGroup) + k / kGroup]));
  }
};

// MR activation rows x NR weight rows (from row n0) in MR * NR accumulators.
template <int64_t MR, int64_t NR, typename Rows>
inline void fold_direct(const Rows& rows, const float* x, int64_t K, float* out, int64_t N, int64_t n0) {
  __m256 a[MR][NR];
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t r = 0; r < NR; ++r) a[i][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NR];
    for (int64_t r = 0; r < NR; ++r) wv[r] = rows(n0 + r, k);
    for (int64_t i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * K + k);
      for (int64_t r = 0; r < NR; ++r) a[i][r] = _mm256_fmadd_ps(wv[r], xv, a[i][r]);
    }
  }
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t r = 0; r < NR; ++r) out[i * N + n0 + r] = hsum(a[i][r]);
}

// A tile of kRows weight rows against every activation row, 4 activation rows at a time.
constexpr int64_t kDirectMaxRows = 4;
template <typename Rows>
void fold_direct_tile(const Rows& rows, const float* x, int64_t M, int64_t K, float* out, int64_t N, int64_t n0) {
  for (int64_t m = 0; m < M; m += kDirectMaxRows) {
    const float* xm = x + m * K;
    float* om = out + m * N;
    switch (std::min(kDirectMaxRows, M - m)) {
      case 1: fold_direct<1, 4>(rows, xm, K, om, N, n0); break;
      case 2: fold_direct<2, 4>(rows, xm, K, om, N, n0); break;
      case 3: fold_direct<3, 2>(rows, xm, K, om, N, n0); fold_direct<3, 2>(rows, xm, K, om, N, n0 + 2); break;
      default: fold_direct<4, 2>(rows, xm, K, om, N, n0); fold_direct<4, 2>(rows, xm, K, om, N, n0 + 2); break;
    }
  }
}
#endif

// out[m, n0 + r] = dot(rows[r], x[m]) for r < nr (nr <= kRows).
void fold_rows(const float* rows, int64_t nr, const float* x, int64_t M, int64_t K, float* out, int64_t N,
               int64_t n0) {
  int64_t m = 0;
#ifdef __AVX2__
  if (nr == kRows && K % 8 == 0) {
    for (; m + 2 <= M; m += 2) fold_tile<2>(rows, x + m * K, K, out + m * N, N, n0);
    if (m < M) fold_tile<1>(rows, x + m * K, K, out + m * N, N, n0);
    return;
  }
#endif
  for (; m < M; ++m) {
    const float* xm = x + m * K;
    for (int64_t r = 0; r < nr; ++r) {
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < K; ++k) sum += rows[r * K + k] * xm[k];
      out[m * N + n0 + r] = sum;
    }
  }
}

int64_t check(int64_t format, const torch::Tensor& weight, const torch::Tensor& scales, const torch::Tensor& mins,
              int64_t K) {
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 2, "weight must be contiguous 2-d");
  const int64_t N = weight.size(0);
  if (format == kF16) {
    TORCH_CHECK(weight.dtype() == torch::kFloat16 && weight.size(1) == K, "f16 weight must be fp16 [N, K]");
    return N;
  }
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of ", kGroup);
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == N * (K / kGroup),
              "scales must be contiguous fp32 [N, K / 32]");
  if (format == kQ8) {
    TORCH_CHECK(weight.dtype() == torch::kInt8 && weight.size(1) == K, "q8 weight must be int8 [N, K]");
  } else {
    TORCH_CHECK(format == kQ4, "unknown weight format ", format);
    TORCH_CHECK(weight.dtype() == torch::kUInt8 && weight.size(1) == K / 2, "q4 weight must be uint8 [N, K / 2]");
    TORCH_CHECK(mins.dtype() == torch::kFloat32 && mins.is_contiguous() && mins.numel() == scales.numel(),
                "mins must be contiguous fp32 like scales");
  }
  return N;
}

}  // namespace

// x [M, K] fp32 times the weight [N, K] transposed -> [M, N] fp32.
torch::Tensor linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scales, torch::Tensor mins,
                     int64_t format, int64_t K) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2 && x.size(1) == K,
              "x must be contiguous fp32 [M, K]");
  const int64_t N = check(format, weight, scales, mins, K), M = x.size(0);
  auto out = torch::empty({M, N}, x.options());
  const void* w = weight.data_ptr();
  const float* s = format == kF16 ? nullptr : scales.data_ptr<float>();
  const float* mn = format == kQ4 ? mins.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t tiles = (N + kRows - 1) / kRows;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rows(kRows * K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRows, nr = std::min(kRows, N - n0);
#if defined(__AVX2__) && defined(__F16C__)
      if (nr == kRows && K % 8 == 0 && format != kQ4) {   // 4-bit codes cost more to unpack again than to store
        if (format == kF16) fold_direct_tile(F16Rows{static_cast<const uint16_t*>(w), K}, xp, M, K, op, N, n0);
        else fold_direct_tile(Q8Rows{static_cast<const int8_t*>(w), s, K}, xp, M, K, op, N, n0);
        continue;
      }
#endif
      for (int64_t r = 0; r < nr; ++r) widen_row(format, w, s, mn, n0 + r, K, rows.data() + r * K);
      fold_rows(rows.data(), nr, xp, M, K, op, N, n0);
    }
  });
  return out;
}

// The whole weight as fp32 [N, K]: for large batches (prefill), which a BLAS matmul runs better than fold_rows.
torch::Tensor dequantize(torch::Tensor weight, torch::Tensor scales, torch::Tensor mins, int64_t format, int64_t K) {
  const int64_t N = check(format, weight, scales, mins, K);
  auto out = torch::empty({N, K}, torch::TensorOptions().dtype(torch::kFloat32));
  const void* w = weight.data_ptr();
  const float* s = format == kF16 ? nullptr : scales.data_ptr<float>();
  const float* mn = format == kQ4 ? mins.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) widen_row(format, w, s, mn, n, K, op + n * K);
  });
  return out;
}
