// Torch implementation of the MoE routing family: the plan, permute, unpermute and its backward
// (CPU and CUDA), and autograd through x, the permuted rows and probs.
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

// An int32 scratch buffer of n elements on t's device (empty on the CPU, where the core needs none).
Tensor workspace(const Tensor& t, int64_t n) {
  return at::empty({t.is_cuda() ? n : 0}, t.options().dtype(at::kInt));
}

std::tuple<Tensor, Tensor, Tensor> moe_plan_impl(const Tensor& indices, int64_t num_experts, int64_t num_out_tokens) {
  // sizes are checked by the core; the allocations below only need them to be sane
  const int64_t T = indices.dim() == 2 ? indices.size(0) : 0, K = indices.dim() == 2 ? indices.size(1) : 0;
  const int64_t n = num_out_tokens == 0 ? T * K : num_out_tokens;
  const bool sane = n >= 0 && n <= T * K && num_experts >= 1;
  const auto i32 = indices.options().dtype(at::kInt);
  Tensor map = at::empty({K, T}, i32), d2s = at::empty({sane ? n : 0}, i32);
  Tensor counts = at::empty({num_experts > 0 ? num_experts : 0}, indices.options().dtype(at::kLong));
  Tensor ws = workspace(indices, sane ? moe_plan_workspace_size(T, K, num_experts) : 0);
  guarded("moe_plan", [&] {
    TensorView mv = view(map, "row_id_map"), cv = view(counts, "counts"), dv = view(d2s, "dst_to_src");
    TensorView wv = view(ws, "workspace");
    c10::OptionalDeviceGuard g(indices.device());
    moe_plan(view(indices, "indices"), num_experts, num_out_tokens, mv, cv, dv, wv, current_stream(indices));
  });
  return {map, counts, d2s};
}

Tensor moe_sort_plan_impl(const Tensor& indices, int64_t num_out_tokens) {
  const int64_t T = indices.dim() == 2 ? indices.size(0) : 0, K = indices.dim() == 2 ? indices.size(1) : 0;
  c10::OptionalDeviceGuard g(indices.device());  // the workspace is sized for the device of indices
  Tensor map = at::empty({K, T}, indices.options().dtype(at::kInt));
  // the sort's workspace is sized on the device (cub's query); the CPU backend needs none
  Tensor ws = workspace(indices, indices.is_cuda() && T * K > 0 && T * K < (int64_t(1) << 31)
                                     ? moe_sort_plan_workspace_size(T, K) : 0);
  guarded("moe_sort_plan", [&] {
    TensorView mv = view(map, "row_id_map"), wv = view(ws, "workspace");
    moe_sort_plan(view(indices, "indices"), num_out_tokens, mv, wv, current_stream(indices));
  });
  return map;
}

Tensor moe_permute_impl(const Tensor& x_in, const Tensor& row_id_map, int64_t num_rows) {
  const Tensor x = kernel_ready(x_in);
  TORCH_CHECK_VALUE(num_rows >= 0, "mmfuse.moe_permute: num_rows: expected >= 0, got ", num_rows);
  Tensor out = at::empty({num_rows, x.dim() == 2 ? x.size(1) : 0}, x.options());
  guarded("moe_permute", [&] {
    TensorView ov = view(out, "out");
    c10::OptionalDeviceGuard g(x.device());
    moe_permute(view(x, "x"), view(row_id_map, "row_id_map"), ov, current_stream(x));
  });
  return out;
}

Tensor moe_unpermute_impl(const Tensor& y_in, const Tensor& row_id_map, const OptTensor& probs) {
  const Tensor y = kernel_ready(y_in);
  Tensor out = at::empty({row_id_map.dim() == 2 ? row_id_map.size(1) : 0, y.dim() == 2 ? y.size(1) : 0}, y.options());
  guarded("moe_unpermute", [&] {
    TensorView ov = view(out, "out");
    c10::OptionalDeviceGuard g(y.device());
    moe_unpermute(view(y, "y"), view(row_id_map, "row_id_map"), view(probs, "probs"), ov, current_stream(y));
  });
  return out;
}

std::tuple<Tensor, Tensor> moe_unpermute_backward_impl(const Tensor& dout_in, const Tensor& y_in,
                                                       const Tensor& row_id_map, const OptTensor& probs,
                                                       bool compute_dprobs) {
  const Tensor dout = kernel_ready(dout_in), y = kernel_ready(y_in);
  const int64_t K = row_id_map.dim() == 2 ? row_id_map.size(0) : 0, T = row_id_map.dim() == 2 ? row_id_map.size(1) : 0;
  Tensor dy = at::empty(y.sizes(), y.options());
  Tensor dprobs = at::empty(compute_dprobs ? at::IntArrayRef{T, K} : at::IntArrayRef{0}, y.options().dtype(at::kFloat));
  Tensor ws = workspace(y, moe_unpermute_backward_workspace_size(y.dim() == 2 ? y.size(0) : 0));
  guarded("moe_unpermute_backward", [&] {
    TensorView dyv = view(dy, "dy"), wv = view(ws, "workspace");
    TensorView dpv = compute_dprobs ? view(dprobs, "dprobs") : TensorView{};
    c10::OptionalDeviceGuard g(y.device());
    moe_unpermute_backward(view(dout, "dout"), view(y, "y"), view(row_id_map, "row_id_map"), view(probs, "probs"),
                           dyv, dpv, wv, current_stream(y));
  });
  return {dy, dprobs};
}

c10::OperatorHandle op(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

struct PermuteFn : public torch::autograd::Function<PermuteFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& map, int64_t num_rows) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({map});
    return {op("mmfuse::moe_permute").typed<Tensor(const Tensor&, const Tensor&, int64_t)>().call(x, map, num_rows)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor map = ctx->get_saved_variables()[0];
    // the backward of a gather of rows: the unweighted sum of each token's K gradient rows
    return {op("mmfuse::moe_unpermute")
                .typed<Tensor(const Tensor&, const Tensor&, const OptTensor&)>()
                .call(grads[0], map, std::nullopt),
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
    const bool want_dprobs = probs.has_value() && ctx->needs_input_grad(2);
    auto [dy, dprobs] = op("mmfuse::moe_unpermute_backward")
                            .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                              const OptTensor&, bool)>()
                            .call(grads[0], s[0], s[1], probs, want_dprobs);
    return {dy, Tensor(), want_dprobs ? dprobs : Tensor()};
  }
};

Tensor moe_permute_autograd(const Tensor& x, const Tensor& map, int64_t num_rows) {
  if (!x.requires_grad()) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return op("mmfuse::moe_permute").typed<Tensor(const Tensor&, const Tensor&, int64_t)>().call(x, map, num_rows);
  }
  return PermuteFn::apply(x, map, num_rows)[0];
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
  m.impl("moe_sort_plan", &moe_sort_plan_impl);
  m.impl("moe_permute", &moe_permute_impl);
  m.impl("moe_unpermute", &moe_unpermute_impl);
  m.impl("moe_unpermute_backward", &moe_unpermute_backward_impl);
}

}  // namespace

TORCH_LIBRARY_IMPL(mmfuse, CPU, m) { register_moe(m); }
TORCH_LIBRARY_IMPL(mmfuse, CUDA, m) { register_moe(m); }

TORCH_LIBRARY_IMPL(mmfuse, Autograd, m) {
  m.impl("moe_permute", &moe_permute_autograd);
  m.impl("moe_unpermute", &moe_unpermute_autograd);
}

}  // namespace mmfuse::torch_bind
