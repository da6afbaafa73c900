// Eight fp32 lanes in a __m256 (AVX2; F16C for fp16). Included inside zoff::avx2 by isa_avx2.cpp.
// Arithmetic uses GCC's vector operators (+ - * /), which with -ffp-contract=off round each operation like the
// scalar path does, so the two give identical results.

struct Avx2 {
  static constexpr int64_t kWidth = 8;
  static constexpr bool kHasStream = true;
  using F = __m256;
  struct Acc {
    __m256d lo, hi;
  };

  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const Bf16* p) {  // bf16 is the top half of an fp32
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static F load(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static __m128i bf16_bits(F x) {  // round to nearest even on the integer bits; NaN -> 0x7FC0
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
    // packus packs within each 128-bit half; then bring quadwords 0 and 2 together.
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
  }
  static __m128i half_bits(F x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT); }
  static void store(Bf16* p, F x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits(x)); }
  static void store(Half* p, F x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), half_bits(x)); }
  // Non-temporal stores (no read for ownership of lines only written): p aligned to kWidth elements.
  static void stream(float* p, F x) { _mm256_stream_ps(p, x); }
  static void stream(Bf16* p, F x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), bf16_bits(x)); }
  static void stream(Half* p, F x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), half_bits(x)); }
  static void stream_fence() { _mm_sfence(); }
  static F sqrt(F x) { return _mm256_sqrt_ps(x); }
  // torch.sign from the sign bit (so -0.0 and +0.0 both give 0): +-1 where x != 0, 0 where x is 0 or NaN.
  static F sign(F x) {
    const F nonzero = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_NEQ_OQ);
    const F one = _mm256_or_ps(_mm256_and_ps(x, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(1.0f));
    return _mm256_and_ps(nonzero, one);
  }
  static float lane_sum(F x) {
    float l[kWidth];
    _mm256_storeu_ps(l, x);
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  }

  static Acc acc_zero() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
  static void add_squares(Acc& acc, F x) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    acc.lo = acc.lo + lo * lo;
    acc.hi = acc.hi + hi * hi;
  }
  static double reduce(const Acc& acc) {
    double l[4];
    _mm256_storeu_pd(l, acc.lo + acc.hi);
    return (l[0] + l[1]) + (l[2] + l[3]);
  }
};
