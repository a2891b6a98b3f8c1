// Optional Python module face of _C.so (built when the Python headers are found): direct entry
// points into the dispatcher for eager calls, skipping torch.ops' schema-driven argument parsing.
// They call the same registered ops (autograd, dispatch modes and all), so results are identical;
// python/mmfuse/rope.py uses them only outside torch.compile and for plain tensors.
#ifdef MMFUSE_WITH_PYTHON
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace mmfuse::torch_bind {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using MropeSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
                                            const OptTensor&, const OptTensor&, at::IntArrayRef, bool,
                                            c10::string_view, bool);

std::tuple<Tensor, Tensor> mrope_entry(const Tensor& q, const Tensor& k, const OptTensor& cos, const OptTensor& sin,
                                       const OptTensor& pos, const OptTensor& inv_freq,
                                       const std::vector<int64_t>& section, bool interleaved,
                                       const std::string& numerics, bool heads_first) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mmfuse::mrope", "").typed<MropeSig>();
  // torch.ops raises c10::ValueError / TypeError as ValueError / TypeError; so does this entry point,
  // also where torch's own pybind11 translators do not reach this module (torch 2.6).
  try {
    return op.call(q, k, cos, sin, pos, inv_freq, section, interleaved, numerics, heads_first);
  } catch (const c10::ValueError& e) {
    throw pybind11::value_error(e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    throw pybind11::type_error(e.what_without_backtrace());
  }
}

}  // namespace
}  // namespace mmfuse::torch_bind

PYBIND11_MODULE(_C, m) {
  m.doc() = "mmfuse extension: registers torch.ops.mmfuse; direct eager entry points";
  m.def("mrope", &mmfuse::torch_bind::mrope_entry);
}
#endif
