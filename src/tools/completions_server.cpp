// The completions server (see completions_server.h): request parsing and checking, the job a
// request becomes (one engine request per prompt, n samples each), the engine thread's
// continuous batching loop, JSON and server-sent-event answers, and shutdown that lets the
// requests in flight finish. Locks: Impl::mu guards the queue and the counters, Job::mu a job's
// choices; no code holds both at once.
#include "tools/completions_server.h"

#include <httplib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/parallel.h"

namespace nibble::tools {
namespace {

using json = nlohmann::json;

// An OpenAI-style error: the HTTP status and {"error": {message, type, param, code}}.
struct ApiError {
  ApiError(int status_, std::string message_, std::string param_ = "", std::string type_ = "invalid_request_error",
           std::string code_ = "")
      : status(status_), message(std::move(message_)), param(std::move(param_)), type(std::move(type_)),
        code(std::move(code_)) {}
  int status;
  std::string message;
  std::string param;  // the offending field ("" for none)
  std::string type;
  std::string code;   // "" for none
};

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json error_json(const ApiError& e) {
  auto or_null = [](const std::string& s) { return s.empty() ? json(nullptr) : json(s); };
  return {{"error", {{"message", e.message}, {"type", e.type}, {"param", or_null(e.param)}, {"code", or_null(e.code)}}}};
}

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(dump(error_json(e)), "application/json");
}

ApiError bad_field(const std::string& field, const std::string& what) {
  return ApiError{400, "'" + field + "' " + what, field};
}

// An integer field in [lo, hi] (JSON integers only: 16.0, "16" and true are not integers).
std::optional<ApiError> int_field(const json& v, const std::string& field, int64_t lo, int64_t hi, int64_t* out) {
  const std::string range = "must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(hi) || static_cast<int64_t>(u) < lo) return bad_field(field, range);
    *out = static_cast<int64_t>(u);
    return std::nullopt;
  }
  if (!v.is_number_integer()) return bad_field(field, range);
  const int64_t i = v.get<int64_t>();
  if (i < lo || i > hi) return bad_field(field, range);
  *out = i;
  return std::nullopt;
}

// A number field in [lo, hi] (lo excluded when lo_open).
std::optional<ApiError> number_field(const json& v, const std::string& field, double lo, double hi, bool lo_open,
                                     double* out) {
  const std::string range = std::string("must be a number in ") + (lo_open ? "(" : "[") + fmt::format("{}, {}]", lo, hi);
  if (!v.is_number()) return bad_field(field, range);
  const double d = v.get<double>();
  if (!(lo_open ? d > lo : d >= lo) || !(d <= hi)) return bad_field(field, range);
  *out = d;
  return std::nullopt;
}

// A parsed and checked POST /v1/completions body.
struct CompletionSpec {
  std::vector<std::vector<int32_t>> prompts;  // token ids, one per prompt
  int64_t max_tokens = 16, top_k = 0, n = 1;
  double temperature = 1.0, top_p = 1.0;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool logprobs = false, stream = false;
};

// What parsing needs to know of the model and the server.
struct Limits {
  const train::Tokenizer* tokenizer = nullptr;
  std::string model_id;
  int64_t context = 0, vocab = 0, max_batch = 0, capacity = 0, max_new_tokens = 0;
};

std::optional<ApiError> parse_prompt(const json& v, const Limits& lim, std::vector<std::vector<int32_t>>* out) {
  const std::string kinds = "must be a string, an array of strings, an array of token ids or an array of arrays of "
                            "token ids";
  auto encode = [&](const std::string& text) -> std::optional<ApiError> {
    auto ids = lim.tokenizer->encode(text);
    if (!ids) return ApiError{400, "'prompt' cannot be tokenized: " + ids.status().message(), "prompt"};
    if (ids->empty()) ids->push_back(lim.tokenizer->eos_id());  // an empty prompt starts a new document
    out->push_back(std::move(*ids));
    return std::nullopt;
  };
  auto token_ids = [&](const json& a) -> std::optional<ApiError> {
    std::vector<int32_t> ids;
    for (const json& t : a) {
      int64_t id = 0;
      if (int_field(t, "prompt", 0, lim.vocab - 1, &id))
        return bad_field("prompt", "token ids must be integers in [0, " + std::to_string(lim.vocab - 1) + "]");
      ids.push_back(static_cast<int32_t>(id));
    }
    if (ids.empty()) return bad_field("prompt", "holds an empty list of token ids");
    out->push_back(std::move(ids));
    return std::nullopt;
  };
  if (v.is_string()) return encode(v.get<std::string>());
  if (!v.is_array() || v.empty()) return bad_field("prompt", kinds);
  if (std::all_of(v.begin(), v.end(), [](const json& e) { return e.is_number(); })) return token_ids(v);
  for (const json& e : v) {
    std::optional<ApiError> err;
    if (e.is_string()) err = encode(e.get<std::string>());
    else if (e.is_array()) err = token_ids(e);
    else err = bad_field("prompt", kinds);
    if (err) return err;
  }
  return std::nullopt;
}

std::optional<ApiError> parse_completion(const std::string& body, const Limits& lim, CompletionSpec* spec) {
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return ApiError{400, "the request body is not valid JSON"};
  if (!j.is_object()) return ApiError{400, "the request body must be a JSON object"};
  if (!j.contains("prompt")) return bad_field("prompt", "is required");
  for (const auto& [key, v] : j.items()) {
    std::optional<ApiError> err;
    if (v.is_null() && key != "prompt") continue;  // null: the default
    if (key == "model") {
      if (!v.is_string()) err = bad_field(key, "must be a string");
      else if (v.get<std::string>() != lim.model_id)
        err = ApiError{404, "the model '" + v.get<std::string>() + "' does not exist (this server serves '" +
                                lim.model_id + "')", key, "invalid_request_error", "model_not_found"};
    } else if (key == "prompt") {
      err = parse_prompt(v, lim, &spec->prompts);
    } else if (key == "max_tokens") {
      err = int_field(v, key, 0, lim.max_new_tokens, &spec->max_tokens);
    } else if (key == "temperature") {
      err = number_field(v, key, 0, 2, false, &spec->temperature);
    } else if (key == "top_p") {
      err = number_field(v, key, 0, 1, true, &spec->top_p);
    } else if (key == "top_k") {  // an extension; -1 (vLLM's "off") is 0
      err = int_field(v, key, -1, std::numeric_limits<int32_t>::max(), &spec->top_k);
      spec->top_k = std::max<int64_t>(spec->top_k, 0);
    } else if (key == "n") {
      err = int_field(v, key, 1, lim.max_batch, &spec->n);
    } else if (key == "seed") {
      if (v.is_number_unsigned()) spec->seed = v.get<uint64_t>();
      else if (v.is_number_integer() && v.get<int64_t>() >= 0) spec->seed = static_cast<uint64_t>(v.get<int64_t>());
      else err = bad_field(key, "must be an integer in [0, 2^64 - 1]");
    } else if (key == "stop") {
      if (v.is_string()) spec->stop = {v.get<std::string>()};
      else if (v.is_array() && v.size() <= 4 && std::all_of(v.begin(), v.end(), [](const json& s) { return s.is_string(); }))
        for (const json& s : v) spec->stop.push_back(s.get<std::string>());
      else err = bad_field(key, "must be a string or an array of at most 4 strings");
      if (!err && std::any_of(spec->stop.begin(), spec->stop.end(), [](const std::string& s) { return s.empty(); }))
        err = bad_field(key, "holds an empty string");
    } else if (key == "logprobs") {
      int64_t k = 0;
      err = int_field(v, key, 0, 5, &k);
      spec->logprobs = true;
    } else if (key == "stream") {
      if (!v.is_boolean()) err = bad_field(key, "must be true or false");
      else spec->stream = v.get<bool>();
    } else if (key == "user") {
      if (!v.is_string()) err = bad_field(key, "must be a string");
    } else {
      err = ApiError{400, "unknown or unsupported field '" + key + "'", key};
    }
    if (err) return err;
  }
  if (spec->stream && spec->logprobs) return bad_field("logprobs", "is not supported with 'stream' (yet)");
  const int64_t sequences = static_cast<int64_t>(spec->prompts.size()) * spec->n;
  if (sequences > lim.capacity)
    return ApiError{400, fmt::format("{} prompts x n {} = {} sequences, more than this server holds at once ({})",
                                     spec->prompts.size(), spec->n, sequences, lim.capacity), "n"};
  for (const std::vector<int32_t>& p : spec->prompts) {
    const int64_t P = static_cast<int64_t>(p.size());
    if (P + spec->max_tokens > lim.context)
      return ApiError{400, fmt::format("this model's maximum context length is {} tokens, but {} were requested ({} in "
                                       "the prompt, {} for the completion): shorten the prompt or lower max_tokens",
                                       lim.context, P + spec->max_tokens, P, spec->max_tokens), "max_tokens",
                      "invalid_request_error", "context_length_exceeded"};
  }
  return std::nullopt;
}

// One choice's tokens as the engine produced them.
struct Choice {
  std::vector<int32_t> tokens;
  std::vector<double> logprobs;
  bool finished = false;
  rollout::FinishReason finish = rollout::FinishReason::kLength;
};

// One HTTP completion request in flight: its engine requests (one per prompt) and their choices
// (prompt-major: choice p * n + s is sample s of prompt p).
struct Job {
  std::vector<rollout::Request> requests;
  CompletionSpec spec;
  std::atomic<bool> cancelled{false};
  std::mutex mu;  // guards what follows
  std::condition_variable cv;
  std::vector<Choice> choices;
  int64_t open = 0;  // choices not finished
  Status error;      // the engine's failure, if it failed
};

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// A choice's text: its tokens (without a final stop id) decoded, cut before the first stop
// string. Unless final, what may be sent now without being taken back later: no trailing U+FFFD
// (a character whose bytes have not all arrived) and none of the last (longest stop - 1) bytes,
// which may begin a stop string, cut on a UTF-8 character boundary.
Result<std::string> choice_text(const train::Tokenizer& tok, std::vector<int32_t> ids,
                                const std::vector<std::string>& stops, bool final) {
  if (!ids.empty() && ids.back() == tok.eos_id()) ids.pop_back();  // eos is the stop id (the only one)
  NIB_ASSIGN_OR_RETURN(std::string text, tok.decode(ids));
  size_t cut = std::string::npos;
  for (const std::string& s : stops) cut = std::min(cut, text.find(s));
  if (cut != std::string::npos) {
    text.resize(cut);
    return text;
  }
  if (final) return text;
  static const std::string kReplacement = "\xEF\xBF\xBD";
  while (ends_with(text, kReplacement)) text.resize(text.size() - kReplacement.size());
  size_t hold = 0;
  for (const std::string& s : stops) hold = std::max(hold, s.size() - 1);
  size_t keep = text.size() > hold ? text.size() - hold : 0;
  while (keep > 0 && keep < text.size() && (static_cast<unsigned char>(text[keep]) & 0xC0) == 0x80) --keep;
  text.resize(keep);
  return text;
}

// Seconds a client has to send its request once connected, and to send the rest of it.
constexpr time_t kClientSendTimeoutSeconds = 5;

const char* openai_finish_reason(rollout::FinishReason r) {
  return r == rollout::FinishReason::kLength ? "length" : "stop";
}

}  // namespace

struct CompletionsServer::Impl {
  rollout::Engine& engine;
  const train::Tokenizer& tokenizer;
  ServeOptions options;
  Limits limits;
  int64_t started_at = 0;
  httplib::Server http;
  int listen_socket = -1;  // the socket start() bound (the last one httplib's socket options saw)
  std::atomic<bool> listen_returned{false};  // httplib's accept loop has ended
  std::thread http_thread, engine_thread;
  std::atomic<uint64_t> next_id{1};

  mutable std::mutex mu;  // guards what follows
  std::condition_variable engine_cv, drained_cv;
  std::deque<std::shared_ptr<Job>> pending;  // accepted, not yet handed to the engine
  int64_t open_responses = 0;                // accepted requests whose answer is not fully written
  bool accepting = false, engine_stop = false, stopped = false;
  ServeCounters counters;

  Impl(rollout::Engine& e, const train::Tokenizer& t, const ServeOptions& o) : engine(e), tokenizer(t), options(o) {}

  void engine_loop();
  void routes();
  void complete(const httplib::Request& req, httplib::Response& res);
  std::optional<ApiError> submit(const std::shared_ptr<Job>& job);
  void settle(const Job& job, int64_t ServeCounters::*outcome);
  json completion_json(const Job& job, uint64_t id, int64_t created) const;
  void stream(httplib::Response& res, const std::shared_ptr<Job>& job, uint64_t id, int64_t created);
  json chunk_json(uint64_t id, int64_t created, int64_t index, const std::string& text, const char* finish) const {
    return {{"id", fmt::format("cmpl-{}", id)}, {"object", "text_completion"}, {"created", created},
            {"model", options.model_id},
            {"choices", json::array({{{"text", text}, {"index", index}, {"logprobs", nullptr},
                                      {"finish_reason", finish ? json(finish) : json(nullptr)}}})}};
  }
};

// The engine thread: one generate() at a time, fed by admit() from the queue; a generate() ends
// when it falls idle after having admitted work (its bookkeeping is dropped then) or on stop.
void CompletionsServer::Impl::engine_loop() {
  if (options.threads > 0) set_num_threads(options.threads);  // OpenMP's count is per thread
  for (;;) {
    std::vector<std::pair<std::shared_ptr<Job>, int64_t>> slots;  // engine request -> (job, prompt)
    bool admitted = false;
    rollout::EngineCallbacks cb;
    cb.admit = [&](bool idle) -> Result<std::vector<rollout::Request>> {
      std::vector<rollout::Request> out;
      std::unique_lock<std::mutex> lk(mu);
      if (idle) {
        if (admitted) return out;
        engine_cv.wait(lk, [&] { return engine_stop || !pending.empty(); });
      }
      for (; !pending.empty(); pending.pop_front()) {
        const std::shared_ptr<Job>& job = pending.front();
        for (size_t p = 0; p < job->requests.size(); ++p) {
          slots.emplace_back(job, static_cast<int64_t>(p));
          out.push_back(job->requests[p]);
        }
      }
      admitted = admitted || !out.empty();
      return out;
    };
    cb.cancelled = [&](int64_t r) { return slots[static_cast<size_t>(r)].first->cancelled.load(); };
    cb.detokenize = [&](std::span<const int32_t> ids) { return tokenizer.decode(ids); };
    cb.on_token = [&](int64_t r, int64_t sample, int32_t token) {
      const auto& [job, p] = slots[static_cast<size_t>(r)];
      {
        std::lock_guard<std::mutex> lk(job->mu);
        job->choices[static_cast<size_t>(p * job->spec.n + sample)].tokens.push_back(token);
      }
      job->cv.notify_all();
      return Status::ok();
    };
    cb.on_finish = [&](const rollout::Completion& c) {
      const auto& [job, p] = slots[static_cast<size_t>(c.request)];
      {
        std::lock_guard<std::mutex> lk(job->mu);
        Choice& ch = job->choices[static_cast<size_t>(p * job->spec.n + c.sample)];
        ch.tokens = c.tokens;
        ch.logprobs = c.logprobs;
        ch.finish = c.finish;
        ch.finished = true;
        --job->open;
      }
      job->cv.notify_all();
      if (c.finish == rollout::FinishReason::kCancelled) {
        std::lock_guard<std::mutex> lk(mu);
        ++counters.sequences_cancelled;
      }
      return Status::ok();
    };
    auto out = engine.generate({}, cb);
    if (!out) {  // every job it held fails (500); the next generate() starts clean
      for (auto& [job, p] : slots) {
        std::lock_guard<std::mutex> lk(job->mu);
        if (job->open == 0) continue;
        job->open = 0;
        job->error = out.status();
        job->cv.notify_all();
      }
    }
    std::lock_guard<std::mutex> lk(mu);
    if (engine_stop && pending.empty()) return;
  }
}

// Queues a checked job, or 503 when the queue is full or the server is stopping.
std::optional<ApiError> CompletionsServer::Impl::submit(const std::shared_ptr<Job>& job) {
  const int64_t sequences = static_cast<int64_t>(job->choices.size());
  {
    std::lock_guard<std::mutex> lk(mu);
    if (!accepting || counters.sequences_in_flight + sequences > limits.capacity) {
      ++counters.rejected;
      return ApiError{503,
                      accepting ? fmt::format("the server is busy ({} sequences in flight, room for {}): retry later",
                                              counters.sequences_in_flight, limits.capacity)
                                : std::string("the server is shutting down"),
                      "", "server_error", accepting ? "queue_full" : "shutting_down"};
    }
    counters.sequences_in_flight += sequences;
    ++open_responses;
    pending.push_back(job);
  }
  engine_cv.notify_all();
  return std::nullopt;
}

// An accepted request is done (answered, abandoned or failed; once per request): its sequences
// leave the count and its outcome is counted.
void CompletionsServer::Impl::settle(const Job& job, int64_t ServeCounters::*outcome) {
  {
    std::lock_guard<std::mutex> lk(mu);
    counters.sequences_in_flight -= static_cast<int64_t>(job.choices.size());
    ++(counters.*outcome);
    --open_responses;
  }
  drained_cv.notify_all();
}

json CompletionsServer::Impl::completion_json(const Job& job, uint64_t id, int64_t created) const {
  json choices = json::array();
  int64_t completion_tokens = 0, prompt_tokens = 0;
  for (const std::vector<int32_t>& p : job.spec.prompts) prompt_tokens += static_cast<int64_t>(p.size());
  for (size_t i = 0; i < job.choices.size(); ++i) {
    const Choice& ch = job.choices[i];
    completion_tokens += static_cast<int64_t>(ch.tokens.size());
    auto text = choice_text(tokenizer, ch.tokens, job.spec.stop, /*final=*/true);
    json logprobs = nullptr;
    if (job.spec.logprobs) {
      json tokens = json::array(), offsets = json::array();
      int64_t offset = 0;
      for (int32_t t : ch.tokens) {
        auto piece = tokenizer.decode(std::span<const int32_t>(&t, 1));
        const std::string s = piece ? *piece : std::string();
        tokens.push_back(s);
        offsets.push_back(offset);
        offset += static_cast<int64_t>(s.size());
      }
      logprobs = {{"tokens", tokens}, {"token_logprobs", ch.logprobs}, {"top_logprobs", nullptr},
                  {"text_offset", offsets}};
    }
    choices.push_back({{"text", text ? *text : std::string()}, {"index", i}, {"logprobs", logprobs},
                       {"finish_reason", openai_finish_reason(ch.finish)}});
  }
  return {{"id", fmt::format("cmpl-{}", id)}, {"object", "text_completion"}, {"created", created},
          {"model", options.model_id}, {"choices", choices},
          {"usage", {{"prompt_tokens", prompt_tokens}, {"completion_tokens", completion_tokens},
                     {"total_tokens", prompt_tokens + completion_tokens}}}};
}

void CompletionsServer::Impl::complete(const httplib::Request& req, httplib::Response& res) {
  auto job = std::make_shared<Job>();
  if (auto err = parse_completion(req.body, limits, &job->spec)) return send_error(res, *err);
  const CompletionSpec& spec = job->spec;
  const uint64_t seed = spec.seed ? *spec.seed : std::random_device{}() * uint64_t{0x100000000} + std::random_device{}();
  for (const std::vector<int32_t>& prompt : spec.prompts) {
    rollout::Request r;
    r.prompt = prompt;
    r.params.sampling = rollout::SamplingParams{spec.temperature, spec.top_k, spec.top_p};
    r.params.max_new_tokens = spec.max_tokens;
    r.params.stop_ids = {tokenizer.eos_id()};
    r.params.stop_strings = spec.stop;
    r.params.seed = seed;
    r.params.num_samples = spec.n;
    r.id = 0;  // each prompt draws the streams `nibble generate` draws for one prompt of this seed
    if (Status s = engine.check_request(r); !s) return send_error(res, ApiError{400, s.message()});
    job->requests.push_back(std::move(r));
  }
  job->choices.resize(spec.prompts.size() * static_cast<size_t>(spec.n));
  job->open = static_cast<int64_t>(job->choices.size());
  if (auto err = submit(job)) return send_error(res, *err);
  const uint64_t id = next_id++;
  const int64_t created = static_cast<int64_t>(std::time(nullptr));
  if (spec.stream) return stream(res, job, id, created);
  {
    std::unique_lock<std::mutex> lk(job->mu);
    job->cv.wait(lk, [&] { return job->open == 0; });
  }
  if (!job->error.is_ok()) {
    send_error(res, ApiError{500, "generation failed: " + job->error.message(), "", "server_error"});
    return settle(*job, &ServeCounters::failed);
  }
  res.set_content(dump(completion_json(*job, id, created)), "application/json");
  settle(*job, &ServeCounters::completed);
}

// Server-sent events: a chunk per choice whenever its text grows, a last one with its
// finish_reason, then [DONE]. A failed write (the client left) cancels the job's sequences.
void CompletionsServer::Impl::stream(httplib::Response& res, const std::shared_ptr<Job>& job, uint64_t id,
                                     int64_t created) {
  struct State {
    std::vector<std::string> sent;  // text sent per choice
    std::vector<size_t> seen;       // tokens looked at per choice
    std::vector<bool> closed;       // finish_reason sent
    bool settled = false;           // [DONE] sent and the request settled
  };
  auto st = std::make_shared<State>();
  st->sent.resize(job->choices.size());
  st->seen.resize(job->choices.size(), 0);
  st->closed.resize(job->choices.size(), false);
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, job, st, id, created](size_t, httplib::DataSink& sink) -> bool {
        std::vector<Choice> snapshot;
        Status error;
        bool all_finished = false;
        {
          std::unique_lock<std::mutex> lk(job->mu);
          auto news = [&] {
            if (job->open == 0) return true;
            for (size_t i = 0; i < job->choices.size(); ++i)
              if (job->choices[i].tokens.size() != st->seen[i] || (job->choices[i].finished && !st->closed[i]))
                return true;
            return false;
          };
          job->cv.wait_for(lk, std::chrono::milliseconds(100), news);
          snapshot = job->choices;
          error = job->error;
          all_finished = job->open == 0;
        }
        auto event = [&](const json& j) {
          const std::string e = "data: " + dump(j) + "\n\n";
          return sink.write(e.data(), e.size());
        };
        if (!error.is_ok()) {
          event(error_json(ApiError{500, "generation failed: " + error.message(), "", "server_error"}));
          return false;
        }
        for (size_t i = 0; i < snapshot.size(); ++i) {
          const Choice& ch = snapshot[i];
          if (st->closed[i] || (ch.tokens.size() == st->seen[i] && !ch.finished)) continue;
          st->seen[i] = ch.tokens.size();
          auto text = choice_text(tokenizer, ch.tokens, job->spec.stop, ch.finished);
          if (!text) return false;
          std::string delta;
          if (text->size() > st->sent[i].size() && text->compare(0, st->sent[i].size(), st->sent[i]) == 0) {
            delta = text->substr(st->sent[i].size());
            st->sent[i] = *text;
          }
          if (delta.empty() && !ch.finished) continue;
          const char* finish = ch.finished ? openai_finish_reason(ch.finish) : nullptr;
          if (!event(chunk_json(id, created, static_cast<int64_t>(i), delta, finish))) return false;
          st->closed[i] = ch.finished;
        }
        if (!all_finished) return true;
        const std::string done = "data: [DONE]\n\n";
        if (!sink.write(done.data(), done.size())) return false;
        settle(*job, &ServeCounters::completed);  // before the last chunk: the client sees the counts
        st->settled = true;
        sink.done();
        return true;
      },
      [this, job, st](bool) {  // the answer is written, or the client is gone
        if (st->settled) return;
        job->cancelled = true;
        {
          std::unique_lock<std::mutex> lk(job->mu);
          job->cv.wait(lk, [&] { return job->open == 0; });  // the engine stops it at its next step
        }
        settle(*job, job->error.is_ok() ? &ServeCounters::cancelled : &ServeCounters::failed);
      });
}

void CompletionsServer::Impl::routes() {
  http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) { complete(req, res); });
  http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    json m = {{"id", options.model_id}, {"object", "model"}, {"created", started_at}, {"owned_by", "nibble"}};
    res.set_content(dump({{"object", "list"}, {"data", json::array({m})}}), "application/json");
  });
  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    std::unique_lock<std::mutex> lk(mu);
    const ServeCounters c = counters;
    const bool ok = accepting;
    lk.unlock();
    res.set_content(dump({{"status", ok ? "ok" : "stopping"}, {"sequences_in_flight", c.sequences_in_flight}, {"completed", c.completed},
                          {"cancelled", c.cancelled}, {"rejected", c.rejected}, {"failed", c.failed}}),
                    "application/json");
  });
  // 404 (no such route), 413 (body too large) and the like: an OpenAI-style error body too
  http.set_error_handler(httplib::Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    const std::string what = res.status == 404 ? "no route " + req.method + " " + req.path
                                               : "HTTP status " + std::to_string(res.status);
    send_error(res, ApiError{res.status, what});
    return httplib::Server::HandlerResponse::Handled;
  }));
  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_error(res, ApiError{500, "internal error: " + what, "", "server_error"});
  });
}

Result<std::unique_ptr<CompletionsServer>> CompletionsServer::create(rollout::Engine& engine,
                                                                     const train::Tokenizer& tokenizer,
                                                                     const ServeOptions& options) {
  const model::ModelConfig& cfg = engine.model_config();
  if (options.queue < 0) return invalid_argument("--queue must be >= 0 (got {})", options.queue);
  if (options.max_new_tokens_limit < 0)
    return invalid_argument("--max-new-tokens-limit must be >= 0 (got {})", options.max_new_tokens_limit);
  if (options.port < 0 || options.port > 65535) return invalid_argument("--port {} is not in [0, 65535]", options.port);
  auto impl = std::make_unique<Impl>(engine, tokenizer, options);
  Limits& lim = impl->limits;
  lim.tokenizer = &tokenizer;
  lim.model_id = options.model_id;
  lim.context = cfg.max_position_embeddings;
  lim.vocab = cfg.vocab_size;
  lim.max_batch = engine.options().max_batch;
  lim.capacity = lim.max_batch + options.queue;
  lim.max_new_tokens = options.max_new_tokens_limit > 0 ? std::min(options.max_new_tokens_limit, lim.context)
                                                        : lim.context;
  impl->started_at = static_cast<int64_t>(std::time(nullptr));
  impl->routes();
  return std::unique_ptr<CompletionsServer>(new CompletionsServer(std::move(impl)));
}

CompletionsServer::CompletionsServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CompletionsServer::~CompletionsServer() { stop(); }

Status CompletionsServer::start() {
  Impl& s = *impl_;
  // a worker per sequence the server holds (each waits on its request), plus a few for health
  // checks and refusals; beyond that, connections wait for a worker
  const size_t workers = static_cast<size_t>(std::min<int64_t>(s.limits.capacity + 8, 512));
  s.http.new_task_queue = [workers] { return new httplib::ThreadPool(workers); };
  s.http.set_payload_max_length(size_t{8} << 20);
  // A worker waits this long for the first bytes of a connection's request (and for the next
  // request of a kept-alive one) before it closes the connection unanswered; as long as the
  // read timeout, so a client slow to send its request is not cut off sooner than one slow to
  // finish it. stop() may wait this long for an idle kept-alive connection.
  s.http.set_read_timeout(kClientSendTimeoutSeconds, 0);
  s.http.set_keep_alive_timeout(kClientSendTimeoutSeconds);
  s.http.set_socket_options([&s](socket_t sock) {
    httplib::default_socket_options(sock);  // SO_REUSEADDR, as without this hook
    s.listen_socket = sock;
  });
  int port = s.options.port;
  if (port == 0) port = s.http.bind_to_any_port(s.options.host);
  else if (!s.http.bind_to_port(s.options.host, port)) port = -1;
  if (port < 0)
    return io_error("cannot listen on {}:{} (address in use, or not an address of this machine)", s.options.host,
                    s.options.port);
  // Issue #15 item 5, requests lost under load: cpp-httplib 0.11 listens with a backlog of 5
  // (CPPHTTPLIB_LISTEN_BACKLOG, compiled into Debian's libcpp-httplib). 32 clients connecting at
  // once overflow it; Linux then answers SYNs with SYN cookies and drops the handshake's last
  // ACK while the accept queue is full, so a client believes it is connected and sends its
  // request; a retransmitted later segment of that request (headers and body go out as two)
  // fails the cookie check and the kernel resets the connection. No handler ever ran: the
  // request was neither answered nor refused, and the client saw a read error. Listening again
  // on the bound socket sets a backlog the kernel caps at net.core.somaxconn (4096 since Linux 5.4),
  // far more connections than the workers take at once: the rest wait in the kernel's queue.
  if (::listen(s.listen_socket, SOMAXCONN) != 0) {
    const int err = errno;
    ::close(s.listen_socket);
    return io_error("cannot listen on {}:{}: {}", s.options.host, port, std::strerror(err));
  }
  s.options.port = port;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    s.accepting = true;
  }
  s.engine_thread = std::thread([&s] { s.engine_loop(); });
  s.http_thread = std::thread([&s] {
    s.http.listen_after_bind();
    s.listen_returned = true;
  });
  // httplib's Server::stop() does nothing until its accept loop runs: a stop() right after
  // start() would leave it accepting and stop() waiting for it forever. Return once it runs.
  while (!s.http.is_running() && !s.listen_returned) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return Status::ok();
}

int CompletionsServer::port() const { return impl_->options.port; }

void CompletionsServer::stop() {
  Impl& s = *impl_;
  {
    std::unique_lock<std::mutex> lk(s.mu);
    if (s.stopped) return;
    s.stopped = true;
    s.accepting = false;  // new requests: 503 "shutting down"
    s.drained_cv.wait(lk, [&] { return s.open_responses == 0; });
  }
  s.http.stop();
  if (s.http_thread.joinable()) s.http_thread.join();
  {
    std::lock_guard<std::mutex> lk(s.mu);
    s.engine_stop = true;
  }
  s.engine_cv.notify_all();
  if (s.engine_thread.joinable()) s.engine_thread.join();
}

ServeCounters CompletionsServer::counters() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->counters;
}

}  // namespace nibble::tools
