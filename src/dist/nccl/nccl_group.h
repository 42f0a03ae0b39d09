// The NCCL process group: one process per GPU, FP32/FP64 buffers in CUDA device memory. The
// communicator is created non-blocking (ncclConfig_t::blocking = 0); every operation waits for
// its completion by polling (cudaStreamQuery + ncclCommGetAsyncError) up to a timeout, and on
// timeout aborts the communicator (ncclCommAbort) and returns an error naming the operation: a
// dead or stuck peer gives an error, not a hang. The unique id goes from rank 0 to the others over
// the bootstrap MPI group (mpirun) or the TCP rendezvous (env launch). Before each blocking
// collective the device is synchronised (the backend's work on any stream is done). The
// nonblocking start_* forms (the gradient reduce overlapped with backward) instead record a CUDA
// event on the compute stream and make the communication stream wait for it, so the collective
// runs after the kernels that produced its input and alongside the ones queued later.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "dist/collectives_bench.h"
#include "dist/process_group.h"

namespace nibble::dist {

struct NcclOptions {
  int cuda_device = 0;         // the GPU of this rank (the backend's)
  double timeout_s = 600;      // per collective and for communicator creation
  // The stream the backend queues its work on (CudaBackend::stream()): start_* order their
  // collective after the work queued there so far. Null: they synchronise the device first.
  cudaStream_t compute_stream = nullptr;
};

// env: the launch (rank, world, rendezvous address). bootstrap: an MPI group of the same world
// (mpirun) to broadcast the unique id through, or null to use the TCP rendezvous (env launch; a
// one-rank world needs neither).
Result<std::unique_ptr<ProcessGroup>> make_nccl_group(const LaunchEnv& env, ProcessGroup* bootstrap,
                                                      const NcclOptions& options);

// CUDA device memory of the current device (cudaMalloc / cudaMemcpy): the NCCL group's memory for
// `nibble bench collectives` (dist/collectives_bench.h).
std::unique_ptr<GroupMemory> make_cuda_group_memory();

}  // namespace nibble::dist
