// The CUDA backend's entry points that plain C++ may call (no CUDA header here): init() selects
// a device and registers the cudaMalloc-based DeviceAllocator for Device::kCUDA with core's
// tensor.h, so Tensor(..., Device::kCUDA) and Tensor::to() work. With no usable device, init()
// returns a Status that says so (never a crash), and callers fall back to the CPU backend.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"

namespace nibble::cuda {

struct DeviceInfo {
  int index = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;   // compute capability
  int multiprocessors = 0;
  int64_t global_memory_bytes = 0;
  int64_t l2_bytes = 0;
  int64_t shared_memory_per_block_optin = 0;
  int memory_bus_bits = 0;
};

// Number of CUDA devices visible (0 when there is no driver or no GPU; never throws).
int device_count();

// Selects `device` and registers the Device::kCUDA allocator. Idempotent. Returns a Status
// (kNotFound) when no device is present or the driver cannot be used.
Status init(int device = 0);

// Properties of `device` (init() not required).
Result<DeviceInfo> device_info(int device = 0);
std::string describe(const DeviceInfo& info);

}  // namespace nibble::cuda
