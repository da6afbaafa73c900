// The portable build of the kernels: plain C++ at the compiler's baseline ISA.
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "kernels.h"

namespace zoff::scalar {
#include "simd_scalar.h"
using Simd = Scalar;
#include "kernel_bodies.h"
}  // namespace zoff::scalar
