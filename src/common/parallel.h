// Minimal host parallel loop for the CPU backends (no OpenMP runtime to clash with the framework's).
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

namespace mmfuse {

// Calls f(begin, end) over [0, n) split into contiguous ranges of at least `grain` items, on up to
// hardware_concurrency threads. An exception from f (a bad entry found inside the loop) is rethrown
// after every range has finished: that of the lowest range, so the first bad entry is the one named.
template <class F>
void parallel_for(int64_t n, int64_t grain, F&& f) {
  if (n <= 0) return;
  static const int64_t hw = std::max(1u, std::thread::hardware_concurrency());  // a syscall: ask once
  const int64_t nt = std::min<int64_t>(hw, std::max<int64_t>(1, n / std::max<int64_t>(grain, 1)));
  if (nt <= 1) {
    f(int64_t(0), n);
    return;
  }
  const int64_t per = (n + nt - 1) / nt;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(nt));
  auto range = [&f, &errors, per, n](int64_t i) {
    try {
      f(i * per, std::min(n, (i + 1) * per));
    } catch (...) {
      errors[size_t(i)] = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(size_t(nt - 1));
  for (int64_t i = 1; i < nt && i * per < n; ++i) pool.emplace_back(range, i);
  range(0);
  for (auto& t : pool) t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace mmfuse
