// JSON-lines metrics writer/reader; see metrics.h.
#include "train/metrics.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/log.h"
#include "io/regular_file.h"
#include "train/atomic_dir.h"

namespace nibble::train {

Result<MetricsWriter> MetricsWriter::open(const std::string& path, bool truncate) {
  std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) NIB_RETURN_IF_ERROR(make_dirs(parent.string()));
  FILE* f = std::fopen(path.c_str(), truncate ? "w" : "a");
  if (!f) return io_error("cannot open metrics file {}: {}", path, std::strerror(errno));
  MetricsWriter w;
  w.path_ = path;
  w.file_ = std::shared_ptr<FILE>(f, [](FILE* p) { std::fclose(p); });
  return w;
}

Status MetricsWriter::write(const nlohmann::json& event) {
  if (!event.is_object()) return invalid_argument("metrics event must be a JSON object, got {}", event.dump());
  std::string line = event.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  line += '\n';
  if (std::fwrite(line.data(), 1, line.size(), file_.get()) != line.size() || std::fflush(file_.get()) != 0)
    return io_error("cannot write metrics file {}: {}", path_, std::strerror(errno));
  return Status::ok();
}

Result<std::vector<nlohmann::json>> read_metrics(const std::string& path, int64_t* damaged) {
  if (damaged) *damaged = 0;
  auto read = io::read_regular_file(path, "metrics file");
  if (!read && read.status().code() == StatusCode::kNotFound) return not_found("metrics file not found: {}", path);
  if (!read) return read.status();
  const std::string text = std::move(read).value();
  std::vector<nlohmann::json> out;
  size_t pos = 0;
  int64_t line_no = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    const bool complete = nl != std::string::npos;
    std::string line = text.substr(pos, (complete ? nl : text.size()) - pos);
    pos = complete ? nl + 1 : text.size();
    ++line_no;
    if (damaged && line.find('\0') != std::string::npos) {
      line.erase(std::remove(line.begin(), line.end(), '\0'), line.end());
      ++*damaged;  // repaired or not, the line was damaged
      if (line.empty()) continue;
      nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.is_object()) out.push_back(std::move(j));
      continue;
    }
    if (line.empty()) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      if (!complete) break;  // a partial last line from an interrupted write
      if (damaged) {
        ++*damaged;
        continue;
      }
      return data_loss("metrics file {}: line {} is not a JSON object", path, line_no);
    }
    out.push_back(std::move(j));
  }
  return out;
}

Status drop_metrics_after_step(const std::string& path, int64_t step) {
  if (!std::filesystem::exists(path)) return Status::ok();
  int64_t damaged = 0;
  NIB_ASSIGN_OR_RETURN(auto events, read_metrics(path, &damaged));
  if (damaged > 0)
    NIB_LOG_WARN("metrics file {}: {} damaged line(s) (NUL bytes or torn writes) cleaned or dropped; {} events kept",
                 path, damaged, events.size());
  std::string kept;
  for (const auto& e : events) {
    if (e.contains("step") && e["step"].is_number() && e["step"].get<double>() > static_cast<double>(step)) continue;
    kept += e.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    kept += '\n';
  }
  return write_file_atomic(path, kept);
}

}  // namespace nibble::train
