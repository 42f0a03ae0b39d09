// CUDA device selection, properties, and the cudaMalloc/cudaFree/cudaMemcpy DeviceAllocator that
// core/tensor.h uses for Device::kCUDA (see device.h). Mirrors ggml-cuda's backend init: probe
// the driver, report a clean error without a device, register the buffer type.
#include "backend/cuda/device.h"

#include <cuda_runtime_api.h>

#include <mutex>

#include "backend/cuda/cuda_check.h"
#include "core/tensor.h"

namespace nibble::cuda {

namespace {

cudaMemcpyKind copy_kind(Device dst, Device src) {
  if (dst == Device::kCUDA && src == Device::kCUDA) return cudaMemcpyDeviceToDevice;
  if (dst == Device::kCUDA) return cudaMemcpyHostToDevice;
  if (src == Device::kCUDA) return cudaMemcpyDeviceToHost;
  return cudaMemcpyHostToHost;
}

class CudaAllocator final : public DeviceAllocator {
 public:
  void* allocate(size_t bytes) override {
    void* p = nullptr;
    NIB_CUDA_CHECK(cudaMalloc(&p, bytes));
    return p;
  }
  void deallocate(void* p) override {
    // Called from destructors: report but never throw (the context may already be torn down
    // at process exit, where cudaFree returns cudaErrorCudartUnloading).
    cudaError_t err = cudaFree(p);
    if (err != cudaSuccess && err != cudaErrorCudartUnloading) (void)cudaGetLastError();
  }
  void copy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes) override {
    NIB_CUDA_CHECK(cudaMemcpy(dst, src, bytes, copy_kind(dst_dev, src_dev)));
  }
};

CudaAllocator g_allocator;
std::mutex g_init_mutex;
int g_initialised_device = -1;

}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device / no driver" error
    return 0;
  }
  return n;
}

Status init(int device) {
  std::lock_guard<std::mutex> lock(g_init_mutex);
  if (g_initialised_device == device) return Status::ok();
  int n = device_count();
  if (n == 0) return not_found("no CUDA device is available (no GPU or no driver); use the CPU backend");
  if (device < 0 || device >= n) return invalid_argument("CUDA device {} requested but {} present", device, n);
  NIB_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device), "cudaSetDevice"));
  NIB_RETURN_IF_ERROR(cuda_status(cudaFree(nullptr), "creating the CUDA context"));
  register_device_allocator(Device::kCUDA, &g_allocator);
  g_initialised_device = device;
  return Status::ok();
}

Result<DeviceInfo> device_info(int device) {
  if (device_count() <= device) return not_found("no CUDA device {}", device);
  cudaDeviceProp p{};
  NIB_RETURN_IF_ERROR(cuda_status(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties"));
  DeviceInfo info;
  info.index = device;
  info.name = p.name;
  info.cc_major = p.major;
  info.cc_minor = p.minor;
  info.multiprocessors = p.multiProcessorCount;
  info.global_memory_bytes = static_cast<int64_t>(p.totalGlobalMem);
  info.l2_bytes = p.l2CacheSize;
  info.shared_memory_per_block_optin = static_cast<int64_t>(p.sharedMemPerBlockOptin);
  info.memory_bus_bits = p.memoryBusWidth;
  return info;
}

std::string describe(const DeviceInfo& i) {
  return fmt::format("{} (sm_{}{}, {} SMs, {:.1f} GiB, L2 {:.0f} MiB)", i.name, i.cc_major, i.cc_minor, i.multiprocessors,
                     static_cast<double>(i.global_memory_bytes) / (1 << 30), static_cast<double>(i.l2_bytes) / (1 << 20));
}

}  // namespace nibble::cuda
