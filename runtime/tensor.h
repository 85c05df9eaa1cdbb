// The runtime's one tensor type: contiguous, row-major, owning, 64-byte aligned, up to
// four dimensions, element type float (training) or double (gradient checks).
//
// Resize() reuses the existing buffer whenever it is large enough, so layers size their
// workspaces once per shape and the steady-state training step allocates nothing.
#ifndef RACKRUN_RUNTIME_TENSOR_H_
#define RACKRUN_RUNTIME_TENSOR_H_

#include <algorithm>
#include <array>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <new>

namespace rackrun::runtime {

inline constexpr int kTensorMaxRank = 4;
inline constexpr size_t kTensorAlignment = 64;

template <typename T>
class Tensor {
 public:
  Tensor() = default;
  Tensor(std::initializer_list<int64_t> shape) { Resize(shape); }

  Tensor(const Tensor& other) { *this = other; }
  Tensor& operator=(const Tensor& other) {
    if (this != &other) {
      ResizeTo(other.rank_, other.shape_.data());
      std::copy(other.data(), other.data() + other.size_, data());
    }
    return *this;
  }
  Tensor(Tensor&& other) noexcept { *this = std::move(other); }
  Tensor& operator=(Tensor&& other) noexcept {
    buffer_ = std::move(other.buffer_);
    capacity_ = other.capacity_;
    size_ = other.size_;
    rank_ = other.rank_;
    shape_ = other.shape_;
    other.capacity_ = other.size_ = 0;
    other.rank_ = 0;
    return *this;
  }

  // Sets the shape; keeps the buffer (and its contents) when it is large enough,
  // otherwise allocates a new zeroed buffer. Contents are unspecified after a grow.
  void Resize(std::initializer_list<int64_t> shape) {
    assert(shape.size() <= kTensorMaxRank);
    ResizeTo(static_cast<int>(shape.size()), shape.begin());
  }

  void Zero() { std::fill(data(), data() + size_, T(0)); }
  void Fill(T value) { std::fill(data(), data() + size_, value); }

  T* data() { return buffer_.get(); }
  const T* data() const { return buffer_.get(); }
  int64_t size() const { return size_; }
  int rank() const { return rank_; }
  int64_t dim(int i) const { return shape_[static_cast<size_t>(i)]; }
  // Bytes currently reserved; does not shrink.
  size_t capacity_bytes() const { return capacity_ * sizeof(T); }

  T& operator[](int64_t i) { return buffer_.get()[i]; }
  const T& operator[](int64_t i) const { return buffer_.get()[i]; }
  // Start of row r of the tensor seen as [dim(0) x (size / dim(0))].
  T* row(int64_t r) { return data() + r * (size_ / shape_[0]); }
  const T* row(int64_t r) const { return data() + r * (size_ / shape_[0]); }

 private:
  struct AlignedFree {
    void operator()(T* p) const { std::free(p); }
  };

  void ResizeTo(int rank, const int64_t* shape) {
    int64_t n = 1;
    for (int i = 0; i < rank; ++i) {
      assert(shape[i] >= 0);
      n *= shape[i];
    }
    rank_ = rank;
    shape_.fill(1);
    std::copy(shape, shape + rank, shape_.begin());
    if (static_cast<size_t>(n) > capacity_) {
      size_t bytes = static_cast<size_t>(n) * sizeof(T);
      bytes = (bytes + kTensorAlignment - 1) / kTensorAlignment * kTensorAlignment;
      T* p = static_cast<T*>(std::aligned_alloc(kTensorAlignment, std::max<size_t>(bytes, 64)));
      if (p == nullptr) throw std::bad_alloc();
      std::fill(p, p + n, T(0));
      buffer_.reset(p);
      capacity_ = static_cast<size_t>(n);
    }
    size_ = n;
  }

  std::unique_ptr<T, AlignedFree> buffer_;
  size_t capacity_ = 0;
  int64_t size_ = 0;
  int rank_ = 0;
  std::array<int64_t, kTensorMaxRank> shape_{1, 1, 1, 1};
};

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_TENSOR_H_
