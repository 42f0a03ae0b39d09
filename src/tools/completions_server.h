// The OpenAI-compatible completions server behind `nibble serve` (docs/cli.md, "serve"): HTTP
// (cpp-httplib) on a thread pool in front of one engine thread that batches every request in
// flight continuously (rollout::EngineCallbacks::admit hands new requests to the running
// generate(), `cancelled` drops those whose client went away). POST /v1/completions (JSON or
// server-sent events), GET /v1/models, GET /health. Every bad request is an HTTP 4xx with an
// OpenAI-style error object; a full queue is 503. The server owns no model: the engine and the
// tokenizer it is given must outlive it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"
#include "rollout/engine.h"
#include "train/tokenizer.h"

namespace nibble::tools {

struct ServeOptions {
  std::string host = "127.0.0.1";  // loopback unless asked otherwise
  int port = 8000;                 // 0: a free port, chosen when binding (port() says which)
  std::string model_id = "nibble"; // what /v1/models lists and a request's "model" must name
  int64_t queue = 64;              // sequences waiting beyond the engine's max batch; more: 503
  int64_t max_new_tokens_limit = 0;  // largest max_tokens accepted; 0: the model's context
  int threads = 0;                   // CPU threads of the engine thread's ops; 0: OpenMP's default
};

// Counters since start (GET /health reports them).
struct ServeCounters {
  int64_t completed = 0;  // requests answered
  int64_t cancelled = 0;  // requests whose client left before the end (their sequences stopped)
  int64_t rejected = 0;   // 503s (queue full or shutting down)
  int64_t failed = 0;     // 500s (the engine failed)
  int64_t sequences_cancelled = 0;  // sequences the engine stopped early because their client left
  int64_t sequences_in_flight = 0;
};

class CompletionsServer {
 public:
  // Checks the options against the engine (queue >= 0, limits); binds nothing yet.
  static Result<std::unique_ptr<CompletionsServer>> create(rollout::Engine& engine, const train::Tokenizer& tokenizer,
                                                           const ServeOptions& options);
  ~CompletionsServer();  // stop()

  // Binds host:port, then serves on background threads until stop(). Error: the address cannot
  // be bound (in use, not local).
  Status start();
  int port() const;

  // Stops accepting connections, lets the requests in flight finish (their clients get their
  // answers), then stops the engine thread. Idempotent; safe to call from any thread but the
  // server's own.
  void stop();

  ServeCounters counters() const;

  struct Impl;

 private:
  explicit CompletionsServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace nibble::tools
