// A decoder layer's small steps as one op each, on AVX512: RMSNorm, SiLU times up, and the whole
// attention of a short forward (rotary, the cache writes, causal attention over each row's own
// cache). Through torch these were some 50 operators a layer, about 3 ms of a 9 ms step of the
// embedded target on 2 cores (a torch profile, Intel Xeon, 2026-12-06).
//
// Every row runs the same instructions whatever the other rows are, so a row's numbers are the
// same alone, batched or in a verify (the engine's speculation depends on it). The rotary is
// rounded step by step as torch's elementwise ops round it (bf16 activations: each product and
// the sum to bf16), so keys written here equal keys the prefill's torch path writes. Scores,
// softmax and the weighted sum run in fp32 over the keys up to the row's own position: no mask,
// no padding. With bf16 activations and cache on AVX512-BF16, the scores' products are taken
// by vdpbf16ps (queries and keys are bf16, so the products are exact but for subnormals, which
// it flushes), summed in fp32.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx512.h"

#include <cmath>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

bool supported() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }();
  return ok;
}

// AVX512-BF16's vdpbf16ps: bf16 queries' and keys' dot products in half the instructions, where
// the CPU has it and `use_bf16_dot` (for the tests of the other path) has not turned it off.
std::atomic<bool> bf16_dot_wanted{true};

bool bf16_dot() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
  }();
  return ok && bf16_dot_wanted.load(std::memory_order_relaxed);
}

#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// e^x in fp32 (Cephes' expf polynomial, scaled by 2^n with vscalefps); within 2 ulp.
AVX512 inline __m512 exp16(__m512 x) {
  // the bounds first: min and max return their second operand for a NaN, which passes through
  x = _mm512_max_ps(_mm512_set1_ps(-88.3762626647949f),
                    _mm512_min_ps(_mm512_set1_ps(88.3762626647949f), x));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// -- RMSNorm: w * (x * rsqrt(mean(x^2) + eps)), the normalised row rounded to x's type first ----

template <typename T>
AVX512 void rms_rows(const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += LANES) {
      __m512 v = load(xr + i, tail(n - i));
      sum = _mm512_fmadd_ps(v, v, sum);
    }
    __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(sum) / n + eps));
    for (int64_t i = 0; i < n; i += LANES) {
      __mmask16 k = tail(n - i);
      __m512 h = round_to(_mm512_mul_ps(load(xr + i, k), scale), xr);
      store(out + r * n + i, _mm512_mul_ps(load(w + i, k), h), k);
    }
  }
}

// Rows split between threads where they are many or costly (`work` a row, in an RMSNorm's
// element's cost): each row's numbers are its own.
template <typename F>
void by_rows(int64_t rows, int64_t work, const F& f) {
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(work, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) { f(begin, end - begin); });
}

void check_rows(const at::Tensor& x) {
  TORCH_CHECK(supported(), "this CPU lacks AVX512");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous [rows, width] CPU matrix");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
}

at::Tensor rms(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous() && weight.numel() == x.size(1),
              "weight must be a CPU [hidden] vector in x's dtype");
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.size(1);
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kBFloat16) {
    const at::BFloat16 *xp = x.data_ptr<at::BFloat16>(), *wp = weight.data_ptr<at::BFloat16>();
    at::BFloat16* op = out.data_ptr<at::BFloat16>();
    by_rows(x.size(0), n, [&](int64_t r, int64_t count) { rms_rows(xp + r * n, wp, op + r * n, count, n, e); });
  } else {
    const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
    float* op = out.data_ptr<float>();
    by_rows(x.size(0), n, [&](int64_t r, int64_t count) { rms_rows(xp + r * n, wp, op + r * n, count, n, e); });
  }
  return out;
}

// -- SiLU(gate) * up over [rows, 2 n] = [gate | up], each step rounded as torch's ----------------

// An element's exp and division cost some 32 of RMSNorm's: a decode's few rows split between the
// threads (a row of 1536 took about 1 us on one).
constexpr int64_t SILU_COST = 32;

template <typename T>
AVX512 void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const T *gate = x + r * 2 * n, *up = gate + n;
    for (int64_t i = 0; i < n; i += LANES) {
      __mmask16 k = tail(n - i);
      __m512 g = load(gate + i, k);
      __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      store(out + r * n + i, _mm512_mul_ps(round_to(s, gate), load(up + i, k)), k);
    }
  }
}

at::Tensor silu_mul(const at::Tensor& x) {
  check_rows(x);
  TORCH_CHECK(x.size(1) % 2 == 0, "x must be [rows, 2 n]: the gate, then the up half");
  const int64_t n = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
    at::BFloat16* op = out.data_ptr<at::BFloat16>();
    by_rows(x.size(0), SILU_COST * n, [&](int64_t r, int64_t count) { silu_mul_rows(xp + r * 2 * n, op + r * n, count, n); });
  } else {
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    by_rows(x.size(0), SILU_COST * n, [&](int64_t r, int64_t count) { silu_mul_rows(xp + r * 2 * n, op + r * n, count, n); });
  }
  return out;
}

// -- attention of a short forward ---------------------------------------------------------------

// One head's rows rotated: x * cos + rotate_half(x) * sin, each product and the sum rounded to
// the activations' type T as torch's elementwise ops round them. Returns it in fp32 (`out`).
template <typename T>
AVX512 void rotate(const T* x, const T* cos, const T* sin, int64_t dim, float* out) {
  const int64_t half = dim / 2;
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  for (int64_t i = 0; i < dim; i += LANES) {
    __mmask16 k = tail(dim - i);
    __m512 turned;  // rotate_half(x): -x[at + half] before half, x[at - half] from it
    if (half % LANES == 0) {  // a chunk lies wholly on one side (the usual head sizes)
      turned = i < half ? _mm512_castsi512_ps(_mm512_xor_si512(
                              _mm512_castps_si512(load(x + i + half, k)), sign))
                        : load(x + i - half, k);
    } else {
      alignas(64) float lanes[LANES];
      for (int64_t j = 0; j < LANES && i + j < dim; ++j) {
        int64_t at = i + j;
        lanes[j] = at < half ? -static_cast<float>(x[at + half]) : static_cast<float>(x[at - half]);
      }
      turned = _mm512_maskz_load_ps(k, lanes);
    }
    __m512 a = round_to(_mm512_mul_ps(load(x + i, k), load(cos + i, k)), x);
    __m512 b = round_to(_mm512_mul_ps(turned, load(sin + i, k)), x);
    store(out + i, round_to(_mm512_add_ps(a, b), x), k);
  }
}

struct Part {
  int64_t start, rows, first_row;  // positions start .. start + rows - 1; its first forward row
  char *k, *v;  // layer's keys and values: [kv_heads, max_len, dim] with these strides
  int64_t head_stride, position_stride;
};

// The sixteen sums of v[0] .. v[15]'s lanes, in order: a transposed reduction, 45 shuffles and
// adds where sixteen horizontal sums take about 130.
AVX512 inline __m512 sums16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: that lane's sums of v[4i] .. v[4i + 3]
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// One query head's scores over keys 0 .. seen - 1, NC chunks of 16 a head (NC = 0: any dim, in
// masked chunks), sixteen keys at a time.
template <int NC, typename C>
AVX512 void scores_of(const float* q, const C* keys, int64_t stride, int64_t seen, int64_t dim,
                      float scale, float* scores) {
  const int64_t chunks = NC ? NC : (dim + LANES - 1) / LANES;
  for (int64_t j0 = 0; j0 < seen; j0 += LANES) {
    const int64_t n = std::min<int64_t>(LANES, seen - j0);
    __m512 acc[LANES];
    for (int64_t j = 0; j < LANES; ++j) {
      acc[j] = _mm512_setzero_ps();
      if (j >= n) continue;
      const C* kj = keys + (j0 + j) * stride;
      for (int64_t c = 0; c < chunks; ++c) {
        __mmask16 k = NC ? ALL : tail(dim - c * LANES);
        acc[j] = _mm512_fmadd_ps(load(q + c * LANES, k), load(kj + c * LANES, k), acc[j]);
      }
    }
    _mm512_mask_storeu_ps(scores + j0, tail(n), _mm512_mul_ps(sums16(acc), _mm512_set1_ps(scale)));
  }
}

// The same scores from bf16 queries and keys, whose products are exact in fp32 (vdpbf16ps flushes
// subnormals), 32 of a head's dims an instruction: NC chunks of 32, dim = 32 NC.
template <int NC>
AVX512_BF16 void scores_bf16(const at::BFloat16* q, const at::BFloat16* keys, int64_t stride,
                             int64_t seen, float scale, float* scores) {
  __m512bh qc[NC];
  for (int c = 0; c < NC; ++c) qc[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  for (int64_t j0 = 0; j0 < seen; j0 += LANES) {
    const int64_t n = std::min<int64_t>(LANES, seen - j0);
    __m512 acc[LANES];
    for (int64_t j = 0; j < LANES; ++j) {
      acc[j] = _mm512_setzero_ps();
      if (j >= n) continue;
      const at::BFloat16* kj = keys + (j0 + j) * stride;
      for (int c = 0; c < NC; ++c)
        acc[j] = _mm512_dpbf16_ps(acc[j], qc[c], (__m512bh)_mm512_loadu_si512(kj + 32 * c));
    }
    _mm512_mask_storeu_ps(scores + j0, tail(n), _mm512_mul_ps(sums16(acc), _mm512_set1_ps(scale)));
  }
}

// Scores [seen] to their softmax, in place.
AVX512 void softmax(float* s, int64_t seen) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < seen; j += LANES)
    top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail(seen - j), s + j));
  __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < seen; j += LANES) {
    __mmask16 k = tail(seen - j);
    __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), peak)));
    _mm512_mask_storeu_ps(s + j, k, e);
    total = _mm512_add_ps(total, e);
  }
  __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
  for (int64_t j = 0; j < seen; j += LANES) {
    __mmask16 k = tail(seen - j);
    _mm512_mask_storeu_ps(s + j, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), inv));
  }
}

// out [H, dim] = each of H heads' probs (p + h * p_stride, [seen]) times the values, key by key.
// The query heads of one key head share each value's load, and each head's sums are its own, in
// the same order as alone: H heads give H times the independent chains (one head's few chains
// waited on the FMA's latency, key after key).
template <int NC, int H, typename C>
AVX512 void weighted_sum(const float* p, int64_t p_stride, const C* values, int64_t stride,
                         int64_t seen, float* out) {
  __m512 acc[H][NC];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < NC; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < seen; ++j) {
    const C* vj = values + j * stride;
    __m512 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = load(vj + c * LANES, ALL);
    for (int h = 0; h < H; ++h) {
      const __m512 pj = _mm512_set1_ps(p[h * p_stride + j]);
      for (int c = 0; c < NC; ++c) acc[h][c] = _mm512_fmadd_ps(pj, v[c], acc[h][c]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + (h * NC + c) * LANES, acc[h][c]);
}

// One head's weighted sum for any dim, in masked chunks of 16.
template <typename C>
AVX512 void weighted_sum_any_dim(const float* p, const C* values, int64_t stride, int64_t seen,
                                 int64_t dim, float* out) {
  for (int64_t i = 0; i < dim; i += LANES) {
    __mmask16 k = tail(dim - i);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < seen; ++j)
      acc = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), load(values + j * stride + i, k), acc);
    _mm512_mask_storeu_ps(out + i, k, acc);
  }
}

// weighted_sum's sums, the same additions in the same order, from bf16 values in NC chunks of 32
// dims: a 64-byte load's even dims are its 32-bit lanes shifted up 16 bits and its odd dims the
// lanes' high halves, so 32 values widen in two instructions (16 took two: vpmovzxwd, a shift).
template <int NC, int H>
AVX512 void weighted_sum_bf16(const float* p, int64_t p_stride, const at::BFloat16* values,
                              int64_t stride, int64_t seen, float* out) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  __m512 even[H][NC], odd[H][NC];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < NC; ++c) even[h][c] = odd[h][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < seen; ++j) {
    const at::BFloat16* vj = values + j * stride;
    __m512 ve[NC], vo[NC];
    for (int c = 0; c < NC; ++c) {
      __m512i v = _mm512_loadu_si512(vj + 32 * c);
      ve[c] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      vo[c] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    }
    for (int h = 0; h < H; ++h) {
      const __m512 pj = _mm512_set1_ps(p[h * p_stride + j]);
      for (int c = 0; c < NC; ++c) {
        even[h][c] = _mm512_fmadd_ps(pj, ve[c], even[h][c]);
        odd[h][c] = _mm512_fmadd_ps(pj, vo[c], odd[h][c]);
      }
    }
  }
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < NC; ++c) {  // back in order: lanes 2i and 2i + 1 of 32
      float* o = out + (h * NC + c) * 32;
      _mm512_storeu_ps(o, _mm512_permutex2var_ps(even[h][c], lo, odd[h][c]));
      _mm512_storeu_ps(o + LANES, _mm512_permutex2var_ps(even[h][c], hi, odd[h][c]));
    }
}

// `heads` heads' weighted sums (`weighted_sum` of NC chunks of 16, or with BF16 of 32), a few
// heads a pass: A sums a head, and a pass's sums and one key's values stay in registers.
template <int NC, bool BF16, typename C>
void weighted_sums(const float* p, int64_t p_stride, const C* values, int64_t stride,
                   int64_t seen, int64_t heads, float* out) {
  constexpr int A = BF16 ? 2 * NC : NC, PASS = A >= 8 ? 2 : 4;
  constexpr int64_t dim = (BF16 ? 32 : 16) * NC;
  auto pass = [&](auto h_count, int64_t h) {
    constexpr int H = decltype(h_count)::value;
    if constexpr (BF16)
      weighted_sum_bf16<NC, H>(p + h * p_stride, p_stride, values, stride, seen, out + h * dim);
    else
      weighted_sum<NC, H>(p + h * p_stride, p_stride, values, stride, seen, out + h * dim);
  };
  for (int64_t h = 0; h < heads; h += PASS) {
    switch (std::min<int64_t>(PASS, heads - h)) {
      case 1: pass(std::integral_constant<int, 1>{}, h); break;
      case 2: pass(std::integral_constant<int, 2>{}, h); break;
      case 3: if constexpr (PASS > 2) pass(std::integral_constant<int, 3>{}, h); break;
      default: pass(std::integral_constant<int, PASS>{}, h);
    }
  }
}

// n numbers from one type to another, bf16 rounded to nearest even (a lambda does not take a
// function's target attribute)
template <typename S, typename T>
AVX512 void copy_out(const S* from, T* to, int64_t n) {
  for (int64_t i = 0; i < n; i += LANES) {
    __mmask16 k = tail(n - i);
    store(to + i, load(from + i, k), k);
  }
}

// One query head's scores over keys 0 .. seen - 1, scaled: a bf16 cache's heads of 32, 64 or 128
// dims by vdpbf16ps with `use_dot` (bf16 activations, so the queries are bf16-exact, on
// AVX512-BF16), else in fp32 with the usual head sizes' chunks in registers.
template <typename C>
void scores_any(const float* q, const C* keys, int64_t stride, int64_t seen, int64_t dim,
                float scale, bool use_dot, float* scores) {
  if constexpr (std::is_same_v<C, at::BFloat16>) {
    if (use_dot && (dim == 32 || dim == 64 || dim == 128)) {
      alignas(64) at::BFloat16 q16[128];
      copy_out(q, q16, dim);
      switch (dim) {
        case 32: return scores_bf16<1>(q16, keys, stride, seen, scale, scores);
        case 64: return scores_bf16<2>(q16, keys, stride, seen, scale, scores);
        default: return scores_bf16<4>(q16, keys, stride, seen, scale, scores);
      }
    }
  }
  switch (dim) {
    case 32: return scores_of<2>(q, keys, stride, seen, dim, scale, scores);
    case 64: return scores_of<4>(q, keys, stride, seen, dim, scale, scores);
    case 128: return scores_of<8>(q, keys, stride, seen, dim, scale, scores);
    default: return scores_of<0>(q, keys, stride, seen, dim, scale, scores);
  }
}

// Attention of a key head's query heads (q [heads, dim], rotated, fp32) of one row over keys
// 0 .. seen - 1: each head's scores and softmax (scores [heads, seen]), then their weighted sums
// in passes that share the values' loads (out [heads, dim]). A bf16 cache's values widen 32 at a
// time for heads of 32, 64 or 128 dims.
template <typename C>
void attend_heads(const float* q, int64_t heads, const C* keys, const C* values, int64_t stride,
                  int64_t seen, int64_t dim, float scale, bool use_dot, float* scores,
                  float* out) {
  for (int64_t h = 0; h < heads; ++h) {
    scores_any(q + h * dim, keys, stride, seen, dim, scale, use_dot, scores + h * seen);
    softmax(scores + h * seen, seen);
  }
  constexpr bool bf16 = std::is_same_v<C, at::BFloat16>;
  switch (dim) {
    case 32: return weighted_sums<bf16 ? 1 : 2, bf16>(scores, seen, values, stride, seen, heads, out);
    case 64: return weighted_sums<bf16 ? 2 : 4, bf16>(scores, seen, values, stride, seen, heads, out);
    case 128: return weighted_sums<bf16 ? 4 : 8, bf16>(scores, seen, values, stride, seen, heads, out);
  }
  for (int64_t h = 0; h < heads; ++h)
    weighted_sum_any_dim(scores + h * seen, values, stride, seen, dim, out + h * dim);
}

template <typename T, typename C>
void attend_parts(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                  const std::vector<Part>& parts, int64_t heads, int64_t kv_heads, double scale,
                  at::Tensor& out) {
  const int64_t rows = qkv.size(0), width = qkv.size(1), dim = width / (heads + 2 * kv_heads);
  const int64_t groups = heads / kv_heads;
  const T* x = qkv.data_ptr<T>();
  const T *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
  // every row's keys rotated and values written to its cache, before any row attends (a verify's
  // rows attend over the rows before them)
  std::vector<float> turned(dim);
  std::vector<int64_t> part_of(rows), position(rows);
  for (size_t p = 0; p < parts.size(); ++p) {
    const Part& part = parts[p];
    for (int64_t r = 0; r < part.rows; ++r) {
      const int64_t row = part.first_row + r, pos = part.start + r;
      part_of[row] = static_cast<int64_t>(p);
      position[row] = pos;
      const T *xr = x + row * width, *c = cp + row * dim, *s = sp + row * dim;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t at = h * part.head_stride + pos * part.position_stride;
        rotate(xr + (heads + h) * dim, c, s, dim, turned.data());
        copy_out(turned.data(), reinterpret_cast<C*>(part.k) + at, dim);
        copy_out(xr + (heads + kv_heads + h) * dim, reinterpret_cast<C*>(part.v) + at, dim);
      }
    }
  }
  T* o = out.data_ptr<T>();
  const float s = static_cast<float>(scale);
  int64_t work = 0;  // multiply-adds: a query head's scores and sum over its row's keys
  for (int64_t row = 0; row < rows; ++row) work += 2 * (position[row] + 1) * heads * dim;
  // A task a key head of a row, its query heads together: key head by key head (the threads'
  // shares mix rows of every length), then row by row (the key head's keys and values read again
  // while still in cache). Where that leaves a thread without a task (a row's decode, few key
  // heads, many threads) a key head's query heads are split between tasks.
  const int64_t split = std::min<int64_t>(
      groups, std::max<int64_t>(1, (at::get_num_threads() + rows * kv_heads - 1) / (rows * kv_heads)));
  const int64_t per = (groups + split - 1) / split;  // query heads a task
  // About 32k multiply-adds a task: below that the threads' start costs more than they share.
  const int64_t tasks = rows * kv_heads * split;
  // queries are bf16-exact with bf16 activations (the rotary rounds them so)
  const bool dot = std::is_same_v<T, at::BFloat16> && bf16_dot();
  const int64_t grain = std::max<int64_t>(1, tasks * 32768 / std::max<int64_t>(work, 1));
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, query(per * dim), result(per * dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task / (rows * split), row = task / split % rows;
      const int64_t first = kv * groups + task % split * per;  // the task's first query head
      const int64_t count = std::min(per, (kv + 1) * groups - first);
      if (count <= 0) continue;
      const Part& part = parts[part_of[row]];
      const int64_t seen = position[row] + 1;
      scores.resize(count * seen);
      for (int64_t g = 0; g < count; ++g)
        rotate(x + row * width + (first + g) * dim, cp + row * dim, sp + row * dim, dim,
               query.data() + g * dim);
      const C* keys = reinterpret_cast<const C*>(part.k) + kv * part.head_stride;
      const C* values = reinterpret_cast<const C*>(part.v) + kv * part.head_stride;
      attend_heads(query.data(), count, keys, values, part.position_stride, seen, dim, s, dot,
                   scores.data(), result.data());
      copy_out(result.data(), o + (row * heads + first) * dim, count * dim);
    }
  });
}

// qkv [rows, (heads + 2 kv_heads) dim] (a forward's rows, parts one after another); cos, sin
// [rows, dim] in qkv's dtype; per part its caches' keys and values [layers, kv_heads, max_len,
// dim] (in one dtype, float32 or bfloat16), its first position and its row count. Writes each
// row's key and value at its position in layer `layer`, and returns each row's attention over its
// part's positions up to its own: [rows, heads dim] in qkv's dtype.
at::Tensor attend(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                  at::TensorList keys, at::TensorList values, at::IntArrayRef starts,
                  at::IntArrayRef counts, int64_t layer, int64_t heads, int64_t kv_heads,
                  double scale) {
  TORCH_CHECK(supported(), "this CPU lacks AVX512");
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.is_contiguous(),
              "qkv must be a contiguous [rows, width] CPU matrix");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 &&
                  qkv.size(1) % (heads + 2 * kv_heads) == 0, "heads do not match qkv");
  const int64_t rows = qkv.size(0), dim = qkv.size(1) / (heads + 2 * kv_heads);
  TORCH_CHECK(dim % 2 == 0, "the head size must be even");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == qkv.scalar_type() && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == rows && t->size(1) == dim, "cos and sin must be [rows, dim] in qkv's dtype");
  TORCH_CHECK(keys.size() == values.size() && keys.size() == starts.size() &&
                  keys.size() == counts.size() && !keys.empty(), "one key, value, start and count a part");
  const at::ScalarType cache_type = keys[0].scalar_type();
  TORCH_CHECK(cache_type == at::kFloat || cache_type == at::kBFloat16, "caches must be float32 or bfloat16");
  std::vector<Part> parts;
  int64_t first_row = 0;
  for (size_t p = 0; p < keys.size(); ++p) {
    const at::Tensor &k = keys[p], &v = values[p];
    TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.strides() == v.strides() &&
                    k.scalar_type() == cache_type && v.scalar_type() == cache_type &&
                    k.device().is_cpu() && v.device().is_cpu(), "caches must match");
    TORCH_CHECK(!k.is_same(v) && k.data_ptr() != v.data_ptr(), "keys and values must be apart");
    TORCH_CHECK(layer >= 0 && layer < k.size(0) && k.size(1) == kv_heads && k.size(3) == dim &&
                    k.stride(3) == 1, "a cache must be [layers, kv_heads, max_len, dim]");
    TORCH_CHECK(counts[p] >= 1 && starts[p] >= 0 && starts[p] + counts[p] <= k.size(2),
                "a part's positions must lie in its cache");
    const int64_t offset = layer * k.stride(0) * k.element_size();
    parts.push_back({starts[p], counts[p], first_row,
                     static_cast<char*>(k.data_ptr()) + offset, static_cast<char*>(v.data_ptr()) + offset,
                     k.stride(1), k.stride(2)});
    first_row += counts[p];
  }
  TORCH_CHECK(first_row == rows, "the parts' counts must add up to the rows");
  at::Tensor out = at::empty({rows, heads * dim}, qkv.options());
  const bool bf16 = qkv.scalar_type() == at::kBFloat16, bf16_cache = cache_type == at::kBFloat16;
  TORCH_CHECK(bf16 || qkv.scalar_type() == at::kFloat, "qkv must be float32 or bfloat16");
  if (bf16 && bf16_cache) attend_parts<at::BFloat16, at::BFloat16>(qkv, cos, sin, parts, heads, kv_heads, scale, out);
  else if (bf16) attend_parts<at::BFloat16, float>(qkv, cos, sin, parts, heads, kv_heads, scale, out);
  else if (bf16_cache) attend_parts<float, at::BFloat16>(qkv, cos, sin, parts, heads, kv_heads, scale, out);
  else attend_parts<float, float>(qkv, cos, sin, parts, heads, kv_heads, scale, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(voiceagent_int, lib) {
  lib.def("use_bf16_dot", [](bool on) { bf16_dot_wanted.store(on); });
  lib.def("bf16_dot", []() { return bf16_dot(); });
  lib.def("rms(Tensor x, Tensor weight, float eps) -> Tensor", &rms);
  lib.def("silu_mul(Tensor x) -> Tensor", &silu_mul);
  lib.def("attend(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!)[] keys, Tensor(b!)[] values, "
          "int[] starts, int[] counts, int layer, int heads, int kv_heads, float scale) -> Tensor",
          &attend);
}
