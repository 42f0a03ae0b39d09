// `nibble bench collectives` (issue #17 item 4): the bandwidth of the collectives data-parallel
// training uses, through nibble's ProcessGroup calls and, in the same run on the same buffers,
// through the group's library called directly (LibraryCollectives: MPI_Allreduce..., ncclAllReduce...).
// Per (op, size, path): one call checked against the expected sums/copies, warm-up calls, then
// timed calls, each started after a barrier; a call's time is the slowest rank's, the row's the
// median. algbw = bytes / time, busbw = algbw x nccl-tests' factor (all-reduce 2(n-1)/n,
// reduce-scatter and all-gather (n-1)/n, broadcast 1; bytes as nccl-tests count them: the whole
// buffer, the gathered output, the scattered input). A one-rank world moves nothing over a link:
// its bus factor is 0 and only algbw is reported.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "dist/process_group.h"

namespace nibble::dist {

// Memory of a group's kind (host for the single and MPI groups, CUDA device memory for NCCL).
class GroupMemory {
 public:
  virtual ~GroupMemory() = default;
  virtual Result<void*> allocate(int64_t bytes) = 0;  // errors: out of memory
  virtual void release(void* p) = 0;
  virtual Status upload(void* dst, const void* host, int64_t bytes) = 0;
  virtual Status download(void* host, const void* src, int64_t bytes) = 0;
};
std::unique_ptr<GroupMemory> make_host_memory();

enum class CollectiveOp { kAllReduce, kReduceScatter, kAllGather, kBroadcast };
const char* collective_op_name(CollectiveOp op);  // "all_reduce", "reduce_scatter", "all_gather", "broadcast"
// "all_reduce" etc. (also "allreduce", "reducescatter", "allgather", "bcast"); else invalid_argument.
Result<CollectiveOp> parse_collective_op(const std::string& name);
// nccl-tests' bus bandwidth factor for `op` over `world` ranks (0 for every op but broadcast at
// world 1; broadcast's factor is 1 but a one-rank world has no bus: 0 there too).
double bus_factor(CollectiveOp op, int world);

struct CollectivesBenchOptions {
  std::vector<CollectiveOp> ops = {CollectiveOp::kAllReduce, CollectiveOp::kReduceScatter, CollectiveOp::kAllGather,
                                   CollectiveOp::kBroadcast};
  int64_t min_bytes = 1024, max_bytes = int64_t{256} << 20;  // sizes min, min*factor, ... <= max
  int64_t factor = 2;
  int warmup = 5, iters = 20;
};

struct CollectiveRow {
  std::string op, path;  // path: "nibble" (ProcessGroup) or the library ("mpi", "nccl")
  int world = 1;
  int64_t bytes = 0;     // as nccl-tests counts them (see above); a multiple of 4*world for RS/AG
  int64_t count = 0;     // f32 elements per call argument (per rank for RS/AG), bytes for broadcast
  double seconds = 0;    // median over iters of the slowest rank's time
  double algbw_gbps = 0, busbw_gbps = 0, bus_factor = 0;  // busbw 0 where bus_factor is 0
  bool verified = false;                                 // the checked call gave the expected values
  double ratio_to_library = -1;  // nibble rows: nibble algbw / the library's (-1: no library row)
};

// The sizes the options ask for (bytes, before the per-op rounding). Errors: bad bounds/factor.
Result<std::vector<int64_t>> bench_sizes(const CollectivesBenchOptions& options);

// The median of v (the mean of the middle two for an even count; 0 for none).
double median(std::vector<double> v);
// Collective: `mine` holds this rank's `count` timings of the same calls; returns, on every rank,
// the median over the calls of the slowest rank's time (all_reduce_sum_host of a (world, count)
// table in which each rank fills its own row). A rank with another count: invalid_argument.
Result<double> slowest_rank_median(ProcessGroup& group, const std::vector<double>& mine, int64_t count);

// Runs the bench on every rank of `group` (a collective: every rank calls it with the same
// options); `library` may be null (the one-rank world: nibble rows only). Buffers come from
// `memory` (the group's kind). Rows in (op, size, nibble then library) order, the same on every
// rank. Errors: a call's error, or a result other than expected (every rank returns it, agree()).
Result<std::vector<CollectiveRow>> bench_collectives(ProcessGroup& group, LibraryCollectives* library,
                                                     GroupMemory& memory, const CollectivesBenchOptions& options);

}  // namespace nibble::dist
