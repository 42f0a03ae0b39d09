// The NCCL process group: one process per GPU, FP32/FP64 buffers in CUDA device memory. The
// communicator is created non-blocking (ncclConfig_t::blocking = 0); every operation waits for
// its completion by polling (cudaStreamQuery + ncclCommGetAsyncError) up to a timeout, and on
// timeout aborts the communicator (ncclCommAbort) and returns an error naming the operation: a
// dead or stuck peer gives an error, not a hang. The unique id goes from rank 0 to the others over
// the bootstrap MPI group (mpirun) or the TCP rendezvous (env launch). Before each collective the
// device is synchronised (the backend's work on any stream is done): gradient reduction after
// backward, not overlapped with it (overlap is a next step).
#pragma once

#include <memory>

#include "dist/process_group.h"

namespace nibble::dist {

struct NcclOptions {
  int cuda_device = 0;         // the GPU of this rank (the backend's)
  double timeout_s = 600;      // per collective and for communicator creation
};

// env: the launch (rank, world, rendezvous address). bootstrap: an MPI group of the same world
// (mpirun) to broadcast the unique id through, or null to use the TCP rendezvous (env launch; a
// one-rank world needs neither).
Result<std::unique_ptr<ProcessGroup>> make_nccl_group(const LaunchEnv& env, ProcessGroup* bootstrap,
                                                      const NcclOptions& options);

}  // namespace nibble::dist
