// The AVX-512 build of the kernels (F, BW, VL). Compiles on any x86 machine; isa.cpp runs it only on CPUs that
// report every feature enabled here. System headers come before the target pragma (see isa_avx2.cpp).
#include "kernels.h"

#if ZOFF_X86
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")

namespace zoff::avx512 {
#include "simd_scalar.h"
#include "simd_avx512.h"
using Simd = Avx512;
#include "kernel_bodies.h"
}  // namespace zoff::avx512
#endif
