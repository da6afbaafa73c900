// Static chunking of one sweep over OpenMP threads.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace zoff {

// Chunk starts are multiples of this many elements: every vector width divides it, so a chunk runs whole vectors
// and only the last chunk has a tail; it also keeps 16-bit arrays of different threads on different cache lines.
constexpr int64_t kChunkAlign = 64;

// Below this many elements per thread, waking another thread costs more than its share of the work.
constexpr int64_t kMinPerThread = 4096;

inline int threads_for(int64_t n, int threads) {
  return int(std::clamp<int64_t>((n + kMinPerThread - 1) / kMinPerThread, 1, threads));
}

// Runs fn(thread, begin, end) on static chunks of [0, n), one per thread of a team of up to `threads`.
// The same n and team give the same chunk to the same thread number, which first-touch placement relies on.
template <class Fn>
void parallel_chunks(int64_t n, int threads, const Fn& fn) {
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    // The team may be smaller than asked for (OMP_THREAD_LIMIT, nesting): split by its real size.
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t per = ((n + team - 1) / team + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
    const int64_t begin = std::min(n, t * per), end = std::min(n, begin + per);
    if (begin < end) fn(int(t), begin, end);
  }
}

}  // namespace zoff
