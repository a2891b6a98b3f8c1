// Torch implementations of the rotary family: CPU and CUDA kernels (one function: the core picks
// the backend from the tensors' device) and the autograd kernels, which save only the angles.
#include <torch/autograd.h>
#include <torch/library.h>

#include "mmfuse/rope.h"
#include "view.h"

namespace mmfuse::torch_bind {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

RopeParams rope_params(at::IntArrayRef section, bool interleaved, c10::string_view numerics, bool backward,
                       bool heads_first) {
  RopeParams p;
  p.heads_first = heads_first;
  if (section.empty()) {
    TORCH_CHECK_VALUE(!interleaved, "mmfuse.mrope: interleaved=True needs mrope_section");
    p.layout = RopeLayout::kPlain;
  } else {
    TORCH_CHECK_VALUE(section.size() == 3, "mmfuse.mrope: mrope_section: expected 3 entries [t, h, w], got ",
                      section.size(), " (", section, ")");
    p.layout = interleaved ? RopeLayout::kInterleaved : RopeLayout::kSectioned;
    for (int i = 0; i < 3; ++i) {
      TORCH_CHECK_VALUE(section[i] >= 0 && section[i] < (int64_t(1) << 20),
                        "mmfuse.mrope: mrope_section: expected small non-negative entries, got ", section);
      p.section[i] = int(section[i]);
    }
  }
  if (numerics == "fp32") {
    p.numerics = RopeNumerics::kFp32;
  } else if (numerics == "hf_eager") {
    p.numerics = RopeNumerics::kHfEager;
  } else {
    TORCH_CHECK_VALUE(false, "mmfuse.mrope: numerics: expected \"fp32\" or \"hf_eager\", got \"", numerics, "\"");
  }
  p.backward = backward;
  return p;
}

void run_mrope(const Tensor& q, const Tensor& k, const OptTensor& cos, const OptTensor& sin, const OptTensor& pos,
               const OptTensor& inv_freq, at::IntArrayRef section, bool interleaved, c10::string_view numerics,
               bool backward, bool heads_first, const Tensor& q_out, const Tensor& k_out) {
  const RopeParams p = rope_params(section, interleaved, numerics, backward, heads_first);
  guarded("mrope", [&] {
    RopeAngles a;
    a.cos = view(cos, "cos");
    a.sin = view(sin, "sin");
    a.positions = view(pos, "positions");
    a.inv_freq = view(inv_freq, "inv_freq");
    TensorView qo = view(q_out, "q_out"), ko = view(k_out, "k_out");
    c10::OptionalDeviceGuard guard(q.device());
    mrope(view(q, "q"), view(k, "k"), a, p, qo, ko, current_stream(q));
  });
}

std::tuple<Tensor, Tensor> mrope_impl(const Tensor& q, const Tensor& k, const OptTensor& cos, const OptTensor& sin,
                                      const OptTensor& pos, const OptTensor& inv_freq, at::IntArrayRef section,
                                      bool interleaved, c10::string_view numerics, bool heads_first) {
  Tensor q_out = at::empty_like(q), k_out = at::empty_like(k);
  run_mrope(q, k, cos, sin, pos, inv_freq, section, interleaved, numerics, false, heads_first, q_out, k_out);
  return {q_out, k_out};
}

std::tuple<Tensor, Tensor> mrope_backward_impl(const Tensor& gq, const Tensor& gk, const OptTensor& cos,
                                               const OptTensor& sin, const OptTensor& pos, const OptTensor& inv_freq,
                                               at::IntArrayRef section, bool interleaved, c10::string_view numerics,
                                               bool heads_first) {
  Tensor dq = at::empty_like(gq), dk = at::empty_like(gk);
  run_mrope(gq, gk, cos, sin, pos, inv_freq, section, interleaved, numerics, true, heads_first, dq, dk);
  return {dq, dk};
}

void mrope_inplace_impl(const Tensor& q, const Tensor& k, const OptTensor& cos, const OptTensor& sin,
                        const OptTensor& pos, const OptTensor& inv_freq, at::IntArrayRef section, bool interleaved,
                        c10::string_view numerics, bool backward, bool heads_first) {
  run_mrope(q, k, cos, sin, pos, inv_freq, section, interleaved, numerics, backward, heads_first, q, k);
}

void mrope_out_impl(const Tensor& q, const Tensor& k, const OptTensor& cos, const OptTensor& sin,
                    const OptTensor& pos, const OptTensor& inv_freq, at::IntArrayRef section, bool interleaved,
                    c10::string_view numerics, bool backward, bool heads_first, const Tensor& q_out,
                    const Tensor& k_out) {
  run_mrope(q, k, cos, sin, pos, inv_freq, section, interleaved, numerics, backward, heads_first, q_out, k_out);
}

void run_vision(const Tensor& q, const Tensor& k, const Tensor& freqs, bool backward, const Tensor& q_out,
                const Tensor& k_out) {
  guarded("vision_rope", [&] {
    TensorView qo = view(q_out, "q_out"), ko = view(k_out, "k_out");
    c10::OptionalDeviceGuard guard(q.device());
    vision_rope(view(q, "q"), view(k, "k"), view(freqs, "freqs"), backward, qo, ko, current_stream(q));
  });
}

std::tuple<Tensor, Tensor> vision_rope_impl(const Tensor& q, const Tensor& k, const Tensor& freqs) {
  Tensor q_out = at::empty_like(q), k_out = at::empty_like(k);
  run_vision(q, k, freqs, false, q_out, k_out);
  return {q_out, k_out};
}

std::tuple<Tensor, Tensor> vision_rope_backward_impl(const Tensor& gq, const Tensor& gk, const Tensor& freqs) {
  Tensor dq = at::empty_like(gq), dk = at::empty_like(gk);
  run_vision(gq, gk, freqs, true, dq, dk);
  return {dq, dk};
}

// ---- autograd -------------------------------------------------------------------------------
// The rotation is linear in (q, k): the backward of mrope is mrope_backward and vice versa. Only the
// angle source is saved (never q or k). Gradients w.r.t. the angles are not provided: asking for
// them is an error rather than a silent zero.

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

const c10::TypedOperatorHandle<decltype(mrope_impl)>& mrope_op(bool backward) {
  static auto fwd = c10::Dispatcher::singleton().findSchemaOrThrow("mmfuse::mrope", "").typed<decltype(mrope_impl)>();
  static auto bwd =
      c10::Dispatcher::singleton().findSchemaOrThrow("mmfuse::mrope_backward", "").typed<decltype(mrope_impl)>();
  return backward ? bwd : fwd;
}

const c10::TypedOperatorHandle<decltype(vision_rope_impl)>& vision_op(bool backward) {
  static auto fwd =
      c10::Dispatcher::singleton().findSchemaOrThrow("mmfuse::vision_rope", "").typed<decltype(vision_rope_impl)>();
  static auto bwd = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("mmfuse::vision_rope_backward", "")
                        .typed<decltype(vision_rope_impl)>();
  return backward ? bwd : fwd;
}

void reject_angle_grad(const OptTensor& t, const char* name) {
  TORCH_CHECK_VALUE(!t.has_value() || !t->requires_grad(), "mmfuse.mrope: ", name,
                    " requires grad, but gradients with respect to the angles are not supported; detach it");
}

template <bool Backward>
struct MropeFn : public torch::autograd::Function<MropeFn<Backward>> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const OptTensor& cos,
                               const OptTensor& sin, const OptTensor& pos, const OptTensor& inv_freq,
                               at::IntArrayRef section, bool interleaved, c10::string_view numerics,
                               bool heads_first) {
    reject_angle_grad(cos, "cos");
    reject_angle_grad(sin, "sin");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [qo, ko] = mrope_op(Backward).call(q, k, cos, sin, pos, inv_freq, section, interleaved, numerics, heads_first);
    ctx->save_for_backward({cos.value_or(Tensor()), sin.value_or(Tensor()), pos.value_or(Tensor()),
                            inv_freq.value_or(Tensor())});
    ctx->saved_data["section"] = section.vec();
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["numerics"] = std::string(numerics);
    ctx->saved_data["heads_first"] = heads_first;
    return {qo, ko};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto opt = [](const Tensor& t) { return t.defined() ? OptTensor(t) : OptTensor(); };
    const auto section = ctx->saved_data["section"].toIntVector();
    const Tensor gq = kernel_ready(grads[0]);  // undefined grads arrive as zeros (materialize_grads)
    const Tensor gk = kernel_ready(grads[1]);
    // The adjoint of the forward rotation is the backward op and vice versa; going through the
    // dispatcher keeps double backward differentiable.
    const bool interleaved = ctx->saved_data["interleaved"].toBool();
    const bool heads_first = ctx->saved_data["heads_first"].toBool();
    const std::string& numerics = ctx->saved_data["numerics"].toStringRef();
    auto outs = Backward ? MropeFn<false>::apply(gq, gk, opt(saved[0]), opt(saved[1]), opt(saved[2]), opt(saved[3]),
                                                 section, interleaved, numerics, heads_first)
                         : MropeFn<true>::apply(gq, gk, opt(saved[0]), opt(saved[1]), opt(saved[2]), opt(saved[3]),
                                                section, interleaved, numerics, heads_first);
    return {outs[0], outs[1], Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// No input needs a gradient (inference, or under no_grad): skip the autograd node (host overhead).
bool needs_grad(const Tensor& q, const Tensor& k) {
  return at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad());
}

template <bool Backward>
std::tuple<Tensor, Tensor> mrope_autograd(const Tensor& q, const Tensor& k, const OptTensor& cos, const OptTensor& sin,
                                          const OptTensor& pos, const OptTensor& inv_freq, at::IntArrayRef section,
                                          bool interleaved, c10::string_view numerics, bool heads_first) {
  if (!needs_grad(q, k)) {
    reject_angle_grad(cos, "cos");
    reject_angle_grad(sin, "sin");
    at::AutoDispatchBelowADInplaceOrView guard;
    return mrope_op(Backward).call(q, k, cos, sin, pos, inv_freq, section, interleaved, numerics, heads_first);
  }
  auto outs = MropeFn<Backward>::apply(q, k, cos, sin, pos, inv_freq, section, interleaved, numerics, heads_first);
  return {outs[0], outs[1]};
}

template <bool Backward>
struct VisionFn : public torch::autograd::Function<VisionFn<Backward>> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& freqs) {
    TORCH_CHECK_VALUE(!freqs.requires_grad(), "mmfuse.vision_rope: freqs requires grad, but gradients with respect "
                                              "to the angles are not supported; detach it");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [qo, ko] = vision_op(Backward).call(q, k, freqs);
    ctx->save_for_backward({freqs});
    return {qo, ko};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor gq = kernel_ready(grads[0]);  // undefined grads arrive as zeros (materialize_grads)
    const Tensor gk = kernel_ready(grads[1]);
    auto outs = Backward ? VisionFn<false>::apply(gq, gk, saved[0]) : VisionFn<true>::apply(gq, gk, saved[0]);
    return {outs[0], outs[1], Tensor()};
  }
};

template <bool Backward>
std::tuple<Tensor, Tensor> vision_autograd(const Tensor& q, const Tensor& k, const Tensor& freqs) {
  if (!needs_grad(q, k) && !freqs.requires_grad()) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return vision_op(Backward).call(q, k, freqs);
  }
  auto outs = VisionFn<Backward>::apply(q, k, freqs);
  return {outs[0], outs[1]};
}

}  // namespace

// One set of kernels for both devices: the core picks the backend from the tensors' device.
void register_kernels(torch::Library& m) {
  m.impl("mrope", &mrope_impl);
  m.impl("mrope_backward", &mrope_backward_impl);
  m.impl("mrope_", &mrope_inplace_impl);
  m.impl("mrope_out", &mrope_out_impl);
  m.impl("vision_rope", &vision_rope_impl);
  m.impl("vision_rope_backward", &vision_rope_backward_impl);
}

TORCH_LIBRARY_IMPL(mmfuse, CPU, m) { register_kernels(m); }
TORCH_LIBRARY_IMPL(mmfuse, CUDA, m) { register_kernels(m); }

TORCH_LIBRARY_IMPL(mmfuse, Autograd, m) {
  m.impl("mrope", &mrope_autograd<false>);
  m.impl("mrope_backward", &mrope_autograd<true>);
  m.impl("vision_rope", &vision_autograd<false>);
  m.impl("vision_rope_backward", &vision_autograd<true>);
}

}  // namespace mmfuse::torch_bind
