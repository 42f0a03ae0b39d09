// The one-rank world, launch detection from the environment and the agreement helpers over any
// process group; see process_group.h. MPI lives in mpi_group.cpp, the TCP rendezvous in
// tcp_rendezvous.cpp, NCCL in dist/nccl/.
#include "dist/process_group.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <fmt/format.h>

namespace nibble::dist {

namespace {

class SingleGroup final : public ProcessGroup {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string kind() const override { return "single"; }
  bool device_memory() const override { return false; }
  Status all_reduce_sum(float*, int64_t n) override { return check_n(n); }
  Status all_reduce_sum(double*, int64_t n) override { return check_n(n); }
  Status reduce_scatter_sum(const float* in, float* out, int64_t n) override { return copy(in, out, n); }
  Status all_gather(const float* in, float* out, int64_t n) override { return copy(in, out, n); }
  Status broadcast_host(void*, int64_t bytes, int root) override {
    if (root != 0) return invalid_argument("broadcast: root {} outside the world of 1", root);
    return check_n(bytes);
  }
  Status all_reduce_sum_host(double*, int64_t n) override { return check_n(n); }
  Status barrier() override { return Status::ok(); }
  void abort_world(int) override {}

 private:
  static Status check_n(int64_t n) {
    return n < 0 ? invalid_argument("collective: negative count {}", n) : Status::ok();
  }
  static Status copy(const float* in, float* out, int64_t n) {
    NIB_RETURN_IF_ERROR(check_n(n));
    if (n > 0 && in != out) std::memmove(out, in, static_cast<size_t>(n) * sizeof(float));
    return Status::ok();
  }
};

// A collective that finished when it was started (the blocking call ran).
class FinishedCollective final : public PendingCollective {
 public:
  Result<bool> test() override { return true; }
  Status wait() override { return Status::ok(); }
};

// The integer value of environment variable `name`; absent: nullopt-like (found = false).
Status env_int(const char* name, bool* found, int* value) {
  const char* v = std::getenv(name);
  *found = v != nullptr && *v != '\0';
  if (!*found) return Status::ok();
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  if (errno != 0 || *end != '\0' || x < 0 || x > 1'000'000)
    return invalid_argument("environment variable {}='{}' is not a count >= 0", name, v);
  *value = static_cast<int>(x);
  return Status::ok();
}

}  // namespace

Result<std::unique_ptr<PendingCollective>> ProcessGroup::start_all_reduce_sum(float* buf, int64_t n) {
  NIB_RETURN_IF_ERROR(all_reduce_sum(buf, n));
  return std::unique_ptr<PendingCollective>(std::make_unique<FinishedCollective>());
}

Result<std::unique_ptr<PendingCollective>> ProcessGroup::start_reduce_scatter_sum(const float* in, float* out,
                                                                                int64_t n_per_rank) {
  NIB_RETURN_IF_ERROR(reduce_scatter_sum(in, out, n_per_rank));
  return std::unique_ptr<PendingCollective>(std::make_unique<FinishedCollective>());
}

Status ProcessGroup::broadcast(void* data, int64_t bytes, int root) {
  if (device_memory())
    return unimplemented("the {} group has no device-memory broadcast", kind());
  return broadcast_host(data, bytes, root);
}

Result<std::unique_ptr<LibraryCollectives>> ProcessGroup::library_collectives() {
  return unimplemented("the {} group calls no collective library", kind());
}

std::unique_ptr<ProcessGroup> make_single_group() { return std::make_unique<SingleGroup>(); }

std::string LaunchEnv::describe() const {
  switch (kind) {
    case Kind::kMpi: return fmt::format("mpirun world of {}", world_size);
    case Kind::kEnv: return fmt::format("env world of {} (MASTER_ADDR={}:{})", world_size, master_addr, master_port);
    case Kind::kSingle: break;
  }
  return "single process";
}

Result<LaunchEnv> detect_launch() {
  LaunchEnv e;
  bool has_size = false, has_rank = false, has_local = false;
  // mpirun (OpenMPI), then PMI (MPICH's mpiexec, Slurm's srun --mpi=pmi2).
  for (const auto& [size_var, rank_var, local_var] :
       {std::tuple{"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"},
        std::tuple{"PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID"}}) {
    NIB_RETURN_IF_ERROR(env_int(size_var, &has_size, &e.world_size));
    if (!has_size) continue;
    NIB_RETURN_IF_ERROR(env_int(rank_var, &has_rank, &e.rank));
    NIB_RETURN_IF_ERROR(env_int(local_var, &has_local, &e.local_rank));
    if (!has_rank) return invalid_argument("{} is set but {} is not", size_var, rank_var);
    if (e.world_size < 1 || e.rank >= e.world_size)
      return invalid_argument("{}={} outside the world of {}={}", rank_var, e.rank, size_var, e.world_size);
    if (!has_local) e.local_rank = e.rank;
    e.kind = LaunchEnv::Kind::kMpi;
    return e;
  }
  NIB_RETURN_IF_ERROR(env_int("WORLD_SIZE", &has_size, &e.world_size));
  if (!has_size) {  // no launcher
    e = LaunchEnv{};
    return e;
  }
  if (e.world_size < 1) return invalid_argument("WORLD_SIZE=0: a world has at least one rank");
  NIB_RETURN_IF_ERROR(env_int("RANK", &has_rank, &e.rank));
  if (!has_rank) return invalid_argument("WORLD_SIZE={} is set but RANK is not", e.world_size);
  if (e.rank >= e.world_size) return invalid_argument("RANK={} outside the world of WORLD_SIZE={}", e.rank, e.world_size);
  NIB_RETURN_IF_ERROR(env_int("LOCAL_RANK", &has_local, &e.local_rank));
  if (!has_local) e.local_rank = e.rank;
  e.kind = LaunchEnv::Kind::kEnv;
  if (e.world_size == 1) return e;  // a one-rank world has no rendezvous
  const char* addr = std::getenv("MASTER_ADDR");
  if (addr == nullptr || *addr == '\0') return invalid_argument("WORLD_SIZE={} is set but MASTER_ADDR is not", e.world_size);
  e.master_addr = addr;
  bool has_port = false;
  NIB_RETURN_IF_ERROR(env_int("MASTER_PORT", &has_port, &e.master_port));
  if (!has_port || e.master_port < 1 || e.master_port > 65535)
    return invalid_argument("WORLD_SIZE={} is set but MASTER_PORT is not a port (1..65535)", e.world_size);
  return e;
}

uint64_t fnv1a64(const std::string& text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

Status agree(ProcessGroup& group, const Status& local) {
  const int n = group.world_size();
  if (n == 1) return local;
  // failed: (world) f64, slot r = 1 where rank r failed (a sum of disjoint slots: exact).
  std::vector<double> failed(static_cast<size_t>(n), 0.0);
  failed[static_cast<size_t>(group.rank())] = local.is_ok() ? 0.0 : 1.0;
  NIB_RETURN_IF_ERROR(group.all_reduce_sum_host(failed.data(), n));
  int first = -1;
  for (int r = 0; r < n && first < 0; ++r)
    if (failed[static_cast<size_t>(r)] != 0) first = r;
  if (first < 0) return Status::ok();
  group.set_failed_together();
  // The lowest failing rank's code and message reach everyone: length first, then the bytes.
  std::string msg = group.rank() == first ? local.message() : std::string();
  double head[2] = {group.rank() == first ? static_cast<double>(msg.size()) : 0.0,
                    group.rank() == first ? static_cast<double>(static_cast<int>(local.code())) : 0.0};
  NIB_RETURN_IF_ERROR(group.all_reduce_sum_host(head, 2));
  msg.resize(static_cast<size_t>(head[0]));
  if (!msg.empty()) NIB_RETURN_IF_ERROR(group.broadcast_host(msg.data(), static_cast<int64_t>(msg.size()), first));
  if (group.rank() == first) return local;
  return Status(static_cast<StatusCode>(static_cast<int>(head[1])), fmt::format("rank {}: {}", first, msg));
}

Status check_ranks_agree(ProcessGroup& group, const std::vector<AgreementItem>& items) {
  if (group.world_size() == 1) return Status::ok();
  // hashes: (1 + items) u64: the world size, then each item's hash; rank 0's broadcast.
  std::vector<uint64_t> mine, root;
  mine.push_back(static_cast<uint64_t>(group.world_size()));
  for (const AgreementItem& it : items) mine.push_back(fnv1a64(it.text));
  root = mine;
  NIB_RETURN_IF_ERROR(group.broadcast_host(root.data(), static_cast<int64_t>(root.size() * sizeof(uint64_t)), 0));
  Status local = Status::ok();
  if (root[0] != mine[0]) {
    local = invalid_argument("ranks disagree on the world size: rank {} is in a world of {}, rank 0 in one of {}",
                             group.rank(), mine[0], root[0]);
  } else {
    for (size_t i = 0; i < items.size(); ++i)
      if (root[i + 1] != mine[i + 1]) {
        local = invalid_argument("ranks disagree on the {}: rank {}'s differs from rank 0's", items[i].what,
                                 group.rank());
        break;
      }
  }
  return agree(group, local);
}

}  // namespace nibble::dist
