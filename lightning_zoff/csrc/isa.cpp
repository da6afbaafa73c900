// Runtime CPU detection. Each build is allowed only when the CPU (and the OS, which libgcc's checks include)
// supports every feature its target pragma enables, so no instruction of it can ever fault here.
#include "isa.h"

#include <stdexcept>

namespace zoff {
namespace {

struct IsaEntry {
  const char* name;
  const IsaKernels* kernels;
  bool (*supported)();
};

#if ZOFF_X86
bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#endif

bool always() { return true; }

const IsaEntry kIsas[] = {  // best first
#if ZOFF_X86
    {"avx512", &avx512::kKernels, cpu_has_avx512},
    {"avx2", &avx2::kKernels, cpu_has_avx2},
#endif
    {"scalar", &scalar::kKernels, always},
};

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

}  // namespace

std::vector<std::string> available_isas() {
  std::vector<std::string> names;
  for (const auto& isa : kIsas) {
    if (isa.supported()) names.emplace_back(isa.name);
  }
  return names;
}

const IsaKernels& kernels_for(const std::string& name) {
  for (const auto& isa : kIsas) {
    if (name == isa.name && isa.supported()) return *isa.kernels;
  }
  throw std::invalid_argument("isa '" + name + "' is not one this CPU runs; choose one of: " +
                              joined(available_isas()));
}

}  // namespace zoff
