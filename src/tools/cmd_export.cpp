// `nibble export`: a checkpoint (run folder or step folder) to a Hugging Face folder (F32/BF16
// safetensors, config.json, tokenizer) or to NVFP4 in ModelOpt's layout (train/export.h). It
// refuses to write into or over the checkpoint, and replaces an existing OUT only when that is an
// earlier export of the same kind or --force is given; SIGINT/SIGTERM leave no temporary behind.
#include <cstdio>
#include <memory>

#include "core/interrupt.h"
#include "tools/command.h"
#include "train/checkpoint.h"
#include "train/export.h"

namespace nibble::tools {
namespace {

struct ExportArgs {
  std::string checkpoint, to, out, dtype = "bf16";
  bool force = false;
};

int run_export(const ExportArgs& a) {
  install_interrupt_handlers();
  auto ck = train::open_checkpoint(a.checkpoint);
  if (!ck) return report_error("export", ck.status());
  Status s;
  if (a.to == "hf") {
    s = train::export_hf(*ck, a.out, a.dtype == "f32" ? DType::kF32 : DType::kBF16, a.force);
  } else {
    train::Nvfp4ExportOptions options;
    options.replace = a.force;
    s = train::export_nvfp4(*ck, a.out, options);
  }
  if (!s) return report_error("export", s);
  std::printf("export: %s (step %lld) -> %s (%s%s)\n", ck->dir.c_str(), static_cast<long long>(ck->step), a.out.c_str(),
              a.to.c_str(), a.to == "hf" ? (", " + a.dtype).c_str() : "");
  return 0;
}

}  // namespace

NIBBLE_REGISTER_COMMAND(kExportCommand, "export",
                        "Export a checkpoint: --to hf (transformers folder) or --to nvfp4 (ModelOpt NVFP4 layout)",
                        [](CLI::App& app) -> CommandRun {
                          auto a = std::make_shared<ExportArgs>();
                          app.add_option("--checkpoint", a->checkpoint, "Run folder (uses its latest checkpoint) or step folder")
                              ->required();
                          app.add_option("--to", a->to, "Target layout")->required()->check(CLI::IsMember({"hf", "nvfp4"}));
                          app.add_option("out_dir", a->out,
                                         "Output folder: new, empty, or an earlier export of the same kind (replaced atomically)")
                              ->required();
                          app.add_flag("--force", a->force, "Replace out_dir whatever it holds (never the checkpoint itself)");
                          app.add_option("--dtype", a->dtype, "hf: tensor dtype (default bf16)")
                              ->check(CLI::IsMember({"f32", "bf16"}));
                          return [a] { return run_export(*a); };
                        });

}  // namespace nibble::tools
