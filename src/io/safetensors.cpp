// safetensors reader and writer (see safetensors.h). Mirrors the format and the validation of
// the Hugging Face `safetensors` library (header length limit of 100 MB, dtype names, offsets in
// range, byte length == numel x dtype size, no overlap), with one-line Status errors that name
// the file and the problem. Files are mmap'ed; tensors view the mapping when the data is aligned
// for the dtype, otherwise they are copied. Writing is atomic (io/atomic_file.h).
#include "io/safetensors.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <limits>
#include <new>
#include <regex>
#include <set>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "io/atomic_file.h"
#include "io/mmap_file.h"

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian; nibble assumes a little-endian host");

namespace nibble::io {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

namespace {

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the limit of the HF library
constexpr size_t kMaxRank = 64;                     // no real tensor comes close; keeps messages short
constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";

// A string from a file, made safe for a one-line message: control bytes escaped, long ones cut.
std::string printable(std::string_view s, size_t max_bytes = 100) {
  std::string out;
  size_t n = std::min(s.size(), max_bytes);
  // Do not cut a UTF-8 sequence in the middle: back up over continuation bytes.
  if (n < s.size())
    while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  for (size_t i = 0; i < n; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) out += fmt::format("\\x{:02x}", c);
    else out += static_cast<char>(c);
  }
  if (n < s.size()) out += "...";
  return out;
}

std::string supported_dtypes() {
  std::string out;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kF8E5M2, DType::kU8, DType::kI32, DType::kI64})
    out += (out.empty() ? "" : ", ") + std::string(dtype_name(t));
  return out;
}

// "a JSON <type>" for messages.
std::string json_kind(const json& j) {
  if (j.is_number_unsigned() || j.is_number_integer()) return "integer";
  if (j.is_number_float()) return "floating-point number";
  return j.type_name();
}

// Parses JSON text into `out`, rejecting duplicate object keys (the HF library rejects them too;
// nlohmann would silently keep the last). Never throws.
Status parse_json(const char* begin, const char* end, const std::string& label, const char* what, json* out) {
  // nlohmann stops at a NUL byte as at the end of input, so "{...}\0junk" would parse; the
  // reference parser (the Rust crate: from_utf8, then serde_json::from_str) rejects any byte
  // after the value but JSON whitespace. A NUL is never valid in JSON text, so refuse it here.
  if (const void* nul = std::memchr(begin, '\0', static_cast<size_t>(end - begin)))
    return invalid_argument("{}: {} has a NUL byte at offset {} (only JSON text, padded with spaces, is allowed)", label,
                            what, static_cast<const char*>(nul) - begin);
  std::vector<std::unordered_set<std::string>> keys;  // one set per open object
  std::string duplicate;
  int duplicate_depth = 0;
  auto cb = [&](int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start: keys.emplace_back(); break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys.empty() && parsed.is_string() && !keys.back().insert(parsed.get_ref<const std::string&>()).second &&
            duplicate.empty()) {
          duplicate = parsed.get_ref<const std::string&>();
          duplicate_depth = depth;
        }
        break;
      default: break;
    }
    return true;
  };
  try {
    *out = json::parse(begin, end, cb, /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const json::parse_error& e) {
    std::string msg = e.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " prefix.
    if (size_t p = msg.find("] "); p != std::string::npos && msg.rfind("[json.exception", 0) == 0) msg = msg.substr(p + 2);
    return invalid_argument("{}: {} is not valid JSON: {}", label, what, printable(msg, 200));
  } catch (const std::exception& e) {
    return invalid_argument("{}: {} could not be parsed: {}", label, what, printable(e.what(), 200));
  }
  if (!duplicate.empty())
    return invalid_argument("{}: {} has the key '{}' twice{}", label, what, printable(duplicate),
                            duplicate_depth == 1 ? "" : " (in a nested object)");
  return Status::ok();
}

// Reads a non-negative integer that fits in int64 (shape entries, offsets).
bool json_to_u63(const json& j, uint64_t* v) {
  if (!j.is_number_unsigned()) return false;
  uint64_t u = j.get<uint64_t>();
  if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  *v = u;
  return true;
}

// Product of dims, multiplied in order (as shape_numel does), or false on int64 overflow.
bool checked_numel(const Shape& shape, int64_t* numel) {
  int64_t n = 1;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(n, d, &n)) return false;
  *numel = n;
  return true;
}

struct ParsedImage {
  std::vector<TensorInfo> tensors;  // sorted by data offset
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // byte offset of the data section in the image
  uint64_t data_size = 0;
};

// Validates a whole safetensors image (`bytes`: (size) bytes) and describes its tensors.
Status parse_image(const uint8_t* bytes, size_t size, const std::string& label, ParsedImage* out) {
  if (size < 8) return data_loss("{}: file of {} bytes is too short to hold the 8-byte header length", label, size);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  if (header_len == 0) return invalid_argument("{}: header length is 0", label);
  if (header_len > kMaxHeaderBytes)
    return invalid_argument("{}: header length {} exceeds the limit of {} bytes", label, header_len, kMaxHeaderBytes);
  if (header_len > size - 8)
    return data_loss("{}: header length {} exceeds the {} bytes that follow it (file truncated?)", label, header_len, size - 8);

  const char* text = reinterpret_cast<const char*>(bytes + 8);
  json header;
  NIB_RETURN_IF_ERROR(parse_json(text, text + header_len, label, "header", &header));
  if (!header.is_object()) return invalid_argument("{}: header is a JSON {}, not an object", label, json_kind(header));

  out->data_start = 8 + header_len;
  out->data_size = size - out->data_start;
  out->tensors.clear();
  out->metadata.clear();
  for (const auto& [name, entry] : header.items()) {
    const std::string pname = printable(name);
    if (name == "__metadata__") {
      if (!entry.is_object())
        return invalid_argument("{}: __metadata__ is a JSON {}, not an object of strings", label, json_kind(entry));
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string())
          return invalid_argument("{}: __metadata__ entry '{}' is a JSON {}, not a string", label, printable(k), json_kind(v));
        out->metadata[k] = v.get<std::string>();
      }
      continue;
    }
    if (!entry.is_object())
      return invalid_argument("{}: tensor '{}': entry is a JSON {}, not an object", label, pname, json_kind(entry));
    TensorInfo info;
    info.name = name;

    auto dt = entry.find("dtype");
    if (dt == entry.end()) return invalid_argument("{}: tensor '{}': missing 'dtype'", label, pname);
    if (!dt->is_string()) return invalid_argument("{}: tensor '{}': 'dtype' is a JSON {}, not a string", label, pname, json_kind(*dt));
    const std::string& dname = dt->get_ref<const std::string&>();
    std::optional<DType> dtype = dtype_from_name(dname);
    if (!dtype)
      return invalid_argument("{}: tensor '{}': unknown dtype '{}' (nibble reads {})", label, pname, printable(dname), supported_dtypes());
    info.dtype = *dtype;

    auto sh = entry.find("shape");
    if (sh == entry.end()) return invalid_argument("{}: tensor '{}': missing 'shape'", label, pname);
    if (!sh->is_array()) return invalid_argument("{}: tensor '{}': 'shape' is a JSON {}, not an array", label, pname, json_kind(*sh));
    if (sh->size() > kMaxRank)
      return invalid_argument("{}: tensor '{}': shape has {} dimensions (at most {} are supported)", label, pname, sh->size(), kMaxRank);
    for (size_t i = 0; i < sh->size(); ++i) {
      const json& d = (*sh)[i];
      uint64_t v = 0;
      if (d.is_number_integer() && !d.is_number_unsigned())
        return invalid_argument("{}: tensor '{}': shape dimension {} is negative ({})", label, pname, i, d.get<int64_t>());
      if (!json_to_u63(d, &v))
        return invalid_argument("{}: tensor '{}': shape dimension {} is not an integer in [0, 2^63) ({})", label, pname, i,
                                printable(d.dump(), 40));
      info.shape.push_back(static_cast<int64_t>(v));
    }
    int64_t numel = 0;
    if (!checked_numel(info.shape, &numel))
      return invalid_argument("{}: tensor '{}': shape {} has too many elements (64-bit overflow)", label, pname, shape_str(info.shape));
    int64_t need = 0;
    if (__builtin_mul_overflow(numel, static_cast<int64_t>(dtype_size(info.dtype)), &need))
      return invalid_argument("{}: tensor '{}': shape {} of dtype {} needs more than 2^63 bytes", label, pname,
                              shape_str(info.shape), dname);

    auto off = entry.find("data_offsets");
    if (off == entry.end()) return invalid_argument("{}: tensor '{}': missing 'data_offsets'", label, pname);
    uint64_t b = 0, e = 0;
    if (!off->is_array() || off->size() != 2 || !json_to_u63((*off)[0], &b) || !json_to_u63((*off)[1], &e))
      return invalid_argument("{}: tensor '{}': 'data_offsets' is {}, not [begin, end] with non-negative integers", label, pname,
                              printable(off->dump(), 60));
    if (b > e) return invalid_argument("{}: tensor '{}': data_offsets [{}, {}] begin after they end", label, pname, b, e);
    if (e > out->data_size)
      return data_loss("{}: tensor '{}': data_offsets [{}, {}] exceed data section of {} bytes", label, pname, b, e, out->data_size);
    if (e - b != static_cast<uint64_t>(need))
      return invalid_argument("{}: tensor '{}': data_offsets [{}, {}] hold {} bytes but shape {} of dtype {} needs {}", label, pname,
                              b, e, e - b, shape_str(info.shape), dname, need);
    info.data_begin = b;
    info.data_end = e;
    out->tensors.push_back(std::move(info));
  }

  std::sort(out->tensors.begin(), out->tensors.end(), [](const TensorInfo& x, const TensorInfo& y) {
    if (x.data_begin != y.data_begin) return x.data_begin < y.data_begin;
    if (x.data_end != y.data_end) return x.data_end < y.data_end;
    return x.name < y.name;
  });
  // Overlap: among tensors holding at least one byte, each must begin at or after the end of
  // the one before it in offset order (empty tensors occupy no bytes and overlap nothing).
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& t : out->tensors) {
    if (t.data_begin == t.data_end) continue;
    if (prev && t.data_begin < prev->data_end)
      return invalid_argument("{}: tensors '{}' [{}, {}] and '{}' [{}, {}] overlap", label, printable(prev->name), prev->data_begin,
                              prev->data_end, printable(t.name), t.data_begin, t.data_end);
    prev = &t;
  }
  return Status::ok();
}

// Shard files named in an index must stay inside the index's folder (lexically: absolute paths
// and ".." are refused; symlinks inside the folder are followed, as the HF hub cache uses them).
Status check_shard_name(const std::string& index_label, const std::string& tensor, const std::string& file) {
  if (file.empty()) return invalid_argument("{}: tensor '{}' is mapped to an empty file name", index_label, printable(tensor));
  if (file.find('\0') != std::string::npos)
    return invalid_argument("{}: tensor '{}' is mapped to a file name with a NUL byte", index_label, printable(tensor));
  fs::path p(file);
  if (p.is_absolute() || p.has_root_name() || p.has_root_directory())
    return invalid_argument("{}: tensor '{}' is mapped to '{}', an absolute path (shards must be relative to the index)", index_label,
                            printable(tensor), printable(file));
  for (const fs::path& part : p)
    if (part == "..")
      return invalid_argument("{}: tensor '{}' is mapped to '{}', which leaves the index's folder", index_label, printable(tensor),
                              printable(file));
  if (p.filename().empty() || p.filename() == ".")
    return invalid_argument("{}: tensor '{}' is mapped to '{}', which is not a file name", index_label, printable(tensor), printable(file));
  return Status::ok();
}

Result<std::string> read_small_file(const std::string& path, uint64_t max_bytes) {
  NIB_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> map, MappedFile::open(path));
  if (map->size() > max_bytes) return invalid_argument("{}: file of {} bytes is larger than the limit of {}", path, map->size(), max_bytes);
  if (map->size() == 0) return std::string();
  return std::string(reinterpret_cast<const char*>(map->data()), map->size());
}

// Validation shared by both writers.
Status check_named_tensors(const std::vector<NamedTensor>& tensors) {
  std::unordered_set<std::string> seen;
  for (const NamedTensor& nt : tensors) {
    if (nt.name.empty()) return invalid_argument("cannot write a tensor with an empty name");
    if (nt.name == "__metadata__") return invalid_argument("cannot write a tensor named '__metadata__' (reserved)");
    if (!nt.tensor.defined()) return invalid_argument("cannot write tensor '{}': it is undefined", printable(nt.name));
    if (!seen.insert(nt.name).second) return invalid_argument("cannot write tensor '{}' twice", printable(nt.name));
  }
  return Status::ok();
}

// Unlinks files of an earlier checkpoint in `dir` (model.safetensors, its index, and
// model-NNNNN-of-NNNNN.safetensors shards) that are not in `keep`.
Status remove_stale_checkpoint_files(const std::string& dir, const std::set<std::string>& keep) {
  static const std::regex shard_re(R"(model-[0-9]{5,}-of-[0-9]{5,}\.safetensors)");
  std::error_code ec;
  std::vector<fs::path> stale;  // collected first: no unlinking while the folder is being listed
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();
    bool ours = name == kSingleName || name == kIndexName || std::regex_match(name, shard_re);
    if (ours && !keep.count(name)) stale.push_back(it->path());
  }
  if (ec) return io_error("{}: cannot list folder: {}", dir, ec.message());
  for (const fs::path& p : stale) {
    fs::remove(p, ec);
    if (ec) return io_error("{}: cannot remove stale checkpoint file: {}", p.string(), ec.message());
  }
  return stale.empty() ? Status::ok() : fsync_dir(dir);
}

}  // namespace

struct SafetensorsFile::Shard {
  std::string label;                // file path (or the label given to parse) for messages
  std::shared_ptr<void> owner;      // keeps `data` alive: a MappedFile or a heap copy
  const uint8_t* data = nullptr;    // data section: (data_size) bytes
  uint64_t data_size = 0;
};

namespace {
// Builds the shard for a validated image whose memory `image` is kept alive by `owner`.
// (A template so that it can name the private SafetensorsFile::Shard through its caller.)
template <typename ShardT>
std::shared_ptr<ShardT> make_shard(const std::string& label, std::shared_ptr<void> owner, const uint8_t* image,
                                   const ParsedImage& parsed) {
  auto shard = std::make_shared<ShardT>();
  shard->label = label;
  shard->owner = std::move(owner);
  shard->data = image ? image + parsed.data_start : nullptr;
  shard->data_size = parsed.data_size;
  return shard;
}
}  // namespace

Result<SafetensorsFile> SafetensorsFile::parse(const uint8_t* bytes, size_t size, const std::string& label) {
  // An exact-size copy (so that AddressSanitizer sees any read past the end), 64-byte aligned
  // like every nibble CPU buffer.
  std::shared_ptr<uint8_t> copy(static_cast<uint8_t*>(::operator new(size ? size : 1, std::align_val_t{64})),
                                [](uint8_t* p) { ::operator delete(p, std::align_val_t{64}); });
  if (size) std::memcpy(copy.get(), bytes, size);
  const uint8_t* image = copy.get();
  return from_image(label, std::move(copy), image, size);
}

Result<SafetensorsFile> SafetensorsFile::from_image(const std::string& label, std::shared_ptr<void> owner,
                                                    const uint8_t* image, size_t size) {
  ParsedImage parsed;
  NIB_RETURN_IF_ERROR(parse_image(image, size, label, &parsed));
  SafetensorsFile f;
  f.shards_.push_back(make_shard<Shard>(label, std::move(owner), image, parsed));
  for (TensorInfo& t : parsed.tensors) {
    std::string name = t.name;
    f.order_.push_back(name);
    f.index_.emplace(std::move(name), std::make_pair(size_t{0}, std::move(t)));
  }
  f.metadata_ = std::move(parsed.metadata);
  return f;
}

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::error_code ec;
  fs::file_status st = fs::status(path, ec);
  if (st.type() == fs::file_type::not_found) return not_found("{}: no such file or folder", path);
  if (ec) return io_error("{}: cannot stat: {}", path, ec.message());
  std::string target = path;
  bool is_index = false;
  if (fs::is_directory(st)) {
    fs::path dir(path);
    if (fs::exists(dir / kIndexName, ec)) {
      target = (dir / kIndexName).string();
      is_index = true;
    } else if (fs::exists(dir / kSingleName, ec)) {
      target = (dir / kSingleName).string();
    } else {
      return not_found("{}: folder holds neither {} nor {}", path, kIndexName, kSingleName);
    }
  } else {
    is_index = fs::path(path).extension() == ".json";
  }

  if (!is_index) {
    NIB_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> map, MappedFile::open(target));
    const uint8_t* image = map->data();
    const size_t size = map->size();
    return from_image(target, std::move(map), image, size);
  }

  // Sharded: {"metadata": {...}, "weight_map": {tensor: shard file}}.
  NIB_ASSIGN_OR_RETURN(std::string text, read_small_file(target, kMaxHeaderBytes));
  json index;
  NIB_RETURN_IF_ERROR(parse_json(text.data(), text.data() + text.size(), target, "index", &index));
  if (!index.is_object()) return invalid_argument("{}: index is a JSON {}, not an object", target, json_kind(index));
  auto wm = index.find("weight_map");
  if (wm == index.end()) return invalid_argument("{}: index has no 'weight_map'", target);
  if (!wm->is_object()) return invalid_argument("{}: 'weight_map' is a JSON {}, not an object", target, json_kind(*wm));
  std::map<std::string, std::vector<std::string>> by_file;  // shard file -> tensors mapped to it (sorted by file name)
  for (const auto& [name, file] : wm->items()) {
    if (!file.is_string())
      return invalid_argument("{}: weight_map entry '{}' is a JSON {}, not a file name", target, printable(name), json_kind(file));
    const std::string& f = file.get_ref<const std::string&>();
    NIB_RETURN_IF_ERROR(check_shard_name(target, name, f));
    by_file[f].push_back(name);
  }

  SafetensorsFile out;
  out.index_path_ = target;
  auto im = index.find("metadata");
  if (im != index.end() && !im->is_null()) {
    if (!im->is_object()) return invalid_argument("{}: 'metadata' is a JSON {}, not an object", target, json_kind(*im));
    // HF writes {"total_size": <number>}; only string values are kept (metadata() is str -> str).
    for (const auto& [k, v] : im->items())
      if (v.is_string()) out.metadata_[k] = v.get<std::string>();
  }

  const fs::path dir = fs::path(target).parent_path();
  for (const auto& [file, mapped] : by_file) {
    const std::string shard_path = (dir / file).string();
    NIB_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> map, MappedFile::open(shard_path));
    ParsedImage parsed;
    NIB_RETURN_IF_ERROR(parse_image(map->data(), map->size(), shard_path, &parsed));
    std::unordered_set<std::string> wanted(mapped.begin(), mapped.end());
    std::unordered_set<std::string> present;
    const size_t shard_index = out.shards_.size();
    out.shards_.push_back(make_shard<Shard>(shard_path, map, map->data(), parsed));
    for (TensorInfo& t : parsed.tensors) {
      if (!wanted.count(t.name)) continue;  // in the file but not in the weight_map: not part of the checkpoint
      present.insert(t.name);
      std::string name = t.name;
      out.order_.push_back(name);
      out.index_.emplace(std::move(name), std::make_pair(shard_index, std::move(t)));
    }
    for (const std::string& name : mapped)
      if (!present.count(name))
        return data_loss("{}: tensor '{}' is mapped to '{}' but that file does not contain it", target, printable(name), printable(file));
    for (auto& [k, v] : parsed.metadata) out.metadata_.emplace(k, v);  // the index's and earlier shards' values win
  }
  return out;
}

std::vector<std::string> SafetensorsFile::names() const { return order_; }

std::vector<std::string> SafetensorsFile::files() const {
  std::vector<std::string> out;
  if (!index_path_.empty()) out.push_back(index_path_);
  for (const auto& shard : shards_) out.push_back(shard->label);
  return out;
}

bool SafetensorsFile::contains(const std::string& name) const { return index_.count(name) != 0; }

Result<TensorInfo> SafetensorsFile::info(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    std::string where = shards_.empty() ? std::string("<empty>") : shards_.front()->label;
    return not_found("{}: no tensor '{}'", where, printable(name));
  }
  return it->second.second;
}

Result<Tensor> SafetensorsFile::get(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    std::string where = shards_.empty() ? std::string("<empty>") : shards_.front()->label;
    return not_found("{}: no tensor '{}'", where, printable(name));
  }
  const auto& [shard_index, info] = it->second;
  const Shard& shard = *shards_[shard_index];
  const uint64_t bytes = info.data_end - info.data_begin;
  // Validated at open: data_begin <= data_end <= data_size and bytes == numel * dtype_size.
  NIB_CHECK(info.data_end <= shard.data_size);
  if (bytes == 0) return Tensor(info.dtype, info.shape);
  const uint8_t* src = shard.data + info.data_begin;  // src: (bytes) bytes of little-endian elements
  if (reinterpret_cast<uintptr_t>(src) % dtype_size(info.dtype) == 0) {
    auto storage = std::make_shared<Storage>(const_cast<uint8_t*>(src), static_cast<size_t>(bytes), Device::kCPU, shard.owner);
    return Tensor(std::move(storage), 0, info.dtype, info.shape);
  }
  Tensor t(info.dtype, info.shape);  // unaligned for the dtype: copy
  std::memcpy(t.raw(), src, static_cast<size_t>(bytes));
  return t;
}

// ---- writing ------------------------------------------------------------------------------

Status write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                         const std::map<std::string, std::string>& metadata, bool stop_on_interrupt) {
  NIB_RETURN_IF_ERROR(check_named_tensors(tensors));
  // Dtype, shape and size come from the tensors as they are; CUDA tensors are copied to the host
  // one at a time while the data is written, so the host never holds more than one copy.
  const std::vector<NamedTensor>& host = tensors;

  // Data placement: stable-sorted by element size, largest first, so that every tensor starts
  // at a multiple of its element size (the data section starts at a multiple of 8) and readers
  // can view it without a copy. No gaps between tensors (the HF library requires that).
  std::vector<size_t> placement(tensors.size());
  for (size_t i = 0; i < placement.size(); ++i) placement[i] = i;
  std::stable_sort(placement.begin(), placement.end(),
                   [&](size_t a, size_t b) { return dtype_size(host[a].tensor.dtype()) > dtype_size(host[b].tensor.dtype()); });
  std::vector<std::pair<uint64_t, uint64_t>> offsets(tensors.size());
  uint64_t pos = 0;
  for (size_t i : placement) {
    offsets[i] = {pos, pos + host[i].tensor.nbytes()};
    pos += host[i].tensor.nbytes();
  }

  ordered_json header = ordered_json::object();
  if (!metadata.empty()) {
    ordered_json m = ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = std::move(m);
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    ordered_json e = ordered_json::object();
    e["dtype"] = std::string(dtype_name(host[i].tensor.dtype()));
    e["shape"] = host[i].tensor.shape();
    e["data_offsets"] = {offsets[i].first, offsets[i].second};
    header[tensors[i].name] = std::move(e);
  }
  std::string text;
  try {
    text = header.dump(-1, ' ', false, ordered_json::error_handler_t::strict);
  } catch (const std::exception& e) {
    return invalid_argument("{}: a tensor name or metadata string is not valid UTF-8", path);
  }
  // Pad with spaces so that the data section starts at a multiple of 8 (as the HF library does).
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  uint8_t len_le[8];
  for (int i = 0; i < 8; ++i) len_le[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));

  NIB_ASSIGN_OR_RETURN(AtomicFileWriter w, AtomicFileWriter::create(path));
  if (stop_on_interrupt) w.stop_on_interrupt();
  NIB_RETURN_IF_ERROR(w.append(len_le, 8));
  NIB_RETURN_IF_ERROR(w.append(text.data(), text.size()));
  for (size_t i : placement) {
    const Tensor& t = host[i].tensor;
    if (t.nbytes() == 0) continue;
    if (t.device() == Device::kCPU) {
      NIB_RETURN_IF_ERROR(w.append(t.raw(), t.nbytes()));
    } else {
      Tensor cpu = t.to(Device::kCPU);
      NIB_RETURN_IF_ERROR(w.append(cpu.raw(), cpu.nbytes()));
    }
  }
  return w.commit();
}

Status write_safetensors_sharded(const std::string& dir, const std::vector<NamedTensor>& tensors, uint64_t max_shard_bytes,
                                 const std::map<std::string, std::string>& metadata) {
  NIB_RETURN_IF_ERROR(check_named_tensors(tensors));
  if (max_shard_bytes == 0) return invalid_argument("{}: max_shard_bytes must be positive", dir);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return io_error("{}: cannot create folder: {}", dir, ec.message());

  // Greedy in the given order; a tensor larger than the limit gets a shard of its own.
  std::vector<std::vector<NamedTensor>> shards;
  uint64_t current = 0, total = 0;
  for (const NamedTensor& nt : tensors) {
    uint64_t b = nt.tensor.nbytes();
    if (shards.empty() || (current > 0 && current + b > max_shard_bytes)) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(nt);
    current += b;
    total += b;
  }
  if (shards.size() <= 1) {
    NIB_RETURN_IF_ERROR(write_safetensors((fs::path(dir) / kSingleName).string(), tensors, metadata));
    return remove_stale_checkpoint_files(dir, {kSingleName});
  }

  std::set<std::string> files;
  json weight_map = json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
    NIB_RETURN_IF_ERROR(write_safetensors((fs::path(dir) / file).string(), shards[s], metadata));
    for (const NamedTensor& nt : shards[s]) weight_map[nt.name] = file;
    files.insert(file);
  }
  json meta = json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  meta["total_size"] = total;  // as the HF library writes it (a number; not returned by metadata())
  json index = {{"metadata", std::move(meta)}, {"weight_map", std::move(weight_map)}};
  std::string text;
  try {
    text = index.dump(2, ' ', false, json::error_handler_t::strict) + "\n";
  } catch (const std::exception& e) {
    return invalid_argument("{}: a tensor name or metadata string is not valid UTF-8", dir);
  }
  NIB_RETURN_IF_ERROR(write_file_atomic((fs::path(dir) / kIndexName).string(), text.data(), text.size()));
  files.insert(kIndexName);
  return remove_stale_checkpoint_files(dir, files);
}

}  // namespace nibble::io
