// parallel.h - minimal fork-join for the CPU backend: the host application's executor
// (sz_set_executor), else a std::thread per worker and call.
// Chosen over OpenMP: no spinning worker pool that competes with the host application's own
// threads (Caffe, OpenBLAS) between calls, and no runtime-specific environment tuning.
// run(T, f) calls f(0..T-1), f(0) on the calling thread, and returns when all are done.
#pragma once
#include <thread>
#include <type_traits>
#include <vector>
#include "sz/sz.h"

namespace szi {

unsigned hardware_threads();

struct Executor {
  sz_executor run;
  void* ctx;
};
Executor executor();  // host.cpp

template <class F>
void call_task(void* f, int t) { (*static_cast<F*>(f))(t); }

template <class F>
void parallel_run(int T, F&& f) {
  if (T <= 1) { f(0); return; }
  const Executor ex = executor();
  if (ex.run) {
    typedef typename std::remove_reference<F>::type Fn;
    ex.run(ex.ctx, T, &call_task<Fn>, (void*)&f);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve((size_t)T - 1);
  for (int t = 1; t < T; ++t) pool.emplace_back([&f, t] { f(t); });
  f(0);
  for (auto& th : pool) th.join();
}

// contiguous share [lo, hi) of n items for worker t of T
inline void share(uint64_t n, int t, int T, uint64_t* lo, uint64_t* hi) {
  *lo = n * (uint64_t)t / (uint64_t)T;
  *hi = n * (uint64_t)(t + 1) / (uint64_t)T;
}

}  // namespace szi
