// The process group of data-parallel training (issue #17): rank, world size and the collectives
// the trainer needs (all-reduce sum of FP32/FP64 buffers, reduce-scatter, all-gather, byte
// broadcast, barrier). Implementations: the one-rank world (no communication: every collective is
// the identity), MPI across CPU processes (mpi_group.cpp, when built with MPI) and NCCL between
// GPUs (dist/nccl/). FP32/FP64 buffers live in the group's memory: host memory for the single and
// MPI groups, CUDA device memory for NCCL (device_memory()); the *_host calls take host memory
// everywhere (small control data: loss sums, flags, hashes). start_all_reduce_sum and
// start_reduce_scatter_sum are the nonblocking forms the trainer overlaps with backward.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace nibble::dist {

class LibraryCollectives;

// A collective started by ProcessGroup::start_*: its buffers must stay untouched (not read, not
// written) until wait() returned. It must not outlive its group.
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  // Lets the transport make progress without blocking (MPI moves data only inside its calls);
  // true once the result is in place.
  virtual Result<bool> test() = 0;
  // Blocks until the result is in place (NCCL: within the group's timeout, else an error).
  virtual Status wait() = 0;
};

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // "single", "mpi", "nccl": the transport, for the run log.
  virtual std::string kind() const = 0;
  // True: the FP32/FP64 buffers below are CUDA device pointers (NCCL); false: host memory.
  virtual bool device_memory() const = 0;

  // buf: (n) f32/f64 in group memory, replaced on every rank by the sum over ranks. The MPI group
  // sums in rank order (0 + 1 + ... + N-1) whatever MPI's algorithm, so every rank gets the same
  // bits and a rerun the same result; NCCL sums in its ring order (identical on all ranks).
  virtual Status all_reduce_sum(float* buf, int64_t n) = 0;
  virtual Status all_reduce_sum(double* buf, int64_t n) = 0;
  // in: (world*n_per_rank) f32; out: (n_per_rank) f32 = sum over ranks of in's slice [rank*n, (rank+1)*n).
  virtual Status reduce_scatter_sum(const float* in, float* out, int64_t n_per_rank) = 0;
  // in: (n_per_rank) f32; out: (world*n_per_rank) f32, rank r's `in` at [r*n, (r+1)*n).
  virtual Status all_gather(const float* in, float* out, int64_t n_per_rank) = 0;

  // ---- nonblocking forms (the gradient reduce overlapped with backward) -----------------------
  // The collectives above, started and returned at once: the same result, bit for bit, once
  // wait() returned. Every rank must start its collectives, blocking ones included, in the same
  // order. MPI: the same rank-order sums (MPI_Ialltoall now; for all-reduce the all-gather of the
  // summed slices runs in wait()). NCCL: the collective on the group's communication stream,
  // ordered after the work already queued on the compute stream (NcclOptions::compute_stream) by
  // a CUDA event. The default (single group) runs the blocking call and returns a finished one.
  virtual Result<std::unique_ptr<PendingCollective>> start_all_reduce_sum(float* buf, int64_t n);
  virtual Result<std::unique_ptr<PendingCollective>> start_reduce_scatter_sum(const float* in, float* out,
                                                                              int64_t n_per_rank);

  // ---- byte broadcast in group memory (the RL weight sync, rl/weight_transport.h) ------------
  // data (bytes) of `root`, in group memory (device for NCCL: GPU to GPU, no host copy), copied to
  // every rank. The default (host-memory groups): broadcast_host.
  virtual Status broadcast(void* data, int64_t bytes, int root);

  // Host memory: data (bytes) of `root` copied to every rank; buf (n) f64 summed over ranks.
  virtual Status broadcast_host(void* data, int64_t bytes, int root) = 0;
  virtual Status all_reduce_sum_host(double* buf, int64_t n) = 0;
  virtual Status barrier() = 0;

  // Ends every process of the world with `exit_code` (MPI_Abort, ncclCommAbort + exit): for an
  // error that only this rank saw, where the others would wait for it in a collective. Only the
  // command line calls it (the library never exits); the one-rank world returns.
  virtual void abort_world(int exit_code) = 0;

  // ---- the transport library called directly (`nibble bench collectives`' baseline) ----------
  // The group's library on its own communicator with nothing of nibble around the calls (see
  // LibraryCollectives). The one-rank world calls no library: unimplemented.
  virtual Result<std::unique_ptr<LibraryCollectives>> library_collectives();

  // True once agree() returned an error: every rank saw it and returns it, so the processes can
  // end normally (no abort_world needed).
  bool failed_together() const { return failed_together_; }
  void set_failed_together() { failed_together_ = true; }

 private:
  bool failed_together_ = false;
};

// The collective calls of a group's own library on its communicator (and, for NCCL, its
// communication stream), each returning once its result is in place, and nothing else: MPI_Allreduce
// (MPI's own summation order), MPI_Reduce_scatter_block, MPI_Allgather, MPI_Bcast; ncclAllReduce,
// ncclReduceScatter, ncclAllGather, ncclBroadcast, then the stream awaited by spinning on
// cudaStreamQuery (no device synchronise, no sleep; the group's timeout still bounds the wait).
// Buffers and counts as in ProcessGroup's calls of the same name, in group memory. It must not
// outlive its group. What `nibble bench collectives` times nibble's calls against.
class LibraryCollectives {
 public:
  virtual ~LibraryCollectives() = default;
  virtual std::string library() const = 0;  // "mpi" | "nccl"
  virtual Status all_reduce_sum(float* buf, int64_t n) = 0;
  virtual Status reduce_scatter_sum(const float* in, float* out, int64_t n_per_rank) = 0;
  virtual Status all_gather(const float* in, float* out, int64_t n_per_rank) = 0;
  virtual Status broadcast(void* data, int64_t bytes, int root) = 0;
};

// The one-rank world: rank 0 of 1, every collective the identity (out = in), host memory.
std::unique_ptr<ProcessGroup> make_single_group();

// ---- launch detection ------------------------------------------------------------------------
// How this process was started, read from the environment.
struct LaunchEnv {
  enum class Kind { kSingle, kMpi, kEnv };
  Kind kind = Kind::kSingle;
  int rank = 0, world_size = 1, local_rank = 0;
  std::string master_addr;  // kEnv: the rendezvous host (rank 0's) and port
  int master_port = 0;
  std::string describe() const;  // "mpirun world of 2", "env world of 4 (MASTER_ADDR=...)", "single process"
};
// mpirun/srun with PMI: OMPI_COMM_WORLD_SIZE/RANK/LOCAL_RANK (OpenMPI), else PMI_SIZE/PMI_RANK
// (MPICH, Slurm). Else RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT (torchrun style; all of
// RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT needed when WORLD_SIZE > 1; WORLD_SIZE=1 RANK=0 is a
// one-rank env world, which runs the collectives' code paths). Else the single world.
// Bad values (non-numbers, rank outside the world, a missing MASTER_*) are invalid_argument naming
// the variable.
Result<LaunchEnv> detect_launch();

// True when this nibble was built with MPI (find_package(MPI)).
bool mpi_available();
// The MPI world (MPI_Init_thread on first use, MPI_Finalize when the last group is destroyed).
// Built without MPI: unimplemented_status naming the packages to install.
Result<std::unique_ptr<ProcessGroup>> make_mpi_group();

// Rank 0's `bytes` sent to every rank of an env-launched world over TCP (rank 0 listens on
// MASTER_PORT, the others connect to MASTER_ADDR:MASTER_PORT), used to hand out the NCCL unique
// id where there is no MPI. Every rank sends its rank and world size; rank 0 refuses a world-size
// mismatch or a duplicate rank (each rank then gets that error). Nothing within timeout_s: a
// timeout error naming the ranks not heard from / the address not reached.
Status tcp_broadcast_from_rank0(const LaunchEnv& env, void* bytes, int64_t n, double timeout_s);

// ---- helpers over any group ------------------------------------------------------------------
// A Status every rank agrees on: ok only where `local` is ok on every rank; else each rank gets
// the failing rank's error (the lowest failing rank's message, prefixed "rank R: " on the others).
Status agree(ProcessGroup& group, const Status& local);

// What every rank must agree on at the start (FNV-1a 64 hashes of each item's canonical text).
// Rank 0's hashes are broadcast; a rank whose hash differs fails with one line naming the first
// differing item, e.g. "ranks disagree on the run config: rank 1's differs from rank 0's". The
// world size is always checked first. Collective (agree()): every rank returns the same error.
struct AgreementItem {
  std::string what;  // "run config", "data", "checkpoint step"
  std::string text;  // canonical text (the hash is taken here)
};
Status check_ranks_agree(ProcessGroup& group, const std::vector<AgreementItem>& items);

uint64_t fnv1a64(const std::string& text);

}  // namespace nibble::dist
