// Reading pre-quantized block-linear weights from a `nibble quantize` file (see quantized_weights.h).
#include "rollout/quantized_weights.h"

#include <cstring>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"

namespace nibble::rollout {

namespace {

// The HF parameters whose rows make up linear `info`'s weight, in order.
Result<std::vector<const model::ParamRef<float>*>> members_of(const model::Model& model, const model::LinearInfo& info) {
  std::vector<const model::ParamRef<float>*> out;
  int64_t rows = 0;
  const auto [first, count] = model.linear_params(info.id);
  for (size_t i = first; i < first + count; ++i) {
    const model::ParamRef<float>& p = model.param_refs()[i];
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

Status read_quantized_linears(const std::string& path, model::Model& model, const QuantizedLinearSink& fn) {
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
  // pass 0 checks every member (views of the mapped file, nothing copied); pass 1 copies one
  // linear's members at a time and hands it over
  std::vector<uint8_t> codes, scales;
  std::vector<float> outer;
  for (int pass = 0; pass < 2; ++pass)
    for (const model::LinearInfo& li : model.linear_infos()) {
      if (li.K % 128 != 0)
        return invalid_argument("linear {} has {} in-features: `nibble quantize --format nvfp4-2level` quantizes "
                                "only multiples of 128", li.name, li.K);
      NIB_ASSIGN_OR_RETURN(auto members, members_of(model, li));
      codes.clear(), scales.clear(), outer.clear();
      for (const model::ParamRef<float>* p : members) {
        const int64_t n = p->shape[0], K = li.K;
        NIB_ASSIGN_OR_RETURN(Tensor c, member(file, path, p->name + ".codes", DType::kU8, Shape{n, K / 2}));
        NIB_ASSIGN_OR_RETURN(Tensor s, member(file, path, p->name + ".scales", DType::kU8, Shape{n, K / 16}));
        NIB_ASSIGN_OR_RETURN(Tensor g, member(file, path, p->name + ".global", DType::kF32, Shape{n, K / 128}));
        if (pass == 0) continue;
        codes.insert(codes.end(), c.data<uint8_t>(), c.data<uint8_t>() + c.numel());
        scales.insert(scales.end(), s.data<uint8_t>(), s.data<uint8_t>() + s.numel());
        outer.insert(outer.end(), g.data<float>(), g.data<float>() + g.numel());
      }
      if (pass == 0) continue;
      backend::QuantizedTensor q;
      q.format = backend::QuantFormat::kNvfp4TwoLevel;
      q.rows = li.N;
      q.cols = li.K;
      q.codes = codes.data();
      q.scales = scales.data();
      q.outer = outer.data();
      NIB_RETURN_IF_ERROR(fn(li.id, q));
    }
  return Status::ok();
}

}  // namespace nibble::rollout
