// `nibble bench collectives`: see collectives_bench.h. One (op, size, path) at a time: the input
// pattern uploaded, one call checked on the host (small integers: exact in FP32 whatever the
// summation order), the verdict agreed by every rank, then warm-up and timed calls on the same
// buffers; the slowest rank's median time (slowest_rank_median) is the same on every rank.
#include "dist/collectives_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>

#include <fmt/format.h>

namespace nibble::dist {

namespace {

class HostMemory final : public GroupMemory {
 public:
  Result<void*> allocate(int64_t bytes) override {
    void* p = std::malloc(static_cast<size_t>(std::max<int64_t>(bytes, 1)));
    if (p == nullptr) return Status(StatusCode::kInternal, fmt::format("out of host memory ({} bytes)", bytes));
    return p;
  }
  void release(void* p) override { std::free(p); }
  Status upload(void* dst, const void* host, int64_t bytes) override {
    std::memcpy(dst, host, static_cast<size_t>(bytes));
    return Status::ok();
  }
  Status download(void* host, const void* src, int64_t bytes) override {
    std::memcpy(host, src, static_cast<size_t>(bytes));
    return Status::ok();
  }
};

// Two buffers of group memory, released on every path out.
struct Buffers {
  GroupMemory& memory;
  void* a = nullptr;  // the input (in place: all-reduce, broadcast)
  void* b = nullptr;  // the output of reduce-scatter and all-gather
  ~Buffers() {
    if (a != nullptr) memory.release(a);
    if (b != nullptr) memory.release(b);
  }
};

// One call of `op` through a path, on buffers a (input) and b (output).
using Call = std::function<Status()>;

struct Shape {
  int64_t count = 0;  // per call argument: f32 elements (per rank for RS/AG), bytes for broadcast
  int64_t bytes = 0;  // nccl-tests' size
  int64_t in_bytes = 0, out_bytes = 0;  // what a and b must hold
};

Shape shape_of(CollectiveOp op, int64_t size, int world) {
  Shape s;
  const int64_t W = world;
  switch (op) {
    case CollectiveOp::kAllReduce:
      s.count = std::max<int64_t>(1, size / 4);
      s.bytes = s.in_bytes = 4 * s.count;
      break;
    case CollectiveOp::kReduceScatter:
      s.count = std::max<int64_t>(1, size / (4 * W));
      s.bytes = s.in_bytes = 4 * W * s.count;
      s.out_bytes = 4 * s.count;
      break;
    case CollectiveOp::kAllGather:
      s.count = std::max<int64_t>(1, size / (4 * W));
      s.in_bytes = 4 * s.count;
      s.bytes = s.out_bytes = 4 * W * s.count;
      break;
    case CollectiveOp::kBroadcast:
      s.count = s.bytes = s.in_bytes = size;
      break;
  }
  return s;
}

uint8_t broadcast_byte(int64_t i) { return static_cast<uint8_t>((i * 31 + 7) & 255); }

// The input of rank `rank` for the checked call (host bytes, in_bytes of them).
std::vector<uint8_t> input_pattern(CollectiveOp op, const Shape& s, int rank) {
  std::vector<uint8_t> host(static_cast<size_t>(s.in_bytes));
  if (op == CollectiveOp::kBroadcast) {
    for (int64_t i = 0; i < s.in_bytes; ++i) host[static_cast<size_t>(i)] = rank == 0 ? broadcast_byte(i) : 0xEE;
    return host;
  }
  auto* f = reinterpret_cast<float*>(host.data());
  for (int64_t i = 0; i < s.in_bytes / 4; ++i) f[i] = static_cast<float>(rank + 1 + i % 7);
  return host;
}

// Checks the checked call's result (`got`: a's bytes for all-reduce/broadcast, b's otherwise).
Status check_result(CollectiveOp op, const Shape& s, int rank, int world, const std::vector<uint8_t>& got,
                    const std::string& what) {
  const int64_t W = world, sum_ranks = W * (W + 1) / 2;
  if (op == CollectiveOp::kBroadcast) {
    for (int64_t i = 0; i < s.count; ++i)
      if (got[static_cast<size_t>(i)] != broadcast_byte(i))
        return Status(StatusCode::kInternal, fmt::format("{}: byte {} on rank {} is {}, rank 0 sent {}", what, i, rank,
                                                         got[static_cast<size_t>(i)], broadcast_byte(i)));
    return Status::ok();
  }
  const auto* f = reinterpret_cast<const float*>(got.data());
  const int64_t n = static_cast<int64_t>(got.size()) / 4;
  for (int64_t i = 0; i < n; ++i) {
    double want = 0;
    if (op == CollectiveOp::kAllReduce) want = static_cast<double>(sum_ranks + W * (i % 7));
    else if (op == CollectiveOp::kReduceScatter) want = static_cast<double>(sum_ranks + W * ((rank * s.count + i) % 7));
    else want = static_cast<double>(i / s.count + 1 + (i % s.count) % 7);  // all-gather: rank q's slice at q*n
    if (static_cast<double>(f[i]) != want)
      return Status(StatusCode::kInternal,
                    fmt::format("{}: element {} on rank {} is {}, expected {}", what, i, rank, f[i], want));
  }
  return Status::ok();
}

using Clock = std::chrono::steady_clock;

// One row: checked call, warm-up, timed calls.
Result<CollectiveRow> measure(ProcessGroup& group, GroupMemory& memory, Buffers& buf, CollectiveOp op,
                              const Shape& s, const std::string& path, const Call& call,
                              const CollectivesBenchOptions& o) {
  const int rank = group.rank(), world = group.world_size();
  const std::string what = fmt::format("{} of {} bytes through {}", collective_op_name(op), s.bytes, path);
  const std::vector<uint8_t> in = input_pattern(op, s, rank);
  NIB_RETURN_IF_ERROR(agree(group, memory.upload(buf.a, in.data(), s.in_bytes)));
  Status checked = call();
  if (checked.is_ok()) {
    const bool in_place = op == CollectiveOp::kAllReduce || op == CollectiveOp::kBroadcast;
    std::vector<uint8_t> got(static_cast<size_t>(in_place ? s.in_bytes : s.out_bytes));
    checked = memory.download(got.data(), in_place ? buf.a : buf.b, static_cast<int64_t>(got.size()));
    if (checked.is_ok()) checked = check_result(op, s, rank, world, got, what);
  } else {
    checked = Status(checked.code(), what + ": " + checked.message());
  }
  NIB_RETURN_IF_ERROR(agree(group, checked));

  for (int i = 0; i < o.warmup; ++i) NIB_RETURN_IF_ERROR(call());
  std::vector<double> times(static_cast<size_t>(o.iters), 0.0);
  for (int i = 0; i < o.iters; ++i) {
    NIB_RETURN_IF_ERROR(group.barrier());
    const auto t0 = Clock::now();
    NIB_RETURN_IF_ERROR(call());
    times[static_cast<size_t>(i)] = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  NIB_ASSIGN_OR_RETURN(const double seconds, slowest_rank_median(group, times, o.iters));

  CollectiveRow row;
  row.op = collective_op_name(op);
  row.path = path;
  row.world = world;
  row.bytes = s.bytes;
  row.count = s.count;
  row.seconds = seconds;
  row.algbw_gbps = row.seconds > 0 ? static_cast<double>(s.bytes) / row.seconds / 1e9 : 0;
  row.bus_factor = bus_factor(op, world);
  row.busbw_gbps = row.algbw_gbps * row.bus_factor;
  row.verified = true;
  return row;
}

// One call of `op` through `c`: a ProcessGroup (nibble's path) or a LibraryCollectives (the
// library's), whose calls share names and arguments.
template <typename Collectives>
Call call_of(Collectives& c, CollectiveOp op, const Shape& s, Buffers& b) {
  auto* a = static_cast<float*>(b.a);
  auto* out = static_cast<float*>(b.b);
  const int64_t n = s.count;
  switch (op) {
    case CollectiveOp::kAllReduce: return [&c, a, n] { return c.all_reduce_sum(a, n); };
    case CollectiveOp::kReduceScatter: return [&c, a, out, n] { return c.reduce_scatter_sum(a, out, n); };
    case CollectiveOp::kAllGather: return [&c, a, out, n] { return c.all_gather(a, out, n); };
    case CollectiveOp::kBroadcast: break;
  }
  return [&c, a, n] { return c.broadcast(a, n, 0); };
}

}  // namespace

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 == 1 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

Result<double> slowest_rank_median(ProcessGroup& group, const std::vector<double>& mine, int64_t count) {
  if (static_cast<int64_t>(mine.size()) != count)
    return invalid_argument("slowest_rank_median: {} times on rank {}, every rank must give {}", mine.size(),
                            group.rank(), count);
  const int world = group.world_size();
  // (world, count): each rank fills its own row, the sum over ranks is the whole table everywhere
  std::vector<double> table(static_cast<size_t>(world * count), 0.0);
  std::copy(mine.begin(), mine.end(), table.begin() + group.rank() * count);
  NIB_RETURN_IF_ERROR(group.all_reduce_sum_host(table.data(), static_cast<int64_t>(table.size())));
  std::vector<double> slowest(static_cast<size_t>(count), 0.0);
  for (int r = 0; r < world; ++r)
    for (int64_t i = 0; i < count; ++i) slowest[i] = std::max(slowest[i], table[r * count + i]);
  return median(std::move(slowest));
}

std::unique_ptr<GroupMemory> make_host_memory() { return std::make_unique<HostMemory>(); }

const char* collective_op_name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllReduce: return "all_reduce";
    case CollectiveOp::kReduceScatter: return "reduce_scatter";
    case CollectiveOp::kAllGather: return "all_gather";
    case CollectiveOp::kBroadcast: return "broadcast";
  }
  return "?";
}

Result<CollectiveOp> parse_collective_op(const std::string& name) {
  if (name == "all_reduce" || name == "allreduce") return CollectiveOp::kAllReduce;
  if (name == "reduce_scatter" || name == "reducescatter") return CollectiveOp::kReduceScatter;
  if (name == "all_gather" || name == "allgather") return CollectiveOp::kAllGather;
  if (name == "broadcast" || name == "bcast") return CollectiveOp::kBroadcast;
  return invalid_argument("collective '{}': all_reduce, reduce_scatter, all_gather or broadcast", name);
}

double bus_factor(CollectiveOp op, int world) {
  if (world <= 1) return 0.0;
  const double n = world;
  switch (op) {
    case CollectiveOp::kAllReduce: return 2 * (n - 1) / n;
    case CollectiveOp::kReduceScatter:
    case CollectiveOp::kAllGather: return (n - 1) / n;
    case CollectiveOp::kBroadcast: return 1.0;
  }
  return 0.0;
}

Result<std::vector<int64_t>> bench_sizes(const CollectivesBenchOptions& o) {
  constexpr int64_t kMaxBytes = int64_t{1} << 30;  // MPI counts are ints; 1 GiB leaves room
  if (o.min_bytes < 1 || o.max_bytes < o.min_bytes || o.max_bytes > kMaxBytes)
    return invalid_argument("collective sizes {}..{} bytes: need 1 <= min <= max <= {}", o.min_bytes, o.max_bytes,
                            kMaxBytes);
  if (o.factor < 2) return invalid_argument("collective size factor {}: must be >= 2", o.factor);
  if (o.warmup < 0 || o.iters < 1)
    return invalid_argument("collectives: {} warm-up and {} timed calls (need >= 0 and >= 1)", o.warmup, o.iters);
  if (o.ops.empty()) return invalid_argument("collectives: no operation to time");
  std::vector<int64_t> sizes;
  for (int64_t s = o.min_bytes; s <= o.max_bytes; s *= o.factor) {
    sizes.push_back(s);
    if (s > o.max_bytes / o.factor) break;
  }
  return sizes;
}

Result<std::vector<CollectiveRow>> bench_collectives(ProcessGroup& group, LibraryCollectives* library,
                                                     GroupMemory& memory, const CollectivesBenchOptions& o) {
  NIB_ASSIGN_OR_RETURN(std::vector<int64_t> sizes, bench_sizes(o));
  const int world = group.world_size();
  int64_t in_need = 1, out_need = 1;
  for (CollectiveOp op : o.ops)
    for (int64_t size : sizes) {
      const Shape s = shape_of(op, size, world);
      in_need = std::max(in_need, s.in_bytes);
      out_need = std::max(out_need, s.out_bytes);
    }
  Buffers buf{memory};
  {
    auto a = memory.allocate(in_need);
    auto b = a.is_ok() ? memory.allocate(out_need) : Result<void*>(a.status());
    if (a.is_ok()) buf.a = *a;
    if (b.is_ok()) buf.b = *b;
    NIB_RETURN_IF_ERROR(agree(group, b.is_ok() ? Status::ok() : b.status()));
  }
  std::vector<CollectiveRow> rows;
  for (CollectiveOp op : o.ops)
    for (int64_t size : sizes) {
      const Shape s = shape_of(op, size, world);
      NIB_ASSIGN_OR_RETURN(CollectiveRow mine, measure(group, memory, buf, op, s, "nibble",
                                                       call_of(group, op, s, buf), o));
      rows.push_back(mine);
      if (library == nullptr) continue;
      NIB_ASSIGN_OR_RETURN(CollectiveRow lib, measure(group, memory, buf, op, s, library->library(),
                                                      call_of(*library, op, s, buf), o));
      if (lib.algbw_gbps > 0) rows.back().ratio_to_library = mine.algbw_gbps / lib.algbw_gbps;
      rows.push_back(lib);
    }
  return rows;
}

}  // namespace nibble::dist
