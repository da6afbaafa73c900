// Sixteen fp32 lanes in a __m512 (AVX-512 F; the TU also enables BW/VL, so dispatch requires them).
// Included inside zoff::avx512 by isa_avx512.cpp. Same formulas and rounding as simd_avx2.h.

struct Avx512 {
  static constexpr int64_t kWidth = 16;
  static constexpr bool kHasStream = true;
  using F = __m512;
  struct Acc {
    __m512d lo, hi;
  };

  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const Bf16* p) {  // bf16 is the top half of an fp32
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static F load(const Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static __m256i bf16_bits(F x) {  // round to nearest even on the integer bits; NaN -> 0x7FC0
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  }
  static __m256i half_bits(F x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT); }
  static void store(Bf16* p, F x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(x)); }
  static void store(Half* p, F x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), half_bits(x)); }
  // Non-temporal stores (no read for ownership of lines only written): p aligned to kWidth elements.
  static void stream(float* p, F x) { _mm512_stream_ps(p, x); }
  static void stream(Bf16* p, F x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), bf16_bits(x)); }
  static void stream(Half* p, F x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), half_bits(x)); }
  static void stream_fence() { _mm_sfence(); }
  static F sqrt(F x) { return _mm512_sqrt_ps(x); }
  // torch.sign from the sign bit: +-1 where x != 0, 0 where x is +-0 or NaN. Integer and/or: the float ones are DQ.
  static F sign(F x) {
    const __mmask16 nonzero = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_OQ);
    const __m512i sign_bit = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(int32_t(0x80000000u)));
    const __m512i one = _mm512_or_si512(sign_bit, _mm512_castps_si512(_mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(nonzero, _mm512_castsi512_ps(one));
  }
  static float lane_sum(F x) { return _mm512_reduce_add_ps(x); }

  static Acc acc_zero() { return {_mm512_setzero_pd(), _mm512_setzero_pd()}; }
  static void add_squares(Acc& acc, F x) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    acc.lo = acc.lo + lo * lo;
    acc.hi = acc.hi + hi * hi;
  }
  static double reduce(const Acc& acc) { return _mm512_reduce_add_pd(acc.lo + acc.hi); }
};
