// The process group a command runs in, from how it was launched (dist::detect_launch): the
// one-rank world for a plain start; under mpirun, MPI across processes on the CPU backend, or
// NCCL (unique id through MPI) on CUDA; from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, NCCL with
// the TCP rendezvous (CUDA only: CPU processes reduce with MPI). `--device` of a multi-rank CUDA
// world without an index becomes cuda:LOCAL_RANK.
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"
#include "core/status.h"
#include "dist/process_group.h"

namespace nibble::tools {

struct ProcessGroupSetup {
  dist::LaunchEnv launch;
  std::unique_ptr<dist::ProcessGroup> bootstrap;  // MPI under NCCL (kept alive; destroyed last)
  std::unique_ptr<dist::ProcessGroup> group;      // what the trainer uses
  ~ProcessGroupSetup() {
    group.reset();  // NCCL before the MPI it was bootstrapped from
    bootstrap.reset();
  }
};

// The launch, read before the device is opened (to pick cuda:LOCAL_RANK).
Result<dist::LaunchEnv> read_launch();
// `requested` --device adjusted for a multi-rank launch (empty or "cuda" -> "cuda:LOCAL_RANK"
// when this build and machine have GPUs); else unchanged.
std::string device_for_launch(const std::string& requested, const dist::LaunchEnv& launch);
// The group for a model on `be`.
Result<std::unique_ptr<ProcessGroupSetup>> open_process_group(const dist::LaunchEnv& launch, backend::Backend& be);

}  // namespace nibble::tools
