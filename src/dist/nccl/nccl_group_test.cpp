// The NCCL group as a one-rank world on one GPU (what one H200 can check): every collective on
// device buffers (all-reduce FP32/FP64, reduce-scatter, all-gather) and the host ones (broadcast,
// FP64 all-reduce, barrier) return their input unchanged, bit for bit (a sum over one rank is
// the value itself); bad arguments are errors. The nonblocking forms (the gradient reduce
// overlapped with backward) run after the work queued on the compute stream before them: a
// reduce-scatter started while that stream is held by a 300 ms host callback, with its input's
// copy queued behind it, still outputs the copied values. Skips without a device. Multi-rank runs
// need a multi-GPU machine (docs/training.md, "Data parallelism"). NCCL called directly
// (LibraryCollectives) and the collectives bench on device buffers: the last test.
#include <cuda_runtime_api.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "dist/nccl/nccl_group.h"

namespace nibble::dist {
namespace {

bool gpu_ok() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

template <typename T>
std::vector<T> pattern(int64_t n, T scale) {
  std::vector<T> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<T>((i % 97) - 48) * scale + T(0.125);
  return v;
}

template <typename T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  NIB_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d), h.size() * sizeof(T)));
  NIB_CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <typename T>
std::vector<T> to_host(const T* d, int64_t n) {
  std::vector<T> h(static_cast<size_t>(n));
  NIB_CUDA_CHECK(cudaMemcpy(h.data(), d, h.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

TEST(NcclGroupTest, OneRankWorldCollectivesAreExactIdentities) {
  if (!gpu_ok()) GTEST_SKIP() << "no CUDA device";
  LaunchEnv env;  // rank 0 of 1: no rendezvous needed
  auto g = make_nccl_group(env, nullptr, NcclOptions{});
  ASSERT_TRUE(g) << g.status().message();
  ProcessGroup& pg = **g;
  EXPECT_EQ(pg.rank(), 0);
  EXPECT_EQ(pg.world_size(), 1);
  EXPECT_EQ(pg.kind(), "nccl");
  EXPECT_TRUE(pg.device_memory());

  const int64_t n = 1000003;  // odd, above one 4 MiB NCCL chunk
  const std::vector<float> f = pattern<float>(n, 0.37f);
  float* df = to_device(f);
  ASSERT_TRUE(pg.all_reduce_sum(df, n));
  EXPECT_EQ(to_host(df, n), f);  // a sum over one rank: exact (bitwise)
  float* dout = nullptr;
  NIB_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dout), n * sizeof(float)));
  NIB_CUDA_CHECK(cudaMemset(dout, 0, n * sizeof(float)));
  ASSERT_TRUE(pg.reduce_scatter_sum(df, dout, n));
  EXPECT_EQ(to_host(dout, n), f);
  NIB_CUDA_CHECK(cudaMemset(dout, 0, n * sizeof(float)));
  ASSERT_TRUE(pg.all_gather(df, dout, n));
  EXPECT_EQ(to_host(dout, n), f);

  const std::vector<double> dv = pattern<double>(4097, 1.0 / 3);
  double* dd = to_device(dv);
  ASSERT_TRUE(pg.all_reduce_sum(dd, 4097));
  EXPECT_EQ(to_host(dd, 4097), dv);

  std::vector<double> host = dv;
  ASSERT_TRUE(pg.all_reduce_sum_host(host.data(), 4097));
  EXPECT_EQ(host, dv);
  std::string bytes = "agreement hash bytes";
  ASSERT_TRUE(pg.broadcast_host(bytes.data(), static_cast<int64_t>(bytes.size()), 0));
  EXPECT_EQ(bytes, "agreement hash bytes");
  EXPECT_TRUE(pg.barrier());
  EXPECT_FALSE(pg.broadcast_host(bytes.data(), 4, 1));  // root outside the world
  EXPECT_FALSE(pg.all_reduce_sum(df, -1));
  // The helpers over the group: a one-rank world agrees with itself.
  EXPECT_TRUE(check_ranks_agree(pg, {{"run config", "{}"}}));
  NIB_CUDA_CHECK(cudaFree(df));
  NIB_CUDA_CHECK(cudaFree(dout));
  NIB_CUDA_CHECK(cudaFree(dd));
}

void CUDART_CB hold_stream(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }

TEST(NcclGroupTest, NonblockingCollectivesRunAfterTheComputeStreamsQueuedWork) {
  if (!gpu_ok()) GTEST_SKIP() << "no CUDA device";
  cudaStream_t compute = nullptr;
  NIB_CUDA_CHECK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  NcclOptions o;
  o.compute_stream = compute;
  auto g = make_nccl_group(LaunchEnv{}, nullptr, o);
  ASSERT_TRUE(g) << g.status().message();
  ProcessGroup& pg = **g;

  const int64_t n = 1 << 20;
  const std::vector<float> f = pattern<float>(n, 0.37f);
  float* pinned = nullptr;  // pinned: the copy is truly asynchronous, queued behind the callback
  NIB_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&pinned), n * sizeof(float)));
  std::memcpy(pinned, f.data(), n * sizeof(float));
  float *din = nullptr, *dout = nullptr;
  NIB_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&din), n * sizeof(float)));
  NIB_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dout), n * sizeof(float)));
  NIB_CUDA_CHECK(cudaMemset(din, 0, n * sizeof(float)));
  NIB_CUDA_CHECK(cudaMemset(dout, 0, n * sizeof(float)));
  NIB_CUDA_CHECK(cudaDeviceSynchronize());
  // The compute stream: held 300 ms, then din <- f. A collective not ordered after it would read zeros.
  NIB_CUDA_CHECK(cudaLaunchHostFunc(compute, hold_stream, nullptr));
  NIB_CUDA_CHECK(cudaMemcpyAsync(din, pinned, n * sizeof(float), cudaMemcpyHostToDevice, compute));
  auto op = pg.start_reduce_scatter_sum(din, dout, n);
  ASSERT_TRUE(op) << op.status().message();
  auto early = (*op)->test();
  ASSERT_TRUE(early);
  EXPECT_FALSE(*early) << "finished while the compute stream was still held";
  ASSERT_TRUE((*op)->wait());
  EXPECT_EQ(to_host(dout, n), f);  // a sum over one rank: the values copied before it, bit for bit
  auto again = (*op)->test();
  ASSERT_TRUE(again);
  EXPECT_TRUE(*again);
  // The in-place all-reduce form: over one rank, the values (ordered the same way).
  auto ar = pg.start_all_reduce_sum(din, n);
  ASSERT_TRUE(ar) << ar.status().message();
  ASSERT_TRUE((*ar)->wait());
  EXPECT_EQ(to_host(din, n), f);
  auto empty = pg.start_all_reduce_sum(din, 0);  // nothing queued: finished at once
  ASSERT_TRUE(empty);
  EXPECT_TRUE((*empty)->wait());
  EXPECT_FALSE(pg.start_reduce_scatter_sum(din, dout, -1));
  NIB_CUDA_CHECK(cudaFree(din));
  NIB_CUDA_CHECK(cudaFree(dout));
  NIB_CUDA_CHECK(cudaFreeHost(pinned));
  g->reset();  // the group (its communicator) before the stream it was given
  NIB_CUDA_CHECK(cudaStreamDestroy(compute));
}

TEST(NcclGroupTest, BadOptionsAreErrors) {
  if (!gpu_ok()) GTEST_SKIP() << "no CUDA device";
  NcclOptions o;
  o.timeout_s = 0;
  EXPECT_FALSE(make_nccl_group(LaunchEnv{}, nullptr, o));
  o = NcclOptions{};
  o.cuda_device = 1 << 20;  // no such GPU
  EXPECT_FALSE(make_nccl_group(LaunchEnv{}, nullptr, o));
  // the refused device is not left behind for the next kernel launch's check (it was, and failed
  // the weight-transport test that ran next in this program on the H200)
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace nibble::dist

namespace nibble::dist {
namespace {

// `nibble bench collectives`' two paths on the one-rank NCCL world: NCCL's own calls
// (LibraryCollectives) on device buffers give the exact one-rank results, a bad root is refused,
// and the bench's rows for both paths are checked (`verified`: the expected values read back from
// device memory), with finite positive algbw, bus factor 0 and a finite nibble/NCCL ratio.
TEST(NcclGroupTest, LibraryCollectivesAndTheBenchOnOneRank) {
  if (!gpu_ok()) GTEST_SKIP() << "no CUDA device";
  auto g = make_nccl_group(LaunchEnv{}, nullptr, NcclOptions{});
  ASSERT_TRUE(g) << g.status().message();
  ProcessGroup& pg = **g;
  auto lib = pg.library_collectives();
  ASSERT_TRUE(lib.is_ok()) << lib.status().message();
  LibraryCollectives& nccl = **lib;
  EXPECT_EQ(nccl.library(), "nccl");
  const int64_t n = 1000;
  const std::vector<float> in = pattern<float>(n, 0.37f);
  float* d = to_device(in);
  float* out = to_device(std::vector<float>(n, -1.0f));
  ASSERT_TRUE(nccl.all_reduce_sum(d, n));
  EXPECT_EQ(to_host(d, n), in);
  ASSERT_TRUE(nccl.reduce_scatter_sum(d, out, n));
  EXPECT_EQ(to_host(out, n), in);
  NIB_CUDA_CHECK(cudaMemset(out, 0, n * sizeof(float)));
  ASSERT_TRUE(nccl.all_gather(d, out, n));
  EXPECT_EQ(to_host(out, n), in);
  ASSERT_TRUE(nccl.broadcast(d, n * 4, 0));
  EXPECT_EQ(to_host(d, n), in);
  EXPECT_FALSE(nccl.broadcast(d, 4, 1));
  EXPECT_FALSE(nccl.all_reduce_sum(d, -1));
  NIB_CUDA_CHECK(cudaFree(d));
  NIB_CUDA_CHECK(cudaFree(out));

  auto memory = make_cuda_group_memory();
  CollectivesBenchOptions o;
  o.min_bytes = 1024, o.max_bytes = 1 << 20, o.factor = 32, o.warmup = 1, o.iters = 3;  // 1 KiB, 32 KiB, 1 MiB
  auto rows = bench_collectives(pg, &nccl, *memory, o);
  ASSERT_TRUE(rows.is_ok()) << rows.status().message();
  ASSERT_EQ(rows->size(), 4u * 3u * 2u);
  for (size_t i = 0; i < rows->size(); ++i) {
    const CollectiveRow& r = (*rows)[i];
    EXPECT_EQ(r.path, i % 2 == 0 ? "nibble" : "nccl") << i;
    EXPECT_TRUE(r.verified) << r.op << " " << r.bytes;
    EXPECT_TRUE(std::isfinite(r.algbw_gbps) && r.algbw_gbps > 0) << r.op << " " << r.bytes;
    EXPECT_EQ(r.bus_factor, 0.0) << r.op;
    if (i % 2 == 0) {
      EXPECT_TRUE(std::isfinite(r.ratio_to_library) && r.ratio_to_library > 0) << r.op << " " << r.bytes;
    }
  }
}

}  // namespace
}  // namespace nibble::dist
