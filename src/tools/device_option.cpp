// --device parsing and backend creation for the commands (device_option.h). The CUDA backend
// registers itself here (nibble::cuda::register_cuda_backend) in builds with CUDA.
#include "tools/device_option.h"

#include <fmt/format.h>

#ifdef NIBBLE_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/device.h"
#endif

namespace nibble::tools {

namespace {

int cuda_device_count() {
#ifdef NIBBLE_HAVE_CUDA
  return nibble::cuda::device_count();
#else
  return 0;
#endif
}

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

// "cuda" or "cuda:N" with N of at most 3 digits; *index gets N (0 for "cuda").
bool parse_cuda(const std::string& s, int* index) {
  if (s == "cuda") return *index = 0, true;
  if (s.rfind("cuda:", 0) != 0) return false;
  const std::string digits = s.substr(5);
  if (digits.empty() || digits.size() > 3 || digits.find_first_not_of("0123456789") != std::string::npos) return false;
  *index = std::stoi(digits);
  return true;
}

}  // namespace

void add_device_option(CLI::App& app, std::string* device) {
  app.add_option("--device", *device,
                 "cpu, cuda or cuda:N (default: cuda when this nibble has CUDA and a GPU is present, else cpu)");
}

std::vector<std::string> available_devices() {
  std::vector<std::string> names{"cpu"};
  for (int i = 0, n = cuda_device_count(); i < n; ++i) names.push_back(fmt::format("cuda:{}", i));
  return names;
}

Result<std::unique_ptr<backend::Backend>> open_device(const std::string& requested) {
#ifdef NIBBLE_HAVE_CUDA
  nibble::cuda::register_cuda_backend();
#endif
  std::string kind = requested;
  if (kind.empty()) kind = cuda_device_count() > 0 ? "cuda:0" : "cpu";
  const std::string available = joined(available_devices());
  int index = 0;
  if (kind != "cpu" && !parse_cuda(kind, &index))
    return invalid_argument("--device {}: not a device (expected cpu, cuda or cuda:N; available: {})", kind,
                            available);
  if (kind != "cpu") {
#ifndef NIBBLE_HAVE_CUDA
    return invalid_argument("--device {}: this nibble was built without CUDA (available: {})", kind, available);
#else
    const int n = cuda_device_count();
    if (n == 0) return invalid_argument("--device {}: no CUDA device is present (available: {})", kind, available);
    if (index >= n)
      return invalid_argument("--device {}: there {} {} CUDA device{} (available: {})", kind, n == 1 ? "is" : "are", n,
                              n == 1 ? "" : "s", available);
#endif
  }
  auto be = backend::make_backend(kind == "cuda" ? "cuda:0" : kind);
  // A GPU that is present but cannot be used (driver, context) is an environment failure: exit 1.
  if (!be) return Status(be.status().code() == StatusCode::kInvalidArgument ? StatusCode::kInternal : be.status().code(),
                         fmt::format("--device {}: {}", kind, be.status().message()));
  return be;
}

}  // namespace nibble::tools
