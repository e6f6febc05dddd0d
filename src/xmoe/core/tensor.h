#pragma once
// Tensor: a contiguous, row-major n-d array with a dtype, a device and shared owning storage.
// Views (reshape, rows) share storage; kernels take raw pointers from data<T>().
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "xmoe/core/allocator.h"
#include "xmoe/core/device.h"
#include "xmoe/core/dtype.h"
#include "xmoe/core/error.h"

namespace xmoe {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& shape);
int64_t shape_numel(const Shape& shape);

/// Bytes on one device, freed through that device's allocator (and counted by it).
class Storage {
 public:
  Storage(size_t bytes, Device device);
  /// Host bytes from `allocator` (e.g. the pinned host allocator), freed through it.
  Storage(size_t bytes, Allocator& allocator);
  /// Memory owned elsewhere (e.g. a PyTorch tensor's): not counted by any allocator, never freed
  /// here. `keep_alive` (may be null) is held as long as this storage.
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
  Device device_;
  Allocator* allocator_ = nullptr;  // null: external memory
  std::shared_ptr<void> keep_alive_;
};

class Tensor {
 public:
  Tensor() = default;

  static Tensor empty(Shape shape, DType dtype = DType::f32, Device device = Device::cpu());
  static Tensor zeros(Shape shape, DType dtype = DType::f32, Device device = Device::cpu());
  /// Uninitialised host tensor in pinned (page-locked) memory, counted by the pinned host
  /// allocator (core/device_api.h): copies to and from a CUDA device overlap other work. Needs
  /// CUDA.
  static Tensor empty_pinned(Shape shape, DType dtype = DType::f32);
  static Tensor full(Shape shape, float value, Device device = Device::cpu());
  /// A tensor over `data` (contiguous, row-major, on `device`) that it does not own: nothing is
  /// copied, allocated or counted, and the memory must outlive every Tensor sharing this view
  /// unless `keep_alive` owns it. How xmoe computes in memory a framework (PyTorch) allocated.
  static Tensor from_external(void* data, Shape shape, DType dtype, Device device,
                              std::shared_ptr<void> keep_alive = nullptr);
  /// Copies host values into a new tensor on `device`.
  template <typename T>
  static Tensor from_vector(const std::vector<T>& values, Shape shape,
                            Device device = Device::cpu());

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  /// Size of dimension i; negative i counts from the end.
  int64_t size(int64_t i) const;
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  bool is_cpu() const { return device_.is_cpu(); }

  void* raw() const;
  template <typename T>
  T* data() const {
    XMOE_CHECK(dtype_of<T>() == dtype_, "[tensor] data<{}>() on a {} tensor",
               dtype_name(dtype_of<T>()), dtype_name(dtype_));
    return static_cast<T*>(raw());
  }
  /// Host-side element view (CPU tensors only).
  template <typename T>
  std::span<T> span() const {
    XMOE_CHECK(is_cpu(), "[tensor] span() on a {} tensor; copy it to the CPU first", device_.str());
    return {data<T>(), static_cast<size_t>(numel_)};
  }

  /// Same storage, new shape (same numel). One dimension may be -1.
  Tensor reshape(Shape shape) const;
  /// Rows [begin, end) of dimension 0 as a view.
  Tensor rows(int64_t begin, int64_t end) const;
  /// Deep copy on the same device.
  Tensor clone() const;
  /// Deep copy on another device (or the same one).
  Tensor to(Device device) const;
  /// f32 <-> bf16 conversion (CPU); other dtype pairs throw.
  Tensor to(DType dtype) const;
  void copy_from(const Tensor& src);

  void zero_();
  /// Fills an f32 tensor on the CPU with `value`.
  void fill_(float value);

  /// Host copy of the elements (any device).
  template <typename T>
  std::vector<T> to_vector() const;
  /// Single f32/i32/i64 element as double (host copy of one element).
  double item(int64_t flat_index = 0) const;

  std::string str() const;  ///< "f32[4, 8] on cpu"
  bool shares_storage(const Tensor& other) const { return storage_ == other.storage_; }
  /// True when no other Tensor refers to this one's storage: writing it in place is invisible.
  bool sole_owner() const { return storage_ != nullptr && storage_.use_count() == 1; }

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;  // bytes into storage_
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::f32;
  Device device_;
};

/// Throws unless `t` has exactly `shape` (use -1 as "any").
void check_shape(const Tensor& t, const Shape& shape, const char* op, const char* name);
void check_dtype(const Tensor& t, DType dtype, const char* op, const char* name);

}  // namespace xmoe
