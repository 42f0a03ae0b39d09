// `nibble serve`: an OpenAI-compatible completions server (POST /v1/completions, streaming as
// server-sent events; GET /v1/models, GET /health) over a checkpoint on the rollout engine, in
// any precision mode, on loopback unless --host says otherwise (tools/completions_server.h).
// Prints "nibble serve: listening on http://HOST:PORT ..." on stdout once bound (--port 0: a
// free port, named there). SIGINT/SIGTERM: new requests get 503, those in flight finish, then
// exit 130/143 (docs/cli.md, exit codes).
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <thread>

#include "core/interrupt.h"
#include "rollout/engine.h"
#include "tools/command.h"
#include "tools/completions_server.h"
#include "tools/device_option.h"
#include "tools/generation_model.h"
#include "tools/option_check.h"
#include "train/checkpoint.h"
#include "train/tokenizer.h"

namespace nibble::tools {
namespace {

struct ServeArgs {
  std::string checkpoint, device, mode = "recipe", model_name;
  ServeOptions server;
  int64_t max_batch = 16;
};

// The served model's name: --model-name, else the checkpoint argument's last folder name.
std::string model_id(const ServeArgs& a) {
  if (!a.model_name.empty()) return a.model_name;
  std::filesystem::path p(a.checkpoint);
  if (!p.has_filename()) p = p.parent_path();
  return p.filename().empty() ? std::string("nibble") : p.filename().string();
}

int run_serve(ServeArgs a) {
  rollout::EngineOptions eo;
  auto mode = rollout::parse_precision_mode(a.mode);
  if (!mode) return report_error("serve", invalid_argument("--mode: {}", mode.status().message()));
  eo.mode = *mode;
  auto be = open_device(a.device);
  if (!be) return report_error("serve", be.status());
  if (!(*be)->supports(backend::Op::kPagedKvCache))
    return report_error("serve", unimplemented("backend '{}' has no paged KV-cache ops yet (issue #15): serve on "
                                               "--device cpu", (*be)->name()));
  auto ck = train::open_checkpoint(a.checkpoint);
  if (!ck) return report_error("serve", ck.status());
  eo.max_batch = a.max_batch;
  // bf16 / w4a16 / w4a4: a model of inference storage, its weights read tensor by tensor
  auto gm = load_generation_model(*ck, nullptr, eo, **be, /*training_forward=*/false);
  if (!gm) return report_error("serve", gm.status());
  auto tok = train::Tokenizer::load(ck->tokenizer_path);
  if (!tok) return report_error("serve", tok.status());
  a.server.model_id = model_id(a);
  auto server = CompletionsServer::create(*gm->engine, *tok, a.server);
  if (!server) return report_error("serve", server.status());
  install_interrupt_handlers();
  std::signal(SIGPIPE, SIG_IGN);  // a client gone mid-answer is a failed write, not the end of the server
  if (Status s = (*server)->start(); !s) return report_error("serve", s);
  std::printf("nibble serve: listening on http://%s:%d (model '%s', mode %s, %s storage, device %s, max batch %lld, "
              "queue %lld)\n",
              a.server.host.c_str(), (*server)->port(), a.server.model_id.c_str(), rollout::precision_mode_name(eo.mode),
              gm->inference_storage() ? "inference" : "training", (*be)->name().c_str(),
              static_cast<long long>(a.max_batch), static_cast<long long>(a.server.queue));
  std::fflush(stdout);
  while (interrupt_signal() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::fprintf(stderr, "nibble serve: %s: finishing the requests in flight\n", signal_name(interrupt_signal()).c_str());
  (*server)->stop();
  const ServeCounters c = (*server)->counters();
  std::fprintf(stderr, "nibble serve: stopped (%lld answered, %lld cancelled, %lld refused, %lld failed)\n",
               static_cast<long long>(c.completed), static_cast<long long>(c.cancelled),
               static_cast<long long>(c.rejected), static_cast<long long>(c.failed));
  return interrupt_exit_code();
}

}  // namespace

NIBBLE_REGISTER_COMMAND(kServeCommand, "serve", "Serve a checkpoint over HTTP (OpenAI-compatible /v1/completions)",
                        [](CLI::App& app) -> CommandRun {
                          auto a = std::make_shared<ServeArgs>();
                          app.add_option("--checkpoint", a->checkpoint, "Run folder (uses its latest checkpoint) or step folder")
                              ->required();
                          app.add_option("--host", a->server.host, "Address to listen on (default 127.0.0.1: this machine only)");
                          app.add_option("--port", a->server.port, "TCP port (default 8000; 0: any free port, printed)")
                              ->check(IntegerIn(0, 65535));
                          app.add_option("--mode", a->mode, "Linear precision: recipe (the run's, default), bf16, w4a16, w4a4");
                          app.add_option("--max-batch", a->max_batch, "Sequences decoded at once (default 16)")
                              ->check(IntegerIn(1, 65536));
                          app.add_option("--queue", a->server.queue,
                                         "Sequences that may wait beyond --max-batch; more get 503 (default 64)")
                              ->check(IntegerIn(0, 1 << 20));
                          app.add_option("--max-new-tokens-limit", a->server.max_new_tokens_limit,
                                         "Largest max_tokens a request may ask (default 0: the model's context)")
                              ->check(IntegerIn(0, std::numeric_limits<int32_t>::max()));
                          app.add_option("--model-name", a->model_name,
                                         "The model name /v1/models lists (default: the checkpoint folder's name)");
                          app.add_option("--threads", a->server.threads, "CPU threads of the engine (default: all)")
                              ->check(IntegerIn(1, 4096));
                          add_device_option(app, &a->device);
                          return [a] { return run_serve(*a); };
                        });

}  // namespace nibble::tools
