// Minimal host parallel loop for the CPU backends (no OpenMP runtime to clash with the framework's).
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace mmfuse {

// Calls f(begin, end) over [0, n) split into contiguous ranges of at least `grain` items, on up to
// hardware_concurrency threads. f must not throw (inputs are validated before the loop).
template <class F>
void parallel_for(int64_t n, int64_t grain, F&& f) {
  if (n <= 0) return;
  static const int64_t hw = std::max(1u, std::thread::hardware_concurrency());  // a syscall: ask once
  const int64_t nt = std::min<int64_t>(hw, std::max<int64_t>(1, n / std::max<int64_t>(grain, 1)));
  if (nt <= 1) {
    f(int64_t(0), n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(size_t(nt - 1));
  const int64_t per = (n + nt - 1) / nt;
  for (int64_t i = 1; i < nt; ++i) {
    const int64_t b = i * per, e = std::min(n, b + per);
    if (b < e) pool.emplace_back([&f, b, e] { f(b, e); });
  }
  f(int64_t(0), std::min(n, per));
  for (auto& t : pool) t.join();
}

}  // namespace mmfuse
