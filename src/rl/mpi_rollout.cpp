// Rank 0's rollout client and the rollout ranks' server over the process group's host broadcasts
// (mpi_rollout.h): message framing in buckets, the binary forms of weights, jobs and replies, the
// split of a step's requests among the rollout ranks and their reassembly on rank 0.
#include "rl/mpi_rollout.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <type_traits>

#include "core/check.h"
#include "rollout/precision.h"

namespace nibble::rl {

namespace {

enum class MsgKind : int64_t { kWeights = 1, kJob = 2, kFinish = 3, kStop = 4, kReply = 5 };

// ---- binary writer / reader (host byte order: both ranks run this build on one machine kind) ----
struct Writer {
  std::vector<uint8_t> bytes;
  template <typename T>
  void put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof(T));
  }
  void put_raw(const void* p, size_t n) {
    put<int64_t>(static_cast<int64_t>(n));
    const auto* b = static_cast<const uint8_t*>(p);
    bytes.insert(bytes.end(), b, b + n);
  }
  template <typename T>
  void put_vec(const std::vector<T>& v) {
    put_raw(v.data(), v.size() * sizeof(T));
  }
  void put_str(const std::string& s) { put_raw(s.data(), s.size()); }
};

struct Reader {
  explicit Reader(const std::vector<uint8_t>& b) : bytes(b) {}
  const std::vector<uint8_t>& bytes;
  size_t off = 0;
  Status status;
  bool take(void* dst, size_t n) {
    if (!status.is_ok() || off + n > bytes.size()) {
      if (status.is_ok()) status = data_loss("rollout message: truncated at byte {} of {}", off, bytes.size());
      return false;
    }
    if (n > 0) std::memcpy(dst, bytes.data() + off, n);
    off += n;
    return true;
  }
  template <typename T>
  T get() {
    T v{};
    take(&v, sizeof(T));
    return v;
  }
  size_t get_len(size_t elem) {
    const int64_t n = get<int64_t>();
    if (n < 0 || n % static_cast<int64_t>(elem) != 0 || off + static_cast<size_t>(n) > bytes.size()) {
      if (status.is_ok()) status = data_loss("rollout message: bad length {} at byte {}", n, off);
      return 0;
    }
    return static_cast<size_t>(n);
  }
  template <typename T>
  std::vector<T> get_vec() {
    const size_t n = get_len(sizeof(T));
    std::vector<T> v(n / sizeof(T));
    take(v.data(), n);
    return v;
  }
  std::string get_str() {
    const size_t n = get_len(1);
    std::string s(n, '\0');
    take(s.data(), n);
    return s;
  }
};

// ---- framing: a header {kind, bytes} then the payload in buckets, all from `root` ----
Status send_message(dist::ProcessGroup& g, int root, MsgKind kind, std::vector<uint8_t>* payload) {
  int64_t header[2] = {static_cast<int64_t>(kind), payload ? static_cast<int64_t>(payload->size()) : 0};
  NIB_RETURN_IF_ERROR(g.broadcast_host(header, sizeof header, root));
  for (int64_t o = 0; payload && o < header[1]; o += kBucketBytes)
    NIB_RETURN_IF_ERROR(g.broadcast_host(payload->data() + o, std::min(kBucketBytes, header[1] - o), root));
  return Status::ok();
}

Result<std::pair<MsgKind, std::vector<uint8_t>>> receive_message(dist::ProcessGroup& g, int root) {
  int64_t header[2] = {0, 0};
  NIB_RETURN_IF_ERROR(g.broadcast_host(header, sizeof header, root));
  if (header[1] < 0) return data_loss("rollout message: negative size {}", header[1]);
  std::vector<uint8_t> payload(static_cast<size_t>(header[1]));
  for (int64_t o = 0; o < header[1]; o += kBucketBytes)
    NIB_RETURN_IF_ERROR(g.broadcast_host(payload.data() + o, std::min(kBucketBytes, header[1] - o), root));
  return std::make_pair(static_cast<MsgKind>(header[0]), std::move(payload));
}

// ---- weights ----
void put_weights(Writer& w, const PolicyWeights& p) {
  w.put<int64_t>(p.version);
  std::vector<io::NamedTensor> named;
  p.append_named(named);
  w.put<int64_t>(static_cast<int64_t>(named.size()));
  for (const io::NamedTensor& nt : named) {
    w.put_str(nt.name);
    w.put<int32_t>(static_cast<int32_t>(nt.tensor.dtype()));
    w.put<int64_t>(nt.tensor.numel());
    w.put_raw(nt.tensor.raw(), nt.tensor.nbytes());
  }
}

Result<PolicyWeights> get_weights(Reader& r, model::Model& model, rollout::PrecisionMode mode,
                                  const std::string& recipe_name) {
  const int64_t version = r.get<int64_t>();
  const int64_t n = r.get<int64_t>();
  std::vector<io::NamedTensor> named;
  for (int64_t i = 0; i < n && r.status.is_ok(); ++i) {
    std::string name = r.get_str();
    const auto dt = static_cast<DType>(r.get<int32_t>());
    const int64_t numel = r.get<int64_t>();
    const size_t bytes = r.get_len(1);
    if (!r.status.is_ok()) break;
    if (numel < 0 || static_cast<size_t>(numel) * dtype_size(dt) != bytes)
      return data_loss("rollout message: tensor '{}' holds {} bytes for {} elements", name, bytes, numel);
    Tensor t(dt, {numel});
    r.take(t.raw(), bytes);
    named.push_back({std::move(name), std::move(t)});
  }
  NIB_RETURN_IF_ERROR(r.status);
  NIB_ASSIGN_OR_RETURN(std::vector<PolicyWeights> ps, policies_from_named(named, model, mode, recipe_name));
  if (ps.size() != 1 || ps[0].version != version)
    return data_loss("rollout message: expected policy version {} alone, got {} versions", version, ps.size());
  return std::move(ps[0]);
}

// ---- the host weight transport: the version's tensors serialized, one message over the host path ----
class HostWeightTransport final : public WeightTransport {
 public:
  HostWeightTransport(dist::ProcessGroup& group, model::Model& model, rollout::PrecisionMode mode,
                      std::string recipe_name)
      : group_(group), model_(model), mode_(mode), recipe_name_(std::move(recipe_name)) {}
  const char* name() const override { return "host"; }
  bool wants_packed() const override { return false; }
  Status send(const PolicyWeights& w) override {
    Writer out;
    put_weights(out, w);  // a packed version is copied to host by append_named
    return send_message(group_, 0, MsgKind::kWeights, &out.bytes);
  }
  Result<PolicyWeights> receive() override {
    NIB_ASSIGN_OR_RETURN(auto msg, receive_message(group_, 0));
    if (msg.first != MsgKind::kWeights)
      return data_loss("host weight transport: expected weights, got message kind {}", static_cast<int64_t>(msg.first));
    Reader r{msg.second};
    return get_weights(r, model_, mode_, recipe_name_);
  }

 private:
  dist::ProcessGroup& group_;
  model::Model& model_;
  rollout::PrecisionMode mode_;
  std::string recipe_name_;
};

// ---- jobs ----
void put_job(Writer& w, const RolloutJob& j) {
  w.put<int64_t>(j.step), w.put<int64_t>(j.version);
  w.put<uint8_t>(j.record_routing), w.put<uint8_t>(j.record_guidance);
  w.put<uint8_t>(static_cast<uint8_t>(j.guidance_mode));
  w.put_vec(j.guidance_layers);
  w.put_str(j.guidance_spill_dir);
  w.put<int64_t>(static_cast<int64_t>(j.requests.size()));
  for (const rollout::Request& q : j.requests) {
    w.put<uint64_t>(q.id);
    w.put_vec(q.prompt);
    const rollout::GenerationParams& p = q.params;
    w.put<double>(p.sampling.temperature), w.put<int64_t>(p.sampling.top_k), w.put<double>(p.sampling.top_p);
    w.put<int64_t>(p.max_new_tokens);
    w.put_vec(p.stop_ids);
    w.put<int64_t>(static_cast<int64_t>(p.stop_strings.size()));
    for (const std::string& s : p.stop_strings) w.put_str(s);
    w.put<uint64_t>(p.seed), w.put<int64_t>(p.num_samples);
  }
}

Result<RolloutJob> get_job(Reader& r) {
  RolloutJob j;
  j.step = r.get<int64_t>(), j.version = r.get<int64_t>();
  j.record_routing = r.get<uint8_t>() != 0, j.record_guidance = r.get<uint8_t>() != 0;
  j.guidance_mode = static_cast<rollout::GuidanceMode>(r.get<uint8_t>());
  j.guidance_layers = r.get_vec<int64_t>();
  j.guidance_spill_dir = r.get_str();
  const int64_t n = r.get<int64_t>();
  for (int64_t i = 0; i < n && r.status.is_ok(); ++i) {
    rollout::Request q;
    q.id = r.get<uint64_t>();
    q.prompt = r.get_vec<int32_t>();
    rollout::GenerationParams& p = q.params;
    p.sampling.temperature = r.get<double>(), p.sampling.top_k = r.get<int64_t>(), p.sampling.top_p = r.get<double>();
    p.max_new_tokens = r.get<int64_t>();
    p.stop_ids = r.get_vec<int32_t>();
    const int64_t ns = r.get<int64_t>();
    for (int64_t k = 0; k < ns && r.status.is_ok(); ++k) p.stop_strings.push_back(r.get_str());
    p.seed = r.get<uint64_t>(), p.num_samples = r.get<int64_t>();
    j.requests.push_back(std::move(q));
  }
  NIB_RETURN_IF_ERROR(r.status);
  return j;
}

// ---- replies: the batch (or the error) ----
int64_t to_ns(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

Status put_records(Writer& w, rollout::RecordStore& store) {
  const std::vector<uint64_t> seqs = store.sequences();
  Writer body;
  int64_t count = 0;
  for (uint64_t s : seqs) {
    NIB_RETURN_IF_ERROR(store.for_each_in_sequence(s, [&](const rollout::RecordKey& k, std::span<const uint8_t> p) {
      body.put<uint64_t>(k.sequence), body.put<uint32_t>(k.position), body.put<uint16_t>(k.layer),
          body.put<uint16_t>(k.site);
      body.put_raw(p.data(), p.size());
      ++count;
      return Status::ok();
    }));
  }
  w.put<int64_t>(count);
  w.bytes.insert(w.bytes.end(), body.bytes.begin(), body.bytes.end());
  return Status::ok();
}

Status get_records(Reader& r, rollout::RecordStore& store) {
  const int64_t n = r.get<int64_t>();
  rollout::RecordBatch batch;
  for (int64_t i = 0; i < n && r.status.is_ok(); ++i) {
    rollout::RecordKey k;
    k.sequence = r.get<uint64_t>(), k.position = r.get<uint32_t>(), k.layer = r.get<uint16_t>(),
    k.site = r.get<uint16_t>();
    std::vector<uint8_t> payload = r.get_vec<uint8_t>();
    if (!r.status.is_ok()) break;
    batch.add(k, payload);
  }
  NIB_RETURN_IF_ERROR(r.status);
  NIB_RETURN_IF_ERROR(store.append_batch(std::move(batch)));
  return store.flush();
}

Status put_reply(Writer& w, Result<RolloutBatch>& res) {
  w.put<int32_t>(static_cast<int32_t>(res.status().code()));
  w.put_str(res.status().message());
  if (!res.is_ok()) return Status::ok();
  RolloutBatch& b = res.value();
  w.put<int64_t>(b.step), w.put<int64_t>(b.version), w.put<int64_t>(b.generated_tokens);
  w.put<int64_t>(to_ns(b.began)), w.put<int64_t>(to_ns(b.ended));
  w.put<int64_t>(static_cast<int64_t>(b.completions.size()));
  for (const rollout::Completion& c : b.completions) {
    w.put<int64_t>(c.request), w.put<int64_t>(c.sample);
    w.put_vec(c.tokens), w.put_vec(c.logprobs);
    w.put<int32_t>(static_cast<int32_t>(c.finish));
  }
  NIB_RETURN_IF_ERROR(put_records(w, *b.routing));
  return put_records(w, *b.guidance);
}

}  // namespace

// ---- rank 0 ----------------------------------------------------------------------------------------

RequestShare rollout_share(int64_t requests, int rollout_ranks, int index) {
  NIB_CHECK(rollout_ranks >= 1 && index >= 0 && index < rollout_ranks && requests >= 0);
  const int64_t base = requests / rollout_ranks, extra = requests % rollout_ranks, k = index;
  RequestShare s;
  s.begin = k * base + std::min(k, extra);
  s.end = s.begin + base + (k < extra ? 1 : 0);
  return s;
}

Status check_rollout_world(int world_size, int64_t prompts_per_step) {
  if (world_size < 2)
    return invalid_argument("disaggregated rl: a world of at least 2 processes (rank 0 trains, the others roll out), got {}",
                            world_size);
  if (world_size - 1 > prompts_per_step)
    return invalid_argument(
        "disaggregated rl: {} rollout ranks but {} prompts per step (each rank needs a whole prompt group): "
        "run at most {} processes or raise prompts_per_step",
        world_size - 1, prompts_per_step, prompts_per_step + 1);
  return Status::ok();
}

Result<std::unique_ptr<WeightTransport>> make_weight_transport(dist::ProcessGroup& group, model::Model& model,
                                                               rollout::PrecisionMode mode,
                                                               const std::string& recipe_name, int64_t versions_held,
                                                               WeightTransportKind kind) {
  const bool on_gpus = group.device_memory() && model.backend().device() != Device::kCPU;
  if (kind == WeightTransportKind::kDevice || (kind == WeightTransportKind::kAuto && on_gpus))
    return make_device_weight_transport(group, model, mode, recipe_name, versions_held);
  return std::unique_ptr<WeightTransport>(new HostWeightTransport(group, model, mode, recipe_name));
}

Result<std::unique_ptr<MpiRolloutClient>> MpiRolloutClient::create(dist::ProcessGroup& group, model::Model& trainer,
                                                                   rollout::PrecisionMode mode,
                                                                   const std::string& recipe_name,
                                                                   WeightTransportKind transport) {
  if (group.world_size() < 2 || group.rank() != 0)
    return invalid_argument("disaggregated rl: rank 0 of a world of at least 2 processes trains, got rank {} of {}",
                            group.rank(), group.world_size());
  std::unique_ptr<MpiRolloutClient> c(new MpiRolloutClient(group));
  NIB_ASSIGN_OR_RETURN(c->transport_, make_weight_transport(group, trainer, mode, recipe_name, /*versions_held=*/1, transport));
  return c;
}

MpiRolloutClient::~MpiRolloutClient() {
  if (!stopped_) (void)send_message(group_, 0, MsgKind::kStop, nullptr);
}

Status MpiRolloutClient::send(std::shared_ptr<const PolicyWeights> weights) {
  NIB_RETURN_IF_ERROR(send_message(group_, 0, MsgKind::kWeights, nullptr));  // then the transport's own
  return transport_->send(*weights);
}

Status MpiRolloutClient::start(RolloutJob job) {
  NIB_CHECK_MSG(!running_, "rollout client: start() while a job runs (call finish() first)");
  NIB_RETURN_IF_ERROR(check_rollout_world(group_.world_size(), static_cast<int64_t>(job.requests.size())));
  Writer w;
  put_job(w, job);
  NIB_RETURN_IF_ERROR(send_message(group_, 0, MsgKind::kJob, &w.bytes));
  job_ = std::move(job);
  running_ = true;
  return Status::ok();
}

namespace {

// Adds rollout rank `rank`'s reply (its share starting at request `first`) to `b`: completions
// with their request index made global, its records, its token count and time interval. The
// first reply sets the step and version; the others must carry the same.
Status add_reply(Reader& r, int rank, int64_t first, int64_t share, bool first_reply, RolloutBatch& b) {
  const auto code = static_cast<StatusCode>(r.get<int32_t>());
  std::string message = r.get_str();
  NIB_RETURN_IF_ERROR(r.status);
  if (code != StatusCode::kOk) return Status(code, fmt::format("rollout rank {}: {}", rank, message));
  const int64_t step = r.get<int64_t>(), version = r.get<int64_t>(), tokens = r.get<int64_t>();
  const auto began = std::chrono::steady_clock::time_point(std::chrono::nanoseconds(r.get<int64_t>()));
  const auto ended = std::chrono::steady_clock::time_point(std::chrono::nanoseconds(r.get<int64_t>()));
  NIB_RETURN_IF_ERROR(r.status);
  if (first_reply) {
    b.step = step, b.version = version, b.began = began, b.ended = ended;
  } else if (step != b.step || version != b.version) {
    return data_loss("rollout rank {}: step {} version {}, rank 1 sent step {} version {}", rank, step, version, b.step,
                     b.version);
  }
  b.generated_tokens += tokens;
  b.began = std::min(b.began, began), b.ended = std::max(b.ended, ended);
  const int64_t n = r.get<int64_t>();
  for (int64_t i = 0; i < n && r.status.is_ok(); ++i) {
    rollout::Completion c;
    c.request = r.get<int64_t>(), c.sample = r.get<int64_t>();
    c.tokens = r.get_vec<int32_t>(), c.logprobs = r.get_vec<double>();
    c.finish = static_cast<rollout::FinishReason>(r.get<int32_t>());
    if (r.status.is_ok() && (c.request < 0 || c.request >= share))
      return data_loss("rollout rank {}: completion of request {} outside its share of {}", rank, c.request, share);
    c.request += first;
    b.completions.push_back(std::move(c));
  }
  NIB_RETURN_IF_ERROR(r.status);
  NIB_RETURN_IF_ERROR(get_records(r, *b.routing));
  return get_records(r, *b.guidance);
}

}  // namespace

Result<RolloutBatch> MpiRolloutClient::finish() {
  NIB_CHECK_MSG(running_, "rollout client: finish() without a started job");
  running_ = false;
  NIB_RETURN_IF_ERROR(send_message(group_, 0, MsgKind::kFinish, nullptr));
  RolloutBatch b;
  NIB_RETURN_IF_ERROR(open_record_stores(b, job_.guidance_spill_dir));
  const int ranks = group_.world_size() - 1;
  const auto requests = static_cast<int64_t>(job_.requests.size());
  Status first_error = Status::ok();  // every reply is received (the servers send them all) before it is returned
  for (int k = 0; k < ranks; ++k) {
    NIB_ASSIGN_OR_RETURN(auto msg, receive_message(group_, k + 1));
    if (!first_error.is_ok()) continue;
    if (msg.first != MsgKind::kReply) {
      first_error = data_loss("rollout client: expected a reply from rank {}, got message kind {}", k + 1,
                              static_cast<int64_t>(msg.first));
      continue;
    }
    const RequestShare sh = rollout_share(requests, ranks, k);
    Reader r{msg.second};
    first_error = add_reply(r, k + 1, sh.begin, sh.end - sh.begin, k == 0, b);
  }
  NIB_RETURN_IF_ERROR(first_error);
  b.requests = std::move(job_.requests);
  return b;
}

// ---- ranks 1..N-1 ----------------------------------------------------------------------------------

Status serve_rollouts(dist::ProcessGroup& group, const model::ModelConfig& config, const model::RecipeConfig& recipe,
                      backend::Backend* backend, const rollout::EngineOptions& engine_options, int64_t max_staleness,
                      WeightTransportKind transport_kind) {
  if (group.world_size() < 2 || group.rank() < 1)
    return invalid_argument("disaggregated rl: the rollout servers are ranks 1.. of a world of at least 2, got rank {} of {}",
                            group.rank(), group.world_size());
  const int ranks = group.world_size() - 1, index = group.rank() - 1;
  NIB_ASSIGN_OR_RETURN(std::unique_ptr<ThreadRolloutWorker> worker,
                       ThreadRolloutWorker::create(config, recipe, backend, engine_options));
  // room for the versions the worker may still generate from (max_staleness + 1) and the one arriving
  NIB_ASSIGN_OR_RETURN(std::unique_ptr<WeightTransport> transport,
                       make_weight_transport(group, worker->model(), engine_options.mode, engine_options.recipe_name,
                                             std::max<int64_t>(max_staleness, 0) + 2, transport_kind));
  Status pending = Status::ok();  // the first error of a version or job, reported at the next finish
  bool running = false;
  for (;;) {
    NIB_ASSIGN_OR_RETURN(auto msg, receive_message(group, 0));
    Reader r{msg.second};
    switch (msg.first) {
      case MsgKind::kWeights: {
        Result<PolicyWeights> w = transport->receive();
        Status st = w.is_ok() ? worker->send(std::make_shared<const PolicyWeights>(std::move(w).value())) : w.status();
        if (pending.is_ok()) pending = st;
        break;
      }
      case MsgKind::kJob: {
        Result<RolloutJob> job = get_job(r);
        if (job.is_ok() && pending.is_ok()) {
          RolloutJob& j = job.value();
          // this rank's share: whole requests, their ids (Philox streams, record keys) kept
          const RequestShare sh = rollout_share(static_cast<int64_t>(j.requests.size()), ranks, index);
          j.requests = std::vector<rollout::Request>(j.requests.begin() + sh.begin, j.requests.begin() + sh.end);
          // rank 0's run folder may not be visible here: spill into this host's temp folder
          j.guidance_spill_dir = (std::filesystem::temp_directory_path() /
                                  fmt::format("nibble_rollout_spill_{}_{}", static_cast<long>(::getpid()), j.step % 2))
                                     .string();
          pending = worker->start(std::move(j));
          running = pending.is_ok();
        } else if (pending.is_ok()) {
          pending = job.status();
        }
        break;
      }
      case MsgKind::kFinish: {
        Result<RolloutBatch> res = Status(StatusCode::kInternal, "rollout server: finish without a started job");
        if (running) res = worker->finish();
        running = false;
        if (!pending.is_ok()) res = pending;
        // the replies go in rank order, each a broadcast from its rank: the others' are dropped
        for (int k = 1; k <= ranks; ++k) {
          if (k == group.rank()) {
            Writer w;
            NIB_RETURN_IF_ERROR(put_reply(w, res));
            NIB_RETURN_IF_ERROR(send_message(group, k, MsgKind::kReply, &w.bytes));
          } else {
            NIB_RETURN_IF_ERROR(receive_message(group, k).status());
          }
        }
        pending = Status::ok();
        break;
      }
      case MsgKind::kStop:
        if (running) (void)worker->finish();
        return Status::ok();
      default:
        return data_loss("rollout server: unknown message kind {}", static_cast<int64_t>(msg.first));
    }
  }
}

}  // namespace nibble::rl
