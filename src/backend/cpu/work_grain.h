// Chunk sizes for parallel_for in the CPU ops: a chunk should carry at least ~16K element
// operations, so that small calls (tests, decode steps, tiny layers) run on the calling thread
// instead of paying an OpenMP fork/join (which costs milliseconds on a busy machine).
#pragma once

#include <cstdint>

namespace nibble::cpu {

constexpr int64_t kMinChunkWork = int64_t{1} << 14;

// Items per chunk when each item costs about `per_item` element operations.
inline int64_t grain_for(int64_t per_item) {
  return per_item >= kMinChunkWork ? 1 : (kMinChunkWork + per_item - 1) / (per_item > 0 ? per_item : 1);
}

}  // namespace nibble::cpu
