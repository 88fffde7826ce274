#include "hybrid/staging_pool.h"

#include <c10/util/Exception.h>

namespace kt::hybrid {

namespace {

// Growth by doubling from 64 KiB: a decode loop settles on one block at once,
// a prefill of growing length reallocates O(log T) times.
size_t rounded_capacity(size_t bytes, size_t current) {
  size_t cap = current > 0 ? current : size_t{64} << 10;
  while (cap < bytes) cap *= 2;
  return cap;
}

}  // namespace

StagingPool& StagingPool::global() {
  static StagingPool* pool =
      new StagingPool();  // never destroyed: host functions may still run at exit
  return *pool;
}

void* StagingPool::acquire(Transport& t, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (t.capturing()) {
    Block b{t.alloc_host(bytes > 0 ? bytes : 64), bytes};
    captured_.push_back({b, t.host_deleter()});
    return b.ptr;
  }
  Block& b = eager_[t.stream_key()];
  if (b.bytes < bytes) {
    if (b.ptr != nullptr) t.free_host_after_stream(b.ptr);
    const size_t cap = rounded_capacity(bytes, b.bytes);
    b.ptr = nullptr;
    b.bytes = 0;
    b.ptr = t.alloc_host(cap);
    b.bytes = cap;
  }
  if (b.ptr == nullptr) {  // first call with bytes == 0 (T = 0): still a valid address
    b.ptr = t.alloc_host(64);
    b.bytes = 64;
  }
  return b.ptr;
}

void StagingPool::release_captured() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Captured& c : captured_) c.free(c.block.ptr);
  captured_.clear();
  captured_states_.clear();
}

void StagingPool::keep_captured_state(std::shared_ptr<void> state) {
  std::lock_guard<std::mutex> lock(mu_);
  captured_states_.push_back(std::move(state));
}

StagingStats StagingPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  StagingStats s;
  for (const auto& kv : eager_) {
    s.eager_blocks += 1;
    s.eager_bytes += static_cast<int64_t>(kv.second.bytes);
  }
  for (const Captured& c : captured_) {
    s.captured_blocks += 1;
    s.captured_bytes += static_cast<int64_t>(c.block.bytes);
  }
  return s;
}

}  // namespace kt::hybrid
