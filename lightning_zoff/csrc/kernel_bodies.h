// The kernels, written once against a lane type (Simd: the ISA's widest, Scalar: one lane; see simd_*.h) and
// included inside each ISA's namespace by isa_*.cpp, so every ISA gets its own compiled copy of the same code.
// Each kernel sweeps [begin, end) once: whole Simd vectors, then the tail with Scalar, whose formula is the same.

// How a kernel stores what it only writes: through the cache, or streamed (non-temporal: the line is not read
// for ownership first, which saves a read of every byte written). Streaming needs aligned whole vectors, so
// only the Simd loop streams, from an aligned start.
enum class Stores { kCached, kStreamOut, kStreamAll };  // kStreamOut: the 16-bit copy; kStreamAll: new state too
                                                       // (the moments as kStreamMoments allows)

template <class V, bool kNonTemporal, class T>
inline void put(T* p, typename V::F x) {
  if constexpr (kNonTemporal) V::stream(p, x);
  else V::store(p, x);
}

// Whether the new moments stream along with the new state: only where one vector of them is 32 bytes or more. On the
// 2-core AMD EPYC test VM (AVX2), streaming bf16 moments (16-byte vectors) made the update into other arrays 5-7x
// slower than cached stores; fp32 ones (32 bytes) cost 1.5-2x there, and gained 1.55x on the GPU machine's Xeon
// (AVX-512, 64 bytes). bf16 moments with AVX-512 (32 bytes) stream: not measured yet (scripts/bench/bench_kernels.py).
template <class V, class M>
constexpr bool kStreamMoments = V::kWidth * sizeof(M) >= 32;

template <class V>
inline void fence() {
  if constexpr (V::kHasStream) V::stream_fence();
}

template <class V>
inline bool aligned_for_stream(const void* p, int64_t element_size) {
  return reinterpret_cast<uintptr_t>(p) % uintptr_t(V::kWidth * element_size) == 0;
}

template <class V>
struct AdamVec {  // AdamConsts broadcast to V's lanes
  using F = typename V::F;
  F grad_scale, weight_decay, decay, lerp_w, lerp_w_comp, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
  explicit AdamVec(const AdamConsts& k)
      : grad_scale(V::set1(k.grad_scale)), weight_decay(V::set1(k.weight_decay)), decay(V::set1(k.decay)),
        lerp_w(V::set1(k.lerp_w)), lerp_w_comp(V::set1(k.lerp_w_comp)), beta2(V::set1(k.beta2)),
        one_minus_beta2(V::set1(k.one_minus_beta2)), bc2_sqrt(V::set1(k.bc2_sqrt)), eps(V::set1(k.eps)),
        neg_step_size(V::set1(k.neg_step_size)) {}
};

// G: the gradient's element type; M: the moments' (float or Bf16: loaded into fp32, stored rounded to nearest
// even); Out: the 16-bit copy's, void when there is none to write.
template <class V, class G, class M, class Out, Stores kStores = Stores::kCached>
inline void adam_at(const AdamTask& t, const AdamVec<V>& c, int64_t i) {
  constexpr bool kStreamState = kStores == Stores::kStreamAll, kStreamOut = kStores != Stores::kCached;
  constexpr bool kStreamM = kStreamState && kStreamMoments<V, M>;
  using F = typename V::F;
  const AdamConsts& k = t.k;
  F g = V::load(static_cast<const G*>(t.grad) + i) * c.grad_scale;
  F p = V::load(t.param + i);
  if (k.l2) g = g + c.weight_decay * p;
  if (k.decoupled_decay) p = p * c.decay;
  F m = V::load(static_cast<const M*>(t.exp_avg) + i);
  const F d = g - m;
  m = k.lerp_from_m ? m + c.lerp_w * d : g - c.lerp_w_comp * d;
  F v = V::load(static_cast<const M*>(t.exp_avg_sq) + i);
  v = c.beta2 * v + c.one_minus_beta2 * g * g;
  const F denom = V::sqrt(v) / c.bc2_sqrt + c.eps;
  p = p + c.neg_step_size * m / denom;
  put<V, kStreamM>(static_cast<M*>(t.exp_avg_out) + i, m);
  put<V, kStreamM>(static_cast<M*>(t.exp_avg_sq_out) + i, v);
  put<V, kStreamState>(t.param_out + i, p);
  if constexpr (!std::is_void_v<Out>) put<V, kStreamOut>(static_cast<Out*>(t.out) + i, p);
}

// Which stores can stream from element i: the 16-bit copy when it is aligned there, the new state when it goes to
// other arrays than the old (an update in place reads its lines anyway) and they are aligned there too.
template <class M, class Out>
Stores stores_from(bool allowed, const void* out, const float* param_out, std::initializer_list<void*> moments_out,
                   bool in_place, int64_t i) {
  if constexpr (!Simd::kHasStream) {
    return Stores::kCached;
  } else {
    if (!allowed) return Stores::kCached;
    if constexpr (!std::is_void_v<Out>) {
      if (!aligned_for_stream<Simd>(static_cast<const Out*>(out) + i, sizeof(Out))) return Stores::kCached;
    }
    if (in_place) return Stores::kStreamOut;
    if (!aligned_for_stream<Simd>(param_out + i, sizeof(float))) return Stores::kStreamOut;
    for (const void* m : moments_out) {
      if (kStreamMoments<Simd, M> && !aligned_for_stream<Simd>(static_cast<const M*>(m) + i, sizeof(M))) {
        return Stores::kStreamOut;
      }
    }
    return Stores::kStreamAll;
  }
}

// Runs at(i) on single elements until the param written is aligned, on whole vectors with the stores that alignment
// allows, then on the tail. Every element gets the same formula whichever loop runs it.
template <class M, class Out, class Task, class One, class Vec>
void sweep(const Task& t, std::initializer_list<void*> moments_out, int64_t begin, int64_t end, const One& one,
           const Vec& vec) {
  int64_t i = begin;
  if constexpr (Simd::kHasStream) {
    while (i < end && !aligned_for_stream<Simd>(t.param_out + i, sizeof(float))) one(i++);
  }
  const auto run = [&](auto mode) {
    for (; i + Simd::kWidth <= end; i += Simd::kWidth) vec(i, mode);
  };
  if constexpr (Simd::kHasStream) {
    const Stores stores = stores_from<M, Out>(t.stream, t.out, t.param_out, moments_out, t.param_out == t.param, i);
    switch (stores) {
      case Stores::kCached: run(std::integral_constant<Stores, Stores::kCached>{}); break;
      case Stores::kStreamOut: run(std::integral_constant<Stores, Stores::kStreamOut>{}); break;
      case Stores::kStreamAll: run(std::integral_constant<Stores, Stores::kStreamAll>{}); break;
    }
    if (stores != Stores::kCached) fence<Simd>();  // streamed lines are visible before the caller copies them
  } else {
    run(std::integral_constant<Stores, Stores::kCached>{});
  }
  for (; i < end; ++i) one(i);
}

template <class G, class M, class Out>
void adam_typed(const AdamTask& t, int64_t begin, int64_t end) {
  const AdamVec<Simd> vec(t.k);
  const AdamVec<Scalar> one(t.k);
  sweep<M, Out>(
      t, {t.exp_avg_out, t.exp_avg_sq_out}, begin, end, [&](int64_t i) { adam_at<Scalar, G, M, Out>(t, one, i); },
      [&](int64_t i, auto mode) { adam_at<Simd, G, M, Out, decltype(mode)::value>(t, vec, i); });
}

template <class V>
struct LionVec {
  using F = typename V::F;
  F grad_scale, beta1, one_minus_beta1, beta2, one_minus_beta2, decay, lr;
  explicit LionVec(const LionConsts& k)
      : grad_scale(V::set1(k.grad_scale)), beta1(V::set1(k.beta1)), one_minus_beta1(V::set1(k.one_minus_beta1)),
        beta2(V::set1(k.beta2)), one_minus_beta2(V::set1(k.one_minus_beta2)), decay(V::set1(k.decay)),
        lr(V::set1(k.lr)) {}
};

template <class V, class G, class M, class Out, Stores kStores = Stores::kCached>
inline void lion_at(const LionTask& t, const LionVec<V>& c, int64_t i) {
  constexpr bool kStreamState = kStores == Stores::kStreamAll, kStreamOut = kStores != Stores::kCached;
  constexpr bool kStreamM = kStreamState && kStreamMoments<V, M>;
  using F = typename V::F;
  const F g = V::load(static_cast<const G*>(t.grad) + i) * c.grad_scale;
  F m = V::load(static_cast<const M*>(t.exp_avg) + i);
  const F direction = c.beta1 * m + c.one_minus_beta1 * g;
  F p = V::load(t.param + i);
  if (t.k.decoupled_decay) p = p * c.decay;
  p = p - c.lr * V::sign(direction);
  m = c.beta2 * m + c.one_minus_beta2 * g;
  put<V, kStreamM>(static_cast<M*>(t.exp_avg_out) + i, m);
  put<V, kStreamState>(t.param_out + i, p);
  if constexpr (!std::is_void_v<Out>) put<V, kStreamOut>(static_cast<Out*>(t.out) + i, p);
}

template <class G, class M, class Out>
void lion_typed(const LionTask& t, int64_t begin, int64_t end) {
  const LionVec<Simd> vec(t.k);
  const LionVec<Scalar> one(t.k);
  sweep<M, Out>(
      t, {t.exp_avg_out}, begin, end, [&](int64_t i) { lion_at<Scalar, G, M, Out>(t, one, i); },
      [&](int64_t i, auto mode) { lion_at<Simd, G, M, Out, decltype(mode)::value>(t, vec, i); });
}

template <class G>
double sumsq_typed(const SumsqTask& t, int64_t begin, int64_t end) {
  const G* grad = static_cast<const G*>(t.grad);
  const Simd::F scale = Simd::set1(t.grad_scale);
  Simd::Acc acc = Simd::acc_zero();
  int64_t i = begin;
  for (; i + Simd::kWidth <= end; i += Simd::kWidth) Simd::add_squares(acc, Simd::load(grad + i) * scale);
  Scalar::Acc tail = Scalar::acc_zero();
  for (; i < end; ++i) Scalar::add_squares(tail, Scalar::load(grad + i) * t.grad_scale);
  return Simd::reduce(acc) + Scalar::reduce(tail);
}

template <class D, class S, bool kReplace>
void accumulate_typed(const AccumulateTask& t, int64_t begin, int64_t end) {
  D* dst = static_cast<D*>(t.dst);
  const S* src = static_cast<const S*>(t.src);
  int64_t i = begin;
  if constexpr (kReplace) {
    for (; i + Simd::kWidth <= end; i += Simd::kWidth) Simd::store(dst + i, Simd::load(src + i));
    for (; i < end; ++i) Scalar::store(dst + i, Scalar::load(src + i));
  } else {
    for (; i + Simd::kWidth <= end; i += Simd::kWidth) Simd::store(dst + i, Simd::load(dst + i) + Simd::load(src + i));
    for (; i < end; ++i) Scalar::store(dst + i, Scalar::load(dst + i) + Scalar::load(src + i));
  }
}

// Four independent sums, so the read is bound by memory, not by the latency of one chain of adds.
double stream_read(const float* a, int64_t begin, int64_t end) {
  Simd::F s0 = Simd::set1(0.0f), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = begin;
  for (; i + 4 * Simd::kWidth <= end; i += 4 * Simd::kWidth) {
    s0 = s0 + Simd::load(a + i);
    s1 = s1 + Simd::load(a + i + Simd::kWidth);
    s2 = s2 + Simd::load(a + i + 2 * Simd::kWidth);
    s3 = s3 + Simd::load(a + i + 3 * Simd::kWidth);
  }
  double sum = Simd::lane_sum((s0 + s1) + (s2 + s3));
  for (; i < end; ++i) sum += a[i];
  return sum;
}

template <class V, bool kNonTemporal>
void stream_copy(float* a, const float* b, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + V::kWidth <= end; i += V::kWidth) put<V, kNonTemporal>(a + i, V::load(b + i));
  for (; i < end; ++i) a[i] = b[i];
  if constexpr (kNonTemporal) V::stream_fence();
}

template <class V, bool kNonTemporal>
void stream_triad(float* a, const float* b, const float* c, float s, int64_t begin, int64_t end) {
  const typename V::F sv = V::set1(s);
  int64_t i = begin;
  for (; i + V::kWidth <= end; i += V::kWidth) put<V, kNonTemporal>(a + i, V::load(b + i) + sv * V::load(c + i));
  for (; i < end; ++i) a[i] = b[i] + s * c[i];
  if constexpr (kNonTemporal) V::stream_fence();
}

template <class V>
constexpr auto stream_copy_nt() {
  if constexpr (V::kHasStream) return &stream_copy<V, true>;
  else return decltype(&stream_copy<V, false>){nullptr};
}

template <class V>
constexpr auto stream_triad_nt() {
  if constexpr (V::kHasStream) return &stream_triad<V, true>;
  else return decltype(&stream_triad<V, false>){nullptr};
}

template <class T>
struct Tag {
  using type = T;
};

// Calls fn(Tag<float, Bf16 or Half>) for a floating-point DType: an element type is chosen once per call, not per
// element.
template <class Fn>
auto with_dtype(DType dtype, const Fn& fn) {
  switch (dtype) {
    case DType::kBF16: return fn(Tag<Bf16>{});
    case DType::kF16: return fn(Tag<Half>{});
    default: return fn(Tag<float>{});
  }
}

// Calls fn(Tag<grad type>, Tag<moment type>, Tag<out type or void>). The moments are fp32 or bf16 only, so the
// kernels are not compiled for fp16 ones.
template <class Task, class Fn>
void with_types(const Task& t, const Fn& fn) {
  with_dtype(t.grad_dtype, [&](auto grad) {
    const auto with_out = [&](auto moment) {
      if (!t.out) return fn(grad, moment, Tag<void>{});
      if (t.out_dtype == DType::kBF16) return fn(grad, moment, Tag<Bf16>{});
      return fn(grad, moment, Tag<Half>{});
    };
    if (t.moment_dtype == DType::kBF16) return with_out(Tag<Bf16>{});
    return with_out(Tag<float>{});
  });
}

void adam(const AdamTask& t, int64_t begin, int64_t end) {
  with_types(t, [&](auto g, auto m, auto o) {
    adam_typed<typename decltype(g)::type, typename decltype(m)::type, typename decltype(o)::type>(t, begin, end);
  });
}

void lion(const LionTask& t, int64_t begin, int64_t end) {
  with_types(t, [&](auto g, auto m, auto o) {
    lion_typed<typename decltype(g)::type, typename decltype(m)::type, typename decltype(o)::type>(t, begin, end);
  });
}

double sumsq(const SumsqTask& t, int64_t begin, int64_t end) {
  return with_dtype(t.grad_dtype, [&](auto g) { return sumsq_typed<typename decltype(g)::type>(t, begin, end); });
}

void accumulate(const AccumulateTask& t, int64_t begin, int64_t end) {
  with_dtype(t.src_dtype, [&](auto src) {
    with_dtype(t.dst_dtype, [&](auto dst) {
      using D = typename decltype(dst)::type;
      using S = typename decltype(src)::type;
      if (t.replace) return accumulate_typed<D, S, true>(t, begin, end);
      return accumulate_typed<D, S, false>(t, begin, end);
    });
  });
}

extern const IsaKernels kKernels = {
    adam,
    lion,
    sumsq,
    accumulate,
    stream_read,
    stream_copy<Simd, false>,
    stream_triad<Simd, false>,
    stream_copy_nt<Simd>(),
    stream_triad_nt<Simd>(),
};
