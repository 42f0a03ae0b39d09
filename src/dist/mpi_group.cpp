// The MPI process group (OpenMPI from Debian; any MPI-3 library): one process per rank, host
// buffers. Sums are done here in rank order (MPI_Ialltoall of the slices, then slice owner adds
// rank 0's, rank 1's, ... contribution), not by MPI_Allreduce, whose summation order depends on
// the library's algorithm choice: so every rank gets the same bits and a rerun the same result.
// The blocking reduce-scatter and all-reduce are their nonblocking forms (MpiPending) waited for.
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

// A started reduce-scatter or all-reduce: per piece, the slices sent with MPI_Ialltoall (row r
// of `send` to rank r); once it completes, this rank's slice is the sum over source ranks in rank
// order (rv[0] + rv[1] + ...). Reduce-scatter (gather = false): the sum is the output, written to
// out + b. All-reduce (gather = true): the summed slices are all-gathered (blocking, in wait():
// every rank waits its collectives in the same order) and copied to out + b (m elements).
template <typename T>
class MpiPending final : public PendingCollective {
 public:
  MpiPending(int world, T* out, bool gather = false) : world_(world), out_(out), gather_(gather) {}
  ~MpiPending() override {
    for (Piece& p : pieces_)  // abandoned after an error: let MPI finish with the buffers first
      if (p.request != MPI_REQUEST_NULL) MPI_Wait(&p.request, MPI_STATUS_IGNORE);
  }

  // send: (world, c) T; b: the piece's output offset; m: its output elements (c for reduce-scatter).
  Status start_piece(std::vector<T> send, int64_t b, int64_t c, int64_t m) {
    pieces_.push_back(Piece{std::move(send), std::vector<T>(static_cast<size_t>(c * world_)), b, c, m, MPI_REQUEST_NULL});
    Piece& p = pieces_.back();
    return mpi_status(MPI_Ialltoall(p.send.data(), static_cast<int>(c), mpi_type<T>(), p.recv.data(),
                                    static_cast<int>(c), mpi_type<T>(), MPI_COMM_WORLD, &p.request),
                      "all_to_all");
  }

  Result<bool> test() override {
    if (done_ || gather_) return done_;  // an all-reduce's all-gather waits for wait()
    for (Piece& p : pieces_) {
      int flag = 0;
      NIB_RETURN_IF_ERROR(mpi_status(MPI_Test(&p.request, &flag, MPI_STATUS_IGNORE), "all_to_all"));
      if (!flag) return false;
    }
    for (Piece& p : pieces_) sum_slices(p, out_ + p.b);
    done_ = true;
    return true;
  }

  Status wait() override {
    if (done_) return Status::ok();
    std::vector<T> mine, gathered;
    for (Piece& p : pieces_) {
      NIB_RETURN_IF_ERROR(mpi_status(MPI_Wait(&p.request, MPI_STATUS_IGNORE), "all_to_all"));
      if (!gather_) {
        sum_slices(p, out_ + p.b);
        continue;
      }
      mine.resize(static_cast<size_t>(p.c));
      sum_slices(p, mine.data());
      gathered.resize(static_cast<size_t>(p.c * world_));
      NIB_RETURN_IF_ERROR(mpi_status(MPI_Allgather(mine.data(), static_cast<int>(p.c), mpi_type<T>(), gathered.data(),
                                                   static_cast<int>(p.c), mpi_type<T>(), MPI_COMM_WORLD), "all_gather"));
      std::memcpy(out_ + p.b, gathered.data(), static_cast<size_t>(p.m) * sizeof(T));
    }
    done_ = true;
    return Status::ok();
  }

 private:
  struct Piece {
    std::vector<T> send, recv;  // (world, c) each
    int64_t b, c, m;
    MPI_Request request;
  };
  // out: (c) T = sum over source ranks of recv's rows, in rank order.
  void sum_slices(const Piece& p, T* out) const {
    const T* rv = p.recv.data();
    for (int64_t i = 0; i < p.c; ++i) out[i] = rv[i];
    for (int r = 1; r < world_; ++r)
      for (int64_t i = 0; i < p.c; ++i) out[i] += rv[r * p.c + i];
  }

  int world_;
  T* out_;
  bool gather_;
  bool done_ = false;
  std::vector<Piece> pieces_;
};

// MPI's own collectives on MPI_COMM_WORLD (LibraryCollectives): one call each, counts < INT_MAX.
class MpiLibrary final : public LibraryCollectives {
 public:
  std::string library() const override { return "mpi"; }
  Status all_reduce_sum(float* buf, int64_t n) override {
    NIB_RETURN_IF_ERROR(check_count("all_reduce", n));
    return mpi_status(MPI_Allreduce(MPI_IN_PLACE, buf, static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
                      "all_reduce");
  }
  Status reduce_scatter_sum(const float* in, float* out, int64_t n) override {
    NIB_RETURN_IF_ERROR(check_count("reduce_scatter", n));
    return mpi_status(MPI_Reduce_scatter_block(in, out, static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
                      "reduce_scatter");
  }
  Status all_gather(const float* in, float* out, int64_t n) override {
    NIB_RETURN_IF_ERROR(check_count("all_gather", n));
    return mpi_status(MPI_Allgather(in, static_cast<int>(n), MPI_FLOAT, out, static_cast<int>(n), MPI_FLOAT,
                                    MPI_COMM_WORLD), "all_gather");
  }
  Status broadcast(void* data, int64_t bytes, int root) override {
    NIB_RETURN_IF_ERROR(check_count("broadcast", bytes));
    return mpi_status(MPI_Bcast(data, static_cast<int>(bytes), MPI_BYTE, root, MPI_COMM_WORLD), "broadcast");
  }

 private:
  static Status check_count(const char* what, int64_t n) {
    if (n < 0 || n > INT_MAX) return invalid_argument("MPI {}: count {} outside [0, INT_MAX]", what, n);
    return Status::ok();
  }
};

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
    NIB_ASSIGN_OR_RETURN(auto op, start_reduce_scatter_sum(in, out, n));
    return op->wait();
  }
  Result<std::unique_ptr<PendingCollective>> start_reduce_scatter_sum(const float* in, float* out, int64_t n) override {
    if (n < 0) return invalid_argument("reduce_scatter: negative count {}", n);
    auto op = std::make_unique<MpiPending<float>>(world_, out);
    // Piece by piece of at most kMaxCount elements per rank: piece [b, e) of every rank's slice.
    for (int64_t b = 0; b < n; b += kMaxCount) {
      const int64_t c = std::min(kMaxCount, n - b);
      std::vector<float> send(static_cast<size_t>(c * world_));
      for (int r = 0; r < world_; ++r) std::memcpy(send.data() + r * c, in + r * n + b, static_cast<size_t>(c) * sizeof(float));
      NIB_RETURN_IF_ERROR(op->start_piece(std::move(send), b, c, c));
    }
    return std::unique_ptr<PendingCollective>(std::move(op));
  }
  Result<std::unique_ptr<PendingCollective>> start_all_reduce_sum(float* buf, int64_t n) override {
    return start_all_reduce(buf, n);
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
  Result<std::unique_ptr<LibraryCollectives>> library_collectives() override {
    return std::unique_ptr<LibraryCollectives>(std::make_unique<MpiLibrary>());
  }
  void abort_world(int exit_code) override { MPI_Abort(MPI_COMM_WORLD, exit_code); }

 private:
  // buf: (n) T, in place: per piece of at most world*kMaxCount elements, each rank sums one
  // slice (zero-padded to a multiple of world) in rank order (MPI_Ialltoall now, the sum in
  // wait()), then the slices are all-gathered (in wait(), piece by piece).
  template <typename T>
  Result<std::unique_ptr<PendingCollective>> start_all_reduce(T* buf, int64_t n) {
    if (n < 0) return invalid_argument("all_reduce: negative count {}", n);
    auto op = std::make_unique<MpiPending<T>>(world_, buf, /*gather=*/true);
    if (world_ == 1) return std::unique_ptr<PendingCollective>(std::move(op));
    for (int64_t b = 0; b < n; b += kMaxCount * world_) {
      const int64_t m = std::min(kMaxCount * world_, n - b);
      const int64_t c = (m + world_ - 1) / world_;  // slice per rank
      std::vector<T> send(static_cast<size_t>(c * world_), T(0));
      std::memcpy(send.data(), buf + b, static_cast<size_t>(m) * sizeof(T));
      NIB_RETURN_IF_ERROR(op->start_piece(std::move(send), b, c, m));
    }
    return std::unique_ptr<PendingCollective>(std::move(op));
  }
  template <typename T>
  Status all_reduce(T* buf, int64_t n) {
    NIB_ASSIGN_OR_RETURN(auto op, start_all_reduce(buf, n));
    return op->wait();
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
