// Linear layers whose weights stay in a compact format: fp16, or GGUF-style blocks of 32 (Q8_0: int8 and a scale;
// Q4_0 / Q4_1: 4-bit codes, a scale and a minimum): fp32 activations and math. Or bf16 weights against activations
// rounded to bf16, products summed in fp32: AVX512_BF16's dot product, twice the multiply-adds per instruction of
// fp32, where the CPU has it (the same rounding, summed in fp32 FMAs, where it does not). Q8_0 and Q4 weights at
// decode batches multiply activations quantized to Q8_0 blocks as llama.cpp does: integer dot products summed exactly
// per block (AVX-512 VNNI, AVX-VNNI or AVX2), each block's sum scaled in fp32.
//
// Why: a decode step reads every weight once per token, so at small batches the step time is the bytes read. Here a
// float weight row is widened to fp32 right before use and never written back to memory as fp32: fp16 rows in
// registers, others into an L1 buffer (Q8_0 and Q4 only where no integer dot product builds). Every output is one
// chain of fused multiply-adds over k (of block sums, for the quantized formats), one vector of the
// widest width this build has (AVX-512: 16 lanes, AVX2: 8) at a time, then a horizontal sum: the same operations in
// the same order whatever the batch size or tile, so a sequence's logits never depend on what it is batched with.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;   // values per scale (GGUF's QK8_0 / QK4_0 / QK4_1)
constexpr int64_t kRows = 4;     // weight rows of one tile (the batched path)

enum Format : int64_t { kF16 = 0, kQ8 = 1, kQ4 = 2, kBF16 = 3 };

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
  if (format == kBF16) {
    const uint16_t* w = static_cast<const uint16_t*>(weight) + n * K;
    for (int64_t k = 0; k < K; ++k) dst[k] = c10::detail::f32_from_bits(w[k]);
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

// The float vector of this build: its width fixes the order of every dot product (see the top of the file).
#if defined(__AVX512F__)
#define STRATA_VECTOR 1
using Vec = __m512;
constexpr int64_t kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec vwiden(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define STRATA_VECTOR 1
using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
inline Vec vwiden(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif

#ifdef STRATA_VECTOR
// fp16 weights widened in registers: each vector of a weight row is widened and used at once, never stored (the store
// and reload of a widened row cost more than widening again for every few activation rows). Each vector is what
// widen_row gives, so the same bits. (Q8_0 and Q4 rows run the integer dot products below wherever this vector code
// builds.)
struct F16Rows {
  static constexpr int64_t kBytes = 2;   // per value
  const uint16_t* w;
  int64_t K;
  const char* address(int64_t n, int64_t k) const { return reinterpret_cast<const char*>(w + n * K + k); }
  Vec operator()(int64_t n, int64_t k) const { return vwiden(w + n * K + k); }
};

// Rows n0.. already widened to fp32 in a buffer (bf16 without AVX512_BF16, fp16 whose K is not whole vectors).
struct WidenedRows {
  static constexpr int64_t kBytes = 4;
  const float* w;
  int64_t K, n0;
  const char* address(int64_t n, int64_t k) const { return reinterpret_cast<const char*>(w + (n - n0) * K + k); }
  Vec operator()(int64_t n, int64_t k) const { return vload(w + (n - n0) * K + k); }
};

constexpr int64_t kLineBytes = 64;

// Weight rows n0..n0+NR-1 against MR activation rows, MR * NR accumulators. The smaller side is held in registers
// and the other loaded one vector at a time, so 3 x 4 fits AVX2's 16 registers (12 sums, 3 activations, 1 weight):
// 7 loads per 12 multiply-adds. (GCC otherwise folds each activation's load into every multiply-add that uses it, 15
// loads per 12, and the loads bound the tile: fp16 linears at 16 rows with weights in cache, AVX2-only Zen 3 EPYC,
// 82-101 GFLOP/s for such tiles of any shape, 110-116 with the activations held.) With Prefetch, each line of the rows read is prefetched for the rows `ahead` further.
template <int64_t MR, int64_t NR, bool Prefetch, typename Rows>
inline void fold_direct(const Rows& rows, const float* x, int64_t K, float* out, int64_t N, int64_t n0,
                        int64_t ahead) {
  constexpr int64_t line_values = kLineBytes / Rows::kBytes;
  Vec a[MR][NR];
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t r = 0; r < NR; ++r) a[i][r] = vzero();
  for (int64_t k = 0; k < K; k += kLanes) {
    if (Prefetch && k % line_values == 0)
      for (int64_t r = 0; r < NR; ++r) _mm_prefetch(rows.address(n0 + r + ahead, k), _MM_HINT_T0);  // no fault
    if constexpr (MR < NR) {
      Vec xv[MR];
      for (int64_t i = 0; i < MR; ++i) {
        xv[i] = vload(x + i * K + k);
        asm("" : "+v"(xv[i]));    // held in a register (see above)
      }
      for (int64_t r = 0; r < NR; ++r) {
        const Vec w = rows(n0 + r, k);
        for (int64_t i = 0; i < MR; ++i) a[i][r] = vfma(w, xv[i], a[i][r]);
      }
    } else {
      Vec w[NR];
      for (int64_t r = 0; r < NR; ++r) w[r] = rows(n0 + r, k);
      for (int64_t i = 0; i < MR; ++i) {
        const Vec xv = vload(x + i * K + k);
        for (int64_t r = 0; r < NR; ++r) a[i][r] = vfma(w[r], xv, a[i][r]);
      }
    }
  }
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t r = 0; r < NR; ++r) out[i * N + n0 + r] = vsum(a[i][r]);
}

// From kTileFromRows activation rows: NR weight rows at a time against every activation row, 3 at a time, the NR rows
// staying in L1 meanwhile (weight rows outer: activation rows outer, each group of 3 over a block of weight rows, ran
// 2-7% slower). The weights come from DRAM in an order the hardware prefetcher follows badly (NR rows of a few KB
// each, interleaved), so the first group prefetches the rows kTileAheadRows on. Against the 8-rows-a-pass stream below
// and the 3 x 4 tiles without prefetch above 16 rows this replaced, a step's fp16 linears on the AVX2-only Zen 3 EPYC
// (medians of 20 steps paired in one process): 8 / 9 / 12 / 16 / 24 / 32 rows 0.96 / 0.66 / 0.79 / 0.75 / 0.65 / 0.64
// of the time (cpu_profile/zen3_f16_tiles_ab.json); at 4 and 6 rows the stream stays faster (tiles 1.12 / 1.04 of it).
// Not measured on an AVX-512 CPU, whose build runs the same tiles 16 lanes wide.
constexpr int64_t kTileFromRows = 8;
constexpr int64_t kTileActivationRows = 3;
constexpr int64_t kTileAheadRows = 16;
static_assert(kTileFromRows >= kTileActivationRows, "the first group of activation rows is a whole one");

template <int64_t NR, typename Rows>
inline void fold_weight_rows(const Rows& rows, const float* x, int64_t M, int64_t K, float* out, int64_t N,
                             int64_t n) {
  constexpr int64_t MR = kTileActivationRows;
  fold_direct<MR, NR, true>(rows, x, K, out, N, n, kTileAheadRows);
  int64_t m = MR;
  for (; m + MR <= M; m += MR) fold_direct<MR, NR, false>(rows, x + m * K, K, out + m * N, N, n, 0);
  if (M - m == 2) fold_direct<2, NR, false>(rows, x + m * K, K, out + m * N, N, n, 0);
  else if (M - m == 1) fold_direct<1, NR, false>(rows, x + m * K, K, out + m * N, N, n, 0);
}

template <typename Rows>
void stream_tiles(const Rows& rows, const float* x, int64_t M, int64_t K, float* out, int64_t N) {
  at::parallel_for(0, (N + kRows - 1) / kRows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRows;
      if (n0 + kRows <= N) fold_weight_rows<kRows>(rows, x, M, K, out, N, n0);
      else
        for (int64_t n = n0; n < N; ++n) fold_weight_rows<1>(rows, x, M, K, out, N, n);
    }
  });
}

// Decode batches below kTileFromRows: one weight row at a time in address order, folded against every activation
// row (kStreamRowsPerPass at a time; the row stays in L1 between them). Interleaving 4 weight rows (the tiles above,
// then without prefetch) made a pattern the hardware prefetcher follows badly: with weights streamed from DRAM (121
// distinct SmolLM2 layers, fp16, 2 threads, AVX-512 EPYC) the linears of a step took 13.5 / 20 / 27 ms tiled at 1 / 4
// / 8 sequences, 7.4-9.4 / 13.6 / 18.5 ms streamed. From 3 sequences on, each row takes long enough that a software
// prefetch kAheadBytes ahead pays; below, the hardware prefetcher alone is faster (the prefetches cost more than they
// hide).
// Each pass's sums are chains of dependent multiply-adds, one per activation row: 4 chains leave an AVX2 core's two
// FMA pipes half idle. On the AVX2-only Zen 3 EPYC, 8 rows a pass took a step's fp16 linears at 6 / 8 / 12 / 16 rows
// from 50 / 51 / 71 / 91 to 32 / 39 / 55 / 73 ms (medians of 20 steps paired with the old build; at 1-4 rows, the same
// code on both sides, 0.91-0.95 of it: the pairing's own bias; cpu_profile/zen3_stream_rows_per_pass_ab.json). The
// AVX-512 build keeps the 4 it was measured with. Each output is still one chain over k: the same bits either way.
// On AVX2 every batch below the tiles (kTileFromRows) is one pass, so the 8-row case below no longer runs there; it
// stays because with 7 rows as the switch's default GCC spilled a pointer in that loop (7 rows 1.07 of the time,
// paired).
constexpr int64_t kStreamRowsPerPass = kLanes == 8 ? 8 : 4;
constexpr int64_t kPrefetchFromRows = 3;
constexpr int64_t kAheadBytes = 1024;
template <int64_t MR, bool Prefetch, typename Rows>
inline void fold_stream_row(const Rows& rows, const float* x, int64_t K, float* out, int64_t N, int64_t n) {
  constexpr int64_t line_values = kLineBytes / Rows::kBytes;
  Vec a[MR];
  for (int64_t i = 0; i < MR; ++i) a[i] = vzero();
  for (int64_t k = 0; k < K; k += kLanes) {
    if (Prefetch && k % line_values == 0) _mm_prefetch(rows.address(n, k) + kAheadBytes, _MM_HINT_T0);  // no fault
    const Vec w = rows(n, k);
    for (int64_t i = 0; i < MR; ++i) a[i] = vfma(w, vload(x + i * K + k), a[i]);
  }
  for (int64_t i = 0; i < MR; ++i) out[i * N + n] = vsum(a[i]);
}

template <bool Prefetch, typename Rows>
void fold_stream(const Rows& rows, const float* x, int64_t M, int64_t K, float* out, int64_t N, int64_t n_begin,
                 int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n)
    for (int64_t m = 0; m < M; m += kStreamRowsPerPass) {
      const float* xm = x + m * K;
      float* om = out + m * N;
      switch (std::min(kStreamRowsPerPass, M - m)) {
        case 1: fold_stream_row<1, Prefetch>(rows, xm, K, om, N, n); break;
        case 2: fold_stream_row<2, Prefetch>(rows, xm, K, om, N, n); break;
        case 3: fold_stream_row<3, Prefetch>(rows, xm, K, om, N, n); break;
        case 4: fold_stream_row<4, Prefetch>(rows, xm, K, om, N, n); break;
        case 5: fold_stream_row<5, Prefetch>(rows, xm, K, om, N, n); break;
        case 6: fold_stream_row<6, Prefetch>(rows, xm, K, om, N, n); break;
        case 7: fold_stream_row<7, Prefetch>(rows, xm, K, om, N, n); break;
        default: fold_stream_row<8, Prefetch>(rows, xm, K, om, N, n); break;
      }
    }
}

template <typename Rows>
void stream(const Rows& rows, const float* x, int64_t M, int64_t K, float* out, int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    if (M >= kPrefetchFromRows) fold_stream<true>(rows, x, M, K, out, N, begin, end);
    else fold_stream<false>(rows, x, M, K, out, N, begin, end);
  });
}
#endif

// bf16 weights: activations rounded to bf16 once per call, then each weight row streamed as above against them, 32
// products per instruction. Every output is one chain over k, 32 values at a time, at any batch size.
#if defined(__AVX512BF16__)
constexpr bool kNativeBF16 = true;
constexpr int64_t kBF16Lanes = 32;   // = kGroup: one vector of bf16 pairs is one Q8_0 block

struct BF16Rows {
  static constexpr int64_t kBytes = 2;
  const uint16_t* w;
  int64_t K;
  const char* address(int64_t n, int64_t k) const { return reinterpret_cast<const char*>(w + n * K + k); }
  __m512bh operator()(int64_t n, int64_t k) const { return (__m512bh)_mm512_loadu_si512(w + n * K + k); }
};

template <int64_t MR, bool Prefetch, typename Rows>
inline void fold_bf16_row(const Rows& rows, const uint16_t* x, int64_t K, float* out, int64_t N, int64_t n) {
  constexpr int64_t line_values = kLineBytes / Rows::kBytes;
  Vec a[MR];
  for (int64_t i = 0; i < MR; ++i) a[i] = vzero();
  for (int64_t k = 0; k < K; k += kBF16Lanes) {
    if (Prefetch && k % line_values == 0) _mm_prefetch(rows.address(n, k) + kAheadBytes, _MM_HINT_T0);
    const __m512bh wv = rows(n, k);
    for (int64_t i = 0; i < MR; ++i) a[i] = _mm512_dpbf16_ps(a[i], wv, (__m512bh)_mm512_loadu_si512(x + i * K + k));
  }
  for (int64_t i = 0; i < MR; ++i) out[i * N + n] = vsum(a[i]);
}

// 8 activation rows per pass over a weight row (bf16 rows, a plain load, ran equal at 4; 16 accumulators spilled).
constexpr int64_t kBF16MaxRowsPerPass = 8;
template <bool P, typename Rows>
void fold_bf16(const Rows& rows, const uint16_t* x, int64_t M, int64_t K, float* out, int64_t N, int64_t begin,
               int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    int64_t m = 0;
    for (; m + kBF16MaxRowsPerPass <= M; m += kBF16MaxRowsPerPass)
      fold_bf16_row<kBF16MaxRowsPerPass, P>(rows, x + m * K, K, out + m * N, N, n);
    const uint16_t* xm = x + m * K;
    float* om = out + m * N;
    switch (M - m) {
      case 1: fold_bf16_row<1, P>(rows, xm, K, om, N, n); break;
      case 2: fold_bf16_row<2, P>(rows, xm, K, om, N, n); break;
      case 3: fold_bf16_row<3, P>(rows, xm, K, om, N, n); break;
      case 4: fold_bf16_row<4, P>(rows, xm, K, om, N, n); break;
      case 5: fold_bf16_row<5, P>(rows, xm, K, om, N, n); break;
      case 6: fold_bf16_row<6, P>(rows, xm, K, om, N, n); break;
      case 7: fold_bf16_row<7, P>(rows, xm, K, om, N, n); break;
      default: break;
    }
  }
}

template <typename Rows>
void stream_bf16(const Rows& rows, const uint16_t* x, int64_t M, int64_t K, float* out, int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    if (M >= kPrefetchFromRows) fold_bf16<true>(rows, x, M, K, out, N, begin, end);
    else fold_bf16<false>(rows, x, M, K, out, N, begin, end);
  });
}
#else
constexpr bool kNativeBF16 = false;
#endif

// Q8_0 and Q4 weights against activations quantized to Q8_0 blocks (llama.cpp's vec_dot_q8_0_q8_0 and
// vec_dot_q4_1_q8_1): each block of 32 activations becomes int8 codes q and an fp32 scale d (max |x| / 127); each
// block's 32 products of weight codes and q are summed exactly in int32 (VNNI's dpbusd, or AVX2's maddubs + madd),
// and only the block sums are scaled and added in fp32. A Q4 block's minimum m_w adds m_w * d * sum(q), one dot
// product of the row's minimums with the activations' block sums per output. A decode step then does a fraction of
// the float work of widening every weight to fp32 (or bf16): at one sequence on the AMX Xeon the Q8_0 linears of a
// SmolLM2 step read half the bytes of bf16 but took longer, the widening being the cost.
constexpr float kInv127 = 1.0f / 127.0f;

// A Q8_0 block's scale d = max |x| * (1 / 127) and 1 / d as written, in a function of its own without reciprocal or
// reassociated math: -ffast-math turned 1 / (max |x| * (1 / 127)) into 127 / max |x|, whose last bit differs, and a
// code at a .5 tie then rounded the other way than the reference's (about one random 8-row batch in 700). Only this
// step: the codes' loop keeps -ffast-math (vectorized rounding; under the pragma it took 15 ms of a 16-row step).
#pragma GCC push_options
#pragma GCC optimize("no-reciprocal-math", "no-associative-math")
__attribute__((noinline)) void block_scale(float amax, float& scale, float& inverse) {
  scale = amax * kInv127;
  inverse = scale != 0.f ? 1.0f / scale : 0.f;
}
#pragma GCC pop_options

// Activations as Q8_0 blocks: codes q[m, k], scales d[m, k / 32] = max |x| * (1 / 127) with q = x / d rounded half to
// even (what the tests' torch reference does, op for op), and d * sum(q) per block (Q4 minimums' term); with
// `offset`, also q + 128 as unsigned bytes (stored as q XOR 0x80), for a kernel that multiplies unsigned activations;
// code_sum, sum(q) per block as an integer.
struct QuantizedRows {
  std::vector<int8_t> q, offset;
  std::vector<float> d, sum;
  std::vector<int32_t> code_sum;
  QuantizedRows(const float* x, int64_t M, int64_t K, bool with_offset)
      : q(M * K), offset(with_offset ? M * K : 0), d(M * (K / kGroup)), sum(d.size()), code_sum(d.size()) {
    for (int64_t b = 0; b < M * (K / kGroup); ++b) {
      const float* v = x + b * kGroup;
      float amax = 0.f;
      for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::abs(v[j]));
      float scale, inverse;
      block_scale(amax, scale, inverse);
      int32_t total = 0;
      for (int64_t j = 0; j < kGroup; ++j) {
        const int8_t code = static_cast<int8_t>(std::nearbyint(v[j] * inverse));
        q[b * kGroup + j] = code;
        total += code;
      }
      d[b] = scale;
      sum[b] = scale * static_cast<float>(total);
      code_sum[b] = total;
    }
    for (size_t i = 0; i < offset.size(); ++i) offset[i] = static_cast<int8_t>(q[i] ^ 0x80);
  }
};

#if defined(STRATA_VECTOR) && defined(__AVX2__)
// One Q4 block's 32 codes in value order (byte j of the block holds code j in its low nibble, j + 16 in its high).
inline __m256i block_codes(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
  return _mm256_set_m128i(high, low);
}
#endif

#if defined(STRATA_VECTOR) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
// A row's codes: two blocks per 512-bit vector, int32 lanes 0-7 holding block k's sums, 8-15 block k + 1's (zero
// for a lone last block). Sixteen blocks per fp32 accumulator, one lane each, and 16 rows per interleaved group.
constexpr int64_t kChunkBlocks = 16;
constexpr int64_t kUnitBlocks = 2;
using QInt = __m512i;
using QVec = __m512;
inline QInt load_codes(const int8_t* p, bool pair) {
  return pair ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, p);
}
inline QInt i_zero() { return _mm512_setzero_si512(); }
inline QInt i_load(const void* p) { return _mm512_loadu_si512(p); }
inline QInt i_set1(uint32_t v) { return _mm512_set1_epi32(static_cast<int32_t>(v)); }
inline QInt dot_u8_s8_onto(QInt acc, QInt u, QInt s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline QInt minus_128_lane_sums(QInt s) {   // -128 * (sum of each int32 lane's 4 signed bytes)
  return _mm512_sub_epi32(i_zero(), dot_u8_s8_onto(i_zero(), _mm512_set1_epi8(static_cast<char>(0x80)), s));
}
#define STRATA_Q8_OFFSET 1
inline QInt nibbles(const uint8_t* p, bool pair) {   // two blocks' 16 code bytes -> 32 codes each, in value order
  const __m256i bytes = pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi8(0xFFFF, p);
  const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F));
  const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(0x0F));
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(low, high, 0x20)),
                            _mm256_permute2x128_si256(low, high, 0x31), 1);
}
// The float steps as rounding intrinsics: -ffast-math may reassociate plain vector arithmetic, and the row and the
// interleaved kernels must round the same operations in the same order.
constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
inline QVec q_zero() { return _mm512_setzero_ps(); }
inline QVec q_set1(float v) { return _mm512_set1_ps(v); }
inline QVec q_load(const float* p) { return _mm512_loadu_ps(p); }
inline QVec q_load_first(const float* p, int64_t n) {   // lanes 0..n-1, zeros after
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
}
inline void q_store(float* p, QVec v) { _mm512_storeu_ps(p, v); }
inline QVec q_cvt(QInt v) { return _mm512_cvtepi32_ps(v); }
inline QVec q_add(QVec a, QVec b) { return _mm512_add_round_ps(a, b, kNearest); }
inline QVec q_mul(QVec a, QVec b) { return _mm512_mul_round_ps(a, b, kNearest); }
inline QVec q_fma(QVec a, QVec b, QVec c) { return _mm512_fmadd_round_ps(a, b, c, kNearest); }
inline float lane_tree_sum(QVec v) {   // lanes l + (l + 8), then 4, 2, 1 apart
  v = q_add(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  v = q_add(v, _mm512_shuffle_f32x4(v, v, 0xB1));
  v = q_add(v, _mm512_permute_ps(v, 0x4E));
  return _mm512_cvtss_f32(q_add(v, _mm512_permute_ps(v, 0xB1)));
}
// Lane indices for _mm512_permutex2var_epi32 (0-15: x, 16-31: y): blocks of `width` lanes -> twice as many blocks of
// width / 2, each lane the sum of lanes j and j + width / 2 of its block (x's blocks first, then y's).
alignas(64) constexpr int32_t kFoldLanes[3][2][16] = {
    {{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
     {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}},   // width 8
    {{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
     {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31}},   // width 4
    {{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
     {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}},   // width 2
};
template <int Level>   // 0: width 8, 1: width 4, 2: width 2
inline QInt fold_lanes(QInt x, QInt y) {
  return _mm512_add_epi32(_mm512_permutex2var_epi32(x, _mm512_load_si512(kFoldLanes[Level][0]), y),
                          _mm512_permutex2var_epi32(x, _mm512_load_si512(kFoldLanes[Level][1]), y));
}
// Lane b of the result: the sum of block b's 8 lanes, from unit(0..7), vectors of block pairs (lanes 0-7: block 2p,
// 8-15: 2p+1), each asked for just before it is folded (fewer vectors live at once).
template <typename Unit>
inline QInt chunk_sums(const Unit& unit) {
  const QInt a = fold_lanes<0>(unit(0), unit(1)), b = fold_lanes<0>(unit(2), unit(3));
  const QInt ab = fold_lanes<1>(a, b);
  const QInt c = fold_lanes<0>(unit(4), unit(5)), d = fold_lanes<0>(unit(6), unit(7));
  return fold_lanes<2>(ab, fold_lanes<1>(c, d));
}
#define STRATA_Q_DOT 1
#elif defined(STRATA_VECTOR) && defined(__AVX2__)
// A row's codes: one block per 256-bit vector. Eight blocks per fp32 accumulator, one lane each, and 8 rows per
// interleaved group.
constexpr int64_t kChunkBlocks = 8;
constexpr int64_t kUnitBlocks = 1;
using QInt = __m256i;
using QVec = __m256;
inline QInt load_codes(const int8_t* p, bool) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline QInt i_zero() { return _mm256_setzero_si256(); }
inline QInt i_load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline QInt i_set1(uint32_t v) { return _mm256_set1_epi32(static_cast<int32_t>(v)); }
#if defined(__AVXVNNI__)
inline QInt dot_u8_s8_onto(QInt acc, QInt u, QInt s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
inline QInt minus_128_lane_sums(QInt s) {
  return _mm256_sub_epi32(i_zero(), dot_u8_s8_onto(i_zero(), _mm256_set1_epi8(static_cast<char>(0x80)), s));
}
#define STRATA_Q8_OFFSET 1
#else   // u * s in pairs fits int16 (at most 2 * 128 * 127), then pairs of those summed in int32; saturates past that
inline QInt dot_u8_s8_onto(QInt acc, QInt u, QInt s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline QInt q_abs(QInt v) { return _mm256_abs_epi8(v); }
inline QInt negate_where(QInt x, QInt w) { return _mm256_sign_epi8(x, w); }   // also 0 where w = 0: |w| = 0 there
#endif
inline QInt nibbles(const uint8_t* p, bool) { return block_codes(p); }
// AVX2 has no rounding-mode intrinsics: adds and products go through the FMA builtin (a * 1 + b, a * b + 0), which
// the compiler does not reassociate, so the row and the interleaved kernels round the same operations alike.
inline QVec q_zero() { return _mm256_setzero_ps(); }
inline QVec q_set1(float v) { return _mm256_set1_ps(v); }
inline QVec q_load(const float* p) { return _mm256_loadu_ps(p); }
inline QVec q_load_first(const float* p, int64_t n) {   // lanes 0..n-1, zeros after
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)), lanes));
}
inline void q_store(float* p, QVec v) { _mm256_storeu_ps(p, v); }
inline QVec q_cvt(QInt v) { return _mm256_cvtepi32_ps(v); }
inline QVec q_add(QVec a, QVec b) { return _mm256_fmadd_ps(a, _mm256_set1_ps(1.0f), b); }
inline QVec q_mul(QVec a, QVec b) { return _mm256_fmadd_ps(a, b, _mm256_setzero_ps()); }
inline QVec q_fma(QVec a, QVec b, QVec c) { return _mm256_fmadd_ps(a, b, c); }
inline float lane_tree_sum(QVec v) {   // lanes l + (l + 4), then 2, 1 apart
  v = q_add(v, _mm256_permute2f128_ps(v, v, 0x01));
  v = q_add(v, _mm256_permute_ps(v, 0x4E));
  return _mm256_cvtss_f32(q_add(v, _mm256_permute_ps(v, 0xB1)));
}
// Lane b of the result: the sum of block b's 8 lanes, from unit(0..7), one vector per block, each asked for just
// before it is folded (16 vector registers: fewer live at once).
template <typename Unit>
inline QInt chunk_sums(const Unit& unit) {
  const QInt low01 = _mm256_hadd_epi32(unit(0), unit(1));
  const QInt low = _mm256_hadd_epi32(low01, _mm256_hadd_epi32(unit(2), unit(3)));
  const QInt high45 = _mm256_hadd_epi32(unit(4), unit(5));
  const QInt high = _mm256_hadd_epi32(high45, _mm256_hadd_epi32(unit(6), unit(7)));
  // low: blocks 0-3's sums of lanes 0-3 | of lanes 4-7; high: the same for blocks 4-7
  return _mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20), _mm256_permute2x128_si256(low, high, 0x31));
}
#define STRATA_Q_DOT 1
#endif

#ifdef STRATA_Q_DOT
// Every Q8_0 / Q4 output: each block's exact int32 sum goes to lane g % kChunkBlocks of an fp32 accumulator, which
// adds block g's fma(sum, d_w * d_x) (then Q4's fma(min, d_x * sum(q))) in ascending g; a fixed tree (lanes 8, 4, 2, 1
// apart) ends it. Two kernels follow that order to the bit, so a row's outputs never depend on its batch: one
// activation row at a time (few rows), and kChunkBlocks rows interleaved in the lanes, each integer dot product taking
// one broadcast weight dword against every row's codes, so scaling a block's sums is paid once for all of them
// instead of per row: on AVX-512 VNNI the linears of a SmolLM2 step on the AMX Xeon took Q8_0 29-35 -> 16-18 ms at 16
// rows and 60-65 -> 31-38 at 32, Q4 35-39 -> 17-21 and 73-76 -> 30-37, the same within noise at 1-6 rows
// (benchmarks/results/cpu_profile/q_interleaved_ab.json). The interleaved kernel runs tiles of weight rows against
// pairs of row groups, each staged weight dword and each row vector loaded once for several products, so it also
// carries prefill: the 120 decoder linears of a 272-row SmolLM2 prefill on the AVX-512 EPYC 174-182 ms against
// 345-469 for widening the weights to fp32 and calling BLAS (cpu_profile/quantized_tiles_ab.json).
#ifdef STRATA_Q8_OFFSET
// One unit of Q8_0 weight blocks against activations offset to unsigned (u = q + 128): VNNI sums u8 x s8 products
// without saturating, so each lane's sum of u * w, started from -128 * its sum of w (taken once per weight block for
// every activation row), is exactly its sum of q * w: one instruction per block and row where the sign trick below
// takes three. Interleaved, the roles swap: the weights enter as w + 128 and each row's sum starts from -128 * sum(q).
struct Q8Blocks {
  static constexpr int64_t kBytesPer32 = 32;
  static constexpr bool kOffsetActivations = true;
  static constexpr bool kInterleavedStart = true;
  QInt w, start;
  Q8Blocks() = default;
  Q8Blocks(const void* p, bool pair)
      : w(load_codes(static_cast<const int8_t*>(p), pair)), start(minus_128_lane_sums(w)) {}
  QInt sums(QInt u) const { return dot_u8_s8_onto(start, u, w); }
  static void dwords(const char* p, uint32_t* out) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                                         _mm256_set1_epi8(static_cast<char>(0x80))));
  }
  static QInt dot_dword(QInt acc, uint32_t dword, QInt rows) { return dot_u8_s8_onto(acc, i_set1(dword), rows); }
};
#else
// One Q8_0 weight block: |w| as unsigned bytes, the activations negated where w < 0 (AVX2's maddubs saturates its
// int16 pair sums, which rules out offsetting either side to unsigned as above).
struct Q8Blocks {
  static constexpr int64_t kBytesPer32 = 32;
  static constexpr bool kOffsetActivations = false;
  static constexpr bool kInterleavedStart = false;
  QInt w, magnitude;
  Q8Blocks() = default;
  Q8Blocks(const void* p, bool) : w(load_codes(static_cast<const int8_t*>(p), true)), magnitude(q_abs(w)) {}
  QInt sums(QInt x) const { return dot_u8_s8_onto(i_zero(), magnitude, negate_where(x, w)); }
  static void dwords(const char* p, uint32_t* out) { std::memcpy(out, p, 32); }
  static QInt dot_dword(QInt acc, uint32_t dword, QInt rows) {
    const QInt w = i_set1(dword);
    return dot_u8_s8_onto(acc, q_abs(w), negate_where(rows, w));
  }
};
#endif

// One unit of Q4 weight blocks: the 4-bit codes (0..15) as unsigned bytes.
struct Q4Blocks {
  static constexpr int64_t kBytesPer32 = 16;
  static constexpr bool kOffsetActivations = false;
  static constexpr bool kInterleavedStart = false;
  QInt codes;
  Q4Blocks() = default;
  Q4Blocks(const void* p, bool pair) : codes(nibbles(static_cast<const uint8_t*>(p), pair)) {}
  QInt sums(QInt x) const { return dot_u8_s8_onto(i_zero(), codes, x); }
  static void dwords(const char* p, uint32_t* out) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), block_codes(reinterpret_cast<const uint8_t*>(p)));
  }
  static QInt dot_dword(QInt acc, uint32_t dword, QInt rows) { return dot_u8_s8_onto(acc, i_set1(dword), rows); }
};

// Rows m0..m0+MR-1 against weight row n, kChunkBlocks blocks at a time. Prefetching kAheadBytes ahead pays here from
// one row on, unlike the float paths (on the AMX Xeon, Q4 at one row 7.8 -> 6.3 ms a step, in the AVX2 build at two
// rows 14.0 -> 6.8).
template <typename Blocks, int64_t MR>
inline void fold_rows(const char* w, const float* ws, const float* wm, const QuantizedRows& x, int64_t m0, int64_t K,
                      float* out, int64_t N, int64_t n) {
  const int64_t groups = K / kGroup;
  const char* row = w + n * groups * Blocks::kBytesPer32;
  const int8_t* codes = Blocks::kOffsetActivations ? x.offset.data() : x.q.data();
  QVec acc[MR];
  for (int64_t i = 0; i < MR; ++i) acc[i] = q_zero();
  for (int64_t g0 = 0; g0 < groups; g0 += kChunkBlocks) {
    const int64_t blocks = std::min<int64_t>(kChunkBlocks, groups - g0);
    const char* at = row + g0 * Blocks::kBytesPer32;
    for (int64_t line = 0; line < blocks * Blocks::kBytesPer32; line += kLineBytes)
      _mm_prefetch(at + line + kAheadBytes, _MM_HINT_T0);
    const int64_t units = (blocks + kUnitBlocks - 1) / kUnitBlocks;
    Blocks weight[8];
    for (int64_t u = 0; u < units; ++u)
      weight[u] = Blocks(at + u * kUnitBlocks * Blocks::kBytesPer32, (u + 1) * kUnitBlocks <= blocks);
    const QVec dw = q_load_first(ws + n * groups + g0, blocks);
    const QVec mins = wm != nullptr ? q_load_first(wm + n * groups + g0, blocks) : q_zero();
    for (int64_t i = 0; i < MR; ++i) {
      const int64_t m = m0 + i;
      const int8_t* row_codes = codes + m * K + g0 * kGroup;
      const auto unit = [&](int64_t u) {
        return u < units ? weight[u].sums(load_codes(row_codes + u * kUnitBlocks * kGroup, (u + 1) * kUnitBlocks <= blocks))
                         : i_zero();
      };
      acc[i] = q_fma(q_cvt(chunk_sums(unit)), q_mul(dw, q_load_first(x.d.data() + m * groups + g0, blocks)), acc[i]);
      if (wm != nullptr) acc[i] = q_fma(mins, q_load_first(x.sum.data() + m * groups + g0, blocks), acc[i]);
    }
  }
  for (int64_t i = 0; i < MR; ++i) out[(m0 + i) * N + n] = lane_tree_sum(acc[i]);
}

// Activation rows kChunkBlocks at a time, interleaved for fold_interleaved: per row group a, block g and dword c, the
// rows' 4 codes each; per (a, g) the rows' scales, d * sum(q) (Q4's minimums term) and -128 * sum(q).
struct InterleavedRows {
  std::vector<int8_t> q;
  std::vector<float> d, sum;
  std::vector<int32_t> start;
  InterleavedRows(const QuantizedRows& x, int64_t M, int64_t K)
      : q((M + kChunkBlocks - 1) / kChunkBlocks * kChunkBlocks * K), d(q.size() / kGroup), sum(d.size()),
        start(d.size()) {
    const int64_t groups = K / kGroup;
    for (int64_t m = 0; m < M; ++m) {
      const int64_t a = m / kChunkBlocks, lane = m % kChunkBlocks;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = (a * groups + g) * kChunkBlocks;
        const int8_t* src = x.q.data() + m * K + g * kGroup;
        for (int64_t c = 0; c < kGroup / 4; ++c)
          std::memcpy(&q[(at * 8 + c * kChunkBlocks + lane) * 4], src + c * 4, 4);
        d[at + lane] = x.d[m * groups + g];
        sum[at + lane] = x.sum[m * groups + g];
        start[at + lane] = -128 * x.code_sum[m * groups + g];
      }
    }
  }
};

// Weight rows n0..n0+J-1 as each dot product takes them (row j's block g at staged[(j * groups + g) * 8]: Q8_0 as
// w + 128 where VNNI offsets, Q4's codes unpacked), prepared once per tile and then read for every row group.
template <typename Blocks, int64_t J>
inline void stage_tile(const char* w, int64_t groups, int64_t n0, uint32_t* staged) {
  for (int64_t j = 0; j < J; ++j) {
    const char* row = w + (n0 + j) * groups * Blocks::kBytesPer32;
    for (int64_t line = 0; line < groups * Blocks::kBytesPer32; line += kLineBytes)
      _mm_prefetch(row + J * groups * Blocks::kBytesPer32 + line, _MM_HINT_T0);   // the next tile's row j
    for (int64_t g = 0; g < groups; ++g) Blocks::dwords(row + g * Blocks::kBytesPer32, staged + (j * groups + g) * 8);
  }
}

// Row groups a0..a0+I-1 (activation rows a * kChunkBlocks + r, lane r of each vector) against the J staged weight
// rows n0..: each output is fold_rows' chain op for op. Lane l of fold_rows' accumulator takes blocks l, l +
// kChunkBlocks, ... in ascending order, so here lane l's blocks run as one chain in registers (I x J accumulators
// and I x J integer sums live: the staged weight dwords and each row vector are loaded once for J, resp. I, dot
// products), its result parked in `lanes`, and the fixed tree over lanes (8, 4, 2, 1 apart) ends each output.
template <typename Blocks, int64_t I, int64_t J>
inline void fold_groups(const uint32_t* staged, const float* ws, const float* wm, const InterleavedRows& x,
                        int64_t a0, int64_t M, int64_t K, float* out, int64_t N, int64_t n0) {
  const int64_t groups = K / kGroup;
  QVec lanes[kChunkBlocks][I][J];
  for (int64_t l = 0; l < kChunkBlocks; ++l) {
    QVec acc[I][J];
    for (int64_t i = 0; i < I; ++i)
      for (int64_t j = 0; j < J; ++j) acc[i][j] = q_zero();
    for (int64_t g = l; g < groups; g += kChunkBlocks) {
      QInt sums[I][J];
      int64_t at[I];
      for (int64_t i = 0; i < I; ++i) {
        at[i] = ((a0 + i) * groups + g) * kChunkBlocks;
        const QInt start = Blocks::kInterleavedStart ? i_load(x.start.data() + at[i]) : i_zero();
        for (int64_t j = 0; j < J; ++j) sums[i][j] = start;
      }
      const uint32_t* dwords = staged + g * 8;
      for (int64_t c = 0; c < 8; ++c) {
        QInt rows[I];
        for (int64_t i = 0; i < I; ++i) {
          rows[i] = i_load(x.q.data() + at[i] * kGroup + c * kChunkBlocks * 4);
          __asm__("" : "+v"(rows[i]));   // one load for J products: else GCC folds it into each as a memory operand
        }
        for (int64_t j = 0; j < J; ++j)
          for (int64_t i = 0; i < I; ++i) sums[i][j] = Blocks::dot_dword(sums[i][j], dwords[j * groups * 8 + c], rows[i]);
      }
      for (int64_t i = 0; i < I; ++i) {
        const QVec dx = q_load(x.d.data() + at[i]);
        for (int64_t j = 0; j < J; ++j) {
          acc[i][j] = q_fma(q_cvt(sums[i][j]), q_mul(q_set1(ws[(n0 + j) * groups + g]), dx), acc[i][j]);
          if (wm != nullptr) acc[i][j] = q_fma(q_set1(wm[(n0 + j) * groups + g]), q_load(x.sum.data() + at[i]), acc[i][j]);
        }
      }
    }
    for (int64_t i = 0; i < I; ++i)
      for (int64_t j = 0; j < J; ++j) lanes[l][i][j] = acc[i][j];
  }
  for (int64_t i = 0; i < I; ++i)
    for (int64_t j = 0; j < J; ++j) {
      for (int64_t width = kChunkBlocks / 2; width >= 1; width /= 2)
        for (int64_t l = 0; l < width; ++l) lanes[l][i][j] = q_add(lanes[l][i][j], lanes[l + width][i][j]);
      alignas(64) float total[kChunkBlocks];
      q_store(total, lanes[0][i][j]);
      const int64_t first = (a0 + i) * kChunkBlocks;
      for (int64_t r = 0; r < std::min(kChunkBlocks, M - first); ++r) out[(first + r) * N + n0 + j] = total[r];
    }
}

// Rows of a group from which the interleaved kernel runs it: at 6 rows it was the faster of the two on both widths,
// at 4 the row kernel (cpu_profile/q_interleaved_ab.json, q_interleaved_avx2_ab.json).
constexpr int64_t kInterleaveFromRows = 6;
// Weight rows per tile and row groups per pass of the interleaved kernel (kTileRows x kPassGroups accumulators and
// as many integer sums held in vector registers: 32 of them on AVX-512, 16 on AVX2). On AVX2 a decode batch of one or
// two groups (up to 16 rows) runs one weight row at a time, which was 10-20% faster there at 6-8 rows than tiles of
// 2 (a tile's dwords are staged and read back; cheap against 16-row vectors, not against 8); tiles from 3 groups
// (cpu_profile/quantized_tiles_ab.json).
constexpr int64_t kTileRows = kChunkBlocks == 16 ? 4 : 2;
constexpr int64_t kTileFromGroups = kChunkBlocks == 16 ? 1 : 3;
constexpr int64_t kPassGroups = 2;

// The interleaved groups (the first `full` groups) against J weight rows from n0, staged once for all of them.
template <typename Blocks, int64_t J>
void fold_tile(const char* w, const float* ws, const float* wm, const InterleavedRows& x, int64_t full, int64_t M,
               int64_t K, float* out, int64_t N, int64_t n0, uint32_t* staged) {
  stage_tile<Blocks, J>(w, K / kGroup, n0, staged);
  int64_t a = 0;
  for (; a + kPassGroups <= full; a += kPassGroups)
    fold_groups<Blocks, kPassGroups, J>(staged, ws, wm, x, a, M, K, out, N, n0);
  for (; a < full; ++a) fold_groups<Blocks, 1, J>(staged, ws, wm, x, a, M, K, out, N, n0);
}

// Every activation row against weight rows begin..end-1: groups of kChunkBlocks rows interleaved (a last group too
// while it holds kInterleaveFromRows rows) against tiles of kTileRows weight rows, the rest 4 rows a pass.
template <typename Blocks>
void fold_quantized(const char* w, const float* ws, const float* wm, const QuantizedRows& x,
                    const InterleavedRows* interleaved, int64_t M, int64_t K, float* out, int64_t N, int64_t begin,
                    int64_t end) {
  int64_t full = 0;
  while (interleaved != nullptr && M - full * kChunkBlocks >= kInterleaveFromRows) ++full;
  if (full > 0) {
    std::vector<uint32_t> staged(kTileRows * K / 4);
    int64_t n = begin;
    for (; full >= kTileFromGroups && n + kTileRows <= end; n += kTileRows)
      fold_tile<Blocks, kTileRows>(w, ws, wm, *interleaved, full, M, K, out, N, n, staged.data());
    for (; n < end; ++n) fold_tile<Blocks, 1>(w, ws, wm, *interleaved, full, M, K, out, N, n, staged.data());
  }
  for (int64_t n = begin; n < end; ++n) {
    for (int64_t m = std::min(M, full * kChunkBlocks); m < M; m += 4) {
      switch (std::min<int64_t>(4, M - m)) {
        case 1: fold_rows<Blocks, 1>(w, ws, wm, x, m, K, out, N, n); break;
        case 2: fold_rows<Blocks, 2>(w, ws, wm, x, m, K, out, N, n); break;
        case 3: fold_rows<Blocks, 3>(w, ws, wm, x, m, K, out, N, n); break;
        default: fold_rows<Blocks, 4>(w, ws, wm, x, m, K, out, N, n); break;
      }
    }
  }
}

template <typename Blocks>
void stream_quantized(const void* w, const float* ws, const float* wm, const float* x, int64_t M, int64_t K,
                      float* out, int64_t N) {
  const QuantizedRows rows(x, M, K, Blocks::kOffsetActivations);
  const char* bytes = static_cast<const char*>(w);
  const std::optional<InterleavedRows> interleaved =
      M >= kInterleaveFromRows ? std::optional<InterleavedRows>(std::in_place, rows, M, K) : std::nullopt;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    fold_quantized<Blocks>(bytes, ws, wm, rows, interleaved ? &*interleaved : nullptr, M, K, out, N, begin, end);
  });
}
constexpr bool kQuantizedDot = true;
#else
constexpr bool kQuantizedDot = false;
#endif

// fp32 -> bf16, round to nearest even (as torch's .bfloat16() and AVX512_BF16's conversion).
void round_to_bf16(const float* x, int64_t n, uint16_t* dst) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) dst[i] = c10::BFloat16(x[i]).x;
}

// out[m, n0 + r] = dot(rows[r], x[m]) for r < nr (nr <= kRows), in the vector order when K allows it.
void fold_rows(const float* rows, int64_t nr, const float* x, int64_t M, int64_t K, float* out, int64_t N,
               int64_t n0) {
#ifdef STRATA_VECTOR
  if (K % kLanes == 0) {
    int64_t m = 0;
    if (nr == kRows) {
      const WidenedRows widened{rows, K, n0};
      for (; m + 2 <= M; m += 2) fold_direct<2, kRows, false>(widened, x + m * K, K, out + m * N, N, n0, 0);
      if (m < M) fold_direct<1, kRows, false>(widened, x + m * K, K, out + m * N, N, n0, 0);
      return;
    }
    for (; m < M; ++m)
      for (int64_t r = 0; r < nr; ++r) {
        Vec a = vzero();
        for (int64_t k = 0; k < K; k += kLanes) a = vfma(vload(rows + r * K + k), vload(x + m * K + k), a);
        out[m * N + n0 + r] = vsum(a);
      }
    return;
  }
#endif
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    for (int64_t r = 0; r < nr; ++r) {
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < K; ++k) sum += rows[r * K + k] * xm[k];
      out[m * N + n0 + r] = sum;
    }
  }
}

int64_t check(int64_t format, const at::Tensor& weight, const at::Tensor& scales, const at::Tensor& mins,
              int64_t K) {
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 2, "weight must be contiguous 2-d");
  const int64_t N = weight.size(0);
  if (format == kF16) {
    TORCH_CHECK(weight.dtype() == at::kHalf && weight.size(1) == K, "f16 weight must be fp16 [N, K]");
    return N;
  }
  if (format == kBF16) {
    TORCH_CHECK(weight.dtype() == at::kBFloat16 && weight.size(1) == K, "bf16 weight must be bf16 [N, K]");
    return N;
  }
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of ", kGroup);
  TORCH_CHECK(scales.dtype() == at::kFloat && scales.is_contiguous() && scales.numel() == N * (K / kGroup),
              "scales must be contiguous fp32 [N, K / 32]");
  if (format == kQ8) {
    TORCH_CHECK(weight.dtype() == at::kChar && weight.size(1) == K, "q8 weight must be int8 [N, K]");
  } else {
    TORCH_CHECK(format == kQ4, "unknown weight format ", format);
    TORCH_CHECK(weight.dtype() == at::kByte && weight.size(1) == K / 2, "q4 weight must be uint8 [N, K / 2]");
    TORCH_CHECK(mins.dtype() == at::kFloat && mins.is_contiguous() && mins.numel() == scales.numel(),
                "mins must be contiguous fp32 like scales");
  }
  return N;
}

}  // namespace

// x [M, K] fp32 times the weight [N, K] transposed -> [M, N] fp32.
at::Tensor linear(at::Tensor x, at::Tensor weight, at::Tensor scales, at::Tensor mins,
                     int64_t format, int64_t K) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == K,
              "x must be contiguous fp32 [M, K]");
  const int64_t N = check(format, weight, scales, mins, K), M = x.size(0);
  auto out = at::empty({M, N}, x.options());
  const void* w = weight.data_ptr();
  const float* s = format == kF16 || format == kBF16 ? nullptr : scales.data_ptr<float>();
  const float* mn = format == kQ4 ? mins.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
#ifdef STRATA_Q_DOT
  if (format == kQ8) {
    stream_quantized<Q8Blocks>(w, s, nullptr, xp, M, K, op, N);
    return out;
  }
  if (format == kQ4) {
    stream_quantized<Q4Blocks>(w, s, mn, xp, M, K, op, N);
    return out;
  }
#endif
  std::vector<float> rounded;
  if (format == kBF16) {
    std::vector<uint16_t> xb(M * K);     // the activations as bf16 once
    round_to_bf16(xp, M * K, xb.data());
#if defined(__AVX512BF16__)
    if (K % kBF16Lanes == 0) {
      stream_bf16(BF16Rows{static_cast<const uint16_t*>(w), K}, xb.data(), M, K, op, N);
      return out;
    }
#endif
    rounded.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) rounded[i] = c10::detail::f32_from_bits(xb[i]);
    xp = rounded.data();     // widened rows below, fp32 FMAs over the bf16-rounded activations
  }
#ifdef STRATA_VECTOR
  // bf16 without AVX512_BF16 is the slow fallback anyway: widened rows in a buffer
  const bool direct = format == kF16 && K % kLanes == 0;
  const F16Rows f16_rows{static_cast<const uint16_t*>(w), K};
  if (direct) {
    if (M < kTileFromRows) stream(f16_rows, xp, M, K, op, N);
    else stream_tiles(f16_rows, xp, M, K, op, N);
    return out;
  }
#endif
  const int64_t tiles = (N + kRows - 1) / kRows;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rows(kRows * K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRows, nr = std::min(kRows, N - n0);
      for (int64_t r = 0; r < nr; ++r) widen_row(format, w, s, mn, n0 + r, K, rows.data() + r * K);
      fold_rows(rows.data(), nr, xp, M, K, op, N, n0);
    }
  });
  return out;
}

// Whether bf16 weights run on AVX512_BF16 dot products here (else the fp32 fallback, several times slower).
bool native_bf16() { return kNativeBF16; }

// Whether Q8_0 and Q4 weights multiply activations quantized to Q8_0 blocks here (else widened to fp32).
bool quantized_dot() { return kQuantizedDot; }

// The whole weight as fp32 [N, K]: for large batches (prefill), which a BLAS matmul runs better than fold_rows.
at::Tensor dequantize(at::Tensor weight, at::Tensor scales, at::Tensor mins, int64_t format, int64_t K) {
  const int64_t N = check(format, weight, scales, mins, K);
  auto out = at::empty({N, K}, at::TensorOptions().dtype(at::kFloat));
  const void* w = weight.data_ptr();
  const float* s = format == kF16 || format == kBF16 ? nullptr : scales.data_ptr<float>();
  const float* mn = format == kQ4 ? mins.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) widen_row(format, w, s, mn, n, K, op + n * K);
  });
  return out;
}
