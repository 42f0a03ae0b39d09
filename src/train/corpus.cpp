// The default corpus (KJV via the `bible` program of bible-kjv) and text-file reading; see
// corpus.h. The program prints one verse per line with -f ("Ge1:1 In the beginning ...").
#include "train/corpus.h"

#include <sys/wait.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "io/regular_file.h"
#include "train/atomic_dir.h"

namespace nibble::train {
namespace fs = std::filesystem;

namespace {
// True when `text` holds only whitespace (or nothing).
bool is_blank(const std::string& text) {
  return std::all_of(text.begin(), text.end(), [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; });
}

// "1Sam3:4" -> "1Sam": the reference minus its trailing "<chapter>:<verse>".
std::string book_of_reference(const std::string& ref) {
  size_t colon = ref.rfind(':');
  if (colon == std::string::npos) return {};
  size_t end = colon;
  while (end > 1 && std::isdigit(static_cast<unsigned char>(ref[end - 1]))) --end;
  return ref.substr(0, end);
}

}  // namespace

Result<std::string> default_corpus_text() {
  std::error_code ec;
  if (!fs::exists(kBibleProgram, ec) || !fs::exists(kBibleData, ec))
    return not_found("default corpus not found: install bible-kjv and bible-kjv-text (scripts/setup.sh); "
                     "missing {}",
                     fs::exists(kBibleProgram, ec) ? kBibleData : kBibleProgram);
  std::string cmd = std::string(kBibleProgram) + " -f Gen1:1-Rev22:21 </dev/null 2>/dev/null";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) return io_error("cannot run {}", kBibleProgram);
  std::string raw;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) raw.append(buf, n);
  int rc = ::pclose(pipe);
  if (rc == -1 || !WIFEXITED(rc) || WEXITSTATUS(rc) != 0)
    return io_error("default corpus: `{}` failed (exit status {})", cmd, rc);

  std::string out;
  out.reserve(raw.size());
  std::string book;
  size_t verses = 0;
  std::istringstream in(raw);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    size_t sp = line.find(' ');
    if (sp == std::string::npos) continue;
    std::string b = book_of_reference(line.substr(0, sp));
    if (b.empty()) continue;  // not a verse line
    if (verses > 0 && b != book) out += '\n';
    book = b;
    out.append(line, sp + 1, std::string::npos);
    out += '\n';
    ++verses;
  }
  if (verses < 30000)  // the KJV has 31102 verses
    return data_loss("default corpus: `{}` printed only {} verses (expected 31102); is {} intact?", cmd, verses,
                     kBibleData);
  return out;
}

Status write_default_corpus(const std::string& path) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec) && fs::file_size(path, ec) > 0) return Status::ok();
  NIB_ASSIGN_OR_RETURN(std::string text, default_corpus_text());
  fs::path parent = fs::path(path).parent_path();
  if (!parent.empty()) NIB_RETURN_IF_ERROR(make_dirs(parent.string()));
  return write_file_atomic(path, text);
}

Result<std::string> read_text_file(const std::string& path) {
  auto read = io::read_regular_file(path, "text file");
  if (!read && read.status().code() == StatusCode::kNotFound) return not_found("text file not found: {}", path);
  if (!read) return read.status();
  std::string text = std::move(read).value();
  if (is_blank(text)) return data_loss("text file {} is empty", path);
  return text;
}

std::vector<std::vector<std::string>> split_documents(const std::string& text) {
  std::vector<std::vector<std::string>> docs;
  std::vector<std::string> cur;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    size_t end = nl == std::string::npos ? text.size() : nl;
    std::string line = text.substr(pos, end - pos);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (is_blank(line)) {
      if (!cur.empty()) docs.push_back(std::move(cur));
      cur.clear();
    } else {
      cur.push_back(std::move(line));
    }
    pos = end + 1;
  }
  if (!cur.empty()) docs.push_back(std::move(cur));
  return docs;
}

Result<std::vector<std::string>> sample_lines(const std::vector<std::string>& files, int64_t max_lines, uint64_t seed,
                                              int64_t* total_lines) {
  if (max_lines < 1) return invalid_argument("sample of {} lines: must be >= 1", max_lines);
  // The reservoir keeps (line number, text); sorted by line number at the end.
  std::vector<std::pair<int64_t, std::string>> reservoir;
  uint64_t state = seed;
  auto next_u64 = [&state]() {  // SplitMix64
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  int64_t seen = 0;
  for (const std::string& path : files) {
    NIB_RETURN_IF_ERROR(io::check_regular_file(path, "text file"));
    std::ifstream in(path, std::ios::binary);
    if (!in) return not_found("text file not found: {}", path);
    std::string line;
    while (std::getline(in, line)) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (is_blank(line)) continue;
      if (seen < max_lines) {
        reservoir.emplace_back(seen, std::move(line));
      } else {
        const uint64_t j = next_u64() % static_cast<uint64_t>(seen + 1);  // uniform in [0, seen]
        if (j < static_cast<uint64_t>(max_lines)) reservoir[j] = {seen, std::move(line)};
      }
      ++seen;
      line.clear();
    }
    if (in.bad()) return io_error("read of text file {} failed", path);
  }
  std::sort(reservoir.begin(), reservoir.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::string> out;
  out.reserve(reservoir.size());
  for (auto& [n, text] : reservoir) out.push_back(std::move(text));
  if (total_lines != nullptr) *total_lines = seen;
  return out;
}

}  // namespace nibble::train
