// The scalars of one optimizer call, computed in double once and rounded to float where torch's single-tensor
// optimizers round their Python scalars (torch.optim.Adam/AdamW; Lion written with the same torch ops).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels.h"

namespace zoff {

// `step` counts this step, 1-based.
inline AdamConsts adam_consts(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                              bool decoupled, bool maximize, double grad_scale) {
  const double bias_correction1 = 1.0 - std::pow(beta1, double(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, double(step));
  const float w = float(1.0 - beta1);
  AdamConsts k{};
  k.grad_scale = float(maximize ? -grad_scale : grad_scale);
  k.l2 = !decoupled && weight_decay != 0.0;
  k.weight_decay = float(weight_decay);
  k.decoupled_decay = decoupled && weight_decay != 0.0;
  k.decay = float(1.0 - lr * weight_decay);
  k.lerp_from_m = w < 0.5f;
  k.lerp_w = w;
  k.lerp_w_comp = 1.0f - w;
  k.beta2 = float(beta2);
  k.one_minus_beta2 = float(1.0 - beta2);
  k.bc2_sqrt = float(std::sqrt(bias_correction2));
  k.eps = float(eps);
  k.neg_step_size = float(-(lr / bias_correction1));
  return k;
}

inline LionConsts lion_consts(double lr, double beta1, double beta2, double weight_decay, bool maximize,
                              double grad_scale) {
  LionConsts k{};
  k.grad_scale = float(maximize ? -grad_scale : grad_scale);
  k.beta1 = float(beta1);
  k.one_minus_beta1 = float(1.0 - beta1);
  k.beta2 = float(beta2);
  k.one_minus_beta2 = float(1.0 - beta2);
  k.decoupled_decay = weight_decay != 0.0;
  k.decay = float(1.0 - lr * weight_decay);
  k.lr = float(lr);
  return k;
}

}  // namespace zoff
