// Which kernel builds this CPU can run, and picking one by name.
#pragma once

#include <string>
#include <vector>

#include "kernels.h"

namespace zoff {

// Names of the builds this CPU runs, best first; always ends with "scalar".
std::vector<std::string> available_isas();

// The build called `name` ("avx512", "avx2", "scalar"); std::invalid_argument (Python ValueError) naming the
// available ones if this CPU cannot run it or the name is unknown.
const IsaKernels& kernels_for(const std::string& name);

}  // namespace zoff
