// The MPI process group (OpenMPI from Debian; any MPI-3 library): one process per rank, host
// buffers. Sums are done here in rank order (MPI_Alltoall of the slices, then slice owner adds
// rank 0's, rank 1's, ... contribution), not by MPI_Allreduce, whose summation order depends on
// the library's algorithm choice: so every rank gets the same bits and a rerun the same result.
// Counts are split below INT_MAX. Built only with MPI (NIBBLE_HAVE_MPI); else a clear error.
#include "dist/process_group.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>

#ifdef NIBBLE_HAVE_MPI
#include <mpi.h>
#endif

namespace nibble::dist {

#ifdef NIBBLE_HAVE_MPI

bool mpi_available() { return true; }

namespace {

constexpr int64_t kMaxCount = int64_t{1} << 26;  // elements per MPI call (well below INT_MAX)
int g_groups = 0;                                 // live MPI groups (MPI_Finalize after the last)
bool g_we_initialized = false;

Status mpi_status(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return Status::ok();
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return Status(StatusCode::kIoError, fmt::format("MPI {}: {}", what, std::string(text, static_cast<size_t>(len))));
}

template <typename T>
MPI_Datatype mpi_type();
template <>
MPI_Datatype mpi_type<float>() { return MPI_FLOAT; }
template <>
MPI_Datatype mpi_type<double>() { return MPI_DOUBLE; }

class MpiGroup final : public ProcessGroup {
 public:
  MpiGroup() {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &world_);
    ++g_groups;
  }
  ~MpiGroup() override {
    if (--g_groups == 0 && g_we_initialized) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) MPI_Finalize();
    }
  }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string kind() const override { return "mpi"; }
  bool device_memory() const override { return false; }

  Status all_reduce_sum(float* buf, int64_t n) override { return all_reduce(buf, n); }
  Status all_reduce_sum(double* buf, int64_t n) override { return all_reduce(buf, n); }
  Status all_reduce_sum_host(double* buf, int64_t n) override { return all_reduce(buf, n); }

  Status reduce_scatter_sum(const float* in, float* out, int64_t n) override {
    if (n < 0) return invalid_argument("reduce_scatter: negative count {}", n);
    // Piece by piece of at most kMaxCount elements per rank: piece [b, e) of every rank's slice.
    std::vector<float> send, recv;
    for (int64_t b = 0; b < n; b += kMaxCount) {
      const int64_t c = std::min(kMaxCount, n - b);
      send.resize(static_cast<size_t>(c * world_));
      for (int r = 0; r < world_; ++r) std::memcpy(send.data() + r * c, in + r * n + b, static_cast<size_t>(c) * sizeof(float));
      NIB_RETURN_IF_ERROR(alltoall_sum(send.data(), out + b, c, &recv));
    }
    return Status::ok();
  }

  Status all_gather(const float* in, float* out, int64_t n) override {
    if (n < 0) return invalid_argument("all_gather: negative count {}", n);
    std::vector<float> tmp;
    for (int64_t b = 0; b < n; b += kMaxCount) {
      const int64_t c = std::min(kMaxCount, n - b);
      tmp.resize(static_cast<size_t>(c * world_));
      NIB_RETURN_IF_ERROR(mpi_status(MPI_Allgather(in + b, static_cast<int>(c), MPI_FLOAT, tmp.data(),
                                                   static_cast<int>(c), MPI_FLOAT, MPI_COMM_WORLD), "all_gather"));
      for (int r = 0; r < world_; ++r) std::memcpy(out + r * n + b, tmp.data() + r * c, static_cast<size_t>(c) * sizeof(float));
    }
    return Status::ok();
  }

  Status broadcast_host(void* data, int64_t bytes, int root) override {
    if (bytes < 0) return invalid_argument("broadcast: negative size {}", bytes);
    if (root < 0 || root >= world_) return invalid_argument("broadcast: root {} outside the world of {}", root, world_);
    auto* p = static_cast<char*>(data);
    for (int64_t b = 0; b < bytes; b += kMaxCount)
      NIB_RETURN_IF_ERROR(mpi_status(MPI_Bcast(p + b, static_cast<int>(std::min(kMaxCount, bytes - b)), MPI_BYTE, root,
                                               MPI_COMM_WORLD), "broadcast"));
    return Status::ok();
  }

  Status barrier() override { return mpi_status(MPI_Barrier(MPI_COMM_WORLD), "barrier"); }
  void abort_world(int exit_code) override { MPI_Abort(MPI_COMM_WORLD, exit_code); }

 private:
  // send: (world, c) T: row r goes to rank r. out: (c) T = sum over source ranks in rank order.
  template <typename T>
  Status alltoall_sum(const T* send, T* out, int64_t c, std::vector<T>* recv) {
    recv->resize(static_cast<size_t>(c * world_));
    NIB_RETURN_IF_ERROR(mpi_status(MPI_Alltoall(send, static_cast<int>(c), mpi_type<T>(), recv->data(),
                                                static_cast<int>(c), mpi_type<T>(), MPI_COMM_WORLD), "all_to_all"));
    const T* rv = recv->data();
    for (int64_t i = 0; i < c; ++i) out[i] = rv[i];
    for (int r = 1; r < world_; ++r)
      for (int64_t i = 0; i < c; ++i) out[i] += rv[r * c + i];
    return Status::ok();
  }

  // buf: (n) T, in place: per piece of at most world*kMaxCount elements, each rank sums one
  // slice (zero-padded to a multiple of world) in rank order, then the slices are all-gathered.
  template <typename T>
  Status all_reduce(T* buf, int64_t n) {
    if (n < 0) return invalid_argument("all_reduce: negative count {}", n);
    if (world_ == 1) return Status::ok();
    std::vector<T> send, recv, mine, gathered;
    for (int64_t b = 0; b < n; b += kMaxCount * world_) {
      const int64_t m = std::min(kMaxCount * world_, n - b);
      const int64_t c = (m + world_ - 1) / world_;  // slice per rank
      send.assign(static_cast<size_t>(c * world_), T(0));
      std::memcpy(send.data(), buf + b, static_cast<size_t>(m) * sizeof(T));
      mine.resize(static_cast<size_t>(c));
      NIB_RETURN_IF_ERROR(alltoall_sum(send.data(), mine.data(), c, &recv));
      gathered.resize(static_cast<size_t>(c * world_));
      NIB_RETURN_IF_ERROR(mpi_status(MPI_Allgather(mine.data(), static_cast<int>(c), mpi_type<T>(), gathered.data(),
                                                   static_cast<int>(c), mpi_type<T>(), MPI_COMM_WORLD), "all_gather"));
      std::memcpy(buf + b, gathered.data(), static_cast<size_t>(m) * sizeof(T));
    }
    return Status::ok();
  }

  int rank_ = 0, world_ = 1;
};

}  // namespace

Result<std::unique_ptr<ProcessGroup>> make_mpi_group() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    // FUNNELED: only the main thread calls MPI (OpenMP workers never do).
    NIB_RETURN_IF_ERROR(mpi_status(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "init"));
    g_we_initialized = true;
  }
  // Errors come back as codes (turned into Status) rather than aborting the job from inside MPI.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  return std::unique_ptr<ProcessGroup>(std::make_unique<MpiGroup>());
}

#else  // built without MPI

bool mpi_available() { return false; }

Result<std::unique_ptr<ProcessGroup>> make_mpi_group() {
  return Status(StatusCode::kUnimplemented,
                "this nibble was built without MPI: install libopenmpi-dev openmpi-bin (scripts/setup.sh) and rebuild "
                "to run under mpirun");
}

#endif

}  // namespace nibble::dist
