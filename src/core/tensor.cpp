// Tensor and Storage (see tensor.h).
#include "core/tensor.h"

#include <array>
#include <cstdlib>
#include <cstring>
#include <new>

#include "core/bits.h"

namespace nibble {

namespace {
std::array<DeviceAllocator*, 2> g_allocators{};

// E4M3 ("fn") and E5M2 decoders for to_f32(); the full codecs live in formats/.
float decode_e4m3(uint8_t b) {
  uint32_t s = b >> 7, e = (b >> 3) & 0xf, m = b & 7;
  float v;
  if (e == 0xf && m == 7) return std::nanf("");
  if (e == 0) v = static_cast<float>(m) * 0.001953125f;  // m * 2^-9
  else v = u32_as_float(((e - 7 + 127) << 23) | (m << 20));
  return s ? -v : v;
}
float decode_e5m2(uint8_t b) { return f16_bits_to_f32(static_cast<uint16_t>(b) << 8); }
}  // namespace

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

void register_device_allocator(Device device, DeviceAllocator* allocator) {
  g_allocators[static_cast<size_t>(device)] = allocator;
}
DeviceAllocator* device_allocator(Device device) { return g_allocators[static_cast<size_t>(device)]; }

Storage::Storage(size_t bytes, Device device) : bytes_(bytes), device_(device) {
  if (device == Device::kCPU) {
    size_t rounded = (bytes + 63) / 64 * 64;
    data_ = std::aligned_alloc(64, rounded ? rounded : 64);
    if (!data_) throw std::bad_alloc();
    std::memset(data_, 0, rounded ? rounded : 64);
  } else {
    DeviceAllocator* a = device_allocator(device);
    NIB_CHECK_MSG(a != nullptr, "no allocator registered for this device (CUDA backend not initialised)");
    data_ = a->allocate(bytes ? bytes : 1);
  }
}

Storage::Storage(void* data, size_t bytes, Device device, std::shared_ptr<void> keep_alive)
    : data_(data), bytes_(bytes), device_(device), owned_(false), keep_alive_(std::move(keep_alive)) {}

Storage::~Storage() {
  if (!owned_) return;
  if (device_ == Device::kCPU) std::free(data_);
  else if (DeviceAllocator* a = device_allocator(device_)) a->deallocate(data_);
}

Tensor::Tensor(DType dtype, Shape shape, Device device) : dtype_(dtype), shape_(std::move(shape)) {
  for (int64_t d : shape_) NIB_CHECK_MSG(d >= 0, "negative dimension in {}", shape_str(shape_));
  storage_ = std::make_shared<Storage>(nbytes(), device);
}

Tensor::Tensor(std::shared_ptr<Storage> storage, size_t byte_offset, DType dtype, Shape shape)
    : storage_(std::move(storage)), offset_(byte_offset), dtype_(dtype), shape_(std::move(shape)) {
  NIB_CHECK(offset_ + nbytes() <= storage_->bytes());
}

Tensor Tensor::from_floats(const std::vector<float>& v, Shape shape) {
  Tensor t(DType::kF32, std::move(shape));
  NIB_CHECK_MSG(static_cast<size_t>(t.numel()) == v.size(), "{} values for shape {}", v.size(), shape_str(t.shape()));
  std::memcpy(t.raw(), v.data(), v.size() * sizeof(float));
  return t;
}

int64_t Tensor::dim(int i) const {
  int r = rank();
  if (i < 0) i += r;
  NIB_CHECK_MSG(i >= 0 && i < r, "dim {} of a rank-{} tensor", i, r);
  return shape_[static_cast<size_t>(i)];
}

void Tensor::check_element_size(size_t s) const {
  NIB_CHECK_MSG(s == dtype_size(dtype_), "element size {} does not match dtype {}", s, dtype_name(dtype_));
}

Tensor Tensor::reshape(Shape shape) const {
  NIB_CHECK_MSG(shape_numel(shape) == numel(), "reshape {} -> {}", shape_str(shape_), shape_str(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::to(Device device) const {
  Tensor t(dtype_, shape_, device);
  if (nbytes() == 0) return t;
  if (this->device() == Device::kCPU && device == Device::kCPU) {
    std::memcpy(t.raw(), raw(), nbytes());
  } else {
    DeviceAllocator* a = device_allocator(this->device() == Device::kCPU ? device : this->device());
    NIB_CHECK_MSG(a != nullptr, "no allocator registered for the CUDA device");
    a->copy(t.raw(), device, raw(), this->device(), nbytes());
  }
  return t;
}

Tensor Tensor::to_f32() const {
  Tensor src = device() == Device::kCPU ? *this : to(Device::kCPU);
  Tensor out(DType::kF32, shape_);
  float* o = out.data<float>();
  const int64_t n = numel();
  switch (dtype_) {
    case DType::kF32: std::memcpy(o, src.raw(), nbytes()); break;
    case DType::kBF16: {
      const auto* p = static_cast<const uint16_t*>(src.raw());
      for (int64_t i = 0; i < n; ++i) o[i] = bf16_bits_to_f32(p[i]);
      break;
    }
    case DType::kF16: {
      const auto* p = static_cast<const uint16_t*>(src.raw());
      for (int64_t i = 0; i < n; ++i) o[i] = f16_bits_to_f32(p[i]);
      break;
    }
    case DType::kF8E4M3: {
      const auto* p = static_cast<const uint8_t*>(src.raw());
      for (int64_t i = 0; i < n; ++i) o[i] = decode_e4m3(p[i]);
      break;
    }
    case DType::kF8E5M2: {
      const auto* p = static_cast<const uint8_t*>(src.raw());
      for (int64_t i = 0; i < n; ++i) o[i] = decode_e5m2(p[i]);
      break;
    }
    default: NIB_CHECK_MSG(false, "to_f32 of non-floating dtype {}", dtype_name(dtype_));
  }
  return out;
}

}  // namespace nibble
