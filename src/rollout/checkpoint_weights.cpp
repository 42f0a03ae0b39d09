// Loading a checkpoint's weights into an engine whose model keeps inference storage, one tensor
// at a time (see checkpoint_weights.h). The error words are train::load_model_state's, so a
// checkpoint is refused alike whichever storage reads it.
#include "rollout/checkpoint_weights.h"

#include <cstring>
#include <vector>

#include "core/bits.h"
#include "core/parallel.h"
#include "io/safetensors.h"
#include "rollout/quantized_weights.h"

namespace nibble::rollout {

namespace {

// dst: (n) f32 host <- t: (n) F32 or BF16 host (a view of the mapped file).
void widen_to_f32(float* dst, const Tensor& t) {
  const int64_t n = t.numel();
  if (t.dtype() == DType::kF32) {
    std::memcpy(dst, t.raw(), static_cast<size_t>(n) * sizeof(float));
    return;
  }
  const uint16_t* b = t.data<uint16_t>();
  parallel_for(n, 4096, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) dst[i] = bf16_bits_to_f32(b[i]);
  });
}

}  // namespace

std::string weight_layout_recipe(model::Model& model) {
  for (const model::LinearInfo& li : model.linear_infos())
    if (model.linear_recipe(li.id)->name() != "bf16") return model.linear_recipe(li.id)->name();
  return "bf16";
}

Status Engine::load_weights(const std::string& path) {
  if (model_->storage() != model::ParameterStorage::kInference)
    return invalid_argument("rollout: load_weights fills a model of inference storage (a training model loads its "
                            "checkpoint itself)");
  if (!linears_) return invalid_argument("rollout: the recipe mode runs the model's own recipes");
  auto opened = io::SafetensorsFile::open(path);
  if (!opened) return data_loss("corrupt checkpoint file '{}': {}", path, opened.status().message());
  const io::SafetensorsFile& file = *opened;
  const bool packed = file.metadata().count("nibble.format") > 0;  // a `nibble quantize` output
  const auto& params = model_->param_refs();

  // ---- check every tensor first: a bad file changes nothing ----
  // A plain (F32 or BF16) tensor of parameter i's shape.
  auto plain = [&](size_t i) -> Result<Tensor> {
    const model::ParamRef<float>& p = params[i];
    if (!file.contains(p.name)) {
      if (file.contains(p.name + ".codes"))
        return data_loss("checkpoint '{}': tensor '{}' is quantized; the engine quantizes only the block linears "
                         "(nibble quantize --skip the embedding, norms, routers and lm_head)", path, p.name);
      return data_loss("checkpoint '{}' lacks tensor '{}'", path, p.name);
    }
    NIB_ASSIGN_OR_RETURN(Tensor t, file.get(p.name));
    if (t.shape() != p.shape)
      return data_loss("checkpoint '{}': tensor '{}' has the wrong shape for this model config", path, p.name);
    if (t.dtype() != DType::kF32 && t.dtype() != DType::kBF16)
      return data_loss("checkpoint '{}': tensor '{}' must be F32 or BF16", path, p.name);
    return t;
  };
  std::vector<bool> member(params.size(), false);  // a block linear's member
  for (const model::LinearInfo& li : model_->linear_infos()) {
    const auto [first, count] = model_->linear_params(li.id);
    for (size_t i = first; i < first + count; ++i) member[i] = true;
  }
  size_t expected = 0;  // tensors the file must hold
  for (size_t i = 0; i < params.size(); ++i) {
    if (member[i] && packed) {
      expected += 3;  // codes, scales, global: read_quantized_linears checks them
      continue;
    }
    NIB_RETURN_IF_ERROR(plain(i).status());
    ++expected;
  }
  if (expected != file.names().size())
    return data_loss("checkpoint '{}' holds {} tensors, the model has {}", path, file.names().size(), expected);

  // ---- the block linears: packed as they are, or one fused (N,K) weight at a time ----
  if (packed) {
    NIB_RETURN_IF_ERROR(load_quantized_weights(path));  // checks every member before taking any
  } else {
    std::vector<float> w;
    for (const model::LinearInfo& li : model_->linear_infos()) {
      w.resize(static_cast<size_t>(li.N * li.K));
      const auto [first, count] = model_->linear_params(li.id);
      float* at = w.data();
      for (size_t i = first; i < first + count; ++i) {
        NIB_ASSIGN_OR_RETURN(Tensor t, plain(i));
        widen_to_f32(at, t);
        at += params[i].numel;
      }
      NIB_RETURN_IF_ERROR(set_linear_weight(li.id, w.data()));
    }
  }
  // ---- the kept parameters (F32 straight from the mapped file) and the BF16 lm_head ----
  backend::Backend& be = model_->backend();
  std::vector<float> widened;
  for (size_t i = 0; i < params.size(); ++i) {
    if (member[i]) continue;
    NIB_ASSIGN_OR_RETURN(Tensor t, plain(i));
    if (static_cast<int64_t>(i) == lm_head_index_) {
      upload_lm_head(t.raw(), t.dtype() == DType::kBF16);
      continue;
    }
    const float* src = static_cast<const float*>(t.raw());
    if (t.dtype() == DType::kBF16) {
      widened.resize(static_cast<size_t>(t.numel()));
      widen_to_f32(widened.data(), t);
      src = widened.data();
    }
    be.copy_to_device(params[i].value, src, static_cast<size_t>(t.numel()) * sizeof(float));
  }
  return Status::ok();
}

Result<InferenceEngine> load_inference_engine(const model::ModelConfig& config, const model::RecipeConfig& recipe,
                                              const std::string& model_file, EngineOptions options,
                                              backend::Backend& be) {
  if (options.mode == PrecisionMode::kRecipe)
    return invalid_argument("rollout: the recipe mode runs the training model's recipes (load it with its checkpoint)");
  InferenceEngine out;
  NIB_ASSIGN_OR_RETURN(out.model, model::Model::create(config, recipe, &be, model::ParameterStorage::kInference));
  options.recipe_name = weight_layout_recipe(*out.model);
  NIB_ASSIGN_OR_RETURN(out.engine, Engine::create(*out.model, options));
  NIB_RETURN_IF_ERROR(out.engine->load_weights(model_file));
  return out;
}

}  // namespace nibble::rollout
