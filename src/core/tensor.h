// Tensor: a contiguous, row-major n-d array of one DType on one device (CPU or CUDA), sharing
// reference-counted storage. Deliberately small: no strides, no autograd; ops take
// destination-first raw pointers with the shape written beside them (04-architecture.md).
// CUDA memory comes through an allocator that the CUDA backend registers, so core itself never
// includes a CUDA header.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"

namespace nibble {

enum class Device : uint8_t { kCPU, kCUDA };

using Shape = std::vector<int64_t>;

int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);

// Allocates and frees raw device memory; the CUDA backend registers one for Device::kCUDA.
struct DeviceAllocator {
  virtual ~DeviceAllocator() = default;
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* p) = 0;
  // Copies `bytes` between any two devices' memory (dst/src device given).
  virtual void copy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes) = 0;
};
void register_device_allocator(Device device, DeviceAllocator* allocator);
DeviceAllocator* device_allocator(Device device);  // nullptr where none is registered

class Storage {
 public:
  Storage(size_t bytes, Device device);  // zero-filled on the CPU
  // Wraps memory owned elsewhere (for example an mmap'ed file); `keep_alive` holds the owner.
  Storage(void* data, size_t bytes, Device device, std::shared_ptr<void> keep_alive);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_ = Device::kCPU;
  bool owned_ = true;
  std::shared_ptr<void> keep_alive_;
};

class Tensor {
 public:
  Tensor() = default;
  // A new zero-filled CPU tensor (uninitialised on CUDA).
  Tensor(DType dtype, Shape shape, Device device = Device::kCPU);
  // A view of existing storage starting at `byte_offset`.
  Tensor(std::shared_ptr<Storage> storage, size_t byte_offset, DType dtype, Shape shape);

  static Tensor empty(DType dtype, Shape shape, Device device = Device::kCPU) { return Tensor(dtype, std::move(shape), device); }
  static Tensor from_floats(const std::vector<float>& v, Shape shape);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device() : Device::kCPU; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const;  // negative i counts from the end
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }

  void* raw() { return storage_ ? static_cast<char*>(storage_->data()) + offset_ : nullptr; }
  const void* raw() const { return storage_ ? static_cast<const char*>(storage_->data()) + offset_ : nullptr; }
  template <typename T> T* data() {
    check_element_size(sizeof(T));
    return static_cast<T*>(raw());
  }
  template <typename T> const T* data() const {
    check_element_size(sizeof(T));
    return static_cast<const T*>(raw());
  }

  // Same storage, new shape with the same element count.
  Tensor reshape(Shape shape) const;
  // A deep copy on `device`.
  Tensor to(Device device) const;
  Tensor clone() const { return to(device()); }
  // Converts floating dtypes (F32/BF16/F16/F8) to a new F32 CPU tensor; others are NIB_CHECKed.
  Tensor to_f32() const;

 private:
  void check_element_size(size_t s) const;
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;
  DType dtype_ = DType::kF32;
  Shape shape_;
};

}  // namespace nibble
