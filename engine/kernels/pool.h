// Work split over XLA's intra-op thread pool, for the kernels of this folder.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace tensorbus {

struct PoolShared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Items [0, count) run by `fn`, on the pool's threads and the calling one: the
// caller takes items too, so a call never waits on a pool that is busy elsewhere.
template <typename F>
void parallel(xla::ffi::ThreadPool& pool, int64_t count, const F& fn) {
  auto state = std::make_shared<PoolShared>();
  int64_t helpers = std::min<int64_t>(pool.num_threads(), count - 1);
  for (int64_t h = 0; h < helpers; ++h) {
    // A late helper finds no item left and touches nothing but `state`.
    pool.Schedule([state, count, fnp = &fn]() {
      for (int64_t i; (i = state->next.fetch_add(1)) < count;) {
        (*fnp)(i);
        state->done.fetch_add(1, std::memory_order_release);
      }
    });
  }
  for (int64_t i; (i = state->next.fetch_add(1)) < count;) {
    fn(i);
    state->done.fetch_add(1, std::memory_order_release);
  }
  while (state->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

}  // namespace tensorbus
