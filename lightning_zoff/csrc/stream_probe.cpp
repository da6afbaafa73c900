#include "stream_probe.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <new>

#include "parallel.h"

namespace zoff {
namespace {

constexpr int kRepetitions = 5;
constexpr size_t kPage = 4096;

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<float[], FreeDeleter>;

Buffer allocate(int64_t n) {
  const size_t bytes = (size_t(n) * sizeof(float) + kPage - 1) / kPage * kPage;
  auto* p = static_cast<float*>(std::aligned_alloc(kPage, bytes));
  if (p == nullptr) throw std::bad_alloc();
  return Buffer(p);
}

template <class Fn>
double best_gbps(int64_t n, int threads, int64_t bytes_per_element, const Fn& fn) {
  double best = 0.0;
  for (int r = 0; r < kRepetitions; ++r) {
    const auto start = std::chrono::steady_clock::now();
    parallel_chunks(n, threads, fn);
    const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - start;
    best = std::max(best, double(bytes_per_element * n) / seconds.count() / 1e9);
  }
  return best;
}

}  // namespace

std::map<std::string, double> stream_probe(int64_t nbytes, int threads, const IsaKernels& k) {
  // A multiple of 64 floats, so every chunk is whole aligned vectors (non-temporal stores need that).
  const int64_t n = std::max<int64_t>(kChunkAlign, nbytes / int64_t(sizeof(float)) / kChunkAlign * kChunkAlign);
  const Buffer a = allocate(n), b = allocate(n), c = allocate(n);
  // First touch by the thread that later sweeps each chunk, so on a NUMA host its pages sit on that thread's node.
  parallel_chunks(n, threads, [&](int, int64_t begin, int64_t end) {
    std::fill(a.get() + begin, a.get() + end, 0.0f);
    std::fill(b.get() + begin, b.get() + end, 1.0f);
    std::fill(c.get() + begin, c.get() + end, 2.0f);
  });
  float* pa = a.get();
  const float* pb = b.get();
  const float* pc = c.get();
  constexpr int64_t f = sizeof(float);
  std::map<std::string, double> gbps;
  gbps["read"] = best_gbps(n, threads, f, [&](int, int64_t i, int64_t j) { k.stream_read(pb, i, j); });
  gbps["copy"] = best_gbps(n, threads, 2 * f, [&](int, int64_t i, int64_t j) { k.stream_copy(pa, pb, i, j); });
  gbps["triad"] =
      best_gbps(n, threads, 3 * f, [&](int, int64_t i, int64_t j) { k.stream_triad(pa, pb, pc, 3.0f, i, j); });
  if (k.stream_copy_nt != nullptr) {
    gbps["copy_nt"] = best_gbps(n, threads, 2 * f, [&](int, int64_t i, int64_t j) { k.stream_copy_nt(pa, pb, i, j); });
  }
  if (k.stream_triad_nt != nullptr) {
    gbps["triad_nt"] =
        best_gbps(n, threads, 3 * f, [&](int, int64_t i, int64_t j) { k.stream_triad_nt(pa, pb, pc, 3.0f, i, j); });
  }
  return gbps;
}

}  // namespace zoff
