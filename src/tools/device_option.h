// `--device cpu|cuda|cuda:N` of pretrain, eval, generate and bench train: which backend
// (backend/backend.h) runs the model. The default is cuda:0 when this nibble was built with CUDA
// and a GPU is present, else cpu. A value that names no device of this build and machine is a
// command-line error (exit 2) whose one line names the option and the devices that exist.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "backend/backend.h"
#include "core/status.h"

namespace nibble::tools {

// Adds --device to `app`, stored in *device (empty: the default).
void add_device_option(CLI::App& app, std::string* device);

// The devices this build can use on this machine: "cpu", then "cuda:0".. for each GPU.
std::vector<std::string> available_devices();

// The backend for --device `requested` (empty: the default above). Errors are
// invalid_argument("--device X: why (available: ...)").
Result<std::unique_ptr<backend::Backend>> open_device(const std::string& requested);

}  // namespace nibble::tools
