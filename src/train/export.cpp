// HF and NVFP4 (ModelOpt layout) exports (see export.h).
#include "train/export.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "core/bits.h"
#include "core/interrupt.h"
#include "formats/quantize_cpu.h"
#include "io/output_guard.h"
#include "train/atomic_dir.h"
#include "train/tokenizer.h"

namespace nibble::train {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

Tensor to_bf16(const Tensor& f32) {
  Tensor out(DType::kBF16, f32.shape());
  const float* src = f32.data<float>();
  uint16_t* dst = out.data<uint16_t>();
  for (int64_t i = 0; i < f32.numel(); ++i) dst[i] = f32_to_bf16_bits(src[i]);
  return out;
}

Tensor scalar_f32(float v) {
  Tensor t(DType::kF32, Shape{});
  *t.data<float>() = v;
  return t;
}

// config.json, generation_config.json and the tokenizer files into `dir`.
Status write_common_files(const Checkpoint& ckpt, const fs::path& dir, const json& config) {
  NIB_RETURN_IF_ERROR(write_file_atomic((dir / "config.json").string(), config.dump(2) + "\n"));
  NIB_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::load(ckpt.tokenizer_path));
  NIB_RETURN_IF_ERROR(tok.save((dir / "tokenizer.model").string()));
  const json specials{{"bos_token", tok.piece(tok.bos_id())},
                      {"eos_token", tok.piece(tok.eos_id())},
                      {"unk_token", tok.piece(tok.unk_id())},
                      {"pad_token", tok.piece(tok.pad_id())}};
  json tc = specials;
  tc["tokenizer_class"] = "LlamaTokenizer";
  tc["add_bos_token"] = false;  // training documents are "text eos text eos ...", no bos
  tc["add_eos_token"] = false;
  tc["legacy"] = true;          // plain sp.encode(text): the tokenizer has no dummy prefix
  tc["add_prefix_space"] = false;
  tc["clean_up_tokenization_spaces"] = false;
  tc["model_max_length"] = ckpt.model_config.max_position_embeddings;
  tc["sp_model_kwargs"] = json::object();
  NIB_RETURN_IF_ERROR(write_file_atomic((dir / "tokenizer_config.json").string(), tc.dump(2) + "\n"));
  NIB_RETURN_IF_ERROR(write_file_atomic((dir / "special_tokens_map.json").string(), specials.dump(2) + "\n"));
  // No "transformers_version": that key records the transformers release that wrote the file,
  // and none did (transformers fills in its own when loading; the export is checked with 5.17,
  // docs/training.md).
  const json gen{{"bos_token_id", tok.bos_id()}, {"eos_token_id", tok.eos_id()}, {"pad_token_id", tok.pad_id()},
                 {"do_sample", true},           {"temperature", 0.8},           {"top_p", 0.95},
                 {"max_new_tokens", 64}};
  return write_file_atomic((dir / "generation_config.json").string(), gen.dump(2) + "\n");
}

json hf_config(const Checkpoint& ckpt, const std::string& torch_dtype) {
  json c = ckpt.model_config.to_json();
  c["torch_dtype"] = torch_dtype;
  c["bos_token_id"] = 1;
  c["eos_token_id"] = 2;
  c["pad_token_id"] = 3;
  c["use_cache"] = true;
  return c;
}

// Files an export writes; an earlier export of the same kind holds only these (and the first two).
const std::set<std::string>& export_files(bool nvfp4) {
  static const std::set<std::string> hf{"config.json",       "model.safetensors",     "generation_config.json",
                                        "tokenizer.model",   "tokenizer_config.json", "special_tokens_map.json"};
  static const std::set<std::string> nv = [] {
    std::set<std::string> s = hf;
    s.insert("hf_quant_config.json");
    return s;
  }();
  return nvfp4 ? nv : hf;
}

// The checkpoint's step folder and, when it sits in RUN/checkpoints/, the run folder.
std::vector<std::string> checkpoint_folders(const Checkpoint& ckpt) {
  std::vector<std::string> out{ckpt.dir};
  const fs::path parent = fs::path(io::resolved_path(ckpt.dir)).parent_path();
  if (parent.filename() == "checkpoints") out.push_back(parent.parent_path().string());
  return out;
}

Status check_interrupt(const std::string& out_dir) {
  if (interrupt_signal() != 0) return cancelled_status("while exporting to " + out_dir);
  return Status::ok();
}

}  // namespace

Status check_export_destination(const Checkpoint& ckpt, const std::string& out_dir, bool nvfp4, bool replace) {
  if (out_dir.empty()) return invalid_argument("export: empty output folder");
  for (const std::string& folder : checkpoint_folders(ckpt)) {
    if (io::path_within(out_dir, folder) || io::path_within(folder, out_dir))
      return invalid_argument("export: output '{}' is inside or holds the checkpoint being read ('{}'): choose a folder "
                              "outside it",
                              out_dir, folder);
  }
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(out_dir, ec);
  if (!fs::exists(st) || replace) return Status::ok();
  const char* kind = nvfp4 ? "nvfp4" : "hf";
  if (!fs::is_directory(st))
    return invalid_argument("export: '{}' exists and is not a folder: choose a new path, or pass --force to replace it",
                            out_dir);
  const std::set<std::string>& ours = export_files(nvfp4);
  std::set<std::string> found;
  for (const auto& e : fs::directory_iterator(out_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!ours.count(name) || !e.is_regular_file())
      return invalid_argument("export: '{}' exists and holds '{}', which a nibble {} export does not write: choose a "
                              "new folder, or pass --force to replace it",
                              out_dir, name, kind);
    found.insert(name);
  }
  if (ec) return io_error("export: cannot list '{}': {}", out_dir, ec.message());
  const bool earlier_export = found.count("config.json") && found.count("model.safetensors") &&
                              (!nvfp4 || found.count("hf_quant_config.json"));
  if (!found.empty() && !earlier_export)
    return invalid_argument("export: '{}' exists and is not an earlier nibble {} export: choose a new folder, or pass "
                            "--force to replace it",
                            out_dir, kind);
  return Status::ok();
}

std::string fused_linear_of(const std::string& name) {
  if (!ends_with(name, "_proj.weight")) return "";
  const std::string module = name.substr(0, name.size() - std::string(".weight").size());
  auto dot = module.rfind('.');
  const std::string prefix = module.substr(0, dot + 1), leaf = module.substr(dot + 1);
  if (leaf == "q_proj" || leaf == "k_proj" || leaf == "v_proj") return prefix + "qkv_proj";
  if (leaf == "gate_proj" || leaf == "up_proj") return prefix + "gate_up_proj";
  if (leaf == "o_proj" || leaf == "down_proj") return module;
  return "";
}

Status export_hf(const Checkpoint& ckpt, const std::string& out_dir, DType dtype, bool replace) {
  if (dtype != DType::kF32 && dtype != DType::kBF16) return invalid_argument("export: --dtype must be f32 or bf16");
  NIB_RETURN_IF_ERROR(check_export_destination(ckpt, out_dir, /*nvfp4=*/false, replace));
  // Loaded and checked against the config as eval/generate/resume do (checkpoint.h).
  NIB_ASSIGN_OR_RETURN(auto tensors, load_checkpoint_tensors(ckpt));
  if (dtype == DType::kBF16)
    for (auto& t : tensors) t.tensor = to_bf16(t.tensor);
  NIB_RETURN_IF_ERROR(check_interrupt(out_dir));
  NIB_ASSIGN_OR_RETURN(AtomicDir dir, AtomicDir::create(out_dir));
  const fs::path tmp(dir.temp_path());
  NIB_RETURN_IF_ERROR(io::write_safetensors((tmp / "model.safetensors").string(), tensors, {{"format", "pt"}},
                                            /*stop_on_interrupt=*/true));
  NIB_RETURN_IF_ERROR(write_common_files(ckpt, tmp, hf_config(ckpt, dtype == DType::kF32 ? "float32" : "bfloat16")));
  NIB_RETURN_IF_ERROR(check_interrupt(out_dir));  // `dir` removes the temporary folder
  return dir.commit();
}

Status export_nvfp4(const Checkpoint& ckpt, const std::string& out_dir, const Nvfp4ExportOptions& options) {
  NIB_RETURN_IF_ERROR(check_export_destination(ckpt, out_dir, /*nvfp4=*/true, options.replace));
  NIB_ASSIGN_OR_RETURN(auto tensors, load_checkpoint_tensors(ckpt));
  // The fused linears and their shared weight amax (max over the q/k/v or gate/up parts).
  std::map<std::string, float> group_amax;
  for (const auto& t : tensors) {
    const std::string g = fused_linear_of(t.name);
    if (g.empty()) continue;
    if (t.tensor.rank() != 2 || t.tensor.shape()[1] % 16 != 0)
      return data_loss("export nvfp4: '{}' has K = {} (must be a multiple of 16)", t.name,
                       t.tensor.rank() == 2 ? t.tensor.shape()[1] : -1);
    float a = formats::amax_cpu(t.tensor.data<float>(), t.tensor.numel());
    group_amax[g] = std::max(group_amax[g], a);
  }
  std::vector<io::NamedTensor> out;
  for (const auto& t : tensors) {
    const std::string g = fused_linear_of(t.name);
    if (g.empty()) {
      out.push_back({t.name, to_bf16(t.tensor)});
      continue;
    }
    const int64_t N = t.tensor.shape()[0], K = t.tensor.shape()[1];
    // A zero weight group gets amax 1 (any positive value encodes zeros exactly).
    const float amax = group_amax[g] > 0 ? group_amax[g] : 1.0f;
    Tensor codes(DType::kU8, Shape{N, K / 2});
    Tensor scales(DType::kF8E4M3, Shape{N, K / 16});
    formats::nvfp4_te_quantize_with_amax_cpu(codes.data<uint8_t>(), scales.data<uint8_t>(), t.tensor.data<float>(), N, K,
                                             amax);
    const std::string module = t.name.substr(0, t.name.size() - std::string(".weight").size());
    auto ia = options.input_amax.find(g);
    const float input_scale = ia != options.input_amax.end() && ia->second > 0 ? ia->second / 2688.0f : 1.0f;
    out.push_back({module + ".weight", codes});
    out.push_back({module + ".weight_scale", scales});
    out.push_back({module + ".weight_scale_2", scalar_f32(amax / 2688.0f)});
    out.push_back({module + ".input_scale", scalar_f32(input_scale)});
  }
  const json quant{{"quant_algo", "NVFP4"},
                   {"kv_cache_quant_algo", nullptr},
                   {"group_size", 16},
                   {"exclude_modules", {"lm_head", "model.layers.*.mlp.gate"}}};
  json config = hf_config(ckpt, "bfloat16");
  config["quantization_config"] = quant;
  config["quantization_config"]["quant_method"] = "modelopt";
  NIB_RETURN_IF_ERROR(check_interrupt(out_dir));
  NIB_ASSIGN_OR_RETURN(AtomicDir dir, AtomicDir::create(out_dir));
  const fs::path tmp(dir.temp_path());
  NIB_RETURN_IF_ERROR(io::write_safetensors((tmp / "model.safetensors").string(), out, {{"format", "pt"}},
                                            /*stop_on_interrupt=*/true));
  NIB_RETURN_IF_ERROR(write_common_files(ckpt, tmp, config));
  const json hq{{"producer", {{"name", "nibble"}, {"version", "0.1.0"}}}, {"quantization", quant}};
  NIB_RETURN_IF_ERROR(write_file_atomic((tmp / "hf_quant_config.json").string(), hq.dump(2) + "\n"));
  NIB_RETURN_IF_ERROR(check_interrupt(out_dir));  // `dir` removes the temporary folder
  return dir.commit();
}

}  // namespace nibble::train
