// Declarations that <gloo/transport/tcp/unbound_buffer.h> needs and Debian 12's
// libgloo-dev (git 2022-05-18) does not package (its gloo/common/memory.h is missing).
// Only comm/gloo_channel.cc includes that header, to read a tcp::UnboundBuffer's
// completion counts under its own mutex (see the Transfer class there); it never creates,
// copies or destroys a Gloo object through these types, and only reads members declared
// before the one of type ShareableNonOwningPtr. The layout below is still Gloo's (one
// std::shared_ptr<T> / std::weak_ptr<T> member) so that the class is the one the library
// was built with. Searched after the system include path (-idirafter): an installed
// gloo/common/memory.h takes precedence over this file.
#pragma once

#include <memory>

namespace gloo {

template <typename T>
class ShareableNonOwningPtr;

template <typename T>
class WeakNonOwningPtr final {
 public:
  WeakNonOwningPtr() = default;
  explicit WeakNonOwningPtr(const ShareableNonOwningPtr<T>& root) : ptr_(root.ptr_) {}

 private:
  std::weak_ptr<T> ptr_;
};

template <typename T>
class NonOwningPtr final {
 public:
  NonOwningPtr() = default;
  T* operator->() const noexcept { return ptr_.get(); }
  explicit operator bool() const noexcept { return static_cast<bool>(ptr_); }

 private:
  std::shared_ptr<T> ptr_;
};

template <typename T>
class ShareableNonOwningPtr final {
 public:
  explicit ShareableNonOwningPtr(T* t) : ptr_(t, [](T*) {}) {}
  ShareableNonOwningPtr(const ShareableNonOwningPtr&) = delete;
  ShareableNonOwningPtr& operator=(const ShareableNonOwningPtr&) = delete;

 private:
  std::shared_ptr<T> ptr_;
  friend class WeakNonOwningPtr<T>;
};

}  // namespace gloo
