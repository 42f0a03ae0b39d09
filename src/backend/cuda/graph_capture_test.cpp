// GPU checks of the CUDA backend's graph capture (backend/graph_capture.h): a captured region runs
// nothing until replayed, a replay runs the recorded ops on the buffers' current contents (the
// same bits as the ops run eagerly), the calls a graph cannot hold (allocate, copies to or from
// the host, synchronize) are refused by name while capturing and the backend works after an
// abort, a second begin_capture is refused, memory_epoch() counts deallocations, and a free
// during a capture is held back until it ends. The CPU
// backend has no capture. Skips without a CUDA device.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/graph_capture.h"

namespace nibble::cuda {
namespace {

TEST(GraphCapture, TheCpuBackendHasNone) { EXPECT_EQ(backend::graph_capture(backend::cpu_backend()), nullptr); }

TEST(GraphCapture, ReplayRunsTheRecordedOpsOnCurrentContents) {
  auto made = CudaBackend::create(0);
  if (!made.is_ok()) GTEST_SKIP() << "no CUDA device: " << made.status().message();
  backend::Backend& be = **made;
  backend::GraphCapture* cap = backend::graph_capture(be);
  ASSERT_NE(cap, nullptr);
  const int64_t n = 1000;
  std::vector<float> x(n), y0(n, -1.0f), out(n), eager(n);
  for (int64_t i = 0; i < n; ++i) x[i] = 0.37f * static_cast<float>(i) - 11.0f;
  backend::Buffer<float> xd, yd, ed;
  be.copy_to_device(xd.ensure(be, n, "x"), x.data(), n * sizeof(float));
  be.copy_to_device(yd.ensure(be, n, "y"), y0.data(), n * sizeof(float));
  ed.ensure(be, n, "eager y");
  // y = round_to_bf16(x + x) * 3, recorded
  cap->begin_capture();
  EXPECT_TRUE(cap->capturing());
  be.add(yd.data(), xd.data(), xd.data(), n);
  be.round_to_bf16(yd.data(), yd.data(), n);
  be.scale(yd.data(), n, 3.0f);
  std::unique_ptr<backend::CapturedGraph> g = cap->end_capture();
  EXPECT_FALSE(cap->capturing());
  be.copy_to_host(out.data(), yd.data(), n * sizeof(float));
  EXPECT_EQ(out, y0) << "capturing runs nothing";
  auto eager_y = [&] {
    be.add(ed.data(), xd.data(), xd.data(), n);
    be.round_to_bf16(ed.data(), ed.data(), n);
    be.scale(ed.data(), n, 3.0f);
    be.copy_to_host(eager.data(), ed.data(), n * sizeof(float));
  };
  g->replay();
  be.copy_to_host(out.data(), yd.data(), n * sizeof(float));
  eager_y();
  EXPECT_EQ(std::memcmp(out.data(), eager.data(), n * sizeof(float)), 0);
  // new contents of x: the replay reads them
  for (float& v : x) v = -v + 0.5f;
  be.copy_to_device(xd.data(), x.data(), n * sizeof(float));
  g->replay();
  g->replay();  // idempotent
  be.copy_to_host(out.data(), yd.data(), n * sizeof(float));
  eager_y();
  EXPECT_EQ(std::memcmp(out.data(), eager.data(), n * sizeof(float)), 0);
}

TEST(GraphCapture, RefusesWhatAGraphCannotHoldAndRecovers) {
  auto made = CudaBackend::create(0);
  if (!made.is_ok()) GTEST_SKIP() << "no CUDA device: " << made.status().message();
  backend::Backend& be = **made;
  backend::GraphCapture* cap = backend::graph_capture(be);
  ASSERT_NE(cap, nullptr);
  backend::Buffer<float> xd;
  xd.ensure(be, 16, "x");
  std::vector<float> h(16, 1.0f);
  auto expect_refused = [&](auto&& call, const std::string& op) {
    cap->begin_capture();
    try {
      call();
      ADD_FAILURE() << op << " was not refused while capturing";
    } catch (const CheckError& e) {
      EXPECT_NE(std::string(e.what()).find(op), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("graph capture"), std::string::npos) << e.what();
    }
    EXPECT_THROW(cap->begin_capture(), CheckError);  // one at a time
    cap->abort_capture();
    EXPECT_FALSE(cap->capturing());
  };
  expect_refused([&] { be.copy_to_host(h.data(), xd.data(), 16 * sizeof(float)); }, "copy_to_host");
  expect_refused([&] { be.copy_to_device(xd.data(), h.data(), 16 * sizeof(float)); }, "copy_to_device");
  expect_refused([&] { be.synchronize(); }, "synchronize");
  cap->begin_capture();
  Result<void*> a = be.allocate(64, "a buffer");
  EXPECT_FALSE(a.is_ok());
  EXPECT_NE(a.status().message().find("while capturing a graph"), std::string::npos) << a.status().message();
  cap->abort_capture();
  cap->abort_capture();  // nothing under way: nothing happens
  // the backend works as before
  be.copy_to_device(xd.data(), h.data(), 16 * sizeof(float));
  be.scale(xd.data(), 16, 2.0f);
  std::vector<float> out(16);
  be.copy_to_host(out.data(), xd.data(), 16 * sizeof(float));
  EXPECT_EQ(out, std::vector<float>(16, 2.0f));
  EXPECT_THROW(cap->end_capture(), CheckError);  // none under way
  // deallocations move the epoch, allocations alone do not
  const int64_t e0 = cap->memory_epoch();
  Result<void*> p = be.allocate(256, "epoch probe");
  ASSERT_TRUE(p.is_ok());
  EXPECT_EQ(cap->memory_epoch(), e0);
  be.deallocate(p.value());
  EXPECT_EQ(cap->memory_epoch(), e0 + 1);
  // a free during a capture is held back (no graph node), done when the capture ends
  Result<void*> q = be.allocate(256, "freed while capturing");
  ASSERT_TRUE(q.is_ok());
  cap->begin_capture();
  be.scale(xd.data(), 16, 0.5f);
  be.deallocate(q.value());
  EXPECT_EQ(cap->memory_epoch(), e0 + 2);
  std::unique_ptr<backend::CapturedGraph> g = cap->end_capture();
  g->replay();
  be.copy_to_host(out.data(), xd.data(), 16 * sizeof(float));
  EXPECT_EQ(out, std::vector<float>(16, 1.0f));  // 2 * 0.5: the graph holds the scale, not the free
}

}  // namespace
}  // namespace nibble::cuda
