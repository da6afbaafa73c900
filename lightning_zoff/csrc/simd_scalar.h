// One lane of plain C++: the portable path, and the tail of every SIMD path (the same formula, one element at a
// time). Included inside an ISA namespace by isa_*.cpp, after the system headers it needs (<cstring>).
// The 16-bit conversions round exactly like the hardware ones of the SIMD paths: bf16 by integer round-to-nearest-
// even with NaN -> 0x7FC0 (as c10::BFloat16), fp16 as IEEE (and F16C) do, NaN payloads included.

inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

inline uint16_t float_to_bf16(float x) {
  if (x != x) return 0x7FC0;
  const uint32_t u = float_bits(x);
  return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F;
  const uint32_t mant = h & 0x3FF;
  if (exp == 0x1F) return bits_float(sign | 0x7F800000 | (mant << 13) | (mant ? 0x400000 : 0));  // NaN quieted
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
    const float x = float(mant) * 0x1p-24f;
    return bits_float(sign | float_bits(x));
  }
  return bits_float(sign | ((exp + 112) << 23) | (mant << 13));  // rebias 15 -> 127
}

inline uint16_t float_to_half(float x) {
  const uint32_t u = float_bits(x);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000);
  const uint32_t a = u & 0x7FFFFFFF;
  if (a > 0x7F800000) return sign | 0x7E00 | ((a >> 13) & 0x3FF);  // NaN: quiet, top payload bits kept
  if (a >= 0x477FF000) return sign | 0x7C00;                        // >= 65520 (a tie with 2^16) and inf
  if (a >= 0x38800000) {                                             // normal half: >= 2^-14
    const uint32_t r = a - (112u << 23);                             // rebias 127 -> 15
    return sign | uint16_t((r + 0xFFF + ((r >> 13) & 1)) >> 13);     // a mantissa carry bumps the exponent
  }
  if (a <= 0x33000000) return sign;  // <= 2^-25: zero (2^-25 itself ties to the even zero)
  // Subnormal half: count units of 2^-24, rounding the shifted-out bits to nearest even.
  const uint32_t shift = 126 - (a >> 23);
  const uint32_t m = (a & 0x7FFFFF) | 0x800000;
  uint32_t q = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  q += (rest > half || (rest == half && (q & 1))) ? 1 : 0;
  return sign | uint16_t(q);
}

struct Scalar {
  static constexpr int64_t kWidth = 1;
  static constexpr bool kHasStream = false;
  using F = float;
  using Acc = double;

  static F set1(float x) { return x; }
  static F load(const float* p) { return *p; }
  static F load(const Bf16* p) { return bits_float(uint32_t(p->bits) << 16); }
  static F load(const Half* p) { return half_to_float(p->bits); }
  static void store(float* p, F x) { *p = x; }
  static void store(Bf16* p, F x) { p->bits = float_to_bf16(x); }
  static void store(Half* p, F x) { p->bits = float_to_half(x); }
  static F sqrt(F x) { return __builtin_sqrtf(x); }
  // torch.sign: 0 for +-0 and NaN.
  static F sign(F x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }
  static float lane_sum(F x) { return x; }

  // Squares of floats are exact in double, so only the additions round.
  static Acc acc_zero() { return 0.0; }
  static void add_squares(Acc& acc, F x) {
    const double d = x;
    acc += d * d;
  }
  static double reduce(Acc acc) { return acc; }
};
