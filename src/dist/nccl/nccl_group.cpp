// The NCCL process group; see nccl_group.h. Host-memory operations (broadcast_host,
// all_reduce_sum_host) stage through a small device buffer. Reusing `ready_` for every start_*
// is safe: cudaStreamWaitEvent captures the event's state at the call, a later record does not
// change what an earlier wait waits for.
#include "dist/nccl/nccl_group.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "backend/cuda/cuda_check.h"

namespace nibble::dist {

namespace {

using Clock = std::chrono::steady_clock;

Status nccl_status(ncclResult_t rc, const char* what) {
  if (rc == ncclSuccess || rc == ncclInProgress) return Status::ok();
  return Status(StatusCode::kIoError, fmt::format("NCCL {}: {}", what, ncclGetErrorString(rc)));
}

class NcclGroup final : public ProcessGroup {
 public:
  NcclGroup(int rank, int world, int device, double timeout_s, cudaStream_t compute_stream)
      : rank_(rank), world_(world), device_(device), timeout_s_(timeout_s), compute_stream_(compute_stream) {}
  ~NcclGroup() override {
    if (comm_ != nullptr) {
      // A healthy communicator is finalized (waits for peers); a failed one was aborted already.
      if (!aborted_) {
        ncclCommFinalize(comm_);
        (void)wait_comm("finalize");
      }
      if (!aborted_) ncclCommDestroy(comm_);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (ready_ != nullptr) cudaEventDestroy(ready_);
    if (staging_ != nullptr) cudaFree(staging_);
  }

  Status init(const ncclUniqueId& id) {
    NIB_RETURN_IF_ERROR(cuda::cuda_status(cudaSetDevice(device_), "cudaSetDevice"));
    NIB_RETURN_IF_ERROR(cuda::cuda_status(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate"));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // calls return at once; wait_comm polls with a deadline
    NIB_RETURN_IF_ERROR(nccl_status(ncclCommInitRankConfig(&comm_, world_, id, rank_, &config), "init"));
    return wait_comm("communicator init");
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string kind() const override { return "nccl"; }
  bool device_memory() const override { return true; }

  Status all_reduce_sum(float* buf, int64_t n) override {
    return run("all_reduce", n, [&] { return ncclAllReduce(buf, buf, size(n), ncclFloat32, ncclSum, comm_, stream_); });
  }
  Status all_reduce_sum(double* buf, int64_t n) override {
    return run("all_reduce", n, [&] { return ncclAllReduce(buf, buf, size(n), ncclFloat64, ncclSum, comm_, stream_); });
  }
  Status reduce_scatter_sum(const float* in, float* out, int64_t n) override {
    return run("reduce_scatter", n,
               [&] { return ncclReduceScatter(in, out, size(n), ncclFloat32, ncclSum, comm_, stream_); });
  }
  Status all_gather(const float* in, float* out, int64_t n) override {
    return run("all_gather", n, [&] { return ncclAllGather(in, out, size(n), ncclFloat32, comm_, stream_); });
  }
  Result<std::unique_ptr<PendingCollective>> start_all_reduce_sum(float* buf, int64_t n) override {
    return start("all_reduce", n, [&] { return ncclAllReduce(buf, buf, size(n), ncclFloat32, ncclSum, comm_, stream_); });
  }
  Result<std::unique_ptr<PendingCollective>> start_reduce_scatter_sum(const float* in, float* out, int64_t n) override {
    return start("reduce_scatter", n,
                 [&] { return ncclReduceScatter(in, out, size(n), ncclFloat32, ncclSum, comm_, stream_); });
  }

  Status broadcast(void* data, int64_t bytes, int root) override {  // data: (bytes) u8 device memory
    if (root < 0 || root >= world_) return invalid_argument("broadcast: root {} outside the world of {}", root, world_);
    return run("broadcast", bytes, [&] { return ncclBroadcast(data, data, size(bytes), ncclUint8, root, comm_, stream_); });
  }
  Status broadcast_host(void* data, int64_t bytes, int root) override {
    if (root < 0 || root >= world_) return invalid_argument("broadcast: root {} outside the world of {}", root, world_);
    if (bytes <= 0) return bytes < 0 ? invalid_argument("broadcast: negative size {}", bytes) : Status::ok();
    NIB_ASSIGN_OR_RETURN(void* d, ensure_staging(static_cast<size_t>(bytes)));
    NIB_RETURN_IF_ERROR(cuda::cuda_status(cudaMemcpy(d, data, static_cast<size_t>(bytes), cudaMemcpyHostToDevice), "cudaMemcpy"));
    NIB_RETURN_IF_ERROR(run("broadcast", bytes, [&] { return ncclBroadcast(d, d, size(bytes), ncclUint8, root, comm_, stream_); }));
    return cuda::cuda_status(cudaMemcpy(data, d, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost), "cudaMemcpy");
  }
  Status all_reduce_sum_host(double* buf, int64_t n) override {
    if (n <= 0) return n < 0 ? invalid_argument("all_reduce: negative count {}", n) : Status::ok();
    const size_t bytes = static_cast<size_t>(n) * sizeof(double);
    NIB_ASSIGN_OR_RETURN(void* d, ensure_staging(bytes));
    NIB_RETURN_IF_ERROR(cuda::cuda_status(cudaMemcpy(d, buf, bytes, cudaMemcpyHostToDevice), "cudaMemcpy"));
    NIB_RETURN_IF_ERROR(all_reduce_sum(static_cast<double*>(d), n));
    return cuda::cuda_status(cudaMemcpy(buf, d, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
  }
  Status barrier() override {
    double x = 0;
    return all_reduce_sum_host(&x, 1);
  }
  Result<std::unique_ptr<LibraryCollectives>> library_collectives() override {
    return std::unique_ptr<LibraryCollectives>(std::make_unique<Library>(this));
  }
  void abort_world(int exit_code) override {
    if (comm_ != nullptr && !aborted_) {
      ncclCommAbort(comm_);
      aborted_ = true;
    }
    // Peers blocked in a collective with this rank time out and abort in turn (see wait_done).
    std::_Exit(exit_code);
  }

 private:
  static size_t size(int64_t n) { return static_cast<size_t>(n); }

  Result<void*> ensure_staging(size_t bytes) {
    if (bytes > staging_bytes_) {
      if (staging_ != nullptr) cudaFree(staging_);
      staging_ = nullptr;
      staging_bytes_ = 0;
      NIB_RETURN_IF_ERROR(cuda::cuda_status(cudaMalloc(&staging_, bytes), "cudaMalloc (NCCL staging)"));
      staging_bytes_ = bytes;
    }
    return staging_;
  }

  Status fail(const std::string& what, const std::string& why) {
    if (!aborted_) {
      ncclCommAbort(comm_);
      aborted_ = true;
    }
    return Status(StatusCode::kIoError, fmt::format("NCCL {} on rank {} of {}: {}; communicator aborted", what, rank_,
                                                    world_, why));
  }

  // Waits until the communicator has no operation in progress (non-blocking mode), or times out.
  Status wait_comm(const std::string& what) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s_);
    for (;;) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t rc = ncclCommGetAsyncError(comm_, &state);
      if (rc != ncclSuccess) return fail(what, ncclGetErrorString(rc));
      if (state == ncclSuccess) return Status::ok();
      if (state != ncclInProgress) return fail(what, ncclGetErrorString(state));
      if (Clock::now() > deadline) return fail(what, fmt::format("no progress within {} s (a peer died or hangs)", timeout_s_));
      std::this_thread::yield();
    }
  }

  // One collective: the device's earlier work done, the call issued, then its completion on our
  // stream awaited with the deadline.
  template <typename Call>
  Status run(const char* what, int64_t n, Call call) {
    if (n < 0) return invalid_argument("{}: negative count {}", what, n);
    if (aborted_) return Status(StatusCode::kIoError, fmt::format("NCCL {}: the communicator was aborted", what));
    if (n == 0) return Status::ok();
    NIB_RETURN_IF_ERROR(cuda::cuda_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize before NCCL"));
    NIB_RETURN_IF_ERROR(nccl_status(call(), what));
    NIB_RETURN_IF_ERROR(wait_comm(what));  // the call enqueued
    return await(what, [&] { return cudaStreamQuery(stream_); });
  }

  // Polls query() (cudaStreamQuery / cudaEventQuery) until it says done, the communicator reports
  // an error, or the deadline passes (then the communicator is aborted).
  template <typename Query>
  Status await(const char* what, Query query) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s_);
    for (;;) {
      const cudaError_t q = query();
      if (q == cudaSuccess) return Status::ok();
      if (q != cudaErrorNotReady) return fail(what, cudaGetErrorString(q));
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess || (state != ncclSuccess && state != ncclInProgress))
        return fail(what, ncclGetErrorString(state));
      if (Clock::now() > deadline)
        return fail(what, fmt::format("not finished within {} s (a peer died or hangs)", timeout_s_));
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // A started collective: `done` recorded on the communication stream after it; wait() polls it.
  class Pending final : public PendingCollective {
   public:
    Pending(NcclGroup* group, const char* what, cudaEvent_t done) : group_(group), what_(what), done_(done) {}
    ~Pending() override {
      if (done_ != nullptr) cudaEventDestroy(done_);
    }
    Result<bool> test() override {
      if (done_ == nullptr) return true;
      const cudaError_t q = cudaEventQuery(done_);
      if (q == cudaErrorNotReady) return false;
      NIB_RETURN_IF_ERROR(cuda::cuda_status(q, "cudaEventQuery (NCCL)"));
      return true;
    }
    Status wait() override {
      if (done_ == nullptr) return Status::ok();
      return group_->await(what_, [&] { return cudaEventQuery(done_); });
    }

   private:
    NcclGroup* group_;
    const char* what_;
    cudaEvent_t done_;  // null: nothing was queued (n == 0)
  };

  // The nonblocking form of run(): the communication stream waits (on the device) for an event
  // recorded on the compute stream after the work that produced the input; the collective and a
  // `done` event follow on the communication stream. Without a compute stream: the device is
  // synchronised first, as run() does.
  template <typename Call>
  Result<std::unique_ptr<PendingCollective>> start(const char* what, int64_t n, Call call) {
    if (n < 0) return invalid_argument("{}: negative count {}", what, n);
    if (aborted_) return Status(StatusCode::kIoError, fmt::format("NCCL {}: the communicator was aborted", what));
    if (n == 0) return std::unique_ptr<PendingCollective>(std::make_unique<Pending>(this, what, nullptr));
    if (compute_stream_ != nullptr) {
      if (ready_ == nullptr)
        NIB_RETURN_IF_ERROR(cuda::cuda_status(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate"));
      NIB_RETURN_IF_ERROR(cuda::cuda_status(cudaEventRecord(ready_, compute_stream_), "cudaEventRecord (compute)"));
      NIB_RETURN_IF_ERROR(cuda::cuda_status(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent"));
    } else {
      NIB_RETURN_IF_ERROR(cuda::cuda_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize before NCCL"));
    }
    NIB_RETURN_IF_ERROR(nccl_status(call(), what));
    NIB_RETURN_IF_ERROR(wait_comm(what));  // the call enqueued
    cudaEvent_t done = nullptr;
    NIB_RETURN_IF_ERROR(cuda::cuda_status(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate"));
    auto op = std::make_unique<Pending>(this, what, done);  // owns `done` from here
    NIB_RETURN_IF_ERROR(cuda::cuda_status(cudaEventRecord(done, stream_), "cudaEventRecord (NCCL)"));
    return std::unique_ptr<PendingCollective>(std::move(op));
  }

  // NCCL's calls alone on this communicator and stream (LibraryCollectives): `direct`, below.
  class Library final : public LibraryCollectives {
   public:
    explicit Library(NcclGroup* g) : g_(g) {}
    std::string library() const override { return "nccl"; }
    Status all_reduce_sum(float* buf, int64_t n) override {  // buf: (n) f32 device
      return g_->direct("all_reduce", n,
                        [&] { return ncclAllReduce(buf, buf, size(n), ncclFloat32, ncclSum, g_->comm_, g_->stream_); });
    }
    Status reduce_scatter_sum(const float* in, float* out, int64_t n) override {  // in: (world*n), out: (n) f32 device
      return g_->direct("reduce_scatter", n,
                        [&] { return ncclReduceScatter(in, out, size(n), ncclFloat32, ncclSum, g_->comm_, g_->stream_); });
    }
    Status all_gather(const float* in, float* out, int64_t n) override {  // in: (n), out: (world*n) f32 device
      return g_->direct("all_gather", n,
                        [&] { return ncclAllGather(in, out, size(n), ncclFloat32, g_->comm_, g_->stream_); });
    }
    Status broadcast(void* data, int64_t bytes, int root) override {  // data: (bytes) u8 device
      if (root < 0 || root >= g_->world_)
        return invalid_argument("broadcast: root {} outside the world of {}", root, g_->world_);
      return g_->direct("broadcast", bytes,
                        [&] { return ncclBroadcast(data, data, size(bytes), ncclUint8, root, g_->comm_, g_->stream_); });
    }

   private:
    NcclGroup* g_;
  };

  // The library's call alone: issued on the communication stream (no device synchronise first:
  // the caller's buffers are ready), its enqueueing awaited (a non-blocking communicator may
  // return ncclInProgress), then the stream spun on with cudaStreamQuery until it is done (no
  // sleep between polls; the communicator's error state looked at every 256 polls, the timeout
  // as in run()).
  template <typename Call>
  Status direct(const char* what, int64_t n, Call call) {
    if (n < 0) return invalid_argument("{}: negative count {}", what, n);
    if (aborted_) return Status(StatusCode::kIoError, fmt::format("NCCL {}: the communicator was aborted", what));
    if (n == 0) return Status::ok();
    NIB_RETURN_IF_ERROR(nccl_status(call(), what));
    NIB_RETURN_IF_ERROR(wait_comm(what));
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s_);
    for (uint64_t polls = 1;; ++polls) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return Status::ok();
      if (q != cudaErrorNotReady) return fail(what, cudaGetErrorString(q));
      if (polls % 256 == 0) {
        ncclResult_t state = ncclSuccess;
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess || (state != ncclSuccess && state != ncclInProgress))
          return fail(what, ncclGetErrorString(state));
        if (Clock::now() > deadline)
          return fail(what, fmt::format("not finished within {} s (a peer died or hangs)", timeout_s_));
      }
    }
  }

  int rank_, world_, device_;
  double timeout_s_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t compute_stream_;  // the backend's (start_* order after it), or null
  cudaStream_t stream_ = nullptr;  // the communication stream
  cudaEvent_t ready_ = nullptr;    // recorded on compute_stream_ by start_*
  void* staging_ = nullptr;
  size_t staging_bytes_ = 0;
  bool aborted_ = false;
};

class CudaGroupMemory final : public GroupMemory {
 public:
  Result<void*> allocate(int64_t bytes) override {
    void* p = nullptr;
    NIB_RETURN_IF_ERROR(cuda::cuda_status(cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(bytes, 1))),
                                          "cudaMalloc (bench collectives)"));
    return p;
  }
  void release(void* p) override { cudaFree(p); }
  Status upload(void* dst, const void* host, int64_t bytes) override {
    return cuda::cuda_status(cudaMemcpy(dst, host, static_cast<size_t>(bytes), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  Status download(void* host, const void* src, int64_t bytes) override {
    return cuda::cuda_status(cudaMemcpy(host, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost), "cudaMemcpy");
  }
};

}  // namespace

std::unique_ptr<GroupMemory> make_cuda_group_memory() { return std::make_unique<CudaGroupMemory>(); }

Result<std::unique_ptr<ProcessGroup>> make_nccl_group(const LaunchEnv& env, ProcessGroup* bootstrap,
                                                      const NcclOptions& options) {
  if (!(options.timeout_s > 0)) return invalid_argument("NCCL timeout {} s must be > 0", options.timeout_s);
  if (bootstrap != nullptr && (bootstrap->world_size() != env.world_size || bootstrap->rank() != env.rank))
    return invalid_argument("NCCL bootstrap group is rank {} of {}, the launch says rank {} of {}", bootstrap->rank(),
                            bootstrap->world_size(), env.rank, env.world_size);
  NIB_RETURN_IF_ERROR(cuda::cuda_status(cudaSetDevice(options.cuda_device), "cudaSetDevice"));
  ncclUniqueId id{};
  if (env.rank == 0) NIB_RETURN_IF_ERROR(nccl_status(ncclGetUniqueId(&id), "get unique id"));
  if (env.world_size > 1) {
    if (bootstrap != nullptr)
      NIB_RETURN_IF_ERROR(bootstrap->broadcast_host(&id, sizeof id, 0));
    else
      NIB_RETURN_IF_ERROR(tcp_broadcast_from_rank0(env, &id, sizeof id, options.timeout_s));
  }
  auto g = std::make_unique<NcclGroup>(env.rank, env.world_size, options.cuda_device, options.timeout_s,
                                       options.compute_stream);
  NIB_RETURN_IF_ERROR(g->init(id));
  return std::unique_ptr<ProcessGroup>(std::move(g));
}

}  // namespace nibble::dist
