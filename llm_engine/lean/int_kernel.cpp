// Weight-only 4- and 8-bit products on AVX512-VNNI: w = d * u + m per group of 32 inputs, with
// u the unsigned code (0..15 or 0..255). Each activation row is quantised per group to two int8
// codes, x ~ dx (q + r / 128) (about 14 bits: finer than bf16's 8), and each group's integer
// dot products with the codes are taken by vpdpbusd, four products a lane.
//
// Why: torch's int4 CPU kernel pays an fp32 FMA for every weight of every extra row, so rows
// sharing a forward cost nearly as much as forwards apart. Int8 activations alone (llama.cpp's
// q8_1) took the embedded target's top-1 agreement with fp32 from 0.967 (torch's kernel) to
// 0.954; with the remainder code it is 0.994, for a second vpdpbusd per chunk. Each row runs the same instructions whatever the
// row count, so a row's outputs are bit-identical alone or batched (the engine's speculation
// depends on it).
//
// Layout (`llm_engine.lean.int_kernel.pack`): outputs in blocks of 16 lanes; per block and group,
// the codes as 8 chunks of [16 lanes][4 inputs] (input k = 4 c + i of the group), 4-bit codes two
// chunks a byte (chunk 2p low nibble, 2p + 1 high); d and m as [block][group][16] halves (fp16,
// as the file has them: a fifth less to read a step than fp32).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include "avx512.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr int64_t GROUP = 32;
constexpr int MAX_ROWS = 8;  // rows a pass over a block carries: accumulators stay in registers
constexpr int64_t AHEAD = 16;  // groups between a group's codes' prefetch and their use

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

inline int32_t four(const int8_t* p) {  // four codes as one lane's operand
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// One row's inputs to two int8 codes per group, x ~ dx (q + r / 128): q = round(x / dx) with
// dx = max|x| / 127, and the remainder's r = round(128 (x / dx - q)) in -64..64; and
// sx = dx * (sum(q) + sum(r) / 128) (what a group's m multiplies).
template <typename T>
VNNI void quantise_row(const T* x, int64_t groups, int8_t* q, int8_t* r, float* dx, float* sx) {
  const __m512 fine = _mm512_set1_ps(128.0f);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 a = load(x + g * GROUP), b = load(x + g * GROUP + LANES);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    // max drops NaNs: a NaN input makes the group's scale NaN, so that the outputs say so
    if (_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q))
      amax = std::numeric_limits<float>::quiet_NaN();
    float d = amax / 127.0f;
    // a subnormal scale's inverse overflows: such a group counts as zeros
    __m512 inv = _mm512_set1_ps(d >= std::numeric_limits<float>::min() ? 1.0f / d : 0.0f);
    __m512 sa = _mm512_mul_ps(a, inv), sb = _mm512_mul_ps(b, inv);
    __m512i qa = _mm512_cvtps_epi32(sa), qb = _mm512_cvtps_epi32(sb);
    __m512i ra = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(sa, _mm512_cvtepi32_ps(qa)), fine));
    __m512i rb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(sb, _mm512_cvtepi32_ps(qb)), fine));
    // to int8 by two saturating packs (saturating as one would), which leave each 128-bit lane
    // L as four codes each of qa, qb, ra and rb from 4 L; a dword permute puts them in order:
    // the group's q, then its r (half the shuffles of four narrowing stores)
    __m512i packed = _mm512_packs_epi16(_mm512_packs_epi32(qa, qb), _mm512_packs_epi32(ra, rb));
    packed = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), packed);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * GROUP), _mm512_castsi512_si256(packed));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r + g * GROUP),
                        _mm512_extracti64x4_epi64(packed, 1));
    dx[g] = d / 128.0f;
    // 128 sum(q) + sum(r) in one reduction (integers: the same sum)
    int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(
        _mm512_slli_epi32(_mm512_add_epi32(qa, qb), 7), _mm512_add_epi32(ra, rb)));
    sx[g] = dx[g] * static_cast<float>(total);
  }
}

// R rows of one block of 16 outputs.
template <int BITS, int R, typename T>
VNNI void block_rows(const uint8_t* codes, uintptr_t codes_end, const at::Half* d, const at::Half* m, int64_t groups,
                     const int8_t* q, const int8_t* rq, const float* dx, const float* sx, int64_t in_features,
                     const float* bias, T* out, int64_t out_stride, __mmask16 mask) {
  constexpr int64_t BLOCK_BYTES = LANES * GROUP * BITS / 8;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = codes + g * BLOCK_BYTES;
    // the codes AHEAD groups on (into the next block near the end: the same thread takes it
    // next): one core's hardware prefetch alone left a pass waiting on memory
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(block) + AHEAD * BLOCK_BYTES;
    if (ahead < codes_end)
      for (int64_t line = 0; line < BLOCK_BYTES; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
    __m512i w[8];
    for (int p = 0; p < 8 * BITS / 8; ++p) {
      __m512i v = _mm512_loadu_si512(block + 64 * p);
      if constexpr (BITS == 4) {
        w[2 * p] = _mm512_and_si512(v, nibble);
        w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      } else {
        w[p] = v;
      }
    }
    __m512 dv = load(d + g * LANES), mv = load(m + g * LANES);
    for (int r = 0; r < R; ++r) {
      const int8_t *qr = q + r * in_features + g * GROUP, *rr = rq + r * in_features + g * GROUP;
      __m512i dot = _mm512_setzero_si512(), rest = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        dot = _mm512_dpbusd_epi32(dot, w[c], _mm512_set1_epi32(four(qr + 4 * c)));
        rest = _mm512_dpbusd_epi32(rest, w[c], _mm512_set1_epi32(four(rr + 4 * c)));
      }
      dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 7), rest);
      __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(dx[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 v = bias ? _mm512_add_ps(acc[r], _mm512_maskz_loadu_ps(mask, bias)) : acc[r];
    store(out + r * out_stride, v, mask);
  }
}

template <int BITS, typename T>
VNNI void block(const uint8_t* codes, uintptr_t codes_end, const at::Half* d, const at::Half* m, int64_t groups,
                const int8_t* q, const int8_t* rq, const float* dx, const float* sx, int64_t rows,
                int64_t in_features, const float* bias, T* out, int64_t out_stride,
                __mmask16 mask) {
  for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
    const int8_t *qr = q + r0 * in_features, *rr = rq + r0 * in_features;
    const float *dxr = dx + r0 * groups, *sxr = sx + r0 * groups;
    T* o = out + r0 * out_stride;
    switch (std::min<int64_t>(MAX_ROWS, rows - r0)) {
#define ROWS_CASE(R) \
      case R: block_rows<BITS, R>(codes, codes_end, d, m, groups, qr, rr, dxr, sxr, in_features, bias, o, out_stride, mask); break;
      ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7)
      default: block_rows<BITS, MAX_ROWS>(codes, codes_end, d, m, groups, qr, rr, dxr, sxr, in_features, bias, o, out_stride, mask);
#undef ROWS_CASE
    }
  }
}

template <typename TIn, typename TOut>
void run(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
         const float* bias, int64_t bits, at::Tensor& out) {
  const int64_t rows = x.size(0), in_features = x.size(1), groups = in_features / GROUP;
  const int64_t out_features = out.size(1), blocks = (out_features + LANES - 1) / LANES;
  at::Tensor q = at::empty({2, rows, in_features}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({2, rows, groups}, x.options().dtype(at::kFloat));
  int8_t *qp = q.data_ptr<int8_t>(), *rp = qp + rows * in_features;
  float *dx = scales.data_ptr<float>(), *sx = dx + rows * groups;
  const TIn* xp = x.data_ptr<TIn>();
  auto quantise = [&](int64_t r) {
    quantise_row(xp + r * in_features, groups, qp + r * in_features, rp + r * in_features,
                 dx + r * groups, sx + r * groups);
  };
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half *dp = d.data_ptr<at::Half>(), *mp = m.data_ptr<at::Half>();
  TOut* op = out.data_ptr<TOut>();
  const int64_t block_bytes = groups * LANES * GROUP * bits / 8;
  const uintptr_t codes_end = reinterpret_cast<uintptr_t>(cp + blocks * block_bytes);
  auto products = [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      int64_t left = out_features - b * LANES;
      __mmask16 mask = left >= LANES ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
      const float* bb = bias ? bias + b * LANES : nullptr;
      const uint8_t* c = cp + b * block_bytes;
      const at::Half *db = dp + b * groups * LANES, *mb = mp + b * groups * LANES;
      if (bits == 4)
        block<4>(c, codes_end, db, mb, groups, qp, rp, dx, sx, rows, in_features, bb, op + b * LANES,
                 out_features, mask);
      else
        block<8>(c, codes_end, db, mb, groups, qp, rp, dx, sx, rows, in_features, bb, op + b * LANES,
                 out_features, mask);
    }
  };
  // About 64k products a task: fewer, and the threads' start costs more than they share.
  const int64_t grain = std::max<int64_t>(1, 65536 / (LANES * in_features * rows));
  if (blocks <= grain || at::get_num_threads() < 2 || at::in_parallel_region()) {
    for (int64_t r = 0; r < rows; ++r) quantise(r);
    products(0, blocks);
    return;
  }
  // One team for both steps: the rows quantised between the threads (a serial step that had
  // the other threads wait, about 20 ns a group of a row), then the blocks split as
  // at::parallel_for splits them. Each row and block runs the same code on any thread. The
  // whole pool as at::parallel_for starts it (a smaller team has libgomp let the rest of its
  // threads go, to start them again for the next op), its threads past `workers` idle.
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num();
    const int64_t workers = std::min<int64_t>(omp_get_num_threads(), (blocks + grain - 1) / grain);
    if (t < workers)
      for (int64_t r = t; r < rows; r += workers) quantise(r);
#pragma omp barrier
    const int64_t chunk = (blocks + workers - 1) / workers, begin = t * chunk;
    if (t < workers && begin < blocks) products(begin, std::min(blocks, begin + chunk));
  }
}

bool supported() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  }();
  return ok;
}

// x [rows, in] (float or bfloat16, contiguous); codes, d, m packed; bias [out] float or None.
// Returns [rows, out] in x's dtype, or float with out_float.
at::Tensor mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
              const at::Tensor& m, const std::optional<at::Tensor>& bias, int64_t out_features,
              int64_t bits, bool out_float) {
  TORCH_CHECK(supported(), "this CPU lacks AVX512-VNNI");
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), "the int kernel runs on a CPU");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % GROUP == 0,
              "x must be a contiguous [rows, in] matrix with in a multiple of 32");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  const int64_t groups = x.size(1) / GROUP, blocks = (out_features + LANES - 1) / LANES;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.numel() == blocks * groups * LANES * GROUP * bits / 8,
              "codes do not match the shape");
  TORCH_CHECK(d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf && d.is_contiguous() &&
                  m.is_contiguous() && d.numel() == blocks * groups * LANES && m.numel() == d.numel(),
              "scales do not match the shape");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == out_features, "bias must be float32 [out]");
    bp = bias->data_ptr<float>();
  }
  bool bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor out = at::empty({x.size(0), out_features},
                             x.options().dtype(out_float ? at::kFloat : x.scalar_type()));
  if (x.size(0) == 0) return out;
  if (bf16 && out_float) run<at::BFloat16, float>(x, codes, d, m, bp, bits, out);
  else if (bf16) run<at::BFloat16, at::BFloat16>(x, codes, d, m, bp, bits, out);
  else run<float, float>(x, codes, d, m, bp, bits, out);
  return out;
}

}  // namespace

TORCH_LIBRARY(voiceagent_int, lib) {
  lib.def("supported", []() { return supported(); });
  lib.def("mm(Tensor x, Tensor codes, Tensor d, Tensor m, Tensor? bias, int out_features, "
          "int bits, bool out_float) -> Tensor", &mm);
}
