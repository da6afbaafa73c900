// A STREAM-style probe of host memory bandwidth, on the same threads and chunks as the kernels.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "kernels.h"

namespace zoff {

// GB/s (bytes read + written, 1e9 per s; best of a few repetitions) of "read" (sum of a), "copy" (a = b) and
// "triad" (a = b + s * c) over arrays of `nbytes` each, plus "copy_nt" and "triad_nt" with non-temporal stores
// where the ISA has them.
std::map<std::string, double> stream_probe(int64_t nbytes, int threads, const IsaKernels& kernels);

}  // namespace zoff
