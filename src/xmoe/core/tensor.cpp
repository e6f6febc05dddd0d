#include "xmoe/core/tensor.h"

#include <cstring>
#include <utility>

#include "xmoe/core/allocator.h"
#include "xmoe/core/device_api.h"

namespace xmoe {

std::string shape_str(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    XMOE_CHECK(d >= 0, "[tensor] negative dimension in shape {}", shape_str(shape));
    n *= d;
  }
  return n;
}

Storage::Storage(size_t bytes, Device device)
    : bytes_(bytes), device_(device), allocator_(&allocator_for(device)) {
  data_ = allocator_->allocate(bytes);
}

Storage::Storage(size_t bytes, Allocator& allocator)
    : bytes_(bytes), device_(Device::cpu()), allocator_(&allocator) {
  data_ = allocator_->allocate(bytes);
}

Storage::Storage(void* data, size_t bytes, Device device, std::shared_ptr<void> keep_alive)
    : data_(data), bytes_(bytes), device_(device), keep_alive_(std::move(keep_alive)) {}

Storage::~Storage() {
  if (allocator_) allocator_->deallocate(data_, bytes_);
}

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  Tensor t;
  t.numel_ = shape_numel(shape);
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  t.storage_ = std::make_shared<Storage>(t.nbytes(), device);
  return t;
}

Tensor Tensor::empty_pinned(Shape shape, DType dtype) {
  Tensor t;
  t.numel_ = shape_numel(shape);
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(t.nbytes(), backend::pinned_host_allocator());
  return t;
}

Tensor Tensor::from_external(void* data, Shape shape, DType dtype, Device device,
                             std::shared_ptr<void> keep_alive) {
  Tensor t;
  t.numel_ = shape_numel(shape);
  XMOE_CHECK(data != nullptr || t.numel_ == 0, "[tensor] from_external: null data for shape {}",
             shape_str(shape));
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  t.storage_ = std::make_shared<Storage>(data, t.nbytes(), device, std::move(keep_alive));
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) {
  Tensor t = empty(std::move(shape), dtype, device);
  t.zero_();
  return t;
}

Tensor Tensor::full(Shape shape, float value, Device device) {
  Tensor t = empty(std::move(shape), DType::f32, Device::cpu());
  t.fill_(value);
  return device.is_cpu() ? t : t.to(device);
}

template <typename T>
Tensor Tensor::from_vector(const std::vector<T>& values, Shape shape, Device device) {
  XMOE_CHECK(shape_numel(shape) == static_cast<int64_t>(values.size()),
             "[tensor] from_vector: {} values do not fill shape {}", values.size(),
             shape_str(shape));
  Tensor t = empty(std::move(shape), dtype_of<T>(), device);
  backend::copy_bytes(t.raw(), device, values.data(), Device::cpu(), t.nbytes());
  return t;
}

template Tensor Tensor::from_vector<float>(const std::vector<float>&, Shape, Device);
template Tensor Tensor::from_vector<bf16>(const std::vector<bf16>&, Shape, Device);
template Tensor Tensor::from_vector<int32_t>(const std::vector<int32_t>&, Shape, Device);
template Tensor Tensor::from_vector<int64_t>(const std::vector<int64_t>&, Shape, Device);
template Tensor Tensor::from_vector<uint8_t>(const std::vector<uint8_t>&, Shape, Device);
template Tensor Tensor::from_vector<double>(const std::vector<double>&, Shape, Device);

int64_t Tensor::size(int64_t i) const {
  const int64_t n = dim();
  if (i < 0) i += n;
  XMOE_CHECK(i >= 0 && i < n, "[tensor] dimension {} out of range for shape {}", i,
             shape_str(shape_));
  return shape_[static_cast<size_t>(i)];
}

void* Tensor::raw() const {
  if (!storage_) return nullptr;
  return static_cast<char*>(storage_->data()) + offset_;
}

Tensor Tensor::reshape(Shape shape) const {
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      XMOE_CHECK(infer < 0, "[reshape] more than one -1 in {}", shape_str(shape));
      infer = static_cast<int64_t>(i);
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    XMOE_CHECK(known > 0 && numel_ % known == 0, "[reshape] cannot reshape {} into {}",
               shape_str(shape_), shape_str(shape));
    shape[static_cast<size_t>(infer)] = numel_ / known;
  }
  XMOE_CHECK(shape_numel(shape) == numel_, "[reshape] cannot reshape {} ({} elements) into {}",
             shape_str(shape_), numel_, shape_str(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::rows(int64_t begin, int64_t end) const {
  XMOE_CHECK(dim() >= 1, "[rows] on a 0-d tensor");
  XMOE_CHECK(0 <= begin && begin <= end && end <= shape_[0],
             "[rows] range [{}, {}) outside dimension 0 of {}", begin, end, shape_str(shape_));
  const int64_t row = shape_[0] ? numel_ / shape_[0] : 0;
  Tensor t = *this;
  t.offset_ += static_cast<size_t>(begin * row) * dtype_size(dtype_);
  t.shape_[0] = end - begin;
  t.numel_ = (end - begin) * row;
  return t;
}

Tensor Tensor::clone() const {
  return to(device_);
}

Tensor Tensor::to(Device device) const {
  Tensor t = empty(shape_, dtype_, device);
  backend::copy_bytes(t.raw(), device, raw(), device_, nbytes());
  return t;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return clone();
  XMOE_CHECK(is_cpu(), "[tensor] dtype conversion of a {} tensor needs ops::cast", device_.str());
  Tensor t = empty(shape_, dtype, device_);
  if (dtype_ == DType::f32 && dtype == DType::bf16) {
    const float* s = data<float>();
    bf16* d = t.data<bf16>();
#pragma omp parallel for schedule(static) if (numel_ > 65536)
    for (int64_t i = 0; i < numel_; ++i) d[i] = bf16(s[i]);
  } else if (dtype_ == DType::bf16 && dtype == DType::f32) {
    const bf16* s = data<bf16>();
    float* d = t.data<float>();
#pragma omp parallel for schedule(static) if (numel_ > 65536)
    for (int64_t i = 0; i < numel_; ++i) d[i] = static_cast<float>(s[i]);
  } else {
    XMOE_FAIL("[tensor] no conversion {} -> {}", dtype_name(dtype_), dtype_name(dtype));
  }
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  XMOE_CHECK(src.numel_ == numel_ && src.dtype_ == dtype_,
             "[copy_from] {} into {}: sizes or dtypes differ", src.str(), str());
  backend::copy_bytes(raw(), device_, src.raw(), src.device_, nbytes());
}

void Tensor::zero_() {
  if (numel_ == 0) return;
  backend::fill_zero(raw(), nbytes(), device_);
}

void Tensor::fill_(float value) {
  XMOE_CHECK(is_cpu() && dtype_ == DType::f32, "[fill_] needs an f32 CPU tensor, got {}", str());
  float* p = data<float>();
  for (int64_t i = 0; i < numel_; ++i) p[i] = value;
}

template <typename T>
std::vector<T> Tensor::to_vector() const {
  XMOE_CHECK(dtype_of<T>() == dtype_, "[to_vector] asked for {} from a {} tensor",
             dtype_name(dtype_of<T>()), dtype_name(dtype_));
  std::vector<T> out(static_cast<size_t>(numel_));
  backend::copy_bytes(out.data(), Device::cpu(), raw(), device_, nbytes());
  return out;
}

template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<bf16> Tensor::to_vector<bf16>() const;
template std::vector<int32_t> Tensor::to_vector<int32_t>() const;
template std::vector<int64_t> Tensor::to_vector<int64_t>() const;
template std::vector<uint8_t> Tensor::to_vector<uint8_t>() const;
template std::vector<double> Tensor::to_vector<double>() const;

double Tensor::item(int64_t i) const {
  XMOE_CHECK(i >= 0 && i < numel_, "[item] index {} out of range for {}", i, str());
  Tensor one = reshape({-1}).rows(i, i + 1).to(Device::cpu());
  switch (dtype_) {
    case DType::f32:
      return *one.data<float>();
    case DType::bf16:
      return static_cast<float>(*one.data<bf16>());
    case DType::i32:
      return *one.data<int32_t>();
    case DType::i64:
      return static_cast<double>(*one.data<int64_t>());
    case DType::u8:
      return *one.data<uint8_t>();
    case DType::f64:
      return *one.data<double>();
  }
  return 0;
}

std::string Tensor::str() const {
  return fmt::format("{}{} on {}", dtype_name(dtype_), shape_str(shape_), device_.str());
}

void check_shape(const Tensor& t, const Shape& shape, const char* op, const char* name) {
  bool ok = t.dim() == static_cast<int64_t>(shape.size());
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] < 0 || shape[i] == t.shape()[i];
  XMOE_CHECK(ok, "[{}] {} has shape {}, expected {}", op, name, shape_str(t.shape()),
             shape_str(shape));
}

void check_dtype(const Tensor& t, DType dtype, const char* op, const char* name) {
  XMOE_CHECK(t.dtype() == dtype, "[{}] {} has dtype {}, expected {}", op, name,
             dtype_name(t.dtype()), dtype_name(dtype));
}

Device parse_device(const std::string& name) {
  if (name == "cpu") return Device::cpu();
  if (name == "cuda") return Device::cuda(0);
  if (name.rfind("cuda:", 0) == 0) {
    try {
      return Device::cuda(std::stoi(name.substr(5)));
    } catch (const std::exception&) {
    }
  }
  XMOE_FAIL("[device] unknown device '{}' (expected cpu, cuda or cuda:N)", name);
}

int cuda_device_count() {
  return backend::cuda_device_count();
}
bool cuda_available() {
  return backend::cuda_available();
}

}  // namespace xmoe
