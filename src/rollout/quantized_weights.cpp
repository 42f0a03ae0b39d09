// Reading pre-quantized block-linear weights from a `nibble quantize` file (see quantized_weights.h).
#include "rollout/quantized_weights.h"

#include <cstring>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"

namespace nibble::rollout {

namespace {

// The HF parameters whose rows make up linear `info`'s weight view, in order.
Result<std::vector<const model::ParamRef<float>*>> members_of(model::Model& model, const model::LinearInfo& info) {
  const float* w = model.linear_weight(info.id);
  std::vector<const model::ParamRef<float>*> out;
  int64_t rows = 0;
  for (const model::ParamRef<float>& p : model.param_refs())
    if (p.value >= w && p.value < w + info.N * info.K) {
      if (p.shape.size() != 2 || p.shape[1] != info.K)
        return invalid_argument("linear {}: member {} is not a ({} columns) matrix", info.name, p.name, info.K);
      out.push_back(&p);
      rows += p.shape[0];
    }
  if (rows != info.N) return invalid_argument("linear {}: its members hold {} of {} rows", info.name, rows, info.N);
  return out;
}

// The tensor `name` of `file` as bytes, checked to be `dtype` of `shape`.
Result<Tensor> member(const io::SafetensorsFile& file, const std::string& path, const std::string& name, DType dtype,
                      const Shape& shape) {
  if (!file.contains(name)) return data_loss("'{}' has no tensor {} (quantize the whole checkpoint)", path, name);
  NIB_ASSIGN_OR_RETURN(Tensor t, file.get(name));
  if (t.dtype() != dtype || t.shape() != shape)
    return data_loss("'{}': tensor {} is {} {}, expected {} {}", path, name, dtype_name(t.dtype()),
                     shape_str(t.shape()), dtype_name(dtype), shape_str(shape));
  return t;
}

}  // namespace

Result<HostQuantizedLinears> read_quantized_linears(const std::string& path, model::Model& model) {
  auto opened = io::SafetensorsFile::open(path);
  if (!opened.is_ok()) {
    if (opened.status().code() == StatusCode::kInvalidArgument) return data_loss("{}", opened.status().message());
    return opened.status();
  }
  const io::SafetensorsFile& file = opened.value();
  // the format record `nibble quantize` writes (tools/quantize_io.h kFormatMetadataKey)
  auto meta = file.metadata().find("nibble.format");
  if (meta == file.metadata().end())
    return data_loss("'{}' is not a `nibble quantize` output (no nibble.format metadata)", path);
  const nlohmann::json info = nlohmann::json::parse(meta->second, nullptr, /*allow_exceptions=*/false);
  if (!info.is_object() || info.value("format", "") != "nvfp4-2level" || info.value("layout", "") != "raw" ||
      info.value("rounding", "") != "rtn")
    return data_loss("'{}' holds {}: the engine takes `nibble quantize --format nvfp4-2level` (layout raw, rounding "
                     "rtn) weights", path, meta->second);
  HostQuantizedLinears out;
  for (const model::LinearInfo& li : model.linear_infos()) {
    if (li.K % 128 != 0)
      return invalid_argument("linear {} has {} in-features: `nibble quantize --format nvfp4-2level` quantizes only "
                              "multiples of 128", li.name, li.K);
    NIB_ASSIGN_OR_RETURN(auto members, members_of(model, li));
    std::vector<uint8_t> codes, scales;
    std::vector<float> outer;
    for (const model::ParamRef<float>* p : members) {
      const int64_t n = p->shape[0], K = li.K;
      NIB_ASSIGN_OR_RETURN(Tensor c, member(file, path, p->name + ".codes", DType::kU8, Shape{n, K / 2}));
      NIB_ASSIGN_OR_RETURN(Tensor s, member(file, path, p->name + ".scales", DType::kU8, Shape{n, K / 16}));
      NIB_ASSIGN_OR_RETURN(Tensor g, member(file, path, p->name + ".global", DType::kF32, Shape{n, K / 128}));
      codes.insert(codes.end(), c.data<uint8_t>(), c.data<uint8_t>() + c.numel());
      scales.insert(scales.end(), s.data<uint8_t>(), s.data<uint8_t>() + s.numel());
      outer.insert(outer.end(), g.data<float>(), g.data<float>() + g.numel());
    }
    out.codes.push_back(std::move(codes));
    out.scales.push_back(std::move(scales));
    out.outer.push_back(std::move(outer));
  }
  const auto& infos = model.linear_infos();
  for (size_t i = 0; i < infos.size(); ++i) {
    backend::QuantizedTensor q;
    q.format = backend::QuantFormat::kNvfp4TwoLevel;
    q.rows = infos[i].N;
    q.cols = infos[i].K;
    q.codes = out.codes[i].data();
    q.scales = out.scales[i].data();
    q.outer = out.outer[i].data();
    out.views.push_back(q);
  }
  return out;
}

}  // namespace nibble::rollout
