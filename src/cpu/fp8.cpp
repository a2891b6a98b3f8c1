// CPU backend of the fp8 building blocks: the CUDA numerics emulated (for tests and CPU-only use).
// Quantize: the same scale and the same round-to-nearest-even saturating conversion as the kernels
// (bitwise equal), per tensor and per row. GEMM: fp8 values decoded exactly, fp32 accumulation in k
// order, then the scales (scalars, or one per row of a and of b).
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/dispatch.h"
#include "common/parallel.h"
#include "backends/fp8.h"
#include "backends/swiglu.h"
#include "mmfuse/fp8.h"

namespace mmfuse {
namespace detail {

void fp8_quantize_cpu(const Fp8QuantJob& j) {
  const int64_t r = j.src.shape[0], sc = j.src.shape[1];
  const int64_t c = j.swiglu ? sc / 2 : j.swiglu_grad ? 2 * sc : sc;  // the quantized tensor's columns
  const DType fmt = j.q.defined() ? j.q.dtype : j.qt.dtype;
  const bool e4m3 = fmt == DType::kFloat8E4M3;
  dispatch_floating(j.src.dtype, "fp8_quantize: x", [&](auto tag) {
    using S = typename decltype(tag)::type;
    const S* x = static_cast<const S*>(j.src.data);
    const uint8_t* pq = j.swiglu_grad ? j.pack_q.ptr<uint8_t>() : nullptr;
    const float* ps = j.swiglu_grad ? j.pack_scale_inv.ptr<float>() : nullptr;
    auto at = [&](int64_t i, int64_t k) {
      const S* row = x + i * j.src.stride[0];
      if (j.swiglu_grad) {  // column k of the [gate | up] gradient: swiglu_backward_fp8's value
        using C = typename compute_type<S>::type;
        const int64_t kk = k < sc ? k : k - sc;
        const uint8_t* qr = pq + i * j.pack_q.stride[0];
        const float* sr = ps + i * j.pack_scale_inv.stride[0];
        C dg, du, y;
        swiglu_grad_value_cpu<C>(swiglu_unpack_cpu(qr[kk], sr[kk / kSwigluPackTile]),
                                 swiglu_unpack_cpu(qr[sc + kk], sr[(sc + kk) / kSwigluPackTile]), load_val(row[kk]),
                                 dg, du, y);
        return float(load_val(store_val<S>(k < sc ? dg : du)));
      }
      return float(load_val(j.swiglu ? swiglu_value_cpu<S>(row[k], row[c + k]) : row[k]));
    };
    const float fmax = fp8_max(fmt);
    auto scale_of = [&](float amax) { return fmax / std::fmax(amax, kFp8AmaxEps); };
    // the scale of each row of q and of each row of qt (all the same per tensor)
    std::vector<float> qs(size_t(fp8_padded(r))), qts(size_t(fp8_padded(c)));
    if (j.per_row) {
      std::vector<float> ra(qs.size(), 0.0f), ca(qts.size(), 0.0f);  // row and column maxima
      for (int64_t i = 0; i < r; ++i)
        for (int64_t k = 0; k < c; ++k) {
          const float v = fp8_finite_abs(at(i, k));
          ra[size_t(i)] = std::fmax(ra[size_t(i)], v);
          ca[size_t(k)] = std::fmax(ca[size_t(k)], v);
        }
      for (size_t i = 0; i < qs.size(); ++i) qs[i] = scale_of(ra[i]);
      for (size_t k = 0; k < qts.size(); ++k) qts[k] = scale_of(ca[k]);
      for (size_t i = 0; i < qs.size(); ++i) j.scale_inv.ptr<float>()[i] = 1.0f / qs[i];
      if (j.qt.defined())
        for (size_t k = 0; k < qts.size(); ++k) j.scale_inv_t.ptr<float>()[k] = 1.0f / qts[k];
    } else {
      float amax = 0.0f;
      for (int64_t i = 0; i < r; ++i)
        for (int64_t k = 0; k < c; ++k) amax = std::fmax(amax, fp8_finite_abs(at(i, k)));
      float* hist = j.state.ptr<float>();
      const int64_t h = j.state.shape[0] - 2;
      auto record = [&] {  // newest first
        for (int64_t i = h - 1; i > 0; --i) hist[i] = hist[i - 1];
        hist[0] = amax;
      };
      float past = 0.0f;
      for (int64_t i = 0; i < h; ++i) past = std::fmax(past, hist[i]);
      if (j.dynamic || past == 0.0f) {  // the amax pass (delayed: only for a fresh history)
        record();
        past = amax;
      }
      const float use = j.dynamic ? amax : past;
      if (!j.dynamic) record();  // the delayed cast records its amax too
      const float scale = scale_of(use);
      *j.scale_inv.ptr<float>() = 1.0f / scale;
      std::fill(qs.begin(), qs.end(), scale);
      std::fill(qts.begin(), qts.end(), scale);
    }
    if (j.col_sums.defined()) {  // fp32, row order
      float* cs = j.col_sums.ptr<float>();
      for (int64_t k = 0; k < c; ++k) cs[k] = 0.0f;
      for (int64_t i = 0; i < r; ++i)
        for (int64_t k = 0; k < c; ++k) cs[k] += at(i, k);
    }
    // one copy: row u, column v of dst is x[u, v] (or x[v, u] transposed), scaled by its row's scale
    auto fill = [&](const TensorView& dst, const std::vector<float>& scales, bool transposed) {
      if (!dst.defined()) return;
      uint8_t* out = dst.ptr<uint8_t>();
      const int64_t cols = dst.shape[1];
      parallel_for(dst.shape[0], 64, [&](int64_t u0, int64_t u1) {
        for (int64_t u = u0; u < u1; ++u)
          for (int64_t v = 0; v < cols; ++v) {
            const int64_t i = transposed ? v : u, k = transposed ? u : v;
            out[u * cols + v] = i < r && k < c ? float_to_fp8(fp8_scaled(at(i, k), scales[size_t(u)]), e4m3) : uint8_t(0);
          }
      });
    };
    fill(j.q, qs, false);
    fill(j.qt, qts, true);
  });
}

void fp8_transpose_cpu(const TensorView& q, TensorView& qt) {
  const int64_t r = q.shape[0], c = q.shape[1];
  const uint8_t* in = q.ptr<uint8_t>();
  uint8_t* out = qt.ptr<uint8_t>();
  parallel_for(c, 64, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k)
      for (int64_t i = 0; i < r; ++i) out[k * r + i] = in[i * c + k];
  });
}

void fp8_gemm_cpu(const TensorView& a, const TensorView& b, const TensorView& scale_a, const TensorView& scale_b,
                  const TensorView& bias, TensorView& out, const Fp8GemmOptions& o) {
  const int64_t m = a.shape[0], n = b.shape[0], k = a.shape[1];
  const bool a43 = a.dtype == DType::kFloat8E4M3, b43 = b.dtype == DType::kFloat8E4M3;
  // decode once: b as fp32 rows (k contiguous)
  std::vector<float> bf(size_t(n * k));
  const uint8_t* B = b.ptr<uint8_t>();
  for (int64_t i = 0; i < n * k; ++i) bf[size_t(i)] = fp8_to_float(B[i], b43);
  const uint8_t* A = a.ptr<uint8_t>();
  const bool vec = scale_a.numel() != 1;  // per row: out[i, j] = acc * sa[i] * sb[j]
  const float* sa = scale_a.ptr<float>();
  const float* sb = scale_b.ptr<float>();
  parallel_for(m, 16, [&](int64_t i0, int64_t i1) {
    std::vector<float> row(static_cast<size_t>(k));
    for (int64_t i = i0; i < i1; ++i) {
      for (int64_t kk = 0; kk < k; ++kk) row[size_t(kk)] = fp8_to_float(A[i * k + kk], a43);
      for (int64_t jj = 0; jj < n; ++jj) {
        const float* w = bf.data() + jj * k;
        float acc = 0.0f;
        for (int64_t kk = 0; kk < k; ++kk) acc += row[size_t(kk)] * w[kk];
        float v = acc * (vec ? sa[i] * sb[jj] : sa[0] * sb[0]);
        const int64_t off = i * out.stride[0] + jj;
        if (out.dtype == DType::kFloat32) {
          float* y = out.ptr<float>();
          y[off] = o.accumulate ? y[off] + v : v;
        } else {
          if (bias.defined()) v += to_float(bias.ptr<bf16>()[jj]);
          out.ptr<bf16>()[off] = to_bf16(v);
        }
      }
    }
  });
}

}  // namespace detail
}  // namespace mmfuse
