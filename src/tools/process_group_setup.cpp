// Picks and opens the process group of a launch; see process_group_setup.h.
#include "tools/process_group_setup.h"

#include "tools/device_option.h"

#ifdef NIBBLE_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#include "dist/nccl/nccl_group.h"
#endif

namespace nibble::tools {

Result<dist::LaunchEnv> read_launch() { return dist::detect_launch(); }

std::string device_for_launch(const std::string& requested, const dist::LaunchEnv& launch) {
  if (launch.kind == dist::LaunchEnv::Kind::kSingle) return requested;
  const bool has_gpu = available_devices().size() > 1;  // "cpu" then "cuda:0".. (see device_option.h)
  if (requested == "cuda" || (requested.empty() && has_gpu)) return "cuda:" + std::to_string(launch.local_rank);
  return requested;
}

Result<std::unique_ptr<ProcessGroupSetup>> open_process_group(const dist::LaunchEnv& launch, backend::Backend& be) {
  auto s = std::make_unique<ProcessGroupSetup>();
  s->launch = launch;
  using Kind = dist::LaunchEnv::Kind;
  if (launch.kind == Kind::kSingle) {
    s->group = dist::make_single_group();
    return s;
  }
  if (be.device() == Device::kCPU) {
    if (launch.kind == Kind::kEnv) {
      if (launch.world_size == 1) {
        s->group = dist::make_single_group();
        return s;
      }
      return invalid_argument("an env-launched world (WORLD_SIZE={}) reduces over NCCL, which needs --device cuda; "
                              "CPU processes are launched with mpirun", launch.world_size);
    }
    NIB_ASSIGN_OR_RETURN(s->group, dist::make_mpi_group());
    if (s->group->world_size() != launch.world_size || s->group->rank() != launch.rank)
      return invalid_argument("MPI says rank {} of {}, the environment rank {} of {}", s->group->rank(),
                              s->group->world_size(), launch.rank, launch.world_size);
    return s;
  }
#ifdef NIBBLE_HAVE_CUDA
  auto* cuda_be = dynamic_cast<cuda::CudaBackend*>(&be);
  if (cuda_be == nullptr) return invalid_argument("data parallelism on {}: no process group for this backend", be.name());
  if (launch.kind == Kind::kMpi) {
    NIB_ASSIGN_OR_RETURN(s->bootstrap, dist::make_mpi_group());
  }
  dist::NcclOptions no;
  no.cuda_device = cuda_be->device_index();
  no.compute_stream = cuda_be->stream();  // the overlapped gradient reduce orders after its work
  NIB_ASSIGN_OR_RETURN(s->group, dist::make_nccl_group(launch, s->bootstrap.get(), no));
  return s;
#else
  return invalid_argument("data parallelism on {}: no process group for this backend", be.name());
#endif
}

}  // namespace nibble::tools
