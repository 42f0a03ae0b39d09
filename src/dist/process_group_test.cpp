// The process groups on CPUs: the one-rank world's collectives are identities; launch detection
// from mpirun's, PMI's and torchrun-style variables (and one-line errors for bad ones); agree()
// and check_ranks_agree() on one rank; the TCP rendezvous between two threads (payload handed
// out, a world-size mismatch refused on both sides, a timeout when rank 0 never comes); and the
// MPI group under `mpirun -np 3` (this program re-launched as its workers): rank-order sums that
// are the same bits on every rank, reduce-scatter, all-gather, broadcast, agree() spreading one
// rank's error, and check_ranks_agree() naming the item that differs. The MPI case is skipped
// (ctest: skipped) when mpirun is absent or nibble was built without MPI.
#include <unistd.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <thread>
#include <vector>

#include "dist/mpi_test_util.h"
#include "dist/process_group.h"

namespace nibble::dist {
namespace {

// Sets (or with nullptr unsets) environment variables for one test, restoring them after.
class EnvVars {
 public:
  EnvVars(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const char* name : kAll) {
      const char* v = std::getenv(name);
      saved_.emplace_back(name, v ? std::optional<std::string>(v) : std::nullopt);
      ::unsetenv(name);
    }
    for (auto [k, v] : vars) ::setenv(k, v, 1);
  }
  ~EnvVars() {
    for (auto& [k, v] : saved_) {
      if (v) ::setenv(k.c_str(), v->c_str(), 1);
      else ::unsetenv(k.c_str());
    }
  }

 private:
  static constexpr const char* kAll[] = {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                                         "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "WORLD_SIZE", "RANK",
                                         "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"};
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

using test::under_mpirun;

TEST(SingleGroupTest, CollectivesAreIdentities) {
  auto g = make_single_group();
  EXPECT_EQ(g->rank(), 0);
  EXPECT_EQ(g->world_size(), 1);
  EXPECT_FALSE(g->device_memory());
  std::vector<float> x = {1.5f, -2.25f, 3.0f}, y(3, 0.0f);
  ASSERT_TRUE(g->all_reduce_sum(x.data(), 3));
  EXPECT_EQ(x, (std::vector<float>{1.5f, -2.25f, 3.0f}));
  ASSERT_TRUE(g->reduce_scatter_sum(x.data(), y.data(), 3));
  EXPECT_EQ(y, x);
  y.assign(3, 0.0f);
  ASSERT_TRUE(g->all_gather(x.data(), y.data(), 3));
  EXPECT_EQ(y, x);
  EXPECT_FALSE(g->broadcast_host(x.data(), 4, 1));  // root 1 is outside a world of one
  EXPECT_FALSE(g->all_reduce_sum(x.data(), -1));
  EXPECT_TRUE(g->barrier());
  // agree() on one rank is the local status; check_ranks_agree() has nothing to compare.
  EXPECT_EQ(agree(*g, invalid_argument("local")).message(), "local");
  EXPECT_TRUE(check_ranks_agree(*g, {{"run config", "a"}}));
}

TEST(LaunchTest, DetectsMpirunPmiAndEnvWorlds) {
  if (under_mpirun()) GTEST_SKIP() << "a worker of the MPI test";
  {
    EnvVars e({});
    auto l = detect_launch();
    ASSERT_TRUE(l);
    EXPECT_EQ(l->kind, LaunchEnv::Kind::kSingle);
    EXPECT_EQ(l->describe(), "single process");
  }
  {
    EnvVars e({{"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
               {"WORLD_SIZE", "9"}});  // mpirun's variables win
    auto l = detect_launch();
    ASSERT_TRUE(l) << l.status().message();
    EXPECT_EQ(l->kind, LaunchEnv::Kind::kMpi);
    EXPECT_EQ(l->world_size, 4);
    EXPECT_EQ(l->rank, 3);
    EXPECT_EQ(l->local_rank, 1);
    EXPECT_EQ(l->describe(), "mpirun world of 4");
  }
  {
    EnvVars e({{"PMI_SIZE", "2"}, {"PMI_RANK", "1"}});
    auto l = detect_launch();
    ASSERT_TRUE(l);
    EXPECT_EQ(l->kind, LaunchEnv::Kind::kMpi);
    EXPECT_EQ(l->local_rank, 1);  // defaults to the rank
  }
  {
    EnvVars e({{"WORLD_SIZE", "8"}, {"RANK", "5"}, {"LOCAL_RANK", "5"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29500"}});
    auto l = detect_launch();
    ASSERT_TRUE(l) << l.status().message();
    EXPECT_EQ(l->kind, LaunchEnv::Kind::kEnv);
    EXPECT_EQ(l->master_addr, "node0");
    EXPECT_EQ(l->master_port, 29500);
    EXPECT_EQ(l->describe(), "env world of 8 (MASTER_ADDR=node0:29500)");
  }
  {
    EnvVars e({{"WORLD_SIZE", "1"}, {"RANK", "0"}});  // a one-rank env world needs no rendezvous
    auto l = detect_launch();
    ASSERT_TRUE(l);
    EXPECT_EQ(l->kind, LaunchEnv::Kind::kEnv);
    EXPECT_EQ(l->world_size, 1);
  }
  struct Bad {
    std::initializer_list<std::pair<const char*, const char*>> vars;
    const char* message;
  };
  for (const Bad& b : {Bad{{{"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}, "RANK is not"},
                       Bad{{{"WORLD_SIZE", "2"}, {"RANK", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}, "RANK=2 outside"},
                       Bad{{{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"MASTER_PORT", "1"}}, "MASTER_ADDR is not"},
                       Bad{{{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}}, "MASTER_PORT"},
                       Bad{{{"WORLD_SIZE", "two"}}, "WORLD_SIZE='two'"},
                       Bad{{{"WORLD_SIZE", "0"}}, "WORLD_SIZE=0"},
                       Bad{{{"OMPI_COMM_WORLD_SIZE", "2"}}, "OMPI_COMM_WORLD_RANK"}}) {
    EnvVars e(b.vars);
    auto l = detect_launch();
    ASSERT_FALSE(l) << b.message;
    EXPECT_NE(l.status().message().find(b.message), std::string::npos) << l.status().message();
  }
}

TEST(FnvTest, KnownValues) {
  EXPECT_EQ(fnv1a64(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a64("a"), 0xaf63dc4c8601ec8cull);
}

// A TCP port for the rendezvous tests, spread by pid so parallel ctest runs do not collide.
int test_port(int k) { return 20000 + static_cast<int>(::getpid() % 10000) * 4 + k; }

LaunchEnv env_rank(int rank, int world, int port) {
  LaunchEnv e;
  e.kind = LaunchEnv::Kind::kEnv;
  e.rank = rank;
  e.world_size = world;
  e.master_addr = "127.0.0.1";
  e.master_port = port;
  return e;
}

TEST(TcpRendezvousTest, HandsRankZerosBytesToEveryRank) {
  const int port = test_port(0);
  char id[16] = "unique-id-bytes", got1[16] = {}, got2[16] = {};
  Status s0, s1, s2;
  std::thread t1([&] { s1 = tcp_broadcast_from_rank0(env_rank(1, 3, port), got1, sizeof got1, 10); });
  std::thread t2([&] { s2 = tcp_broadcast_from_rank0(env_rank(2, 3, port), got2, sizeof got2, 10); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the others start first: they retry
  s0 = tcp_broadcast_from_rank0(env_rank(0, 3, port), id, sizeof id, 10);
  t1.join();
  t2.join();
  ASSERT_TRUE(s0) << s0.message();
  ASSERT_TRUE(s1) << s1.message();
  ASSERT_TRUE(s2) << s2.message();
  EXPECT_STREQ(got1, "unique-id-bytes");
  EXPECT_STREQ(got2, "unique-id-bytes");
}

TEST(TcpRendezvousTest, WorldSizeMismatchFailsOnBothSidesAndAbsentRankZeroTimesOut) {
  const int port = test_port(1);
  char id[8] = "abcdefg", got[8] = {};
  Status s0, s1;
  std::thread t1([&] { s1 = tcp_broadcast_from_rank0(env_rank(1, 3, port), got, sizeof got, 10); });
  s0 = tcp_broadcast_from_rank0(env_rank(0, 2, port), id, sizeof id, 10);
  t1.join();
  ASSERT_FALSE(s0);
  ASSERT_FALSE(s1);
  EXPECT_NE(s0.message().find("WORLD_SIZE=3, rank 0 with 2"), std::string::npos) << s0.message();
  EXPECT_NE(s1.message().find("WORLD_SIZE=3, rank 0 with 2"), std::string::npos) << s1.message();

  Status lonely = tcp_broadcast_from_rank0(env_rank(1, 2, port + 1), got, sizeof got, 0.5);
  ASSERT_FALSE(lonely);
  EXPECT_NE(lonely.message().find("timed out reaching rank 0"), std::string::npos) << lonely.message();
  Status waiting = tcp_broadcast_from_rank0(env_rank(0, 3, port + 2), id, sizeof id, 0.5);
  ASSERT_FALSE(waiting);
  EXPECT_NE(waiting.message().find("waiting for rank(s) 1,2"), std::string::npos) << waiting.message();
}

// ---- MPI ---------------------------------------------------------------------------------------

// The worker body (run in each of 3 ranks): every check is an ASSERT so a failing rank exits
// non-zero and mpirun reports it.
void mpi_worker_checks() {
  auto g_or = make_mpi_group();
  ASSERT_TRUE(g_or) << g_or.status().message();
  ProcessGroup& g = **g_or;
  const int r = g.rank(), n = g.world_size();
  ASSERT_EQ(n, 3);
  EXPECT_EQ(g.kind(), "mpi");
  // Values whose sum depends on the order: 1e8 + 1 (rank 0 and 1) and -1e8 (rank 2) in FP32.
  // Rank order ((x0 + x1) + x2) gives 0 (1 is lost in 1e8+1); the order (x0 + x2) + x1 would give 1.
  const int64_t len = 10;  // not a multiple of the world: the padding path
  std::vector<float> x(len);
  for (int64_t i = 0; i < len; ++i) x[i] = r == 0 ? 1e8f : r == 1 ? 1.0f : -1e8f;
  ASSERT_TRUE(g.all_reduce_sum(x.data(), len));
  for (float v : x) EXPECT_EQ(v, 0.0f);
  // Exact sums and bitwise agreement across ranks.
  std::vector<double> d(len);
  for (int64_t i = 0; i < len; ++i) d[i] = std::pow(2.0, -r) * static_cast<double>(i + 1);
  ASSERT_TRUE(g.all_reduce_sum(d.data(), len));
  for (int64_t i = 0; i < len; ++i) EXPECT_EQ(d[i], 1.75 * static_cast<double>(i + 1));
  // reduce_scatter: rank r gets the sum of every rank's slice r.
  const int64_t per = 4;
  std::vector<float> in(per * n), out(per);
  for (int64_t i = 0; i < per * n; ++i) in[i] = static_cast<float>(100 * r + i);
  ASSERT_TRUE(g.reduce_scatter_sum(in.data(), out.data(), per));
  for (int64_t i = 0; i < per; ++i) EXPECT_EQ(out[i], static_cast<float>(300 + 3 * (r * per + i)));
  // all_gather: rank k's values at [k*per, (k+1)*per).
  std::vector<float> mine(per, static_cast<float>(r + 1)), all(per * n);
  ASSERT_TRUE(g.all_gather(mine.data(), all.data(), per));
  for (int64_t i = 0; i < per * n; ++i) EXPECT_EQ(all[i], static_cast<float>(i / per + 1));
  // broadcast from rank 2.
  std::string b = r == 2 ? "from two" : "xxxxxxxx";
  ASSERT_TRUE(g.broadcast_host(b.data(), 8, 2));
  EXPECT_EQ(b, "from two");
  // agree(): rank 1's error reaches everyone; a later agree() on ok is ok.
  Status a = agree(g, r == 1 ? Status(StatusCode::kDataLoss, "bad shard") : Status::ok());
  ASSERT_FALSE(a);
  EXPECT_EQ(a.code(), StatusCode::kDataLoss);
  EXPECT_EQ(a.message(), r == 1 ? "bad shard" : "rank 1: bad shard");
  EXPECT_TRUE(g.failed_together());
  EXPECT_TRUE(agree(g, Status::ok()));
  // check_ranks_agree(): rank 2 has another data hash.
  Status c = check_ranks_agree(g, {{"run config", "same"}, {"data", r == 2 ? "other" : "same"}});
  ASSERT_FALSE(c);
  EXPECT_NE(c.message().find("ranks disagree on the data: rank 2's differs from rank 0's"), std::string::npos)
      << c.message();
  EXPECT_TRUE(check_ranks_agree(g, {{"run config", "same"}}));
  EXPECT_TRUE(g.barrier());
}

TEST(MpiGroupTest, CollectivesAcrossThreeProcesses) {
  if (under_mpirun()) {  // a worker
    mpi_worker_checks();
    return;
  }
  if (const std::string why = dist::test::why_no_mpirun(); !why.empty()) GTEST_SKIP() << why;
  test::expect_every_rank_passes(3, "MpiGroupTest.CollectivesAcrossThreeProcesses");
}

}  // namespace
}  // namespace nibble::dist
