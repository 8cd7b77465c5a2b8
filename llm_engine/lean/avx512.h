// Loads and stores of 16 lanes in fp32, bf16 and fp16, shared by our kernels (int_kernel.cpp,
// layer_ops.cpp): bf16 rounded to nearest even as torch's float -> bfloat16, NaN kept NaN.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

namespace {

constexpr int64_t LANES = 16;
constexpr __mmask16 ALL = 0xffff;

inline __mmask16 tail(int64_t left) {
  return left >= LANES ? ALL : static_cast<__mmask16>((1u << left) - 1);
}

AVX512 inline __m512 load(const float* p, __mmask16 k = ALL) { return _mm512_maskz_loadu_ps(k, p); }

AVX512 inline __m512 load(const at::BFloat16* p, __mmask16 k = ALL) {
  __m256i half = _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

AVX512 inline __m512 load(const at::Half* p, __mmask16 k = ALL) {  // a GGUF's scales
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
}

// v rounded to the storage type of `as` (bf16: to nearest even; NaN stays NaN).
AVX512 inline __m512 round_to(__m512 v, const float*) { return v; }

AVX512 inline __m512 round_to(__m512 v, const at::BFloat16*) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  rounded = _mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  // a NaN quietened: its top 16 bits then say NaN too (a payload below them alone reads Inf)
  __m512i quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000));
  return _mm512_mask_blend_ps(nan, _mm512_castsi512_ps(rounded), _mm512_castsi512_ps(quiet));
}

AVX512 inline void store(float* p, __m512 v, __mmask16 k = ALL) { _mm512_mask_storeu_ps(p, k, v); }

AVX512 inline void store(at::BFloat16* p, __m512 v, __mmask16 k = ALL) {
  __m512i bits = _mm512_castps_si512(round_to(v, p));
  _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

}  // namespace
