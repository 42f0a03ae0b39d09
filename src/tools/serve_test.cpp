// Tests of `nibble serve` (completions_server.h, cmd_serve.cpp) over loopback HTTP with
// cpp-httplib's client, on a tiny checkpoint trained here (tiny_run_test_util.h; 128 positions):
// completions equal `nibble generate`'s for the same seed (greedy and sampled, text and
// log-probs); streamed chunks concatenate to the same text, stop strings included; every bad
// request is a 4xx with an OpenAI-style error; a full queue is 503; a client leaving mid-stream
// cancels its sequences; 32 concurrent clients are all answered (correctly, or 503 and retried)
// and none is lost; the listen backlog queues a burst of connections; and the CLI prints its
// port, answers (also in w4a16 from a model of inference storage, as `nibble generate`), and on
// SIGTERM finishes and exits 143.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "rollout/engine.h"
#include "tools/cli_test_util.h"
#include "tools/completions_server.h"
#include "tools/tiny_run_test_util.h"
#include "train/checkpoint.h"
#include "train/tokenizer.h"

namespace nibble::tools::test {
namespace {

using nlohmann::json;

constexpr int64_t kContext = 128;

class ServeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<ScratchDir>("serve");
    const std::string cfg_path = write_tiny_config(*dir_);
    json cfg = json::parse(slurp(cfg_path));
    cfg["model"]["max_position_embeddings"] = kContext;
    cfg["steps"] = 3;
    std::ofstream(cfg_path, std::ios::trunc) << cfg.dump(2);
    RunResult r = run_nibble(dir_->path, "pretrain --config '" + cfg_path + "' --data '" + (*dir_ / "corpus.txt") +
                                             "' --out '" + run() + "' --no-progress");
    ASSERT_EQ(r.code, 0) << r.err;
    auto ck = train::open_checkpoint(run());
    ASSERT_TRUE(ck.is_ok()) << ck.status().message();
    auto m = train::load_checkpoint_model(*ck);
    ASSERT_TRUE(m.is_ok()) << m.status().message();
    model_ = std::move(m).value();
    auto tok = train::Tokenizer::load(ck->tokenizer_path);
    ASSERT_TRUE(tok.is_ok()) << tok.status().message();
    tokenizer_ = std::make_unique<train::Tokenizer>(std::move(tok).value());
  }
  static void TearDownTestSuite() {
    model_.reset();
    tokenizer_.reset();
    dir_.reset();
  }
  static std::string run() { return *dir_ / "run"; }

  // A server on a free loopback port over the test checkpoint.
  void start(int64_t max_batch = 16, int64_t queue = 64) {
    ASSERT_FALSE(HasFatalFailure());
    rollout::EngineOptions eo;
    eo.mode = rollout::PrecisionMode::kRecipe;  // as `nibble generate` and `nibble serve` by default
    eo.max_batch = max_batch;
    auto e = rollout::Engine::create(*model_, eo);
    ASSERT_TRUE(e.is_ok()) << e.status().message();
    engine_ = std::move(e).value();
    ServeOptions so;
    so.port = 0;
    so.queue = queue;
    so.model_id = "tiny";
    so.threads = 1;  // 2 shared cores: OpenMP's barriers would only wait
    auto s = CompletionsServer::create(*engine_, *tokenizer_, so);
    ASSERT_TRUE(s.is_ok()) << s.status().message();
    server_ = std::move(s).value();
    ASSERT_TRUE(server_->start().is_ok());
    ASSERT_GT(server_->port(), 0);
  }
  void TearDown() override {
    if (server_) server_->stop();
    server_.reset();
    engine_.reset();
  }

  std::unique_ptr<httplib::Client> client() const {
    auto c = std::make_unique<httplib::Client>("127.0.0.1", server_->port());
    c->set_read_timeout(120, 0);      // generous: CI runs this under ASan on 2 busy cores
    c->set_connection_timeout(60, 0);
    return c;
  }
  // POST /v1/completions; status -1 when no answer came.
  std::pair<int, json> post(const json& body) const { return post_raw(body.dump()); }
  std::pair<int, json> post_raw(const std::string& body) const {
    auto r = client()->Post("/v1/completions", body, "application/json");
    if (!r) return {-1, json()};
    json j = json::parse(r->body, nullptr, false);
    return {r->status, j};
  }

  static std::unique_ptr<ScratchDir> dir_;
  static std::unique_ptr<model::Model> model_;
  static std::unique_ptr<train::Tokenizer> tokenizer_;
  std::unique_ptr<rollout::Engine> engine_;
  std::unique_ptr<CompletionsServer> server_;
};
std::unique_ptr<ScratchDir> ServeTest::dir_;
std::unique_ptr<model::Model> ServeTest::model_;
std::unique_ptr<train::Tokenizer> ServeTest::tokenizer_;

// The backlog of this process's socket listening on `port` (the kernel's queue of connections
// not yet accepted; TCP_INFO's tcpi_sacked for a listening socket); -1 if none listens there.
int listen_backlog(int port) {
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    const int fd = std::atoi(entry.path().filename().c_str());
    int listening = 0;
    socklen_t len = sizeof(listening);
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || listening == 0) continue;
    sockaddr_in addr{};
    socklen_t addr_len = sizeof(addr);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &addr_len) != 0 || addr.sin_family != AF_INET ||
        ntohs(addr.sin_port) != port)
      continue;
    tcp_info info{};
    socklen_t info_len = sizeof(info);
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &info_len) != 0) return -1;
    return static_cast<int>(info.tcpi_sacked);
  }
  return -1;
}

// The events of a server-sent-event body: the JSON of each `data:` line, and whether [DONE] came last.
std::vector<json> sse_events(const std::string& body, bool* done) {
  std::vector<json> out;
  *done = false;
  size_t at = 0;
  while (at < body.size()) {
    size_t end = body.find("\n\n", at);
    if (end == std::string::npos) end = body.size();
    const std::string ev = body.substr(at, end - at);
    at = end + 2;
    EXPECT_EQ(ev.rfind("data: ", 0), 0u) << ev;
    EXPECT_FALSE(*done) << "an event after [DONE]";
    if (ev == "data: [DONE]") *done = true;
    else out.push_back(json::parse(ev.substr(6), nullptr, false));
  }
  return out;
}

// Per choice index: the concatenated text and the finish_reason (exactly one per choice).
std::map<int64_t, std::pair<std::string, std::string>> stream_texts(const std::vector<json>& events) {
  std::map<int64_t, std::pair<std::string, std::string>> out;
  for (const json& e : events) {
    EXPECT_EQ(e["object"], "text_completion");
    for (const json& c : e["choices"]) {
      auto& [text, finish] = out[c["index"].get<int64_t>()];
      EXPECT_TRUE(finish.empty()) << "text after the finish_reason";
      text += c["text"].get<std::string>();
      if (!c["finish_reason"].is_null()) finish = c["finish_reason"].get<std::string>();
    }
  }
  for (const auto& [i, tf] : out) EXPECT_FALSE(tf.second.empty()) << "choice " << i << " has no finish_reason";
  return out;
}

// `nibble generate --prompts` on the same checkpoint: its JSON lines.
std::vector<json> generate_lines(const ScratchDir& d, const std::string& run, const std::string& prompt,
                                 const std::string& args) {
  std::ofstream(d / "prompts.jsonl", std::ios::trunc) << json{{"prompt", prompt}}.dump() << "\n";
  RunResult r = run_nibble(d.path, "generate --checkpoint '" + run + "' --prompts '" + (d / "prompts.jsonl") +
                                       "' --out '" + (d / "gen.jsonl") + "' --force " + args);
  EXPECT_EQ(r.code, 0) << r.err;
  std::vector<json> out;
  std::istringstream in(slurp(d / "gen.jsonl"));
  for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
  return out;
}

TEST_F(ServeTest, CompletionEqualsGenerateForTheSameSeed) {
  start();
  const std::string prompt = "And the 3 sheep";
  struct Mode {
    std::string gen_args;
    json params;
    int64_t n;
  };
  const std::vector<Mode> modes = {
      {"--temperature 0 --max-new-tokens 40 --seed 3", {{"temperature", 0}, {"max_tokens", 40}, {"seed", 3}}, 1},
      {"--temperature 0.8 --top-p 0.95 --top-k 20 --max-new-tokens 30 --seed 7 --samples 2",
       {{"temperature", 0.8}, {"top_p", 0.95}, {"top_k", 20}, {"max_tokens", 30}, {"seed", 7}}, 2},
  };
  for (const Mode& m : modes) {
    const std::vector<json> gen = generate_lines(*dir_, run(), prompt, m.gen_args);
    ASSERT_EQ(static_cast<int64_t>(gen.size()), m.n);
    json body = m.params;
    body["prompt"] = prompt;
    body["model"] = "tiny";
    body["n"] = m.n;
    body["logprobs"] = 0;
    auto [status, j] = post(body);
    ASSERT_EQ(status, 200) << j.dump();
    EXPECT_EQ(j["object"], "text_completion");
    EXPECT_EQ(j["model"], "tiny");
    EXPECT_EQ(j["id"].get<std::string>().rfind("cmpl-", 0), 0u);
    ASSERT_EQ(static_cast<int64_t>(j["choices"].size()), m.n);
    int64_t completion_tokens = 0;
    for (int64_t s = 0; s < m.n; ++s) {
      const json& c = j["choices"][static_cast<size_t>(s)];
      EXPECT_EQ(c["index"], s);
      EXPECT_EQ(c["text"], gen[static_cast<size_t>(s)]["text"]) << m.gen_args;
      const std::string gen_finish = gen[static_cast<size_t>(s)]["finish_reason"];
      EXPECT_EQ(c["finish_reason"], gen_finish == "length" ? "length" : "stop");
      const std::vector<double> lp = c["logprobs"]["token_logprobs"], want = gen[static_cast<size_t>(s)]["logprobs"];
      EXPECT_EQ(lp, want) << m.gen_args;  // the same engine on the same weights: the same bits
      EXPECT_EQ(c["logprobs"]["tokens"].size(), lp.size());
      completion_tokens += static_cast<int64_t>(lp.size());
    }
    EXPECT_EQ(j["usage"]["prompt_tokens"], tokenizer_->encode(prompt)->size());
    EXPECT_EQ(j["usage"]["completion_tokens"], completion_tokens);
    EXPECT_EQ(j["usage"]["total_tokens"], j["usage"]["prompt_tokens"].get<int64_t>() + completion_tokens);
  }
  // a list of prompts: choice p * n + s is sample s of prompt p; token-id prompts are the same prompt
  const std::vector<int32_t> ids = *tokenizer_->encode(prompt);
  auto [status, j] = post({{"prompt", json::array({"Hello", prompt, ids})}, {"temperature", 0}, {"max_tokens", 12}, {"n", 2}});
  ASSERT_EQ(status, 200) << j.dump();
  ASSERT_EQ(j["choices"].size(), 6u);
  EXPECT_EQ(j["choices"][2]["text"], j["choices"][4]["text"]);
  EXPECT_EQ(j["choices"][4]["text"], j["choices"][5]["text"]);  // greedy: both samples alike
  EXPECT_EQ(j["choices"][5]["index"], 5);
}

TEST_F(ServeTest, StreamedChunksConcatenateToTheCompletion) {
  start();
  json body = {{"prompt", "And the"}, {"max_tokens", 60}, {"temperature", 0.9}, {"seed", 11}, {"n", 3}};
  auto [status, whole] = post(body);
  ASSERT_EQ(status, 200) << whole.dump();
  // a stop string from the middle of the greedy text: it ends the sample before it
  auto [gs, greedy] = post({{"prompt", "And the"}, {"max_tokens", 60}, {"temperature", 0}});
  ASSERT_EQ(gs, 200);
  const std::string full = greedy["choices"][0]["text"];
  ASSERT_GT(full.size(), 20u) << full;
  const std::string stop = full.substr(10, 3);
  const size_t cut = full.find(stop);
  for (const json& b : {body, json{{"prompt", "And the"}, {"max_tokens", 60}, {"temperature", 0}, {"stop", {stop, "@@"}}}}) {
    json sb = b;
    sb["stream"] = true;
    auto r = client()->Post("/v1/completions", sb.dump(), "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(r->get_header_value("Content-Type"), "text/event-stream");
    bool done = false;
    const auto texts = stream_texts(sse_events(r->body, &done));
    EXPECT_TRUE(done) << r->body;
    if (!b.contains("stop")) {
      ASSERT_EQ(texts.size(), 3u);
      for (int64_t i = 0; i < 3; ++i) {
        EXPECT_EQ(texts.at(i).first, whole["choices"][static_cast<size_t>(i)]["text"]) << "choice " << i;
        EXPECT_EQ(texts.at(i).second, whole["choices"][static_cast<size_t>(i)]["finish_reason"]);
      }
    } else {
      ASSERT_EQ(texts.size(), 1u);
      EXPECT_EQ(texts.at(0).first, full.substr(0, cut)) << "stop '" << stop << "' in '" << full << "'";
      EXPECT_EQ(texts.at(0).second, "stop");
      auto [ns, nonstream] = post(b);
      ASSERT_EQ(ns, 200);
      EXPECT_EQ(nonstream["choices"][0]["text"], full.substr(0, cut));
      EXPECT_EQ(nonstream["choices"][0]["finish_reason"], "stop");
    }
  }
}

TEST_F(ServeTest, BadRequestsAreClientErrorsWithAnOpenAiErrorObject) {
  start();
  const std::string long_prompt(400, 'x');  // > 100 tokens of the tiny vocabulary
  ASSERT_GT(static_cast<int64_t>(tokenizer_->encode(long_prompt)->size()) + 40, kContext);
  struct Case {
    std::string body;
    int status;
    std::string needle;  // in error.message
  };
  const std::vector<Case> cases = {
      {"{\"prompt\": \"hi\",", 400, "not valid JSON"},
      {"[1, 2]", 400, "JSON object"},
      {R"({"max_tokens": 4})", 400, "'prompt' is required"},
      {R"({"prompt": "hi", "echo": true})", 400, "unsupported field 'echo'"},
      {R"({"prompt": "hi", "max_tokens": "16"})", 400, "'max_tokens' must be an integer in [0, 128]"},
      {R"({"prompt": "hi", "max_tokens": 1.5})", 400, "'max_tokens'"},
      {R"({"prompt": "hi", "max_tokens": -1})", 400, "'max_tokens'"},
      {R"({"prompt": "hi", "max_tokens": 129})", 400, "'max_tokens'"},
      {R"({"prompt": "hi", "temperature": 3})", 400, "'temperature' must be a number in [0, 2]"},
      {R"({"prompt": "hi", "temperature": true})", 400, "'temperature'"},
      {R"({"prompt": "hi", "top_p": 0})", 400, "'top_p' must be a number in (0, 1]"},
      {R"({"prompt": "hi", "top_k": -2})", 400, "'top_k'"},
      {R"({"prompt": "hi", "n": 0})", 400, "'n' must be an integer in [1, 16]"},
      {R"({"prompt": "hi", "n": 17})", 400, "'n'"},
      {R"({"prompt": "hi", "seed": -1})", 400, "'seed'"},
      {R"({"prompt": "hi", "seed": "1"})", 400, "'seed'"},
      {R"({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]})", 400, "'stop'"},
      {R"({"prompt": "hi", "stop": [""]})", 400, "empty string"},
      {R"({"prompt": "hi", "stop": 5})", 400, "'stop'"},
      {R"({"prompt": "hi", "logprobs": 6})", 400, "'logprobs'"},
      {R"({"prompt": "hi", "stream": "yes"})", 400, "'stream' must be true or false"},
      {R"({"prompt": "hi", "stream": true, "logprobs": 1})", 400, "not supported with 'stream'"},
      {R"({"prompt": 5})", 400, "'prompt' must be a string"},
      {R"({"prompt": []})", 400, "'prompt' must be a string"},
      {R"({"prompt": null})", 400, "'prompt' must be a string"},
      {R"({"prompt": [1, "a"]})", 400, "'prompt' must be a string"},
      {R"({"prompt": [[]]})", 400, "empty list"},
      {R"({"prompt": [1, 300]})", 400, "token ids must be integers in [0, 299]"},
      {R"({"prompt": [1, -1]})", 400, "token ids"},
      {R"({"prompt": "hi", "n": 16, "max_tokens": 2, "user": 3})", 400, "'user'"},
      {json{{"prompt", long_prompt}, {"max_tokens", 40}}.dump(), 400, "maximum context length is 128 tokens"},
      {json{{"prompt", {"hi", long_prompt}}}.dump(), 400, "maximum context length"},
      {R"({"prompt": "hi", "model": "gpt-4"})", 404, "'gpt-4' does not exist"},
      {R"({"prompt": "hi", "model": 4})", 400, "'model' must be a string"},
  };
  for (const Case& c : cases) {
    auto [status, j] = post_raw(c.body);
    EXPECT_EQ(status, c.status) << c.body << "\n" << j.dump();
    ASSERT_TRUE(j.is_object() && j.contains("error")) << c.body << " -> " << j.dump();
    const std::string msg = j["error"]["message"];
    EXPECT_NE(msg.find(c.needle), std::string::npos) << c.body << " -> " << msg;
    EXPECT_TRUE(j["error"].contains("type") && j["error"].contains("param") && j["error"].contains("code"));
  }
  // more sequences than the server holds (16 decoding + 64 queued) at once
  auto [s1, j1] = post({{"prompt", json::array({"a", "b", "c", "d", "e", "f"})}, {"n", 16}, {"max_tokens", 1}});
  EXPECT_EQ(s1, 400) << j1.dump();
  EXPECT_EQ(j1["error"]["param"], "n");
  // routes and bodies httplib refuses: the same error object
  auto c = client();
  auto r = c->Get("/v1/nothing");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  EXPECT_NE(json::parse(r->body)["error"]["message"].get<std::string>().find("/v1/nothing"), std::string::npos);
  r = c->Post("/v1/completions", std::string(size_t{9} << 20, ' '), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 413);
  EXPECT_TRUE(json::parse(r->body, nullptr, false).contains("error"));
  // still serving, nothing counted as answered or failed
  auto [ok, jo] = post({{"prompt", "hi"}, {"max_tokens", 3}, {"temperature", 0}, {"model", "tiny"}});
  EXPECT_EQ(ok, 200) << jo.dump();
  const ServeCounters k = server_->counters();
  EXPECT_EQ(k.completed, 1);
  EXPECT_EQ(k.failed, 0);
  EXPECT_EQ(k.sequences_in_flight, 0);
}

TEST_F(ServeTest, ModelsAndHealth) {
  start();
  auto c = client();
  auto r = c->Get("/v1/models");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  const json m = json::parse(r->body);
  EXPECT_EQ(m["object"], "list");
  ASSERT_EQ(m["data"].size(), 1u);
  EXPECT_EQ(m["data"][0]["id"], "tiny");
  r = c->Get("/health");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  EXPECT_EQ(json::parse(r->body)["status"], "ok");
}

// With room for 2 sequences (1 decoding + 1 queued), rounds of 12 concurrent long requests meet
// a full queue (503, code queue_full); every request let in is answered correctly.
TEST_F(ServeTest, FullQueueAnswers503) {
  start(/*max_batch=*/1, /*queue=*/1);
  const json body = {{"prompt", "And"}, {"max_tokens", 120}, {"temperature", 0}};
  auto [s0, alone] = post(body);
  ASSERT_EQ(s0, 200);
  const json expected = alone;  // a named copy: clang 14 lambdas cannot capture a structured binding
  int64_t ok = 0, busy = 0;
  for (int round = 0; round < 20 && busy == 0; ++round) {
    std::vector<std::thread> threads;
    std::mutex mu;
    for (int t = 0; t < 12; ++t)
      threads.emplace_back([&] {
        auto [status, j] = post(body);
        std::lock_guard<std::mutex> lk(mu);
        if (status == 200) {
          ++ok;
          EXPECT_EQ(j["choices"][0]["text"], expected["choices"][0]["text"]);
        } else {
          ++busy;
          EXPECT_EQ(status, 503) << j.dump();
          EXPECT_EQ(j["error"]["code"], "queue_full") << j.dump();
        }
      });
    for (std::thread& t : threads) t.join();
  }
  EXPECT_GT(busy, 0);
  EXPECT_GE(ok, 2);
  EXPECT_EQ(server_->counters().rejected, busy);
  EXPECT_EQ(server_->counters().sequences_in_flight, 0);
}

// A client that leaves after the first chunk: its 16 sequences stop at the engine's next steps
// (not 127 tokens each later), and the server goes on serving.
TEST_F(ServeTest, ClientLeavingMidStreamCancelsItsSequences) {
  start();
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = json{{"prompt", "And"}, {"max_tokens", 126}, {"n", 16}, {"temperature", 1.0}, {"stream", true}}.dump();
  req.set_header("Content-Type", "application/json");
  int chunks = 0;
  req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 1; };
  auto c = client();
  auto r = c->send(req);
  EXPECT_FALSE(r);  // the client cancelled its read
  EXPECT_EQ(chunks, 1);
  ServeCounters k;
  for (int i = 0; i < 400; ++i) {  // up to 20 s
    k = server_->counters();
    if (k.cancelled + k.completed > 0 && k.sequences_in_flight == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(k.cancelled, 1);
  EXPECT_EQ(k.sequences_in_flight, 0);
  EXPECT_GT(k.sequences_cancelled, 0);
  auto [ok, j] = post({{"prompt", "hi"}, {"max_tokens", 3}});
  EXPECT_EQ(ok, 200) << j.dump();
}

// 32 clients x 3 requests at once (greedy and sampled, streamed and not, 4 prompts) on a server
// holding 24 sequences: every request gets exactly one answer per try, a completion equal to the
// one the same request gets alone or a 503 queue_full (then the client retries); none is lost (a
// transport error, another status, a truncated stream). Before the server listened with a long
// backlog (CompletionsServer::start) about one run in four lost ~8 requests to connection resets.
TEST_F(ServeTest, ManyConcurrentClientsAreAllAnsweredCorrectly) {
  start(/*max_batch=*/8, /*queue=*/16);
  const std::vector<std::string> prompts = {"And the", "the shepherd", "And the 7 sheep went", "over"};
  auto body_of = [&](int k) {
    json b = {{"prompt", prompts[static_cast<size_t>(k % 4)]}, {"max_tokens", 8 + 4 * (k % 5)}, {"seed", k % 7}};
    b["temperature"] = k % 3 == 0 ? 0.0 : 0.7;
    return b;
  };
  // a string field of a JSON body ("" if the body is not JSON or has no such string)
  auto field = [](const std::string& body, const char* pointer) {
    const json j = json::parse(body, nullptr, false);
    const json::json_pointer at(pointer);
    return j.is_object() && j.contains(at) && j[at].is_string() ? j[at].get<std::string>() : std::string();
  };
  constexpr int kKinds = 20, kThreads = 32, kPerThread = 3;
  std::vector<std::string> expected;
  for (int k = 0; k < kKinds; ++k) {
    auto [status, j] = post(body_of(k));
    ASSERT_EQ(status, 200) << j.dump();
    expected.push_back(j["choices"][0]["text"]);
  }
  // bounds against a hang (ASan on 2 busy cores in CI), not speed figures
  const auto t0 = std::chrono::steady_clock::now();
  const auto give_up = t0 + std::chrono::seconds(90);
  std::atomic<int> right{0}, rejected{0};
  std::mutex mu;
  std::vector<std::string> lost;  // what each lost or wrong try saw
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      httplib::Client c("127.0.0.1", server_->port());
      c.set_connection_timeout(30, 0);
      c.set_read_timeout(60, 0);
      for (int i = 0; i < kPerThread; ++i) {
        const int k = (t * kPerThread + i) % kKinds;
        const bool stream = (t + i) % 2 == 1;
        json b = body_of(k);
        b["stream"] = stream;
        for (int attempt = 0;; ++attempt) {
          auto r = c.Post("/v1/completions", b.dump(), "application/json");
          std::string seen;  // empty: answered right
          if (!r) {
            seen = "no answer: " + httplib::to_string(r.error());
          } else if (r->status == 503 && field(r->body, "/error/code") == "queue_full") {
            ++rejected;
            if (std::chrono::steady_clock::now() < give_up) {
              std::this_thread::sleep_for(std::chrono::milliseconds(5 * std::min(attempt + 1, 20)));
              continue;
            }
            seen = "still 503 after 90 s";
          } else if (r->status != 200) {
            seen = "status " + std::to_string(r->status) + ": " + r->body;
          } else if (!stream) {
            if (field(r->body, "/choices/0/text") != expected[static_cast<size_t>(k)]) seen = "wrong text: " + r->body;
          } else {
            bool done = false;
            const auto texts = stream_texts(sse_events(r->body, &done));
            if (!done || texts.size() != 1 || texts.begin()->second.first != expected[static_cast<size_t>(k)])
              seen = "wrong or truncated stream: " + r->body;
          }
          if (seen.empty()) {
            ++right;
          } else {
            std::lock_guard<std::mutex> lk(mu);
            lost.push_back("request " + std::to_string(i) + " of client " + std::to_string(t) + " (" +
                           (stream ? "stream" : "json") + "): " + seen);
          }
          break;
        }
      }
    });
  for (std::thread& t : threads) t.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string lost_list;
  for (const std::string& l : lost) lost_list += l + "\n";
  EXPECT_TRUE(lost.empty()) << lost.size() << " of " << kThreads * kPerThread << " requests lost:\n" << lost_list;
  EXPECT_EQ(right.load(), kThreads * kPerThread);
  EXPECT_LT(seconds, 120.0);
  RecordProperty("rejected_503", rejected.load());  // retried; none is needed, any is allowed
  const ServeCounters k = server_->counters();
  EXPECT_EQ(k.rejected, rejected.load());
  EXPECT_EQ(k.completed, kKinds + kThreads * kPerThread);
  EXPECT_EQ(k.cancelled, 0);
  EXPECT_EQ(k.failed, 0);
  EXPECT_EQ(k.sequences_in_flight, 0);
}

// The kernel queues a burst of connections for the workers rather than dropping them: the
// listening socket's backlog is far above cpp-httplib's 5 (which cost the load test above its
// requests: see CompletionsServer::start), up to what net.core.somaxconn allows.
TEST_F(ServeTest, ListeningSocketQueuesABurstOfConnections) {
  start();
  const int somaxconn = std::stoi(slurp("/proc/sys/net/core/somaxconn"));
  EXPECT_GE(listen_backlog(server_->port()), std::min(somaxconn, 128)) << "net.core.somaxconn " << somaxconn;
}

// The CLI: --port 0 prints the port it took; it answers; SIGTERM ends it (143) after the answer.
// In the default (recipe) mode the model is the checkpoint's training model; with --mode w4a16
// one of inference storage (the listening line says which), whose sampled answer equals
// `nibble generate --mode w4a16`'s for the same seed (text and log-probs).
TEST_F(ServeTest, CliServesAndStopsOnSigterm) {
  ASSERT_FALSE(HasFatalFailure());
  for (const std::string mode : {"recipe", "w4a16"}) {
    SCOPED_TRACE(mode);
    const std::string out = *dir_ / ("serve_out_" + mode + ".txt"), err = *dir_ / ("serve_err_" + mode + ".txt");
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      const std::string bin = nibble_binary(), ck = run();
      if (!freopen(out.c_str(), "w", stdout) || !freopen(err.c_str(), "w", stderr)) _exit(99);
      execl(bin.c_str(), bin.c_str(), "serve", "--checkpoint", ck.c_str(), "--port", "0", "--max-batch", "4",
            "--threads", "1", "--mode", mode.c_str(), static_cast<char*>(nullptr));
      _exit(98);
    }
    int port = 0;
    for (int i = 0; i < 600 && port == 0; ++i) {  // up to 30 s to load and bind
      const std::string text = slurp(out);
      const size_t at = text.find("listening on http://127.0.0.1:");
      if (at != std::string::npos) port = std::atoi(text.c_str() + at + 30);
      else std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ASSERT_GT(port, 0) << slurp(err);
    const std::string storage = mode == "recipe" ? "training" : "inference";
    EXPECT_NE(slurp(out).find("mode " + mode + ", " + storage + " storage"), std::string::npos) << slurp(out);
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(30, 0);
    auto r = c.Get("/v1/models");
    ASSERT_TRUE(r);
    EXPECT_EQ(json::parse(r->body)["data"][0]["id"], "run");  // the checkpoint folder's name
    const json body = {{"prompt", "And the"}, {"max_tokens", 8},  {"temperature", 0.8},
                       {"top_p", 0.95},       {"seed", 7},        {"logprobs", 0}};
    r = c.Post("/v1/completions", body.dump(), "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
    if (mode != "recipe") {
      const std::vector<json> gen =
          generate_lines(*dir_, run(), "And the", "--mode " + mode + " --temperature 0.8 --top-p 0.95 "
                                                  "--max-new-tokens 8 --seed 7");
      ASSERT_EQ(gen.size(), 1u);
      const json choice = json::parse(r->body)["choices"][0];
      EXPECT_EQ(choice["text"], gen[0]["text"]);
      EXPECT_EQ(choice["logprobs"]["token_logprobs"].get<std::vector<double>>(),
                gen[0]["logprobs"].get<std::vector<double>>());
    }
    ASSERT_EQ(kill(pid, SIGTERM), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 143) << slurp(err);
    EXPECT_NE(slurp(err).find("stopped (1 answered"), std::string::npos) << slurp(err);
  }
}

}  // namespace
}  // namespace nibble::tools::test
