// The AVX2 build of the kernels: the x86-64-v3 set (AVX2, FMA, F16C; F16C converts fp16). FMA is allowed, but
// -ffp-contract=off (build.py) keeps the compiler from fusing, so results match the scalar build.
// System headers come before the target pragma, so no inline function they define is compiled for AVX2: the
// linker could otherwise keep that copy for every caller and run AVX2 code on a CPU without it.
#include "kernels.h"

#if ZOFF_X86
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#pragma GCC target("avx2,fma,f16c")

namespace zoff::avx2 {
#include "simd_scalar.h"
#include "simd_avx2.h"
using Simd = Avx2;
#include "kernel_bodies.h"
}  // namespace zoff::avx2
#endif
