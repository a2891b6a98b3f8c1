// Torch implementation of the MoE routing family: the plan, permute, unpermute and its backward
// (CPU for now; the core reports CUDA tensors until its CUDA backend lands), and autograd through x,
// the permuted rows and probs.
#include <torch/autograd.h>
#include <torch/library.h>

#include "mmfuse/moe.h"
#include "view.h"

namespace mmfuse::torch_bind {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

Tensor rows_ready(const Tensor& t) { return t.dim() == 2 && t.size(1) > 1 && t.stride(1) != 1 ? t.contiguous() : t; }

std::tuple<Tensor, Tensor, Tensor> moe_plan_impl(const Tensor& indices, int64_t num_experts, int64_t num_out_tokens) {
  TORCH_CHECK_VALUE(indices.dim() == 2, "mmfuse.moe_plan: indices: expected [T, K], got ", indices.sizes());
  const int64_t T = indices.size(0), K = indices.size(1);
  const int64_t n = num_out_tokens == 0 ? T * K : num_out_tokens;
  TORCH_CHECK_VALUE(n >= 0 && n <= T * K, "mmfuse.moe_plan: num_out_tokens: expected 0 (all) or in [0, T*K = ", T * K,
                    "], got ", num_out_tokens);
  const auto i32 = indices.options().dtype(at::kInt);
  Tensor map = at::empty({K, T}, i32), d2s = at::empty({n}, i32);
  Tensor counts = at::empty({num_experts > 0 ? num_experts : 0}, indices.options().dtype(at::kLong));
  guarded("moe_plan", [&] {
    TensorView mv = view(map, "row_id_map"), cv = view(counts, "counts"), dv = view(d2s, "dst_to_src");
    c10::OptionalDeviceGuard g(indices.device());
    moe_plan(view(indices, "indices"), num_experts, num_out_tokens, mv, cv, dv, current_stream(indices));
  });
  return {map, counts, d2s};
}

Tensor moe_permute_impl(const Tensor& x_in, const Tensor& row_id_map, const Tensor& dst_to_src) {
  const Tensor x = rows_ready(x_in);
  TORCH_CHECK_VALUE(x.dim() == 2, "mmfuse.moe_permute: x: expected [T, H], got ", x.sizes());
  TORCH_CHECK_VALUE(row_id_map.dim() == 2, "mmfuse.moe_permute: row_id_map: expected [K, T], got ", row_id_map.sizes());
  Tensor out = at::empty({dst_to_src.size(0), x.size(1)}, x.options());
  guarded("moe_permute", [&] {
    TensorView ov = view(out, "out");
    c10::OptionalDeviceGuard g(x.device());
    moe_permute(view(x, "x"), view(dst_to_src, "dst_to_src"), row_id_map.size(0), ov, current_stream(x));
  });
  return out;
}

Tensor moe_unpermute_impl(const Tensor& y, const Tensor& row_id_map, const OptTensor& probs) {
  TORCH_CHECK_VALUE(y.dim() == 2 && row_id_map.dim() == 2, "mmfuse.moe_unpermute: expected y [N, H] and row_id_map "
                    "[K, T], got ", y.sizes(), " and ", row_id_map.sizes());
  Tensor out = at::empty({row_id_map.size(1), y.size(1)}, y.options());
  guarded("moe_unpermute", [&] {
    TensorView ov = view(out, "out");
    c10::OptionalDeviceGuard g(y.device());
    moe_unpermute(view(y, "y"), view(row_id_map, "row_id_map"), view(probs, "probs"), ov, current_stream(y));
  });
  return out;
}

std::tuple<Tensor, Tensor> moe_unpermute_backward_impl(const Tensor& dout, const Tensor& y, const Tensor& row_id_map,
                                                       const OptTensor& probs) {
  TORCH_CHECK_VALUE(y.dim() == 2 && row_id_map.dim() == 2, "mmfuse.moe_unpermute_backward: expected y [N, H] and "
                    "row_id_map [K, T], got ", y.sizes(), " and ", row_id_map.sizes());
  Tensor dy = at::empty_like(y, at::MemoryFormat::Contiguous);
  Tensor dprobs = at::empty({row_id_map.size(1), row_id_map.size(0)}, y.options().dtype(at::kFloat));
  guarded("moe_unpermute_backward", [&] {
    TensorView dyv = view(dy, "dy"), dpv = view(dprobs, "dprobs");
    c10::OptionalDeviceGuard g(y.device());
    moe_unpermute_backward(view(dout, "dout"), view(y, "y"), view(row_id_map, "row_id_map"), view(probs, "probs"),
                           dyv, dpv, current_stream(y));
  });
  return {dy, dprobs};
}

c10::OperatorHandle op(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

struct PermuteFn : public torch::autograd::Function<PermuteFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& map, const Tensor& d2s) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({map});
    return {op("mmfuse::moe_permute").typed<Tensor(const Tensor&, const Tensor&, const Tensor&)>().call(x, map, d2s)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor map = ctx->get_saved_variables()[0];
    // the backward of a gather of rows: the unweighted sum of each token's K gradient rows
    return {op("mmfuse::moe_unpermute")
                .typed<Tensor(const Tensor&, const Tensor&, const OptTensor&)>()
                .call(rows_ready(grads[0]), map, std::nullopt),
            Tensor(), Tensor()};
  }
};

struct UnpermuteFn : public torch::autograd::Function<UnpermuteFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& y, const Tensor& map, const OptTensor& probs) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({y, map, probs.value_or(Tensor())});
    return {op("mmfuse::moe_unpermute")
                .typed<Tensor(const Tensor&, const Tensor&, const OptTensor&)>()
                .call(y, map, probs)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const OptTensor probs = s[2].defined() ? OptTensor(s[2]) : std::nullopt;
    auto [dy, dprobs] = op("mmfuse::moe_unpermute_backward")
                            .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                              const OptTensor&)>()
                            .call(rows_ready(grads[0]), s[0], s[1], probs);
    return {dy, Tensor(), probs ? dprobs : Tensor()};
  }
};

Tensor moe_permute_autograd(const Tensor& x, const Tensor& map, const Tensor& d2s) {
  if (!x.requires_grad()) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return op("mmfuse::moe_permute").typed<Tensor(const Tensor&, const Tensor&, const Tensor&)>().call(x, map, d2s);
  }
  return PermuteFn::apply(x, map, d2s)[0];
}

Tensor moe_unpermute_autograd(const Tensor& y, const Tensor& map, const OptTensor& probs) {
  if (!y.requires_grad() && !(probs && probs->requires_grad())) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return op("mmfuse::moe_unpermute").typed<Tensor(const Tensor&, const Tensor&, const OptTensor&)>().call(y, map, probs);
  }
  return UnpermuteFn::apply(y, map, probs)[0];
}

void register_moe(torch::Library& m) {
  m.impl("moe_plan", &moe_plan_impl);
  m.impl("moe_permute", &moe_permute_impl);
  m.impl("moe_unpermute", &moe_unpermute_impl);
  m.impl("moe_unpermute_backward", &moe_unpermute_backward_impl);
}

}  // namespace

TORCH_LIBRARY_IMPL(mmfuse, CPU, m) { register_moe(m); }
TORCH_LIBRARY_IMPL(mmfuse, CUDA, m) { register_moe(m); }  // the core reports that its CUDA backend is not built yet

TORCH_LIBRARY_IMPL(mmfuse, Autograd, m) {
  m.impl("moe_permute", &moe_permute_autograd);
  m.impl("moe_unpermute", &moe_unpermute_autograd);
}

}  // namespace mmfuse::torch_bind
