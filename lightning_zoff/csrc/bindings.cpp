// The Python boundary: every check runs first, under the GIL; then the GIL is released and one sweep runs on up
// to `threads` OpenMP threads. Nothing is ever copied: a non-contiguous tensor is an error, not a slow path.
// The Tensor type and torch's pybind11 casters for it: the two parts of torch/extension.h used here, at a third of
// its compile time (it also parses the whole C++ frontend).
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "isa.h"
#include "kernels.h"
#include "parallel.h"
#include "step_consts.h"
#include "stream_probe.h"

namespace zoff {
namespace {

void check_layout(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous (these kernels never copy; pass .contiguous())");
  TORCH_CHECK_VALUE(t.numel() == numel, name, " has ", t.numel(), " elements, param has ", numel);
}

void check_f32(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  check_layout(t, name, numel);
}

DType float_dtype(const at::Tensor& grad, int64_t numel, const char* name = "grad") {
  DType dtype = DType::kF32;
  switch (grad.scalar_type()) {
    case at::kFloat: dtype = DType::kF32; break;
    case at::kBFloat16: dtype = DType::kBF16; break;
    case at::kHalf: dtype = DType::kF16; break;
    default: TORCH_CHECK_VALUE(false, name, " must be float32, bfloat16 or float16, got ", grad.scalar_type());
  }
  check_layout(grad, name, numel);
  return dtype;
}

// The optional 16-bit copy of the updated param: its pointer (nullptr for none) and dtype.
std::pair<void*, DType> out_buffer(const std::optional<at::Tensor>& out, int64_t numel) {
  if (!out.has_value()) return {nullptr, DType::kBF16};
  const auto st = out->scalar_type();
  TORCH_CHECK_VALUE(st == at::kBFloat16 || st == at::kHalf, "out must be bfloat16 or float16, got ", st);
  check_layout(*out, "out", numel);
  return {out->data_ptr(), st == at::kBFloat16 ? DType::kBF16 : DType::kF16};
}

// The optimizer moments' dtype: fp32, or bf16 (the kernels compute in fp32 and store rounded to nearest even).
DType moment_dtype(const at::Tensor& t, const char* name, int64_t numel) {
  const auto st = t.scalar_type();
  TORCH_CHECK_VALUE(st == at::kFloat || st == at::kBFloat16, name,
                    " (an optimizer moment) must be float32 or bfloat16, got ", st);
  check_layout(t, name, numel);
  return st == at::kFloat ? DType::kF32 : DType::kBF16;
}

// fp32 param and the moments in one dtype, all of `numel` elements; returns the moments' dtype.
DType check_state(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor* exp_avg_sq, int64_t numel) {
  check_f32(param, "param", numel);
  const DType dtype = moment_dtype(exp_avg, "exp_avg", numel);
  if (exp_avg_sq != nullptr) {
    TORCH_CHECK_VALUE(moment_dtype(*exp_avg_sq, "exp_avg_sq", numel) == dtype, "exp_avg_sq must have exp_avg's dtype (",
                      exp_avg.scalar_type(), "), got ", exp_avg_sq->scalar_type());
  }
  return dtype;
}

// Where the updated state goes: `into` (param, exp_avg[, exp_avg_sq]), each in the dtype of the tensor it replaces,
// or, when absent, the inputs themselves.
std::vector<void*> state_out(const std::optional<std::vector<at::Tensor>>& into, const std::vector<at::Tensor>& state,
                             int64_t numel) {
  std::vector<void*> out;
  if (!into.has_value()) {
    for (const auto& t : state) out.push_back(t.data_ptr());
    return out;
  }
  TORCH_CHECK_VALUE(into->size() == state.size(), "into must hold ", state.size(), " tensors (the updated state), got ",
                    into->size());
  for (size_t i = 0; i < state.size(); ++i) {
    const at::Tensor& target = (*into)[i];
    TORCH_CHECK_VALUE(target.scalar_type() == state[i].scalar_type(), "into[", i, "] must be ", state[i].scalar_type(),
                      " like the state it replaces, got ", target.scalar_type());
    check_layout(target, "into", numel);
    out.push_back(target.data_ptr());
  }
  return out;
}

int checked_threads(int64_t threads) {
  TORCH_CHECK_VALUE(threads >= 1 && threads <= 4096, "threads must be in [1, 4096], got ", threads);
  return int(threads);
}

void adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& out, double lr, double beta1,
               double beta2, double eps, double weight_decay, int64_t step, bool decoupled, bool maximize,
               double grad_scale, const std::optional<std::vector<at::Tensor>>& into, bool stream,
               const std::string& isa, int64_t threads) {
  const int64_t n = param.numel();
  const DType mdtype = check_state(param, exp_avg, &exp_avg_sq, n);
  const auto dst = state_out(into, {param, exp_avg, exp_avg_sq}, n);
  const DType gdtype = float_dtype(grad, n);
  const auto [out_ptr, out_dtype] = out_buffer(out, n);
  TORCH_CHECK_VALUE(step >= 1, "step counts this step, starting at 1; got ", step);
  const IsaKernels& kernels = kernels_for(isa);
  const int team = threads_for(n, checked_threads(threads));
  const AdamTask task{param.data_ptr<float>(),
                      exp_avg.data_ptr(),
                      exp_avg_sq.data_ptr(),
                      static_cast<float*>(dst[0]),
                      dst[1],
                      dst[2],
                      mdtype,
                      grad.data_ptr(),
                      gdtype,
                      out_ptr,
                      out_dtype,
                      stream,
                      adam_consts(lr, beta1, beta2, eps, weight_decay, step, decoupled, maximize, grad_scale)};
  pybind11::gil_scoped_release no_gil;
  parallel_chunks(n, team, [&](int, int64_t begin, int64_t end) { kernels.adam(task, begin, end); });
}

void lion_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const std::optional<at::Tensor>& out, double lr, double beta1, double beta2, double weight_decay,
               double grad_scale, bool maximize, const std::optional<std::vector<at::Tensor>>& into, bool stream,
               const std::string& isa, int64_t threads) {
  const int64_t n = param.numel();
  const DType mdtype = check_state(param, exp_avg, nullptr, n);
  const auto dst = state_out(into, {param, exp_avg}, n);
  const DType gdtype = float_dtype(grad, n);
  const auto [out_ptr, out_dtype] = out_buffer(out, n);
  const IsaKernels& kernels = kernels_for(isa);
  const int team = threads_for(n, checked_threads(threads));
  const LionTask task{param.data_ptr<float>(),
                      exp_avg.data_ptr(),
                      static_cast<float*>(dst[0]),
                      dst[1],
                      mdtype,
                      grad.data_ptr(),
                      gdtype,
                      out_ptr,
                      out_dtype,
                      stream,
                      lion_consts(lr, beta1, beta2, weight_decay, maximize, grad_scale)};
  pybind11::gil_scoped_release no_gil;
  parallel_chunks(n, team, [&](int, int64_t begin, int64_t end) { kernels.lion(task, begin, end); });
}

std::tuple<double, bool> grad_sumsq_finite(const at::Tensor& grad, double grad_scale, const std::string& isa,
                                           int64_t threads) {
  const int64_t n = grad.numel();
  const SumsqTask task{grad.data_ptr(), float_dtype(grad, n), float(grad_scale)};
  const IsaKernels& kernels = kernels_for(isa);
  const int team = threads_for(n, checked_threads(threads));
  pybind11::gil_scoped_release no_gil;
  std::vector<double> partial(team, 0.0);
  parallel_chunks(n, team, [&](int t, int64_t begin, int64_t end) { partial[t] = kernels.sumsq(task, begin, end); });
  double total = 0.0;
  for (const double p : partial) total += p;
  // The square of a finite float is finite in double and so is any sum of them: the total is finite exactly
  // when every scaled gradient value (grad * grad_scale, in fp32) is.
  return {total, std::isfinite(total)};
}

void accumulate(const at::Tensor& dst, const at::Tensor& src, bool replace, const std::string& isa, int64_t threads) {
  const int64_t n = dst.numel();
  const AccumulateTask task{dst.data_ptr(), float_dtype(dst, n, "dst"), src.data_ptr(), float_dtype(src, n, "src"),
                            replace};
  const IsaKernels& kernels = kernels_for(isa);
  const int team = threads_for(n, checked_threads(threads));
  pybind11::gil_scoped_release no_gil;
  parallel_chunks(n, team, [&](int, int64_t begin, int64_t end) { kernels.accumulate(task, begin, end); });
}

std::map<std::string, double> stream_probe_gbps(int64_t nbytes, int64_t threads, const std::string& isa) {
  TORCH_CHECK_VALUE(nbytes > 0, "nbytes must be positive, got ", nbytes);
  const IsaKernels& kernels = kernels_for(isa);
  const int team = checked_threads(threads);
  pybind11::gil_scoped_release no_gil;
  return stream_probe(nbytes, team, kernels);
}

}  // namespace
}  // namespace zoff

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "lightning_zoff fused CPU optimizer kernels (see lightning_zoff.ops for the documented wrappers)";
  m.def("adam_step", &zoff::adam_step, py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("out"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("step"), py::arg("decoupled"), py::arg("maximize"), py::arg("grad_scale"), py::arg("into"),
        py::arg("stream"), py::arg("isa"), py::arg("threads"));
  m.def("lion_step", &zoff::lion_step, py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("out"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("weight_decay"), py::arg("grad_scale"),
        py::arg("maximize"), py::arg("into"), py::arg("stream"), py::arg("isa"), py::arg("threads"));
  m.def("grad_sumsq_finite", &zoff::grad_sumsq_finite, py::arg("grad"), py::arg("grad_scale"), py::arg("isa"),
        py::arg("threads"));
  m.def("accumulate", &zoff::accumulate, py::arg("dst"), py::arg("src"), py::arg("replace"), py::arg("isa"),
        py::arg("threads"));
  m.def("stream_probe", &zoff::stream_probe_gbps, py::arg("nbytes"), py::arg("threads"), py::arg("isa"));
  m.def("available_isas", &zoff::available_isas);
}
