// Host staging memory of the CPU/GPU bridge.
//
// Eager calls: one block per stream, reused by every call on that stream (the
// calls are ordered by the stream, so the next call's copies start after the
// previous call's copy back has read the block). It grows by doubling; the old
// block is freed after the stream's queued work, never under the caller.
//
// Graph capture: every captured call gets its own block, allocated during
// capture (the transport relaxes the capture mode for it) and kept, together
// with the call's state, for as long as the graph may replay: until
// release_captured(), since a CUDA graph tells no one when it dies. Replays
// therefore see stable addresses, and two graphs never share staging.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "hybrid/transport.h"

namespace kt::hybrid {

struct StagingStats {
  int64_t eager_blocks = 0;
  int64_t eager_bytes = 0;
  int64_t captured_blocks = 0;
  int64_t captured_bytes = 0;
};

class StagingPool {
 public:
  static StagingPool& global();

  // Host memory of at least `bytes` for one call on t's stream (under capture,
  // the call's own block).
  void* acquire(Transport& t, size_t bytes);
  // Keeps a captured call's state (read by its host function at every replay)
  // until release_captured().
  void keep_captured_state(std::shared_ptr<void> state);

  // Frees the blocks and states of captured calls. Only after every graph
  // that captured a kt:: call has been destroyed (or will never replay).
  void release_captured();

  StagingStats stats() const;

 private:
  struct Block {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  struct Captured {
    Block block;
    Transport::HostDeleter free = nullptr;
  };
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Block> eager_;  // by stream
  std::vector<Captured> captured_;
  std::vector<std::shared_ptr<void>> captured_states_;
};

}  // namespace kt::hybrid
