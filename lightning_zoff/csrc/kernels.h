// The interface between the ISA-neutral code (bindings, threading, stream probe) and the per-ISA builds of the
// kernels (isa_*.cpp). Plain structs and function pointers only: the ISA builds never see torch.
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#define ZOFF_X86 1
#else
#define ZOFF_X86 0
#endif

namespace zoff {

// 16-bit storage as distinct types, so the kernels overload their loads and stores on the element type.
struct Bf16 {
  uint16_t bits;
};
struct Half {
  uint16_t bits;
};

enum class DType : uint8_t { kF32, kBF16, kF16 };

// Adam/AdamW per-call constants: computed once in double, then rounded to float where torch's single-tensor
// Adam rounds its Python scalars, so every ISA (and torch) multiplies by the same numbers.
struct AdamConsts {
  float grad_scale;       // negated when maximizing: g * -s == -(g * s) exactly
  bool l2;                // Adam: g += weight_decay * p
  float weight_decay;
  bool decoupled_decay;   // AdamW: p *= 1 - lr * weight_decay
  float decay;
  bool lerp_from_m;       // torch's lerp: m + w * (g - m) for w < 0.5, else g - (1 - w) * (g - m)
  float lerp_w;           // w = 1 - beta1
  float lerp_w_comp;      // 1 - w, in float as torch computes it
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;         // sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;    // -lr / (1 - beta1^step)
};

// The state is read from param/exp_avg/exp_avg_sq and the updated state written to the *_out pointers: the same
// arrays for an update in place, others to keep the old state intact (the engine's speculative updates).
// The moments are fp32 or bf16 (`moment_dtype`, both alike); bf16 ones are computed on in fp32 and stored rounded to
// nearest even. The param (the master) is always fp32.
struct AdamTask {
  const float* param;
  const void* exp_avg;
  const void* exp_avg_sq;
  float* param_out;
  void* exp_avg_out;
  void* exp_avg_sq_out;
  DType moment_dtype;
  const void* grad;
  DType grad_dtype;
  void* out;  // nullptr: no 16-bit copy of the updated param
  DType out_dtype;
  bool stream;  // non-temporal stores allowed for what is only written (see Stores in kernel_bodies.h)
  AdamConsts k;
};

struct LionConsts {
  float grad_scale;  // negated when maximizing
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  bool decoupled_decay;
  float decay;  // 1 - lr * weight_decay
  float lr;
};

struct LionTask {
  const float* param;
  const void* exp_avg;  // moment_dtype, as in AdamTask
  float* param_out;
  void* exp_avg_out;
  DType moment_dtype;
  const void* grad;
  DType grad_dtype;
  void* out;
  DType out_dtype;
  bool stream;
  LionConsts k;
};

// dst += src elementwise, in fp32, rounded to dst's dtype (what torch's dst.add_(src) computes); with `replace`,
// dst = src converted (dst.copy_(src)).
struct AccumulateTask {
  void* dst;
  DType dst_dtype;
  const void* src;
  DType src_dtype;
  bool replace;
};

struct SumsqTask {
  const void* grad;
  DType grad_dtype;
  float grad_scale;
};

// One ISA's build of every kernel; each runs over elements [begin, end) of its arrays.
struct IsaKernels {
  void (*adam)(const AdamTask& task, int64_t begin, int64_t end);
  void (*lion)(const LionTask& task, int64_t begin, int64_t end);
  double (*sumsq)(const SumsqTask& task, int64_t begin, int64_t end);  // of grad * grad_scale, in double
  void (*accumulate)(const AccumulateTask& task, int64_t begin, int64_t end);
  double (*stream_read)(const float* a, int64_t begin, int64_t end);
  void (*stream_copy)(float* a, const float* b, int64_t begin, int64_t end);
  void (*stream_triad)(float* a, const float* b, const float* c, float s, int64_t begin, int64_t end);
  // Non-temporal stores; nullptr where the ISA has none.
  void (*stream_copy_nt)(float* a, const float* b, int64_t begin, int64_t end);
  void (*stream_triad_nt)(float* a, const float* b, const float* c, float s, int64_t begin, int64_t end);
};

namespace scalar {
extern const IsaKernels kKernels;
}
#if ZOFF_X86
namespace avx2 {
extern const IsaKernels kKernels;
}
namespace avx512 {
extern const IsaKernels kKernels;
}
#endif

}  // namespace zoff
