// Tests of the collectives bench (collectives_bench.h): the sizes a range gives, nccl-tests' bus
// factors, medians and the slowest rank's median over a world, the one-rank world (nibble rows
// only, bus factor 0), a library whose all-reduce is wrong failing the bench's check, and under
// `mpirun -np 2` every (op, size, path) row of the MPI group against MPI's own calls: checked,
// nccl-tests' byte counts for sizes that do not split evenly, finite positive bandwidths, busbw =
// algbw x factor, the nibble/MPI ratio of the two rows, and the same rows on both ranks.
#include "dist/collectives_bench.h"

#include <cmath>

#include <gtest/gtest.h>

#include "dist/mpi_test_util.h"

namespace nibble::dist {
namespace {

using test::under_mpirun;

TEST(CollectivesBenchTest, SizesAndBusFactors) {
  if (under_mpirun()) GTEST_SKIP() << "a worker of the MPI test";
  CollectivesBenchOptions o;
  o.min_bytes = 1024, o.max_bytes = 4096;
  EXPECT_EQ(bench_sizes(o).value(), (std::vector<int64_t>{1024, 2048, 4096}));
  o.min_bytes = 1000, o.max_bytes = 5000, o.factor = 4;
  EXPECT_EQ(bench_sizes(o).value(), (std::vector<int64_t>{1000, 4000}));
  o.min_bytes = 1, o.max_bytes = int64_t{1} << 30, o.factor = 1024;
  EXPECT_EQ(bench_sizes(o).value(), (std::vector<int64_t>{1, 1024, 1 << 20, 1 << 30}));
  for (auto bad : {std::pair<int64_t, int64_t>{0, 10}, {10, 9}, {1, (int64_t{1} << 30) + 1}}) {
    CollectivesBenchOptions b;
    b.min_bytes = bad.first, b.max_bytes = bad.second;
    EXPECT_EQ(bench_sizes(b).status().code(), StatusCode::kInvalidArgument) << bad.first << ".." << bad.second;
  }
  CollectivesBenchOptions f;
  f.factor = 1;
  EXPECT_FALSE(bench_sizes(f).is_ok());
  f.factor = 2, f.iters = 0;
  EXPECT_FALSE(bench_sizes(f).is_ok());
  f.iters = 1, f.ops.clear();
  EXPECT_FALSE(bench_sizes(f).is_ok());

  EXPECT_EQ(bus_factor(CollectiveOp::kAllReduce, 8), 1.75);
  EXPECT_EQ(bus_factor(CollectiveOp::kReduceScatter, 8), 0.875);
  EXPECT_EQ(bus_factor(CollectiveOp::kAllGather, 2), 0.5);
  EXPECT_EQ(bus_factor(CollectiveOp::kBroadcast, 4), 1.0);
  for (auto op : {CollectiveOp::kAllReduce, CollectiveOp::kReduceScatter, CollectiveOp::kAllGather,
                  CollectiveOp::kBroadcast}) {
    EXPECT_EQ(bus_factor(op, 1), 0.0) << collective_op_name(op);
    EXPECT_EQ(parse_collective_op(collective_op_name(op)).value(), op);
  }
  EXPECT_EQ(parse_collective_op("allgather").value(), CollectiveOp::kAllGather);

  EXPECT_EQ(median({3, 1, 2}), 2.0);
  EXPECT_EQ(median({4, 1, 3, 2}), 2.5);
  EXPECT_EQ(median({}), 0.0);
  auto one = make_single_group();
  EXPECT_EQ(slowest_rank_median(*one, {5, 7, 6}, 3).value(), 6.0);
  EXPECT_EQ(slowest_rank_median(*one, {5, 7}, 3).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(parse_collective_op("alltoall").status().code(), StatusCode::kInvalidArgument);
}

TEST(CollectivesBenchTest, OneRankWorldHasNibbleRowsWithoutBus) {
  if (under_mpirun()) GTEST_SKIP() << "a worker of the MPI test";
  auto g = make_single_group();
  auto mem = make_host_memory();
  CollectivesBenchOptions o;
  o.min_bytes = 256, o.max_bytes = 1024, o.factor = 4, o.warmup = 1, o.iters = 3;
  EXPECT_EQ(g->library_collectives().status().code(), StatusCode::kUnimplemented);
  auto rows = bench_collectives(*g, nullptr, *mem, o);
  ASSERT_TRUE(rows.is_ok()) << rows.status().message();
  ASSERT_EQ(rows->size(), 4u * 2u);  // 4 ops x sizes 256, 1024
  for (const CollectiveRow& r : *rows) {
    EXPECT_EQ(r.path, "nibble");
    EXPECT_EQ(r.world, 1);
    EXPECT_TRUE(r.verified);
    EXPECT_EQ(r.bus_factor, 0.0) << r.op;
    EXPECT_EQ(r.busbw_gbps, 0.0) << r.op;
    EXPECT_EQ(r.ratio_to_library, -1.0) << r.op;
    EXPECT_GT(r.algbw_gbps, 0.0) << r.op;
    EXPECT_TRUE(std::isfinite(r.algbw_gbps)) << r.op;
  }
  EXPECT_EQ((*rows)[1].bytes, 1024);
  EXPECT_EQ((*rows)[1].count, 256);  // all-reduce: f32 elements
}

// A library whose all-reduce is off by one in its first element: the bench's check catches it.
class OffByOneLibrary final : public LibraryCollectives {
 public:
  std::string library() const override { return "off-by-one"; }
  Status all_reduce_sum(float* buf, int64_t n) override {
    if (n > 0) buf[0] += 1;
    return Status::ok();
  }
  Status reduce_scatter_sum(const float*, float*, int64_t) override { return Status::ok(); }
  Status all_gather(const float*, float*, int64_t) override { return Status::ok(); }
  Status broadcast(void*, int64_t, int) override { return Status::ok(); }
};

TEST(CollectivesBenchTest, AWrongResultFailsTheBench) {
  if (under_mpirun()) GTEST_SKIP() << "a worker of the MPI test";
  auto g = make_single_group();
  auto mem = make_host_memory();
  OffByOneLibrary lib;
  CollectivesBenchOptions o;
  o.min_bytes = o.max_bytes = 64, o.ops = {CollectiveOp::kAllReduce}, o.iters = 1;
  auto rows = bench_collectives(*g, &lib, *mem, o);
  ASSERT_FALSE(rows.is_ok());
  EXPECT_EQ(rows.status().code(), StatusCode::kInternal);
  EXPECT_NE(rows.status().message().find("all_reduce of 64 bytes through off-by-one: element 0 on rank 0 is 2, expected 1"),
            std::string::npos)
      << rows.status().message();
}

// The worker body under mpirun -np 2 (ASSERTs end a failing rank with a non-zero exit).
void mpi_bench_worker() {
  auto g_or = make_mpi_group();
  ASSERT_TRUE(g_or) << g_or.status().message();
  ProcessGroup& g = **g_or;
  ASSERT_EQ(g.world_size(), 2);
  auto lib = g.library_collectives();
  ASSERT_TRUE(lib.is_ok()) << lib.status().message();
  EXPECT_EQ((*lib)->library(), "mpi");
  auto mem = make_host_memory();
  CollectivesBenchOptions o;
  o.min_bytes = 100, o.max_bytes = 6400, o.factor = 8, o.warmup = 1, o.iters = 3;  // 100, 800, 6400 bytes
  auto rows = bench_collectives(g, lib->get(), *mem, o);
  ASSERT_TRUE(rows.is_ok()) << rows.status().message();
  ASSERT_EQ(rows->size(), 4u * 3u * 2u);
  const std::vector<std::string> ops = {"all_reduce", "reduce_scatter", "all_gather", "broadcast"};
  // nccl-tests' sizes of the requested 100 bytes over 2 ranks: RS/AG round to 12 f32 a rank
  const std::vector<int64_t> bytes_at_100 = {100, 96, 96, 100}, count_at_100 = {25, 12, 12, 100};
  for (size_t i = 0; i < rows->size(); ++i) {
    const CollectiveRow& r = (*rows)[i];
    const size_t op = i / 6, size = (i / 2) % 3;
    EXPECT_EQ(r.op, ops[op]) << i;
    EXPECT_EQ(r.path, i % 2 == 0 ? "nibble" : "mpi") << i;
    EXPECT_EQ(r.world, 2);
    EXPECT_TRUE(r.verified) << i;
    if (size == 0) {
      EXPECT_EQ(r.bytes, bytes_at_100[op]) << r.op;
      EXPECT_EQ(r.count, count_at_100[op]) << r.op;
    }
    EXPECT_TRUE(std::isfinite(r.algbw_gbps) && r.algbw_gbps > 0) << r.op << " " << r.algbw_gbps;
    EXPECT_NEAR(r.seconds, static_cast<double>(r.bytes) / (r.algbw_gbps * 1e9), 1e-12 * r.seconds) << r.op;
    EXPECT_EQ(r.bus_factor, op == 0 ? 1.0 : op == 3 ? 1.0 : 0.5) << r.op;
    EXPECT_EQ(r.busbw_gbps, r.algbw_gbps * r.bus_factor) << r.op;
    if (i % 2 == 0) {
      // nibble against MPI on the same buffers, the row after it: a finite positive ratio (no
      // bound on its size: ranks oversubscribed on a loaded CI machine can lose a time slice)
      EXPECT_TRUE(std::isfinite(r.ratio_to_library) && r.ratio_to_library > 0) << r.op;
      EXPECT_EQ(r.ratio_to_library, r.algbw_gbps / (*rows)[i + 1].algbw_gbps) << r.op;
    } else {
      EXPECT_EQ(r.ratio_to_library, -1.0) << r.op;
    }
  }
  // the slowest rank's median: rank 0 {1, 10, 3}, rank 1 {2, 9, 4} -> slowest {2, 10, 4} -> 4
  const std::vector<double> mine = g.rank() == 0 ? std::vector<double>{1, 10, 3} : std::vector<double>{2, 9, 4};
  EXPECT_EQ(slowest_rank_median(g, mine, 3).value(), 4.0);
  // every rank computed the same medians (from the shared table of times)
  std::vector<double> secs;
  for (const CollectiveRow& r : *rows) secs.push_back(r.seconds);
  std::vector<double> rank0 = secs;
  ASSERT_TRUE(g.broadcast_host(rank0.data(), static_cast<int64_t>(rank0.size() * sizeof(double)), 0));
  EXPECT_EQ(secs, rank0);
}

TEST(CollectivesBenchTest, MpiRowsAgainstMpiAcrossTwoProcesses) {
  if (under_mpirun()) {
    mpi_bench_worker();
    return;
  }
  if (const std::string why = test::why_no_mpirun(); !why.empty()) GTEST_SKIP() << why;
  test::expect_every_rank_passes(2, "CollectivesBenchTest.MpiRowsAgainstMpiAcrossTwoProcesses");
}

}  // namespace
}  // namespace nibble::dist
